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

``pack_compact_layers`` is the same copy for several layers in one launch
(the SFI refresh: one launch per refresh instead of one per layer): the
layers' pools come as an address table (``layer_pools.LayerPools``), the grid's
first axis runs over (layer, request) pairs, and the positions may be given
as a sink prefix ``[0, sink)`` plus the selected ones (a Top-K's output as it is).

This is a pure copy (no arithmetic), so the packed rows are bit-identical to
the pool rows.

``list_compact_layers`` is the same launch writing each row's pool slot instead of
its K and V (SFI's ``selections: slot_lists``): ``lists[layer, slot, h, i]`` is the
pool slot ``pack_compact_layers`` would copy to ``a_k[layer, slot, h, i]``, and the
decode kernel's ``a_slot_lists`` reads the rows there.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import cdiv, next_pow2
from .layer_pools import LayerPools, load_layer_pool

__all__ = ["list_compact_layers", "pack_compact", "pack_compact_layers"]


# The address tables (K_PTRS / V_PTRS) are views at any layer (LayerPools.layers: a
# refresh chunk may start at an odd layer, 8 bytes into the table): their alignment
# must not pick the binary, or such a chunk compiles mid-decode (session 13: 350 ms).
@triton.jit(do_not_specialize=["BS", "SEL_W", "stride_spb", "stride_sph"],
            do_not_specialize_on_alignment=["K_PTRS", "V_PTRS"])
def _pack_compact_kernel(
    K_POOL,
    V_POOL,
    K_PTRS,
    V_PTRS,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    SEL_POS,
    SEL_LEN,
    SINK,
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
    stride_slh,
    stride_akl,
    stride_aks,
    stride_akh,
    stride_akn,
    stride_avl,
    stride_avs,
    stride_avh,
    stride_avn,
    stride_alb,
    BS,
    SEL_W,
    CAP,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LAYERED: tl.constexpr,
    SINK_PREFIX: tl.constexpr,
    WRITE_SLOTS: tl.constexpr,  # A_K: [layers, slots, Hkv, cap] int32 pool slots; no K/V read
):
    # Axis 0: (layer, request) pairs, layer-major; one layer unless LAYERED.
    cur_lb = tl.program_id(0)
    cur_b = cur_lb % BS
    layer = cur_lb // BS
    cur_h = tl.program_id(1)
    chunk = tl.program_id(2)
    num_chunks = tl.num_programs(2)

    do_pack = tl.load(DO_PACK + cur_b)
    if do_pack != 0:
        n_sel = tl.load(SEL_LEN + cur_b * stride_slb + cur_h * stride_slh).to(tl.int32)
        n_sel = tl.minimum(tl.maximum(n_sel, 0), CAP)
        # One program per (request, head) publishes the new length (the same for
        # every layer). Nothing in this launch reads a_len: no ordering hazard.
        if (chunk == 0) & (layer == 0):
            tl.store(A_LEN + cur_b * stride_alb + cur_h, n_sel.to(A_LEN.dtype.element_ty))

        k_pool = load_layer_pool(K_POOL, K_PTRS, layer, LAYERED)
        v_pool = load_layer_pool(V_POOL, V_PTRS, layer, LAYERED)
        req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)
        slot = tl.load(A_SLOT + cur_b).to(tl.int64)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        sel_base = SEL_POS + cur_lb.to(tl.int64) * stride_spb + cur_h * stride_sph
        ak_base = A_K + layer.to(tl.int64) * stride_akl + slot * stride_aks + cur_h * stride_akh
        av_base = A_V + layer.to(tl.int64) * stride_avl + slot * stride_avs + cur_h * stride_avh
        if SINK_PREFIX:
            sink = tl.load(SINK + cur_b).to(tl.int32)
        # Tiles chunk, chunk + num_chunks, ...: neighbouring programs touch
        # neighbouring tiles, which keeps the writes to a_k/a_v streaming.
        for n0 in range(chunk * BLOCK_N, n_sel, num_chunks * BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < n_sel
            if SINK_PREFIX:  # positions [0, sink), then the selected ones
                from_sel = offs - sink
                picked = tl.load(sel_base + from_sel, mask=mask_n & (from_sel >= 0) & (from_sel < SEL_W), other=0)
                pos = tl.where(from_sel < 0, offs, picked)
            else:
                pos = tl.load(sel_base + offs, mask=mask_n, other=0)
            tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos, mask=mask_n, other=0).to(tl.int64)
            if WRITE_SLOTS:
                tl.store(ak_base + offs * stride_akn, tok.to(tl.int32), mask=mask_n)
            else:
                mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(k_pool + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :], mask=mask)
                v = tl.load(v_pool + tok[:, None] * stride_vt + cur_h * stride_vh + offs_d[None, :], mask=mask)
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
    assert a_k.shape[1:] == (num_kv_heads, cap, k_pool.shape[2]) and a_v.shape == a_k.shape
    _launch(LayerPools.one(k_pool), LayerPools.one(v_pool), req_to_token, req_pool_idx, sel_pos,
            sel_len, None, do_pack, a_k[None], a_v[None], a_slot, a_len,
            layered=False, block_n=block_n, max_chunks=max_chunks, num_warps=num_warps)


