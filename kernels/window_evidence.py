"""
Window evidence: SFI's Selector step 1, fused, keys read in place
=================================================================

For each request and KV head, the evidence of candidate position ``j`` is

    u_j = (1 / nq) * sum_{i < nq} ( mean_g softmax_A(l_{g,i})_j ) ** beta

over the request's candidate range ``A = [lo, hi)`` (keys after a query's
position excluded), where ``l_{g,i} = q_{g,i} . k_j * sm_scale`` for the ``G``
query heads ``g`` of the group and the ``nq`` window queries ``i``. Writing the
``[G, w, N]`` logits and reducing them with PyTorch ops costs a dozen launches
and passes per layer; this reads the keys once, in three launches:

1. per block of keys: the logits of every (g, i) row restricted to ``A``, written
   as fp32 (``G * w`` values per key: a few percent of the key's bytes), and the
   block's max and sum of ``exp`` per row (partials ``[r, Hkv, blocks, BLOCK_M]``);
2. per (request, KV head): the partials merged into each row's log-sum-exp;
3. per block of keys: ``p = exp(l - lse)`` from the stored logits, the mean over
   the group, ``** beta``, the mean over the valid window queries -> ``u``.

Integer arguments that follow the sequence length are not specialized
(``do_not_specialize``): Triton would otherwise compile a variant per
divisibility class of the length, in the middle of serving.

``stored_evidence`` is the same ``u`` for a one-query window (``w = 1``: a slow
decode step after the first) from the logits the slow step's dense attention
already stored (``two_segment_decode(..., logits_out=)``): pass 1 reads those
``G`` fp32 values per key instead of the key (a sixteenth of its bytes at
``D = 128``, ``G = 2``), pass 2 is the same formula.

``window_evidence`` also takes the keys of several layers at once (a
``layer_pools.LayerPools`` address table: SGLang keeps one pool tensor per
layer): its rows are then (layer, request) pairs, layer-major, and pass 1 loads
the row's layer's pool from the table -- one launch per pass for all of them.

Rows of the ``[BLOCK_M, D]`` query tile are ``m = g * W_PAD + i`` so the group
mean is a reshape + sum. Grid ``(r, Hkv, cdiv(N, BLOCK_N))``; pass 2 uses larger blocks (it reads logits only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import as_dtype, needs_fp32_dot, next_pow2
from .layer_pools import LayerPools, load_layer_pool
from .two_segment_decode import FP8_KV_DTYPES

__all__ = ["window_evidence", "stored_evidence"]

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(Q, K_POOL, REQ_TO_TOKEN, req, cur_r, cur_kvh, offs_n, mask_n, qpos, lo, hi, qk_scale,
            stride_qr, stride_qw, stride_qh, stride_kt, stride_kh, stride_r2t,
            W, GROUP, W_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr):
    """Base-2 scaled logits [BLOCK_M, BLOCK_N] of the window rows, -inf off A / after the query."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // W_PAD
    i = offs_m % W_PAD
    mask_m = (g < GROUP) & (i < W)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + cur_r * stride_qr + i[:, None] * stride_qw + (cur_kvh * GROUP + g)[:, None] * stride_qh
                + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    tok = tl.load(REQ_TO_TOKEN + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
    # an fp8 pool's keys widen to q's dtype exactly; their scale is in qk_scale
    k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_kvh * stride_kh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))
    ok = mask_m[:, None] & (offs_n[None, :] >= lo) & (offs_n[None, :] < hi) & (offs_n[None, :] <= qpos[:, None])
    return tl.where(ok, s * qk_scale, float("-inf"))


@triton.jit
def _powered_group_probs(s, lse, beta, G_PAD: tl.constexpr, W_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GROUP):
    """(mean_g p_g)^beta per window query, 0 where no head attends: p = exp2(s - lse)
    of the rows m = g * W_PAD + i of s [G_PAD * W_PAD, BLOCK_N] -> [W_PAD, BLOCK_N].
    The evidence formula both second passes share (keys, or stored logits)."""
    p = tl.exp2(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None])  # 0 where s = -inf
    pg = tl.sum(tl.reshape(p, [G_PAD, W_PAD, BLOCK_N]), 0) / GROUP
    return tl.where(pg > 0, tl.exp2(beta * tl.log2(tl.where(pg > 0, pg, 1.0))), 0.0)


