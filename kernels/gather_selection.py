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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

__all__ = ["gather_selection"]


@triton.jit
def _gather_selection_kernel(SRC, POS, LEN, A_POS, A_LEN, stride_ps, stride_ph, stride_ls, stride_ab, stride_ah,
                             stride_lb, W, BLOCK: tl.constexpr):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    s = tl.load(SRC + cur_b).to(tl.int64)
    if s < 0:
        return
    n = tl.minimum(tl.maximum(tl.load(LEN + s * stride_ls + cur_h), 0), W)
    offs = tl.arange(0, BLOCK)
    src = POS + s * stride_ps + cur_h * stride_ph
    dst = A_POS + cur_b * stride_ab + cur_h * stride_ah
    for start in range(0, n, BLOCK):
        ok = start + offs < n
        tl.store(dst + start + offs, tl.load(src + start + offs, mask=ok), mask=ok)
    tl.store(A_LEN + cur_b * stride_lb + cur_h, n)


def gather_selection(src: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, a_pos: torch.Tensor,
                     a_len: torch.Tensor, *, block: int = 256) -> None:
    """For each batch row b with ``src[b] >= 0``: ``a_len[b] = length[src[b]]`` (capped at
    ``pos``'s width) and the first ``a_len[b, h]`` entries of ``a_pos[b, h]`` from
    ``pos[src[b], h]``, in place; rows with ``src[b] < 0`` are left as they are.

    src ``[bs]`` int; pos ``[S, Hkv, W]`` int32; length ``[S, Hkv]`` int32; a_pos
    ``[bs, Hkv, >= W]`` int32; a_len ``[bs, Hkv]`` int32 (last dims stride 1)."""
    bs = src.shape[0]
    s, hkv, w = pos.shape
    assert length.shape == (s, hkv) and length.stride(1) == 1 and pos.stride(2) == 1
    assert a_pos.shape[0] == bs and a_pos.shape[1] == hkv and a_pos.shape[2] >= w and a_pos.stride(2) == 1
    assert a_len.shape == (bs, hkv) and a_len.stride(1) == 1 and src.is_contiguous()
    assert pos.dtype == a_pos.dtype and length.dtype == a_len.dtype
    if bs == 0 or hkv == 0:
        return
    _gather_selection_kernel[(bs, hkv)](
        src, pos, length, a_pos, a_len, pos.stride(0), pos.stride(1), length.stride(0), a_pos.stride(0),
        a_pos.stride(1), a_len.stride(0), w, BLOCK=min(int(block), max(16, next_pow2(w))), num_warps=1,
    )
