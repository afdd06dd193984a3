"""
A balanced decode step's splits and gate in one launch
=====================================================

Where a decode step balances the two-segment kernel's splits (SFI rows that may be
slow beside fast ones, or an all-slow step over fp8), the backend computes once a
step, inside the captured graph, each request's share of the programs
(:func:`~.two_segment_decode.step_row_splits`) and the gate between the balanced
launch and its plain twin (:func:`~.two_segment_decode.balance_gate`). As torch ops
on ``[bs]`` tensors that is ~45 tiny kernels (12 ``where``, 9 dtype copies, 6
clamps, ...; a torch profile of the pair) replayed at every such step (natural
sfi: every step), each a graph node of its own. Here it is one program: the same
integer arithmetic over the batch, the same splits and gate bit for bit
(``tests/kernels/test_balance_step.py`` compares both on random batches).

The torch functions stay its reference (and what ``probe_balanced_launch.py``
computes, outside its timed launches).
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# the module, not the package's function of that name; its switches read at each call
tsd = importlib.import_module(".two_segment_decode", __package__)

__all__ = ["step_balance"]

#: requests a tile (the kernel walks the batch in tiles: one binary for every size)
_BLOCK = 128


# The integers are not specialized: one binary for every batch size, and no
# constexpr 1 (a single split, a share of one program) where a value is 1.
@triton.jit(do_not_specialize=["bs", "stride_a", "programs", "double_keys", "base_splits", "min_program_keys"])
def _step_balance_kernel(
    A_LEN,  # [bs, Hkv] int: segment A's count a KV head (column 0 read)
    B_START,  # [bs] int
    B_END,  # [bs] int
    ROW_MASK,  # [>= bs] int32: 1 = the launch serves the row (HAS_MASK)
    SPLITS,  # [bs] int32 out
    GATE,  # [1] int32 out (GATE_ON)
    COUNT,  # [1] int64: the gate added (COUNT_ON; balanced_launches' counter)
    bs,
    stride_a,
    programs,  # the balanced program target a KV head (P)
    double_keys,  # keys from which P doubles (FP8_DOUBLE)
    base_splits,  # the plain partition's splits (plain_partition_splits)
    min_program_keys,
    HAS_MASK: tl.constexpr,
    FP8_DOUBLE: tl.constexpr,
    GATE_ON: tl.constexpr,
    COUNT_ON: tl.constexpr,
    SEGMENT_GATE: tl.constexpr,
    MAX_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # two passes over the batch in BLOCK-wide tiles (one binary for every batch size):
    # the batch's keys, then each request's share and the gate's terms
    summed = tl.zeros([], dtype=tl.int64)
    for start in range(0, bs, BLOCK):
        keys = _served_keys(A_LEN, B_START, B_END, ROW_MASK, start, bs, stride_a, HAS_MASK, BLOCK)[0]
        summed += tl.sum(keys, 0)
    # balanced_splits: floor(keys x P / batch keys), P doubled over fp8 from double_keys
    total = tl.maximum(summed, 1)
    p = programs.to(tl.int64)
    if FP8_DOUBLE:
        p = tl.where(total >= double_keys, 2 * p, p)
    off_base = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int64)
    lo = tl.full([], 1 << 30, dtype=tl.int64)
    launched = tl.zeros([], dtype=tl.int64)
    for start in range(0, bs, BLOCK):
        keys, served = _served_keys(A_LEN, B_START, B_END, ROW_MASK, start, bs, stride_a, HAS_MASK, BLOCK)
        share = tl.minimum(tl.maximum(keys * p // total, 1), MAX_S)
        offs = start + tl.arange(0, BLOCK)
        tl.store(SPLITS + offs, share.to(tl.int32), mask=offs < bs)
        # balance_gate's terms: a served share off the heuristic's splits; the served
        # shares' largest, smallest and sum
        off_base += tl.sum((served & (share != base_splits)).to(tl.int32), 0)
        hi = tl.maximum(hi, tl.max(tl.where(served, share, 0), 0))
        lo = tl.minimum(lo, tl.min(tl.where(served, share, 1 << 30), 0))
        launched += tl.sum(tl.where(served, share, 0), 0)
    if GATE_ON:
        # open where a share differs from the plain twin's splits and (segments) the shares
        # are unequal or every balanced program reads min_program_keys keys
        gate = off_base > 0
        if SEGMENT_GATE:
            gate = gate & ((hi != lo) | (summed >= launched * min_program_keys))
        tl.store(GATE, gate.to(tl.int32))
        if COUNT_ON:  # one program: a plain add, no atomic
            tl.store(COUNT, tl.load(COUNT) + gate.to(tl.int64))


@triton.jit
def _served_keys(A_LEN, B_START, B_END, ROW_MASK, start, bs, stride_a, HAS_MASK: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Requests [start, start + BLOCK)'s keys of KV head 0 (0 where not served), and
    whether each is served: _row_keys' arithmetic, int64."""
    offs = start + tl.arange(0, BLOCK)
    ok = offs < bs
    a = tl.load(A_LEN + offs.to(tl.int64) * stride_a, mask=ok, other=0).to(tl.int64)
    b0 = tl.load(B_START + offs, mask=ok, other=0).to(tl.int64)
    b1 = tl.load(B_END + offs, mask=ok, other=0).to(tl.int64)
    served = ok
    if HAS_MASK:
        served = ok & (tl.load(ROW_MASK + offs, mask=ok, other=0) == 1)
    return tl.where(served, tl.maximum(a, 0) + tl.maximum(b1 - b0, 0), 0), served


