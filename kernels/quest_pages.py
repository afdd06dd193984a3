"""
Quest: per-page key bounds and query-aware page scores
======================================================

Quest (the ``quest`` baseline policy) keeps, per layer, request and KV head,
the element-wise minimum and maximum of the keys of every *page* of 16
consecutive positions (page ``p`` = positions ``[16p, 16p + 16)`` of the
request, independent of SGLang's own page_size 1 pool). At decode it bounds
each page's attention logit from above without reading the page's keys::

    q . k  <=  sum_d max(q_d * kmin_d, q_d * kmax_d)      for every k in the page

and attends only to the top-k pages (plus sink and recent tokens).

The bounds store is ``kmin/kmax [layers, slots, Hkv, max_pages, D]`` in the KV
dtype (min/max of values of that dtype are exact); every kernel here takes one
layer's view ``[slots, Hkv, max_pages, D]`` and a per-row ``slot`` into it.

Kernels
-------
* :func:`quest_bounds_update` (extend): recompute the bounds of every page
  touching positions ``[lo, hi)`` from the keys in the pool -- whole pages,
  from their first position, so a page left half-filled by an earlier chunk or
  by a radix-cache prefix hit (``lo = 0``: the whole prefix) is rebuilt right.
* :func:`quest_bounds_decode` (decode): fold the one key written this step
  (position ``n - 1``) into its page: min/max with the stored bounds, or a
  plain copy when it is the page's first position. One program per (row, KV
  head), CUDA-graph friendly. ``two_segment_decode(..., quest_bounds=(kmin,
  kmax, slot))`` does the same inside the decode launch, saving this one.
* :func:`quest_page_scores`: the bound above for every page in
  ``[first_page, last_page)`` (the caller leaves sink and recent pages out),
  ``-inf`` elsewhere, fp32 ``[bs, Hkv, max_pages]``. The sum splits into two
  matrix products, ``relu(q) . kmax + min(q, 0) . kmin`` (exact: for
  ``q_d >= 0`` the max is ``q_d * kmax_d``, otherwise ``q_d * kmin_d``), so the
  whole GQA group is scored with tensor-core ``tl.dot``\\ s. GQA aggregate: the
  **max over the group's query heads** -- a page is kept if any head of the
  group may attend to it strongly, and the result is still an upper bound of
  every head's logit.
* :func:`quest_select_positions`: ``torch.topk`` pages, then one kernel
  expanding them into the per-head position list ``a_pos`` / ``a_len`` that
  ``two_segment_decode`` reads in place (``a_slot == -2``), with sink
  positions in front, clipped below ``b_start``.

No host syncs anywhere; grids depend on static shapes only.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ._utils import QUEST_PAGE_SIZE, cdiv, needs_fp32_dot, next_pow2
from .indexed_slots import unpack_slots
from .two_segment_decode import FP8_KV_DTYPES, _dot

__all__ = [
    "QUEST_PAGE_SIZE",
    "quest_bounds_update",
    "quest_bounds_decode",
    "quest_page_scores",
    "quest_select_positions",
]


def _bounds_dtypes(k_pool: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The page bounds' dtypes over this pool: its own; over an fp8 pool the model's
    (bf16 or fp16 hold every fp8 value exactly, and the page scores read the bounds
    beside the queries)."""
    return (torch.bfloat16, torch.float16) if k_pool.dtype in FP8_KV_DTYPES else (k_pool.dtype,)


# -----------------------------------------------------------------------------
# Bounds at extend: whole pages covering [lo, hi)
# -----------------------------------------------------------------------------


