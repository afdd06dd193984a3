"""
Window logits: a few queries against a whole prefix, read in place (SFI's Selector)
===================================================================================

After an SFI slow step the Selector needs, per request and KV head, the scaled
logits ``q . k * sm_scale`` of the evidence window's queries (the slow step's
query, plus the prompt's last queries on the first slow step) for every position
of the prefix. The keys are read once, in place from SGLang's paged pool through
``req_to_token`` (page_size 1); all ``G`` query heads of a GQA group and all ``w``
window queries form the rows of one ``[BLOCK_M, D]`` tile, so each key row is
loaded once per group and the scores are one tensor-core ``tl.dot``.

Grid ``(r, Hkv, cdiv(N, BLOCK_N))``. Keys after a query's position get ``-inf``
(causal); a block entirely after every query of its request is written as
``-inf`` without loading keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import needs_fp32_dot, next_pow2

__all__ = ["window_logits"]


@triton.jit
def _window_logits_kernel(
    Q,  # [r, w, Hq, D]
    K_POOL,  # [pool, Hkv, D]
    REQ_TO_TOKEN,
    REQ_IDX,  # [r]
    QPOS,  # [r, w] int64: position of each window query
    OUT,  # [r, Hkv, G, w, N] fp32
    sm_scale,
    N,
    stride_qr,
    stride_qw,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_pr,
    stride_or,
    stride_oh,
    stride_og,
    stride_ow,
    W: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_kvh = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N

    offs_m = tl.arange(0, BLOCK_M)  # row m = g * W + i
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    g = offs_m // W
    i = offs_m % W
    mask_m = offs_m < GROUP * W
    mask_d = offs_d < HEAD_DIM
    mask_n = offs_n < N

    qpos = tl.load(QPOS + cur_r * stride_pr + i, mask=mask_m, other=-1)
    out_ptr = (OUT + cur_r * stride_or + cur_kvh * stride_oh + g[:, None] * stride_og
               + i[:, None] * stride_ow + offs_n[None, :])
    out_mask = mask_m[:, None] & mask_n[None, :]
    if n0 > tl.max(qpos, 0):
        tl.store(out_ptr, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=out_mask)
    else:
        q = tl.load(
            Q + cur_r * stride_qr + i[:, None] * stride_qw + (cur_kvh * GROUP + g)[:, None] * stride_qh
            + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :], other=0.0,
        )
        req = tl.load(REQ_IDX + cur_r).to(tl.int64)
        tok = tl.load(REQ_TO_TOKEN + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_kvh * stride_kh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale
        s = tl.where(offs_n[None, :] <= qpos[:, None], s, float("-inf"))
        tl.store(out_ptr, s, mask=out_mask)


def window_logits(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_idx: torch.Tensor,
    qpos: torch.Tensor,
    n: int,
    sm_scale: float,
    *,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Scaled logits of window queries over positions ``[0, n)`` of each request.

    Args:
        q: ``[r, w, Hq, D]`` queries (Hq = G * Hkv), same dtype as the pool.
        k_pool: ``[pool, Hkv, D]`` paged key pool (page_size 1).
        req_to_token: ``[max_reqs, max_ctx]`` int32; req_idx: ``[r]`` rows of it.
        qpos: ``[r, w]`` int64 position of each query (keys after it: ``-inf``).
        n: positions to score (host-known bound, ``<= max_ctx``).

    Returns fp32 ``[r, Hkv, G, w, n]``. No host sync; grid ``(r, Hkv, cdiv(n, block_n))``.
    """
    r, w, hq, d = q.shape
    hkv = k_pool.shape[1]
    assert hq % hkv == 0 and k_pool.shape[2] == d and q.dtype == k_pool.dtype
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and req_to_token.stride(1) == 1
    assert qpos.shape == (r, w) and 0 < n <= req_to_token.shape[1]
    group = hq // hkv
    qpos = qpos.to(torch.int64).contiguous()
    out = torch.empty(r, hkv, group, w, n, dtype=torch.float32, device=q.device)
    grid = (r, hkv, triton.cdiv(n, block_n))
    _window_logits_kernel[grid](
        q, k_pool, req_to_token, req_idx, qpos, out, float(sm_scale), n,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        req_to_token.stride(0), qpos.stride(0),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        W=w, GROUP=group, HEAD_DIM=d,
        BLOCK_M=max(16, next_pow2(group * w)), BLOCK_D=next_pow2(d), BLOCK_N=block_n,
        FP32_DOT=needs_fp32_dot(q.dtype),
        num_warps=num_warps,
    )
    return out