def pack_compact_layers(
    k_pools: LayerPools,
    v_pools: LayerPools,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    sel_pos: torch.Tensor,
    sel_len: torch.Tensor,
    sink: torch.Tensor,
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
    """``pack_compact`` for several layers in one launch, the sink as a prefix.

    Request ``b``'s compact rows of layer ``l`` are its positions ``[0, sink[b])``
    then ``sel_pos[l * bs + b, h, :sel_len[b, h] - sink[b]]`` (e.g. a Top-K's
    ascending output as it is: no ``[bs, Hkv, cap]`` position tensor to build).

    Args:
        k_pools, v_pools: the layers' pools (``LayerPools``, layer ``l`` =
            ``ptrs[l]``).
        sel_pos: ``[layers * bs, Hkv, W]`` int32 (layer-major), stride 1 along ``W``;
            ``sel_len - sink <= W``.
        sel_len: ``[bs, Hkv]`` (any strides) rows to write per (request, head),
            the same for every layer (clamped to [0, cap]); ``a_len`` ``[bs, Hkv]``
            is set to it.
        sink: ``[bs]`` int32 positions kept before the selected ones.
        a_k, a_v: ``[layers, num_slots, Hkv, cap, D]`` (e.g. ``CompactStore.k[l0:l1]``).
        Others as in ``pack_compact``.
    """
    layers = len(k_pools)
    bs, num_kv_heads = sel_len.shape
    assert len(v_pools) == layers and a_k.shape[0] == layers and sel_pos.shape[:2] == (layers * bs, num_kv_heads)
    assert sink.shape == (bs,)
    _launch(k_pools, v_pools, req_to_token, req_pool_idx, sel_pos, sel_len, sink, do_pack, a_k, a_v, a_slot, a_len,
            layered=True, block_n=block_n, max_chunks=max_chunks, num_warps=num_warps)


def list_compact_layers(
    k_pools: LayerPools,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    sel_pos: torch.Tensor,
    sel_len: torch.Tensor,
    sink: torch.Tensor,
    do_pack: torch.Tensor,
    lists: torch.Tensor,
    a_slot: torch.Tensor,
    a_len: torch.Tensor,
    *,
    block_n: int = 64,
    max_chunks: Optional[int] = None,
    num_warps: int = 4,
) -> None:
    """``pack_compact_layers`` writing the rows' pool slots instead of copying them.

    ``lists``: ``[layers, num_slots, Hkv, cap]`` int32 (e.g. ``CompactStore.lists[l0:l1]``),
    last dim contiguous: ``lists[l, a_slot[b], h, i] = req_to_token[req_pool_idx[b], p]``
    for the same rows ``p`` (the sink prefix, then ``sel_pos``) that ``pack_compact_layers``
    copies. ``k_pools`` only sizes the launch (its layer count); no K or V is read.
    Others as in ``pack_compact_layers``.
    """
    layers = len(k_pools)
    bs, num_kv_heads = sel_len.shape
    assert lists.dim() == 4 and lists.shape[0] == layers and lists.shape[2] == num_kv_heads, \
        "lists: [layers, slots, Hkv, cap]"
    assert lists.dtype == torch.int32 and lists.stride(3) == 1, "lists: int32, last dim contiguous"
    assert sel_pos.shape[:2] == (layers * bs, num_kv_heads) and sink.shape == (bs,)
    _launch(k_pools, k_pools, req_to_token, req_pool_idx, sel_pos, sel_len, sink, do_pack, lists[..., None],
            lists[..., None], a_slot, a_len, layered=True, block_n=block_n, max_chunks=max_chunks,
            num_warps=num_warps, write_slots=True)


def _launch(k_pools: LayerPools, v_pools: LayerPools, req_to_token, req_pool_idx, sel_pos, sel_len,
            sink: Optional[torch.Tensor], do_pack, a_k, a_v, a_slot, a_len, *, layered: bool, block_n: int,
            max_chunks: Optional[int], num_warps: int, write_slots: bool = False) -> None:
    """One launch over (layer, request) x head x chunks; ``a_k``/``a_v`` ``[layers, slots, Hkv, cap, D]``
    (``write_slots``: both the lists ``[layers, slots, Hkv, cap, 1]``)."""
    k_pool, v_pool = k_pools.pool, v_pools.pool
    layers, _, num_kv_heads, cap, head_dim = a_k.shape
    bs = sel_len.shape[0]
    if write_slots:
        head_dim = k_pool.shape[2]
    else:
        assert a_v.shape == a_k.shape and a_k.dtype == k_pool.dtype and a_v.dtype == v_pool.dtype
    assert k_pool.shape[1:] == (num_kv_heads, head_dim) and v_pool.shape == k_pool.shape
    assert sel_len.shape == (bs, num_kv_heads) and a_len.shape == (bs, num_kv_heads)
    assert sel_pos.shape[:2] == (layers * bs, num_kv_heads)
    assert do_pack.shape[0] == bs and a_slot.shape[0] == bs and req_pool_idx.shape[0] == bs
    assert sel_pos.stride(2) == 1 and a_len.stride(1) == 1
    assert req_to_token.stride(1) == 1
    for t in (k_pool, v_pool, a_k, a_v):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    if do_pack.dtype == torch.bool:
        do_pack = do_pack.view(torch.uint8)  # reinterpret, no copy / no sync

    num_chunks = cdiv(cap, block_n)
    if max_chunks is not None:
        num_chunks = max(1, min(num_chunks, max_chunks))
    grid = (layers * bs, num_kv_heads, num_chunks)
    _pack_compact_kernel[grid](
        k_pool,
        v_pool,
        k_pools.ptrs,
        v_pools.ptrs,
        req_to_token,
        req_pool_idx,
        sel_pos,
        sel_len,
        sel_len if sink is None else sink,  # unread without a sink prefix
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
        sel_len.stride(1),
        a_k.stride(0),
        a_k.stride(1),
        a_k.stride(2),
        a_k.stride(3),
        a_v.stride(0),
        a_v.stride(1),
        a_v.stride(2),
        a_v.stride(3),
        a_len.stride(0),
        bs,
        sel_pos.shape[2],
        cap,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim),
        LAYERED=layered,
        SINK_PREFIX=sink is not None,
        WRITE_SLOTS=write_slots,
        num_warps=num_warps,
    )