@triton.jit
def _quest_bounds_update_kernel(
    K_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    SLOT,  # [bs] int32 slot in the bounds store; < 0: row untouched
    LO,  # [bs] int32
    HI,  # [bs] int32
    KMIN,  # [slots, Hkv, max_pages, D]
    KMAX,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_bs,  # KMIN/KMAX strides (shared layout)
    stride_bh,
    stride_bp,
    MAX_PAGES,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    pid = tl.program_id(2)
    nprog = tl.num_programs(2)
    slot = tl.load(SLOT + cur_b).to(tl.int64)
    lo = tl.maximum(tl.load(LO + cur_b), 0)
    hi = tl.load(HI + cur_b)
    if slot < 0:
        return
    first = lo // PAGE
    last = tl.minimum(tl.cdiv(hi, PAGE), MAX_PAGES)  # pages [first, last)
    req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)

    offs_p = tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, PAGE)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    kmin_base = KMIN + slot * stride_bs + cur_h * stride_bh
    kmax_base = KMAX + slot * stride_bs + cur_h * stride_bh
    # Blocks of BLOCK_P pages, strided over the programs of this (row, head).
    for p0 in range(first + pid * BLOCK_P, last, nprog * BLOCK_P):
        pages = p0 + offs_p  # [BLOCK_P]
        pos = pages[:, None] * PAGE + offs_j[None, :]  # [BLOCK_P, PAGE]
        # A page is rebuilt from its first position (positions below lo are
        # already in the pool); positions >= hi are not written yet.
        valid = (pages[:, None] < last) & (pos < hi)
        tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
        m3 = valid[:, :, None] & mask_d[None, None, :]
        k = tl.load(K_POOL + tok[:, :, None] * stride_kt + cur_h * stride_kh + offs_d[None, None, :],
                    mask=m3, other=0.0).to(tl.float32)  # exact; fp32 also dodges the interpreter's bf16 bits
        kmin = tl.min(tl.where(m3, k, float("inf")), axis=1)  # [BLOCK_P, BLOCK_D]
        kmax = tl.max(tl.where(m3, k, float("-inf")), axis=1)
        smask = (pages < last)[:, None] & mask_d[None, :]
        off = pages[:, None].to(tl.int64) * stride_bp + offs_d[None, :]
        tl.store(kmin_base + off, kmin.to(KMIN.dtype.element_ty), mask=smask)
        tl.store(kmax_base + off, kmax.to(KMAX.dtype.element_ty), mask=smask)


def quest_bounds_update(
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    slot: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    num_programs: Optional[int] = None,
    block_p: int = 4,
    num_warps: int = 4,
) -> None:
    """Recompute the bounds of every page touching positions ``[lo[b], hi[b])``.

    Args:
        k_pool: ``[pool, Hkv, D]`` key buffer of one layer (page_size 1).
        req_to_token: ``[max_reqs, max_ctx]`` int32; req_pool_idx: ``[bs]``.
        slot: ``[bs]`` int32 row of the bounds store; rows with ``slot < 0`` are
            not touched.
        lo, hi: ``[bs]`` int32. Pages ``lo // 16 .. ceil(hi / 16) - 1`` (capped
            at ``max_pages``) are rebuilt from *all* their positions below
            ``hi``: positions of the first page before ``lo`` must already be in
            the pool. Pass ``lo = 0`` after a radix-cache prefix hit to cover
            the reused prefix too. ``hi <= lo``: nothing.
        kmin, kmax: ``[slots, Hkv, max_pages, D]`` (one layer's view), KV dtype
            (the model's over an fp8 pool), same strides; written in place. Pages
            outside the range keep their values.
        num_programs: programs per (row, KV head) (default from ``max_pages``).
    """
    bs = slot.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    assert kmin.shape == kmax.shape and kmin.stride() == kmax.stride()
    assert kmin.dim() == 4 and kmin.shape[1] == num_kv_heads and kmin.shape[3] == head_dim
    assert kmin.dtype in _bounds_dtypes(k_pool) and kmin.stride(3) == 1 and k_pool.stride(2) == 1
    assert req_to_token.stride(1) == 1
    assert lo.shape == (bs,) and hi.shape == (bs,) and req_pool_idx.shape == (bs,)
    max_pages = kmin.shape[2]
    if num_programs is None:
        num_programs = max(1, min(cdiv(max_pages, block_p), 32))
    grid = (bs, num_kv_heads, int(num_programs))
    _quest_bounds_update_kernel[grid](
        k_pool, req_to_token, req_pool_idx, slot, lo, hi, kmin, kmax,
        k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        max_pages,
        HEAD_DIM=head_dim, PAGE=QUEST_PAGE_SIZE, BLOCK_P=block_p, BLOCK_D=next_pow2(head_dim),
        num_warps=num_warps,
    )


