"""
Per-slot selections -> the batch rows of a_pos / a_len, in one launch
=====================================================================

The CUDA-graph path of quest and asyncspade (``sgl_sparse/query_device.py``)
computes or stores each slot's segment A as ``[slots, Hkv, W]`` positions and
``[slots, Hkv]`` lengths; the batch row holding the slot reads them into the
step's ``a_pos [bs, Hkv, cap]`` / ``a_len [bs, Hkv]``. As torch ops that was a
gather, a ``where`` and a copy of the whole ``[bs, Hkv, W]`` block plus two for
the lengths, at every layer, whatever the batch held. Here one program per
(batch row, KV head): a row without a selection this step (``src[b] < 0``)
returns at once and keeps its ``a_pos`` / ``a_len``; the others copy their
first ``len`` positions (what the attention reads) and the length.

With ``slots`` the same pass also writes each copied position's pool slot
(``req_to_token[req_pool_idx[b], pos]``, what ``two_segment_decode(...,
a_pos_slots=True)`` gathers from fastest): kernels/indexed_slots.py's mapping
without a launch of its own (4.8 us a layer on an H200). The copy is latency-bound
(one (row, head) per program, ~2000 entries): blocks of up to 1024 entries and
four warps take it in two or three iterations instead of nine.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._utils import next_pow2
from .indexed_slots import unpack_slots

__all__ = ["gather_selection"]


@triton.jit
def _gather_selection_kernel(SRC, POS, LEN, A_POS, A_LEN, REQ_TO_TOKEN, REQ_POOL_IDX, A_SLOTS, stride_ps, stride_ph,
                             stride_ls, stride_ab, stride_ah, stride_lb, stride_r2t, stride_sb, stride_sh, W, CTX,
                             BLOCK: tl.constexpr, HAS_SLOTS: tl.constexpr):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    s = tl.load(SRC + cur_b).to(tl.int64)
    if s < 0:
        return
    n = tl.minimum(tl.maximum(tl.load(LEN + s * stride_ls + cur_h), 0), W)
    offs = tl.arange(0, BLOCK)
    src = POS + s * stride_ps + cur_h * stride_ph
    dst = A_POS + cur_b * stride_ab + cur_h * stride_ah
    if HAS_SLOTS:
        r2t = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_b).to(tl.int64) * stride_r2t
        dst_s = A_SLOTS + cur_b * stride_sb + cur_h * stride_sh
    for start in range(0, n, BLOCK):
        ok = start + offs < n
        p = tl.load(src + start + offs, mask=ok)
        tl.store(dst + start + offs, p, mask=ok)
        if HAS_SLOTS:
            # the clamp keeps a bad list inside req_to_token's row (memory safety only)
            slot = tl.load(r2t + tl.minimum(tl.maximum(p, 0), CTX - 1), mask=ok, other=0)
            tl.store(dst_s + start + offs, slot, mask=ok)
    tl.store(A_LEN + cur_b * stride_lb + cur_h, n)


def gather_selection(src: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, a_pos: torch.Tensor,
                     a_len: torch.Tensor, *, block: int = 1024,
                     slots: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> None:
    """For each batch row b with ``src[b] >= 0``: ``a_len[b] = length[src[b]]`` (capped at
    ``pos``'s width) and the first ``a_len[b, h]`` entries of ``a_pos[b, h]`` from
    ``pos[src[b], h]``, in place; rows with ``src[b] < 0`` are left as they are.

    src ``[bs]`` int; pos ``[S, Hkv, W]`` int32; length ``[S, Hkv]`` int32; a_pos
    ``[bs, Hkv, >= W]`` int32; a_len ``[bs, Hkv]`` int32 (last dims stride 1).

    ``slots`` = ``(req_to_token [reqs, ctx] int32, req_pool_idx [bs] int, a_slots)``:
    the same entries of ``a_slots`` (shaped as ``a_pos``) get
    ``req_to_token[req_pool_idx[b], pos]`` (pos clamped into ``[0, ctx)``)."""
    bs = src.shape[0]
    s, hkv, w = pos.shape
    assert length.shape == (s, hkv) and length.stride(1) == 1 and pos.stride(2) == 1
    assert a_pos.shape[0] == bs and a_pos.shape[1] == hkv and a_pos.shape[2] >= w and a_pos.stride(2) == 1
    assert a_len.shape == (bs, hkv) and a_len.stride(1) == 1 and src.is_contiguous()
    assert pos.dtype == a_pos.dtype and length.dtype == a_len.dtype
    req_to_token, req_pool_idx, a_slots = unpack_slots(slots, bs, a_pos, src)
    if bs == 0 or hkv == 0:
        return
    blk = min(int(block), max(16, next_pow2(w)))
    _gather_selection_kernel[(bs, hkv)](
        src, pos, length, a_pos, a_len, req_to_token, req_pool_idx, a_slots, pos.stride(0), pos.stride(1),
        length.stride(0), a_pos.stride(0), a_pos.stride(1), a_len.stride(0),
        req_to_token.stride(0) if slots is not None else 0, a_slots.stride(0), a_slots.stride(1), w,
        req_to_token.shape[1] if slots is not None else 1,
        BLOCK=blk, HAS_SLOTS=slots is not None, num_warps=max(1, min(4, blk // 256)),
    )
