"""
Pack selected tokens into the compact buffer (segment A)
========================================================

A sparse policy picks, per request and KV head, up to ``cap`` token
*positions* of the request's sequence (``sel_pos[b, h, :sel_len[b, h]]``).
This kernel gathers their K and V rows from SGLang's paged KV pool
(page_size 1, through ``req_to_token``) and writes them contiguously into
the request's slot of the compact buffers ``a_k``/``a_v``
``[num_slots, Hkv, cap, D]``, then sets ``a_len[b, h]``. Afterwards
``two_segment_decode`` reads segment A with plain contiguous loads.

Only requests with ``do_pack[b] != 0`` are touched (e.g. those whose
selection was refreshed this step); every other program exits right away.
The grid is fixed -- ``(bs, Hkv, num_chunks)`` with ``num_chunks`` derived
from ``cap`` only -- and all descriptors are read on the device, so the
launch is CUDA-graph capturable. Each program copies a strided subset of
BLOCK_N-row tiles, so a short selection costs little and a long one is
spread over ``num_chunks`` programs.

This is a pure copy (no arithmetic), so the packed rows are bit-identical to
the pool rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import cdiv, next_pow2

__all__ = ["pack_compact"]


@triton.jit
def _pack_compact_kernel(
    K_POOL,
    V_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    SEL_POS,
    SEL_LEN,
    DO_PACK,
    A_K,
    A_V,
    A_SLOT,
    A_LEN,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    stride_spb,
    stride_sph,
    stride_slb,
    stride_aks,
    stride_akh,
    stride_akn,
    stride_avs,
    stride_avh,
    stride_avn,
    stride_alb,
    CAP,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    chunk = tl.program_id(2)
    num_chunks = tl.num_programs(2)

    do_pack = tl.load(DO_PACK + cur_b)
    if do_pack != 0:
        n_sel = tl.load(SEL_LEN + cur_b * stride_slb + cur_h).to(tl.int32)
        n_sel = tl.minimum(tl.maximum(n_sel, 0), CAP)
        # One program per (request, head) publishes the new length. Nothing
        # in this launch reads a_len, so there is no ordering hazard.
        if chunk == 0:
            tl.store(A_LEN + cur_b * stride_alb + cur_h, n_sel.to(A_LEN.dtype.element_ty))

        req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)
        slot = tl.load(A_SLOT + cur_b).to(tl.int64)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        sel_base = SEL_POS + cur_b * stride_spb + cur_h * stride_sph
        ak_base = A_K + slot * stride_aks + cur_h * stride_akh
        av_base = A_V + slot * stride_avs + cur_h * stride_avh
        # Tiles chunk, chunk + num_chunks, ...: neighbouring programs touch
        # neighbouring tiles, which keeps the writes to a_k/a_v streaming.
        for n0 in range(chunk * BLOCK_N, n_sel, num_chunks * BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < n_sel
            pos = tl.load(sel_base + offs, mask=mask_n, other=0)
            tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos, mask=mask_n, other=0).to(tl.int64)
            mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :], mask=mask)
            v = tl.load(V_POOL + tok[:, None] * stride_vt + cur_h * stride_vh + offs_d[None, :], mask=mask)
            tl.store(ak_base + offs[:, None] * stride_akn + offs_d[None, :], k, mask=mask)
            tl.store(av_base + offs[:, None] * stride_avn + offs_d[None, :], v, mask=mask)


def pack_compact(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    sel_pos: torch.Tensor,
    sel_len: torch.Tensor,
    do_pack: torch.Tensor,
    a_k: torch.Tensor,
    a_v: torch.Tensor,
    a_slot: torch.Tensor,
    a_len: torch.Tensor,
    *,
    block_n: int = 64,
    max_chunks: Optional[int] = None,
    num_warps: int = 4,
) -> None:
    """Gather selected K/V rows from the paged pool into the compact buffer (in place).

    Args:
        k_pool, v_pool: ``[num_tokens_total, Hkv, D]`` paged KV pool (page_size 1).
        req_to_token: ``[max_reqs, max_ctx]`` int32 (req_pool_idx, pos) -> pool slot.
        req_pool_idx: ``[bs]`` int32/int64.
        sel_pos: ``[bs, Hkv, cap]`` int32 selected positions (in the request's
            sequence, each ``< seq_len``); only the first ``sel_len[b, h]`` are used.
        sel_len: ``[bs, Hkv]`` int32/int64 number of selected positions (clamped to [0, cap]).
        do_pack: ``[bs]`` bool/int; requests with 0/False are not touched at all.
        a_k, a_v: ``[num_slots, Hkv, cap, D]`` compact buffers (written in place).
        a_slot: ``[bs]`` int32 destination slot per request.
        a_len: ``[bs, Hkv]`` int32, set to the clamped ``sel_len`` for packed requests.
        block_n: rows per tile; max_chunks: programs per (request, head)
            (``None``, the default: one per tile; the H100 A/B of
            ``bench_selector.py --pack-ab``, run 8, against at most 16: 92 vs 110 us
            at 32768 x 8, 64 vs 67 us at 131072 x 4, equal at 8192 x 32);
            num_warps: Triton knob.

    Rows at or beyond ``sel_len`` in the destination slot are left untouched.
    No host sync; the grid ``(bs, Hkv, min(cdiv(cap, block_n), max_chunks))``
    depends only on shapes.
    """
    bs, num_kv_heads, cap = sel_pos.shape
    head_dim = k_pool.shape[2]
    assert k_pool.shape[1] == num_kv_heads and v_pool.shape == k_pool.shape
    assert a_k.shape[1:] == (num_kv_heads, cap, head_dim) and a_v.shape == a_k.shape
    assert a_k.dtype == k_pool.dtype and a_v.dtype == v_pool.dtype
    assert sel_len.shape == (bs, num_kv_heads) and a_len.shape == (bs, num_kv_heads)
    assert do_pack.shape[0] == bs and a_slot.shape[0] == bs and req_pool_idx.shape[0] == bs
    assert sel_pos.stride(2) == 1 and sel_len.stride(1) == 1 and a_len.stride(1) == 1
    assert req_to_token.stride(1) == 1
    for t in (k_pool, v_pool, a_k, a_v):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    if do_pack.dtype == torch.bool:
        do_pack = do_pack.view(torch.uint8)  # reinterpret, no copy / no sync

    num_chunks = cdiv(cap, block_n)
    if max_chunks is not None:
        num_chunks = max(1, min(num_chunks, max_chunks))
    grid = (bs, num_kv_heads, num_chunks)
    _pack_compact_kernel[grid](
        k_pool,
        v_pool,
        req_to_token,
        req_pool_idx,
        sel_pos,
        sel_len,
        do_pack,
        a_k,
        a_v,
        a_slot,
        a_len,
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        sel_pos.stride(0),
        sel_pos.stride(1),
        sel_len.stride(0),
        a_k.stride(0),
        a_k.stride(1),
        a_k.stride(2),
        a_v.stride(0),
        a_v.stride(1),
        a_v.stride(2),
        a_len.stride(0),
        cap,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim),
        num_warps=num_warps,
    )