# -----------------------------------------------------------------------------
# Bounds at decode: fold in the key at position n - 1
# -----------------------------------------------------------------------------


@triton.jit
def _quest_bounds_decode_kernel(
    K_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    SLOT,
    SEQ_LENS,  # [bs] int32: the key written this step is at position seq_lens - 1
    KMIN,
    KMAX,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_bs,
    stride_bh,
    stride_bp,
    MAX_PAGES,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    slot = tl.load(SLOT + cur_b).to(tl.int64)
    pos = tl.load(SEQ_LENS + cur_b) - 1
    page = pos // PAGE
    if (slot >= 0) & (pos >= 0) & (page < MAX_PAGES):
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)
        tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos).to(tl.int64)
        k = tl.load(K_POOL + tok * stride_kt + cur_h * stride_kh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        off = slot * stride_bs + cur_h * stride_bh + page.to(tl.int64) * stride_bp + offs_d
        # A page's first position starts it afresh: whatever the store held
        # there belonged to an earlier request of the slot.
        keep = (pos % PAGE) != 0
        old_min = tl.load(KMIN + off, mask=mask_d & keep, other=float("inf")).to(tl.float32)
        old_max = tl.load(KMAX + off, mask=mask_d & keep, other=float("-inf")).to(tl.float32)
        tl.store(KMIN + off, tl.minimum(old_min, k).to(KMIN.dtype.element_ty), mask=mask_d)
        tl.store(KMAX + off, tl.maximum(old_max, k).to(KMAX.dtype.element_ty), mask=mask_d)


def quest_bounds_decode(
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    slot: torch.Tensor,
    seq_lens: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    num_warps: int = 1,
) -> None:
    """Fold the key at position ``seq_lens[b] - 1`` into its page's bounds.

    Call after the step's key is in the pool. Rows with ``slot < 0`` (or
    ``seq_lens == 0``, or a page past ``max_pages``) are not touched. When the
    position is the first of its page the bounds are set to the key; else
    ``kmin = min(kmin, k)``, ``kmax = max(kmax, k)``. Grid ``(bs, Hkv)``.
    """
    bs = slot.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    assert kmin.shape == kmax.shape and kmin.stride() == kmax.stride() and kmin.dtype in _bounds_dtypes(k_pool)
    assert kmin.stride(3) == 1 and k_pool.stride(2) == 1 and req_to_token.stride(1) == 1
    assert seq_lens.shape == (bs,) and req_pool_idx.shape == (bs,)
    _quest_bounds_decode_kernel[(bs, num_kv_heads)](
        k_pool, req_to_token, req_pool_idx, slot, seq_lens, kmin, kmax,
        k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        kmin.shape[2],
        HEAD_DIM=head_dim, PAGE=QUEST_PAGE_SIZE, BLOCK_D=next_pow2(head_dim),
        num_warps=num_warps,
    )


# -----------------------------------------------------------------------------
# Page scores
# -----------------------------------------------------------------------------


@triton.jit
def _quest_page_scores_kernel(
    Q,  # [bs, Hq, D]
    KMIN,
    KMAX,
    SLOT,
    FIRST_PAGE,  # [bs] int32
    LAST_PAGE,  # [bs] int32
    OUT,  # [bs, Hkv, max_pages] fp32
    Q_ROWS,  # [bs] int: the row of Q of each row (only if HAS_Q_ROWS)
    stride_qb,
    stride_qh,
    stride_bs,
    stride_bh,
    stride_bp,
    stride_ob,
    stride_oh,
    MAX_PAGES,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FILL: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    blk = tl.program_id(2)
    offs_p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    slot = tl.load(SLOT + cur_b).to(tl.int64)
    first = tl.maximum(tl.load(FIRST_PAGE + cur_b), 0)
    last = tl.minimum(tl.load(LAST_PAGE + cur_b), MAX_PAGES)
    if not FILL:
        # only [first, last) of live rows is read: a block outside it has nothing to do
        if (slot < 0) | (last <= first) | (blk * BLOCK_P >= last) | (blk * BLOCK_P + BLOCK_P <= first):
            return
    in_range = (offs_p >= first) & (offs_p < last) & (slot >= 0)
    out_ptr = OUT + cur_b * stride_ob + cur_h * stride_oh + offs_p
    score = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    # Skip the loads (not the store) when no page of this block is in range.
    if (blk * BLOCK_P < last) & (blk * BLOCK_P + BLOCK_P > first) & (slot >= 0):
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        q_b = cur_b.to(tl.int64)
        if HAS_Q_ROWS:
            q_b = tl.load(Q_ROWS + cur_b).to(tl.int64)
        q = tl.load(Q + q_b * stride_qb + (cur_h * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        # max(q*kmin, q*kmax) summed over d == relu(q).kmax + min(q,0).kmin;
        # both halves of q are exact in q's dtype, so two tensor-core dots.
        # (Split in fp32: the interpreter compares bf16 as raw bit patterns.)
        q32 = q.to(tl.float32)
        q_pos = tl.maximum(q32, 0.0).to(q.dtype)
        q_neg = tl.minimum(q32, 0.0).to(q.dtype)
        base = slot * stride_bs + cur_h * stride_bh
        kmask = in_range[:, None] & mask_d[None, :]
        off = base + offs_p[:, None].to(tl.int64) * stride_bp + offs_d[None, :]
        kmn = tl.load(KMIN + off, mask=kmask, other=0.0)
        kmx = tl.load(KMAX + off, mask=kmask, other=0.0)
        s = _dot(q_pos, tl.trans(kmx), FP32_DOT) + _dot(q_neg, tl.trans(kmn), FP32_DOT)  # [BLOCK_H, BLOCK_P]
        s = tl.where(mask_h[:, None], s, float("-inf"))
        score = tl.where(in_range, tl.max(s, 0), float("-inf"))
    tl.store(out_ptr, score, mask=offs_p < MAX_PAGES)


def quest_page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slot: torch.Tensor,
    first_page: torch.Tensor,
    last_page: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    block_p: int = 64,
    num_warps: int = 4,
    fill: bool = True,
    q_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Quest upper bounds of the attention logits per page, fp32 ``[bs, Hkv, max_pages]``.

    ``score[b, h, p] = max_{g in group(h)} sum_d max(q[b,g,d] * kmin[s,h,p,d],
    q[b,g,d] * kmax[s,h,p,d])`` with ``s = slot[b]``, for ``first_page[b] <= p <
    last_page[b]``; ``-inf`` for every other page and for rows with ``slot < 0``.
    Unscaled (no ``sm_scale``): only the ranking matters. ``q``: ``[bs, Hq, D]``
    in the KV dtype. Grid ``(bs, Hkv, ceil(max_pages / block_p))``. ``fill=False``:
    only ``[first_page, last_page)`` of rows with ``slot >= 0`` is written (what
    ``topk_range`` over that range reads); every other program returns at once.
    ``q_rows`` (int ``[bs]``): row ``b`` reads ``q[q_rows[b]]`` (``q`` then has any
    number of rows).
    """
    _, num_q_heads, head_dim = q.shape
    bs = q.shape[0] if q_rows is None else q_rows.shape[0]
    if q_rows is not None:
        assert not q_rows.is_floating_point() and q_rows.is_contiguous()
    num_kv_heads, max_pages = kmin.shape[1], kmin.shape[2]
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    assert kmin.shape == kmax.shape and kmin.stride() == kmax.stride() and kmin.shape[3] == head_dim
    assert q.dtype == kmin.dtype, "q and the bounds must share a dtype"
    assert q.stride(2) == 1 and kmin.stride(3) == 1
    assert first_page.shape == (bs,) and last_page.shape == (bs,) and slot.shape == (bs,)
    if out is None:
        out = torch.empty((bs, num_kv_heads, max_pages), dtype=torch.float32, device=q.device)
    assert out.shape == (bs, num_kv_heads, max_pages) and out.dtype == torch.float32 and out.stride(2) == 1
    block_p = max(16, min(int(block_p), next_pow2(max_pages)))  # tl.dot needs N >= 16
    grid = (bs, num_kv_heads, cdiv(max_pages, block_p))
    _quest_page_scores_kernel[grid](
        q, kmin, kmax, slot, first_page, last_page, out, q_rows if q_rows is not None else slot,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), out.stride(0), out.stride(1),
        max_pages,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_H=max(16, next_pow2(group)), BLOCK_P=block_p,
        BLOCK_D=next_pow2(head_dim), FP32_DOT=needs_fp32_dot(q.dtype), FILL=bool(fill),
        HAS_Q_ROWS=q_rows is not None,
        num_warps=num_warps,
    )
    return out


# -----------------------------------------------------------------------------
# Top-k pages -> position list for two_segment_decode's indexed segment A
# -----------------------------------------------------------------------------


@triton.jit
def _store_slots(DST, R2T_ROW, pos, mask, CTX):
    # pos clamped into the request's row for memory safety only (listed positions are < b_start)
    tl.store(DST, tl.load(R2T_ROW + tl.minimum(tl.maximum(pos, 0), CTX - 1), mask=mask, other=0), mask=mask)


@triton.jit(do_not_specialize=["budget_all"])
def _expand_selection_kernel(
    VALS,  # [bs, Hkv, K] fp32 top-k scores (descending); HAS_COUNT: [bs, Hkv] int32 entries listed
    IDX,  # [bs, Hkv, K] int their indices: pages (PAGE > 1), positions, or candidate slots (HAS_CAND)
    CAND,  # [bs, Hkv, C] int32 candidate positions (only if HAS_CAND)
    BUDGET,  # [bs] int32 entries to keep per row (only if HAS_BUDGET)
    SINK,  # [bs] int32 sink positions per row (only if HAS_SINK; else N_SINK for all)
    B_START,  # [bs] int32
    A_POS,  # [bs, Hkv, WIDTH] int32 out (WIDTH >= n_sink + PAGE K unless HAS_SINK)
    A_LEN,  # [bs, Hkv] int32 out
    OUT_ROWS,  # [bs] int: the row of A_POS / A_LEN that row b writes, < 0: none (only if HAS_ROWS)
    REQ_TO_TOKEN,  # [reqs, CTX] int32 (only if HAS_SLOTS)
    REQ_POOL_IDX,  # [bs] int: row b's request (only if HAS_SLOTS)
    A_SLOTS,  # shaped as A_POS, int32 out: the listed positions' pool slots (only if HAS_SLOTS)
    stride_vb,
    stride_vh,
    stride_ib,
    stride_ih,
    stride_cb,
    stride_ch,
    stride_pb,
    stride_ph,
    stride_lb,
    stride_r2t,
    stride_sb,
    stride_sh,
    budget_all,
    K,
    N_SINK,
    WIDTH,
    CTX,
    PAGE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    HAS_CAND: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    """Top-k entries -> [sinks, listed positions] per (row, KV head), compacted.

    Entry i (i < budget, finite score; HAS_COUNT: i < VALS[row, head], as
    ``topk_range`` lists them) stands for positions [PAGE*p, PAGE*p + PAGE)
    with p = IDX[i] (or CAND[IDX[i]]); those in [n_sink, b_start) are listed, in
    entry order, each entry's run placed by an exclusive prefix sum of the counts.
    HAS_SINK (per-row sinks, the query-aware serving path inside CUDA graphs): the
    sink runs are written in a loop of BLOCK_S and nothing is written at or past
    WIDTH (a_len is capped there too), so a row's knobs can never overrun the
    fixed-width buffer.
    HAS_SLOTS: every listed position (sinks included) also as its pool slot
    ``req_to_token[req_pool_idx[b], pos]``, at the same place of A_SLOTS (the
    decode's fastest gather, kernels/indexed_slots.py, without a launch of its own).
    """
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    out_b = cur_b.to(tl.int64)
    if HAS_ROWS:
        out_b = tl.load(OUT_ROWS + cur_b).to(tl.int64)
        if out_b < 0:  # nothing to write for this row
            return
    b_start = tl.load(B_START + cur_b)
    budget = budget_all
    if HAS_BUDGET:
        budget = tl.load(BUDGET + cur_b)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    if HAS_COUNT:
        in_k = in_k & (offs_k < tl.load(VALS + cur_b * stride_vb + cur_h * stride_vh))
    else:
        vals = tl.load(VALS + cur_b * stride_vb + cur_h * stride_vh + offs_k, mask=in_k, other=float("-inf"))
        in_k = in_k & (vals > float("-inf"))
    page = tl.load(IDX + cur_b * stride_ib + cur_h * stride_ih + offs_k, mask=in_k, other=0).to(tl.int32)
    if HAS_CAND:
        page = tl.load(CAND + cur_b * stride_cb + cur_h * stride_ch + page, mask=in_k, other=0)
    sink_all = N_SINK
    if HAS_SINK:
        sink_all = tl.maximum(tl.load(SINK + cur_b), 0)
    chosen = in_k & (offs_k < budget)
    # Positions of page p that are listed: [max(16p, n_sink), min(16p + 16, b_start)).
    start = tl.maximum(page * PAGE, sink_all)
    cnt = tl.where(chosen, tl.maximum(tl.minimum(page * PAGE + PAGE, b_start) - start, 0), 0)
    n_sink = tl.minimum(sink_all, tl.maximum(b_start, 0))
    off = n_sink + tl.cumsum(cnt, 0) - cnt  # exclusive prefix sum: where each page's run goes
    pos_base = A_POS + out_b * stride_pb + cur_h * stride_ph
    if HAS_SLOTS:
        r2t = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_b).to(tl.int64) * stride_r2t
        slot_base = A_SLOTS + out_b * stride_sb + cur_h * stride_sh
    offs_s = tl.arange(0, BLOCK_S)
    if HAS_SINK:
        for s0 in range(0, n_sink, BLOCK_S):
            ok_s = (s0 + offs_s < n_sink) & (s0 + offs_s < WIDTH)
            tl.store(pos_base + s0 + offs_s, s0 + offs_s, mask=ok_s)
            if HAS_SLOTS:
                _store_slots(slot_base + s0 + offs_s, r2t, s0 + offs_s, ok_s, CTX)
    else:
        tl.store(pos_base + offs_s, offs_s, mask=offs_s < n_sink)
        if HAS_SLOTS:
            _store_slots(slot_base + offs_s, r2t, offs_s, offs_s < n_sink, CTX)
    if PAGE == 1:
        tl.store(pos_base + off, start, mask=(cnt > 0) & (off < WIDTH))
        if HAS_SLOTS:
            _store_slots(slot_base + off, r2t, start, (cnt > 0) & (off < WIDTH), CTX)
    else:
        offs_j = tl.arange(0, PAGE)
        dst = off[:, None] + offs_j[None, :]
        ok_j = (offs_j[None, :] < cnt[:, None]) & (dst < WIDTH)
        tl.store(pos_base + dst, start[:, None] + offs_j[None, :], mask=ok_j)
        if HAS_SLOTS:
            _store_slots(slot_base + dst, r2t, start[:, None] + offs_j[None, :], ok_j, CTX)
    tl.store(A_LEN + out_b * stride_lb + cur_h, tl.minimum(n_sink + tl.sum(cnt, 0), WIDTH))


def quest_select_positions(
    scores: torch.Tensor,
    num_pages: Union[int, torch.Tensor],
    b_start: torch.Tensor,
    *,
    max_select_pages: int,
    n_sink: int = 0,
    out_pos: Optional[torch.Tensor] = None,
    out_len: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top pages per (row, KV head) -> ``(a_pos, a_len)`` for ``a_slot == -2``.

    ``torch.topk`` picks the pages, then one small kernel (grid ``(bs, Hkv)``)
    expands them into positions -- instead of a dozen elementwise/sort launches
    per layer, which under a CUDA graph would cost more than the attention of a
    short request.

    Args:
        scores: ``[bs, Hkv, max_pages]`` fp32 from :func:`quest_page_scores`
            (``-inf`` = not selectable).
        num_pages: pages to keep per row, an int or an int32 tensor ``[bs]``
            (values above ``max_select_pages`` act as it).
        b_start: ``[bs]`` int32; only positions ``< b_start`` are listed
            (segment B, the recent window, starts there).
        max_select_pages: static k of ``torch.topk`` (fixed per CUDA graph).
        n_sink: positions ``[0, n_sink)`` (clipped at ``b_start``) are listed
            first; page positions below ``n_sink`` are dropped so that every
            listed position is distinct.
        out_pos, out_len: optional preallocated outputs.

    Returns:
        ``a_pos`` int32 ``[bs, Hkv, n_sink + 16 * max_select_pages]`` and
        ``a_len`` int32 ``[bs, Hkv]``. ``a_pos[b, h, :a_len[b, h]]`` holds the
        sink positions, then the listed positions of each kept page in
        descending page score (ascending within a page); entries past
        ``a_len`` are not written. Pages scored ``-inf`` are never listed.
    """
    bs, num_kv_heads, max_pages = scores.shape
    dev = scores.device
    k = max(1, min(int(max_select_pages), max_pages))
    n_sink = max(0, int(n_sink))
    vals, idx = torch.topk(scores, k, dim=-1)  # [bs, Hkv, k], descending
    width = n_sink + QUEST_PAGE_SIZE * k
    if out_pos is None:
        out_pos = torch.empty((bs, num_kv_heads, width), dtype=torch.int32, device=dev)
    if out_len is None:
        out_len = torch.empty((bs, num_kv_heads), dtype=torch.int32, device=dev)
    assert out_pos.shape == (bs, num_kv_heads, width) and out_pos.dtype == torch.int32 and out_pos.stride(2) == 1
    assert out_len.shape == (bs, num_kv_heads) and out_len.dtype == torch.int32 and out_len.stride(1) == 1
    expand_selection(vals, idx, num_pages, b_start, out_pos, out_len, page=QUEST_PAGE_SIZE, n_sink=n_sink)
    return out_pos, out_len


def expand_selection(
    vals: Optional[torch.Tensor],
    idx: torch.Tensor,
    budget: Union[int, torch.Tensor],
    b_start: torch.Tensor,
    out_pos: torch.Tensor,
    out_len: torch.Tensor,
    *,
    page: int,
    n_sink: Union[int, torch.Tensor],
    cand_pos: Optional[torch.Tensor] = None,
    count: Optional[torch.Tensor] = None,
    out_rows: Optional[torch.Tensor] = None,
    slots: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Launch :func:`_expand_selection_kernel` (shared by the Quest and token-level selections).

    ``n_sink`` an int32 tensor ``[bs]``: per-row sinks (the serving path, whose
    rows mix request knobs); entries are then written below ``out_pos``'s width
    only, and ``a_len`` is capped at it.

    ``count`` (int32 ``[bs, Hkv]``, ``vals`` then ``None``): ``idx`` is a
    :func:`~.topk_range.topk_range` output, its first ``count`` entries listed
    (ascending indices give ascending positions).

    ``out_rows`` (int ``[bs]``): row ``b`` writes row ``out_rows[b]`` of ``out_pos`` /
    ``out_len`` (which may have any number of rows), nothing where it is ``< 0``
    (its program returns at once): the CUDA-graph path writes the slots'
    selections straight into the batch rows or the store that hold them.

    ``slots`` = ``(req_to_token [reqs, ctx] int32, req_pool_idx, out_slots)``: every
    entry written to ``out_pos`` (sinks included) is written to ``out_slots``
    (shaped as ``out_pos``, same row) as ``req_to_token[req_pool_idx[b], pos]``;
    ``req_pool_idx`` is per INPUT row b (``[bs]``, like ``b_start``), not per
    ``out_rows`` row."""
    if count is not None:
        assert vals is None and count.shape == idx.shape[:2] and count.dtype == torch.int32 and count.stride(1) == 1
        vals = count[..., None]  # only its strides are read below
    bs, num_kv_heads, k = idx.shape
    has_sink = isinstance(n_sink, torch.Tensor)
    if has_sink:
        assert n_sink.shape == (bs,) and n_sink.dtype == torch.int32
    assert vals.shape[:2] == idx.shape[:2] and vals.stride(2) == 1 and idx.stride(2) == 1
    assert count is not None or vals.shape == idx.shape
    has_budget = isinstance(budget, torch.Tensor)
    if has_budget:
        assert budget.shape == (bs,) and budget.dtype == torch.int32
    if cand_pos is not None:
        assert cand_pos.shape[:2] == (bs, num_kv_heads) and cand_pos.dtype == torch.int32 and cand_pos.stride(2) == 1
    if out_rows is not None:
        assert out_rows.shape == (bs,) and out_rows.is_contiguous()
        assert out_pos.shape[1] == num_kv_heads and out_len.shape == (out_pos.shape[0], num_kv_heads)
    else:
        assert out_pos.shape[0] == bs and out_len.shape[0] == bs
    req_to_token, req_pool_idx, out_slots = unpack_slots(slots, bs, out_pos, b_start)
    _expand_selection_kernel[(bs, num_kv_heads)](
        vals, idx, cand_pos if cand_pos is not None else b_start, budget if has_budget else b_start,
        n_sink if has_sink else b_start, b_start,
        out_pos, out_len, out_rows if out_rows is not None else b_start, req_to_token, req_pool_idx, out_slots,
        vals.stride(0), vals.stride(1), idx.stride(0), idx.stride(1),
        cand_pos.stride(0) if cand_pos is not None else 0, cand_pos.stride(1) if cand_pos is not None else 0,
        out_pos.stride(0), out_pos.stride(1), out_len.stride(0),
        req_to_token.stride(0) if slots is not None else 0, out_slots.stride(0), out_slots.stride(1),
        0 if has_budget else int(budget), k, 0 if has_sink else int(n_sink), out_pos.shape[2],
        req_to_token.shape[1] if slots is not None else 1,
        PAGE=page, BLOCK_K=next_pow2(k), BLOCK_S=16 if has_sink else max(2, next_pow2(n_sink)),
        HAS_BUDGET=has_budget, HAS_CAND=cand_pos is not None, HAS_SINK=has_sink, HAS_COUNT=count is not None,
        HAS_ROWS=out_rows is not None, HAS_SLOTS=slots is not None,
        num_warps=1 if k <= 64 else 4,
    )