# K_PTRS: a view of the layers' address table at any layer (pack_compact.py says why
# its alignment is not specialized on).
@triton.jit(do_not_specialize=["ROWS_PER_LAYER", "stride_part_r", "stride_part_h", "stride_part_b", "stride_lg_r",
                               "stride_lg_h", "stride_lg_m"], do_not_specialize_on_alignment=["K_PTRS"])
def _evidence_pass1(
    Q, K_POOL, K_PTRS, K_SCALES, REQ_TO_TOKEN, REQ_IDX, QPOS, LO, HI, PART_M, PART_L, LOGITS,
    qk_scale, W, ROWS_PER_LAYER,
    stride_qr, stride_qw, stride_qh, stride_kt, stride_kh, stride_r2t, stride_pr,
    stride_part_r, stride_part_h, stride_part_b, stride_lg_r, stride_lg_h, stride_lg_m,
    GROUP: tl.constexpr, W_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, LAYERED: tl.constexpr,
    HAS_K_SCALES: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    blk = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    lo = tl.load(LO + cur_r)
    hi = tl.load(HI + cur_r)
    n0 = blk * BLOCK_N
    part = cur_r * stride_part_r + cur_kvh * stride_part_h + blk * stride_part_b + offs_m
    if (n0 >= hi) | (n0 + BLOCK_N <= lo):
        tl.store(PART_M + part, tl.full([BLOCK_M], float("-inf"), tl.float32))
        tl.store(PART_L + part, tl.zeros([BLOCK_M], tl.float32))
    else:
        req = tl.load(REQ_IDX + cur_r).to(tl.int64)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        i = offs_m % W_PAD
        qpos = tl.load(QPOS + cur_r * stride_pr + i, mask=i < W, other=-1)
        k_pool = load_layer_pool(K_POOL, K_PTRS, cur_r // ROWS_PER_LAYER, LAYERED)  # rows are layer-major
        if HAS_K_SCALES:  # the layer's fp8 key scale (the pool holds k / k_scale)
            qk_scale = qk_scale * tl.load(K_SCALES + cur_r // ROWS_PER_LAYER)
        s = _scores(Q, k_pool, REQ_TO_TOKEN, req, cur_r, cur_kvh, offs_n, offs_n < hi, qpos, lo, hi, qk_scale,
                    stride_qr, stride_qw, stride_qh, stride_kt, stride_kh, stride_r2t,
                    W, GROUP, W_PAD, HEAD_DIM, BLOCK_M, BLOCK_D, FP32_DOT)
        m = tl.max(s, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(PART_M + part, m)
        tl.store(PART_L + part, tl.sum(tl.exp2(s - m_safe[:, None]), 1))
        # Valid rows only, as row g * W + i of [G * W, N].
        g = offs_m // W_PAD
        row = g * W + i
        ok = (g < GROUP) & (i < W)
        tl.store(LOGITS + cur_r * stride_lg_r + cur_kvh * stride_lg_h + row[:, None] * stride_lg_m
                 + offs_n[None, :], s, mask=ok[:, None] & (offs_n < hi)[None, :])


@triton.jit(do_not_specialize=["NBLOCKS", "stride_part_r", "stride_part_h", "stride_part_b"])
def _evidence_lse(
    PART_M, PART_L, LSE, NBLOCKS,
    stride_part_r, stride_part_h, stride_part_b, stride_lse_r, stride_lse_h,
    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Merge the per-block (max, sum) of every window row into its base-2 LSE."""
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, BLOCK_B)
    base = cur_r * stride_part_r + cur_kvh * stride_part_h
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    for b0 in range(0, NBLOCKS, BLOCK_B):
        mask = (b0 + offs_b < NBLOCKS)[:, None]
        ptr = base + (b0 + offs_b)[:, None] * stride_part_b + offs_m[None, :]
        pm = tl.load(PART_M + ptr, mask=mask, other=float("-inf"))
        pl = tl.load(PART_L + ptr, mask=mask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_run = l_run * tl.exp2(m_run - m_safe) + tl.sum(pl * tl.exp2(pm - m_safe[None, :]), 0)
        m_run = m_new
    lse = tl.where(l_run > 0, tl.where(m_run == float("-inf"), 0.0, m_run) + tl.log2(l_run), float("-inf"))
    tl.store(LSE + cur_r * stride_lse_r + cur_kvh * stride_lse_h + offs_m, lse)


@triton.jit(do_not_specialize=["N", "stride_lg_r", "stride_lg_h", "stride_lg_m", "stride_ur", "stride_uh"])
def _evidence_pass2(
    LOGITS, QPOS, LO, HI, NQ, LSE, BETA, U, W, N,
    stride_pr, stride_lg_r, stride_lg_h, stride_lg_m, stride_lse_r, stride_lse_h, stride_ur, stride_uh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, W_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    lo = tl.load(LO + cur_r)
    hi = tl.load(HI + cur_r)
    u_ptr = U + cur_r * stride_ur + cur_kvh * stride_uh + offs_n
    if (n0 >= hi) | (n0 + BLOCK_N <= lo):
        tl.store(u_ptr, tl.zeros([BLOCK_N], tl.float32), mask=mask_n)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        i = offs_m % W_PAD
        g = offs_m // W_PAD
        ok = (g < GROUP) & (i < W)
        qpos = tl.load(QPOS + cur_r * stride_pr + i, mask=i < W, other=-1)
        live = ok[:, None] & (offs_n[None, :] >= lo) & (offs_n[None, :] < hi) & (offs_n[None, :] <= qpos[:, None])
        s = tl.load(LOGITS + cur_r * stride_lg_r + cur_kvh * stride_lg_h + (g * W + i)[:, None] * stride_lg_m
                    + offs_n[None, :], mask=live, other=float("-inf"))
        lse = tl.load(LSE + cur_r * stride_lse_r + cur_kvh * stride_lse_h + offs_m)
        pb = _powered_group_probs(s, lse, tl.load(BETA + cur_r), G_PAD, W_PAD, BLOCK_N, GROUP)  # [W_PAD, BLOCK_N]
        nq = tl.load(NQ + cur_r)
        offs_w = tl.arange(0, W_PAD)
        pb = tl.where((offs_w < nq)[:, None], pb, 0.0)
        tl.store(u_ptr, tl.sum(pb, 0) / nq.to(tl.float32), mask=mask_n)


def window_evidence(
    q: torch.Tensor,
    k_pool: torch.Tensor | LayerPools,
    req_to_token: torch.Tensor,
    req_idx: torch.Tensor,
    qpos: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    nq: torch.Tensor,
    beta: torch.Tensor,
    n: int,
    sm_scale: float,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    block_n2: int | None = None,
    k_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unnormalized evidence ``u`` ``[r, Hkv, n]`` fp32 (0 off the candidate range).

    Args:
        q: ``[r, w, Hq, D]`` window queries; qpos ``[r, w]`` their positions.
        lo, hi: ``[r]`` candidate range A = [lo, hi) per request.
        nq: ``[r]`` int32 valid window queries (the first nq columns, >= 1).
        beta: ``[r]`` fp32 power-mean exponent.
        n: host bound on positions (``>= max(hi)``, ``<= max_ctx``).
        out: optional ``[r, Hkv, n]`` fp32 destination (e.g. a slice of a buffer
            stacking several layers).

    ``k_pool`` may be a ``LayerPools`` of ``L`` layers: one launch per pass for
    all of them. The ``r`` rows of ``q``, ``qpos`` and the per-row arguments
    are then ``L`` layers' rows, layer-major: row ``i`` reads layer
    ``i // (r / L)``'s keys.

    The pool may be fp8 (SGLang's ``--kv-cache-dtype fp8_*``) beside queries in the
    model's dtype: it holds ``k / k_scale``, and ``k_scales`` (fp32 ``[L]``, or
    ``[1]`` for one pool; None: unscaled) gives each layer's ``k_scale``.
    """
    r, w, hq, d = q.shape
    layered = isinstance(k_pool, LayerPools)
    pools = k_pool if layered else LayerPools.one(k_pool)
    k_pool = pools.pool
    assert not layered or r % len(pools) == 0, "rows: the same requests in every layer"
    rows_per_layer = r // len(pools) if layered else max(r, 1)
    hkv = k_pool.shape[1]
    group = hq // hkv
    assert hq % hkv == 0 and q.stride(-1) == 1 and k_pool.stride(-1) == 1
    assert k_pool.dtype in (q.dtype, *FP8_KV_DTYPES), "keys: q's dtype or fp8"
    if k_scales is not None:
        assert k_scales.dtype == torch.float32 and k_scales.shape == (len(pools),) and k_scales.is_contiguous()
    assert 0 < n <= req_to_token.shape[1] and req_to_token.stride(1) == 1
    g_pad, w_pad = next_pow2(group), next_pow2(w)
    block_m = max(16, g_pad * w_pad)
    if block_m > g_pad * w_pad:  # pad the group dim so rows reshape to [G_PAD, W_PAD]
        g_pad = block_m // w_pad
    nblocks = triton.cdiv(n, block_n)
    dev = q.device
    # Callers on the hot path pass these already in the right dtype (no copies).
    qpos = qpos if qpos.dtype == torch.int64 and qpos.is_contiguous() else qpos.to(torch.int64).contiguous()
    lo = as_dtype(lo, torch.int32)
    hi = as_dtype(hi, torch.int32)
    nq = as_dtype(nq, torch.int32)
    beta = as_dtype(beta, torch.float32)
    part_m = torch.empty(r, hkv, nblocks, block_m, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    qk_scale = float(sm_scale) * _LOG2E
    common = dict(GROUP=group, W_PAD=w_pad, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=next_pow2(d),
                  BLOCK_N=block_n, FP32_DOT=needs_fp32_dot(q.dtype), LAYERED=layered, num_warps=num_warps)
    strides = (q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1),
               req_to_token.stride(0), qpos.stride(0))
    logits = torch.empty(r, hkv, group * w, n, dtype=torch.float32, device=dev)
    grid = (r, hkv, nblocks)
    _evidence_pass1[grid](q, k_pool, pools.ptrs, k_scales if k_scales is not None else lo, req_to_token, req_idx,
                          qpos, lo, hi, part_m, part_l, logits, qk_scale, w, rows_per_layer, *strides,
                          part_m.stride(0), part_m.stride(1), part_m.stride(2),
                          logits.stride(0), logits.stride(1), logits.stride(2),
                          HAS_K_SCALES=k_scales is not None, **common)
    lse = torch.empty(r, hkv, block_m, dtype=torch.float32, device=dev)
    _evidence_lse[(r, hkv)](part_m, part_l, lse, nblocks, part_m.stride(0), part_m.stride(1), part_m.stride(2),
                            lse.stride(0), lse.stride(1), BLOCK_M=block_m, BLOCK_B=32)
    u = torch.empty(r, hkv, n, dtype=torch.float32, device=dev) if out is None else out
    assert u.shape == (r, hkv, n) and u.dtype == torch.float32 and u.stride(2) == 1
    # Pass 2 reads G * w logits per key, not the key: with pass 1's 64-key blocks
    # its programs would be too small to hide their launch (w = 1: 16 x 64 tiles,
    # tens of thousands of programs per layer). ~8K-element tiles instead.
    block_n2 = block_n2 or max(block_n, min(1024, 8192 // block_m))
    _evidence_pass2[(r, hkv, triton.cdiv(n, block_n2))](
        logits, qpos, lo, hi, nq, lse, beta, u, w, n,
        qpos.stride(0), logits.stride(0), logits.stride(1), logits.stride(2),
        lse.stride(0), lse.stride(1), u.stride(0), u.stride(1),
        GROUP=group, G_PAD=g_pad, W_PAD=w_pad, BLOCK_M=block_m, BLOCK_N=block_n2, num_warps=num_warps)
    return u


# -----------------------------------------------------------------------------
# From the slow step's stored logits (w = 1)
# -----------------------------------------------------------------------------


@triton.jit
def _stored_tile(LOGITS, SLOT, LO, HI, cur_r, cur_kvh, offs_n, stride_ls, stride_lh, stride_lg,
                 GROUP: tl.constexpr, G_PAD: tl.constexpr):
    """The stored base-2 logits [G_PAD, BLOCK_N] of the row's slot, -inf off A = [lo, hi)."""
    lo = tl.load(LO + cur_r)
    hi = tl.load(HI + cur_r)
    slot = tl.load(SLOT + cur_r).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    live = (offs_g < GROUP)[:, None] & ((offs_n >= lo) & (offs_n < hi))[None, :]
    return tl.load(LOGITS + slot * stride_ls + cur_kvh * stride_lh + offs_g[:, None] * stride_lg + offs_n[None, :],
                   mask=live, other=float("-inf"))


@triton.jit(do_not_specialize=["stride_part_r", "stride_part_h", "stride_part_b"])
def _stored_partials(
    LOGITS, SLOT, LO, HI, PART_M, PART_L,
    stride_ls, stride_lh, stride_lg, stride_part_r, stride_part_h, stride_part_b,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per block of positions: each query head's max and sum of exp2 over A (pass 1's partials)."""
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    blk = tl.program_id(2)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    s = _stored_tile(LOGITS, SLOT, LO, HI, cur_r, cur_kvh, offs_n, stride_ls, stride_lh, stride_lg, GROUP, G_PAD)
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    part = cur_r * stride_part_r + cur_kvh * stride_part_h + blk * stride_part_b + tl.arange(0, G_PAD)
    tl.store(PART_M + part, m)
    tl.store(PART_L + part, tl.sum(tl.exp2(s - m_safe[:, None]), 1))


@triton.jit(do_not_specialize=["N", "stride_ur", "stride_uh"])
def _stored_pass2(
    LOGITS, SLOT, LO, HI, LSE, BETA, U, N,
    stride_ls, stride_lh, stride_lg, stride_lse_r, stride_lse_h, stride_ur, stride_uh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """u = (mean_g p_g)^beta, 0 off A: _evidence_pass2's formula with one window query."""
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = _stored_tile(LOGITS, SLOT, LO, HI, cur_r, cur_kvh, offs_n, stride_ls, stride_lh, stride_lg, GROUP, G_PAD)
    lse = tl.load(LSE + cur_r * stride_lse_r + cur_kvh * stride_lse_h + tl.arange(0, G_PAD))
    # one window query (W_PAD 1): 0 off A and for padded heads
    pb = _powered_group_probs(s, lse, tl.load(BETA + cur_r), G_PAD, 1, BLOCK_N, GROUP)
    tl.store(U + cur_r * stride_ur + cur_kvh * stride_uh + offs_n, tl.sum(pb, 0), mask=offs_n < N)


def stored_evidence(
    logits: torch.Tensor,
    slot: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    beta: torch.Tensor,
    n: int,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``u`` ``[r, Hkv, n]`` fp32 of a one-query window from stored logits, as
    ``window_evidence`` with ``w = 1`` computes it from the keys.

    Args:
        logits: ``[slots, Hkv, G, L]`` fp32 base-2 logits by position of this
            layer (``two_segment_decode(..., logits_out=)``), ``L >= n``; only
            positions in each row's ``A`` are read.
        slot: ``[r]`` int32 row of ``logits`` holding request ``i``'s slow step.
        lo, hi: ``[r]`` int32 candidate range ``A = [lo, hi)``, ``hi <=`` the slow
            step's length (every position of ``A`` was stored).
        beta: ``[r]`` fp32 power-mean exponent.
        n: host bound on positions (``>= max(hi)``, ``<= L``).
        out: optional ``[r, Hkv, n]`` fp32 destination (last dim contiguous).
    """
    _, hkv, group, length = logits.shape
    r = slot.shape[0]
    assert logits.dtype == torch.float32 and logits.stride(3) == 1 and 0 < n <= length
    g_pad = max(2, next_pow2(group))
    # ~8K logits per program: the reads are a few bytes per key, the launch is not.
    block_n = block_n or max(64, min(2048, 8192 // g_pad))
    nblocks = triton.cdiv(n, block_n)
    dev = logits.device
    slot = as_dtype(slot, torch.int32)
    lo = as_dtype(lo, torch.int32)
    hi = as_dtype(hi, torch.int32)
    beta = as_dtype(beta, torch.float32)
    part_m = torch.empty(r, hkv, nblocks, g_pad, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    strides = (logits.stride(0), logits.stride(1), logits.stride(2))
    common = dict(GROUP=group, G_PAD=g_pad, BLOCK_N=block_n, num_warps=num_warps)
    _stored_partials[(r, hkv, nblocks)](logits, slot, lo, hi, part_m, part_l, *strides,
                                        part_m.stride(0), part_m.stride(1), part_m.stride(2), **common)
    lse = torch.empty(r, hkv, g_pad, dtype=torch.float32, device=dev)
    _evidence_lse[(r, hkv)](part_m, part_l, lse, nblocks, part_m.stride(0), part_m.stride(1), part_m.stride(2),
                            lse.stride(0), lse.stride(1), BLOCK_M=g_pad, BLOCK_B=32)
    u = torch.empty(r, hkv, n, dtype=torch.float32, device=dev) if out is None else out
    assert u.shape == (r, hkv, n) and u.dtype == torch.float32 and u.stride(2) == 1
    _stored_pass2[(r, hkv, nblocks)](logits, slot, lo, hi, lse, beta, u, n, *strides,
                                     lse.stride(0), lse.stride(1), u.stride(0), u.stride(1), **common)
    return u
