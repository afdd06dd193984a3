"""
Indexed segment A: position lists -> pool-slot lists
====================================================

The selections of quest, asyncspade and lfps list *positions* (``a_pos [bs, Hkv,
cap]``, rows with ``a_slot == -2``): what their references, tests and metrics
speak in. The decode kernel reading them in place must map each through
``req_to_token`` before it can fetch the K/V tiles, a chain of three dependent
loads (list -> slot -> tiles). Triton's pipeliner keeps the list load
synchronous inside the loop then, and the gather ran at 1.72 TB/s on an H200 at
32768 x 8 with ~2300 keys a head; with the lists already holding pool slots
(``two_segment_decode(..., a_pos_slots=True)``) the list load is asynchronous
like segment B's and the same launch ran at 2.51 TB/s: 44.6 -> 30.5 us
(bench/README "Session 23", ``bench_decode.py``'s ``ours_sparse_indexed_slots``).

This kernel does the mapping for every indexed row of a layer in one launch, into
a separate buffer, so the positions stay what every other consumer reads. One
program per (row, KV head); rows that are not indexed return at once (CUDA
graphs capture the launch whatever the batch holds). Positions are clamped into
``[0, b_start)`` exactly as the decode kernel clamps them, so a bad list reads the
same memory either way.

Serving no longer launches it: this launch cost 4.8 us a layer on an H200, so the
lists' producers (gather_selection, expand_selection, lfps_select_out; their
``slots=`` argument) write each entry's pool slot beside its position in the same
pass. This kernel stays the mapping's definition (what those outputs must equal)
and serves lists made elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import env_switch

__all__ = ["indexed_pool_slots", "indexed_pool_slots_ref", "ENABLED"]

#: The backend translates the indexed rows' positions and launches the decode on
#: pool slots; ``SGLANG_SPARSE_INDEXED_SLOTS=0`` keeps the position lists (A/B).
ENABLED = env_switch("INDEXED_SLOTS", True)

#: a_slot of the rows whose segment A is a per-head list (two_segment_decode).
_INDEXED = -2


@triton.jit
def _indexed_pool_slots_kernel(A_POS, A_LEN, A_SLOT, B_START, REQ_TO_TOKEN, REQ_POOL_IDX, OUT,
                               stride_pb, stride_ph, stride_lb, stride_r2t, stride_ob, stride_oh, CAP,
                               BLOCK: tl.constexpr):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    if tl.load(A_SLOT + cur_b) != -2:
        return
    b_start = tl.load(B_START + cur_b)
    # the decode kernel's own clamp of the list's length: distinct positions below b_start
    n = tl.minimum(tl.maximum(tl.load(A_LEN + cur_b * stride_lb + cur_h), 0), tl.minimum(b_start, CAP))
    row = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_b).to(tl.int64) * stride_r2t
    src = A_POS + cur_b.to(tl.int64) * stride_pb + cur_h * stride_ph
    dst = OUT + cur_b.to(tl.int64) * stride_ob + cur_h * stride_oh
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        ok = start + offs < n
        pos = tl.minimum(tl.maximum(tl.load(src + start + offs, mask=ok, other=0), 0), b_start - 1)
        tl.store(dst + start + offs, tl.load(row + pos, mask=ok, other=0), mask=ok)


def unpack_slots(slots: Optional[tuple], rows: int, a_pos: torch.Tensor, dummy: torch.Tensor) -> tuple:
    """A producer's ``slots=(req_to_token, req_pool_idx [rows], a_slots)`` checked
    (``a_slots`` shaped as ``a_pos``), or placeholders that the kernel never reads
    when ``slots`` is None: ``(dummy, dummy, a_pos)``."""
    if slots is None:
        return dummy, dummy, a_pos
    req_to_token, req_pool_idx, a_slots = slots
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert req_pool_idx.shape == (rows,) and req_pool_idx.is_contiguous()
    assert a_slots.shape == a_pos.shape and a_slots.dtype == torch.int32 and a_slots.stride(2) == 1
    return req_to_token, req_pool_idx, a_slots


def indexed_pool_slots(a_pos: torch.Tensor, a_len: torch.Tensor, a_slot: torch.Tensor, b_start: torch.Tensor,
                       req_to_token: torch.Tensor, req_pool_idx: torch.Tensor, *,
                       out: Optional[torch.Tensor] = None, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """``out[b, h, i] = req_to_token[req_pool_idx[b], clamp(a_pos[b, h, i], 0, b_start[b] - 1)]``
    for the rows with ``a_slot[b] == -2`` and ``i < min(a_len[b, h], cap, b_start[b])``
    (what ``two_segment_decode`` reads of them); nothing else of ``out`` is written.

    a_pos ``[bs, Hkv, cap]`` int32 (last dim contiguous); a_len ``[bs, Hkv]`` int32;
    a_slot, b_start ``[bs]`` int32; req_to_token ``[reqs, ctx]`` int32; req_pool_idx
    ``[bs]`` int32/int64. Returns ``out`` (default a new ``empty_like(a_pos)``), for
    ``two_segment_decode(..., a_pos=out, a_pos_slots=True)``."""
    bs, hkv, cap = a_pos.shape
    assert a_pos.dtype == torch.int32 and a_pos.stride(2) == 1, "a_pos: int32, last dim contiguous"
    assert a_len.shape == (bs, hkv) and a_len.dtype == torch.int32 and a_len.stride(1) == 1
    assert a_slot.shape == (bs,) and b_start.shape == (bs,) and req_pool_idx.shape == (bs,)
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    if out is None:
        out = torch.empty_like(a_pos)
    assert out.shape == a_pos.shape and out.dtype == torch.int32 and out.stride(2) == 1
    if bs == 0 or hkv == 0 or cap == 0:
        return out
    block = max(16, min(int(block), triton.next_power_of_2(cap)))
    _indexed_pool_slots_kernel[(bs, hkv)](
        a_pos, a_len, a_slot, b_start, req_to_token, req_pool_idx, out,
        a_pos.stride(0), a_pos.stride(1), a_len.stride(0), req_to_token.stride(0), out.stride(0), out.stride(1), cap,
        BLOCK=block, num_warps=max(1, min(int(num_warps), block // 32)),
    )
    return out


def indexed_pool_slots_ref(a_pos: torch.Tensor, a_len: torch.Tensor, a_slot: torch.Tensor, b_start: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_idx: torch.Tensor,
                           out: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch :func:`indexed_pool_slots` (writes the same entries of ``out``)."""
    out = out.clone()
    cap = a_pos.shape[2]
    for b in range(a_pos.shape[0]):
        s = int(b_start[b])
        if int(a_slot[b]) != _INDEXED or s <= 0:
            continue
        row = req_to_token[int(req_pool_idx[b])]
        for h in range(a_pos.shape[1]):
            n = min(max(int(a_len[b, h]), 0), cap, s)
            out[b, h, :n] = row[a_pos[b, h, :n].long().clamp(0, s - 1)]
    return out
