"""
The Selector's key norms for a chunk of layers, in its row layout, in one launch
================================================================================

SFI's refresh reads the key norm of every candidate (``CompactStore.knorm``
``[layers, pool, Hkv]``, written once with the key) as ``[layers x rows, Hkv, N]``,
the layout of its evidence. As torch ops that was an index gather into ``[layers,
rows, N, Hkv]`` and a permuting copy: two passes and an intermediate the size of
the output (session 33, 130000 x 4 over fp8: 0.31 ms for each chunk of 8 layers,
~1.2 ms of a 15.7 ms refresh). Here a program takes a block of one (layer, row)'s
positions, loads each position's ``Hkv`` norms (one contiguous run of ``4 Hkv``
bytes per pool slot) and stores them transposed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

__all__ = ["gather_key_norms", "gather_key_norms_ref"]


# R (the refresh's rows) only divides the program id: not specialized, so a refresh of
# 16 or 32 rows launches the binary the warm-up's 1- and 2-row launches compiled
# (session 42: sfi-pinned's first 32-row refresh at 8192 x 32 compiled it mid-decode,
# 135 ms).
@triton.jit(do_not_specialize=["R"])
def _gather_key_norms_kernel(KNORM, TOK, OUT, N, R, HKV, stride_kl, stride_ks, stride_tr, stride_om, stride_oh,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    cur_m = tl.program_id(0)  # (layer, row), layer-major: the refresh's row order
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = tl.arange(0, BLOCK_H)
    layer = cur_m // R
    ok = offs < N
    slot = tl.load(TOK + (cur_m % R).to(tl.int64) * stride_tr + offs, mask=ok, other=0).to(tl.int64)
    mask = ok[:, None] & (heads < HKV)[None, :]
    v = tl.load(KNORM + layer.to(tl.int64) * stride_kl + slot[:, None] * stride_ks + heads[None, :], mask=mask)
    tl.store(OUT + cur_m.to(tl.int64) * stride_om + heads[None, :] * stride_oh + offs[:, None], v, mask=mask)


def gather_key_norms_ref(knorm: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The torch ops the kernel replaces: ``[L * R, Hkv, N]``, layer-major."""
    layers, _, hkv = knorm.shape
    r, n = tok.shape
    return knorm[:, tok.long()].permute(0, 1, 3, 2).reshape(layers * r, hkv, n)


def gather_key_norms(knorm: torch.Tensor, tok: torch.Tensor, *, block_n: int = 256) -> torch.Tensor:
    """``out[l * R + r, h, j] = knorm[l, tok[r, j], h]``: ``[L * R, Hkv, N]`` fp32.

    knorm ``[L, P, Hkv]`` (a slice of ``CompactStore.knorm``'s layers: its last dim
    stride 1), tok ``[R, N]`` pool slots (int32 or int64, last dim stride 1)."""
    layers, _, hkv = knorm.shape
    r, n = tok.shape
    assert knorm.stride(2) == 1 and tok.stride(1) == 1, "gather_key_norms: contiguous heads and positions"
    out = torch.empty(layers * r, hkv, n, dtype=knorm.dtype, device=knorm.device)
    if out.numel() == 0:
        return out
    block_h = next_pow2(hkv)
    # ~2K values a program: a block of positions times the heads
    blk = max(16, min(int(block_n), next_pow2(max(1, 2048 // block_h))))
    _gather_key_norms_kernel[(layers * r, triton.cdiv(n, blk))](
        knorm, tok, out, n, r, hkv, knorm.stride(0), knorm.stride(1), tok.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_N=blk, num_warps=4,
    )
    return out