def step_balance(a_len: torch.Tensor, b_start: torch.Tensor, b_end: torch.Tensor,
                 row_mask: Optional[torch.Tensor], num_kv_heads: int, max_kv_len: int, num_sms: int,
                 kv_fp8: bool = False, *, segments: bool = True, count: Optional[torch.Tensor] = None
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(step_row_splits(...), balance_gate(splits, ..., segments=(a_len, b_start,
    b_end) if segments else None))`` in one launch: ``([bs] int32, [1] int32)``, the
    splits None where the batch's shape does not balance (``balances``) and the gate
    None where BALANCE_GATE is off. ``a_len`` ``[bs, Hkv]`` (column 0 read), ``b_start``
    / ``b_end`` ``[bs]``, ``row_mask`` ``[>= bs]`` int32 or None (every row served).
    ``count`` ``[1]`` int64 or None: the gate is added to it in the same launch (the
    backend's count of balanced launches, ``balanced_launches.py``: one graph node a
    step fewer than a torch add). No host sync: capturable."""
    bs = b_end.shape[0]
    if not tsd.balances(bs, num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8):
        return None, None
    # the module's switches read at the call, as the torch functions read them
    programs = tsd._programs_per_head(num_sms, num_kv_heads, kv_fp8)
    fp8_double = bool(kv_fp8 and tsd.FP8_DENSE_SPLIT_KEYS > 0)
    splits = torch.empty(bs, dtype=torch.int32, device=b_end.device)
    gate = torch.empty(1, dtype=torch.int32, device=b_end.device) if tsd.BALANCE_GATE else None
    assert a_len.dim() == 2 and a_len.shape[0] >= bs and b_start.shape == b_end.shape
    count_on = count is not None and gate is not None
    assert count is None or (count.dtype == torch.int64 and count.numel() == 1), "count: [1] int64"
    _step_balance_kernel[(1,)](
        a_len, b_start, b_end, row_mask if row_mask is not None else splits, splits,
        gate if gate is not None else splits, count if count_on else splits, bs, a_len.stride(0), programs,
        tsd._dense_double_keys(programs) if fp8_double else 0,
        tsd.plain_partition_splits(bs, num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8),
        tsd.BALANCE_MIN_PROGRAM_KEYS,
        HAS_MASK=row_mask is not None, FP8_DOUBLE=fp8_double, GATE_ON=gate is not None, COUNT_ON=count_on,
        SEGMENT_GATE=segments,
        MAX_S=tsd.MAX_SPLITS, BLOCK=_BLOCK, num_warps=4,
    )
    return splits, gate
