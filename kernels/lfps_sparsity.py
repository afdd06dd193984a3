"""
LFPS head sparsity, keys read in place
======================================

``lfps_head_sparsity`` computes LFPS's ρ of Eq. (6) (ALGORITHMS.md §3, step 1) per
query head, for every row of a batch, from the paged pool::

    ρ = w_sink / (w_sink + w_global + w_local)
    w_sink   = Σ_{i < sink} exp(s_i)                 s_i = scale · q.k_i
    w_global = (n - sink) · exp(scale · q.K̄ + |q|² σ̂² / 2)
    w_local  = Σ_{max(n-1-local, sink) <= i < n-1} exp(s_i)

in log space (no overflow), as ``sgl_sparse.queryaware.lfps.head_sparsity`` does on a
dense view of the keys -- which the CUDA-graph path cannot build: its width would be
the batch's longest sequence. Here the sink and local ranges are per-row knobs,
each read once by a loop over blocks of ``BLOCK_N`` keys (an online log-sum-exp per
query head), so the work of a row is ``sink + local`` keys whatever the context.

One program per (row, KV head), grid ``(bs, Hkv)``: the group's queries are the rows
of a ``[BLOCK_H, D]`` tile, the logits ``tl.dot``\\ s with fp32 accumulation (16-bit
products are exact in fp32, as the reference's fp32 einsum of upcast inputs), K̄ and
σ̂² fp32. A row with ``n <= 0`` (no request this step) writes ρ = 0 (no bypass) and
reads nothing. CUDA-graph capturable: no host sync, the grid from shapes only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .token_scores import _common_checks, _load_q_parts, group_tile_meta
from .two_segment_decode import _dot

__all__ = ["lfps_head_sparsity", "RhoFrom", "rho_launch_args"]


@triton.jit
def _range_lse(q_hi, q_lo, K_POOL, tok_row, cur_h, stride_kt, stride_kh, lo, hi, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               Q_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    """log Σ_{lo <= i < hi} exp(scale q.k_i) per query head of the tile -> [BLOCK_H] (-inf if empty)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        ok = pos < hi
        tok = tl.load(tok_row + pos, mask=ok, other=0).to(tl.int64)
        k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :],
                    mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(q_hi.dtype)
        s = _dot(q_hi, tl.trans(k), FP32_DOT)
        if Q_SPLIT:
            s += _dot(q_lo, tl.trans(k), FP32_DOT)
        s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
        # every block holds a key (start < hi): the new max is finite
        m_new = tl.maximum(m, tl.max(s, 1))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    return tl.where(acc > 0, m + tl.log(tl.where(acc > 0, acc, 1.0)), float("-inf"))


@triton.jit
def _lfps_head_sparsity_kernel(
    Q,  # [bs, Hq, D]
    K_POOL,  # [pool, Hkv, D]
    REQ_TO_TOKEN,
    REQ_POOL_IDX,  # [bs]
    N,  # [bs] int32 keys incl. the current one (<= 0: no row)
    SINK,  # [bs] int32
    LOCAL,  # [bs] int32
    KBAR,  # [bs, Hkv, D] fp32
    SIGMA_HAT2,  # [bs, Hq] fp32
    RHO,  # [bs, Hq] fp32 out
    Q_ROWS,  # [bs] int: the row of Q of each row (only if HAS_Q_ROWS)
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_kbb,
    stride_kbh,
    stride_sb,
    stride_rb,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
):
    _head_sparsity(Q, K_POOL, REQ_TO_TOKEN, REQ_POOL_IDX, N, SINK, LOCAL, KBAR, SIGMA_HAT2, RHO, Q_ROWS, sm_scale,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_r2t, stride_kbb, stride_kbh, stride_sb,
                   stride_rb, tl.program_id(0), tl.program_id(1), HEAD_DIM, GROUP, BLOCK_H, BLOCK_N, BLOCK_D,
                   Q_SPLIT, FP32_DOT, HAS_Q_ROWS)


@triton.jit
def _head_sparsity(Q, K_POOL, REQ_TO_TOKEN, REQ_POOL_IDX, N, SINK, LOCAL, KBAR, SIGMA_HAT2, OUT, Q_ROWS, sm_scale,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_r2t, stride_kbb, stride_kbh, stride_sb,
                   stride_ob, cur_b, cur_h, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, Q_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
                   HAS_Q_ROWS: tl.constexpr):
    """ρ of row cur_b's query heads in KV head cur_h's group (the module docstring's
    formula): the body of _lfps_head_sparsity_kernel's programs, and of the program
    past the chunks of each row in lfps_tables' stats launch (``lfps_priority(rho_from=...)``)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    # n <= 0 (no row): both ranges below are empty, nothing of the pool is read, ρ = 0
    n = tl.load(N + cur_b)
    out = OUT + cur_b * stride_ob + cur_h * GROUP + offs_h
    sink = tl.maximum(tl.load(SINK + cur_b), 0)
    local = tl.maximum(tl.load(LOCAL + cur_b), 0)
    tok_row = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_b).to(tl.int64) * stride_r2t
    q_b = cur_b.to(tl.int64)
    if HAS_Q_ROWS:
        q_b = tl.load(Q_ROWS + cur_b).to(tl.int64)
    q_hi, q_lo = _load_q_parts(Q, q_b, cur_h, stride_qb, stride_qh, K_POOL.dtype.element_ty, HEAD_DIM, GROUP,
                               BLOCK_H, BLOCK_D, Q_SPLIT)
    ls = _range_lse(q_hi, q_lo, K_POOL, tok_row, cur_h, stride_kt, stride_kh, 0, tl.minimum(sink, n), sm_scale,
                    HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, Q_SPLIT, FP32_DOT)
    ll = _range_lse(q_hi, q_lo, K_POOL, tok_row, cur_h, stride_kt, stride_kh, tl.maximum(n - 1 - local, sink),
                    n - 1, sm_scale, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, Q_SPLIT, FP32_DOT)
    # log w_global: the log-normal estimate over the n - sink offloaded keys (Eq. 5)
    mask_qd = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + q_b * stride_qb + (cur_h * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                mask=mask_qd, other=0.0).to(tl.float32)
    kbar = tl.load(KBAR + cur_b * stride_kbb + cur_h * stride_kbh + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    sig = tl.load(SIGMA_HAT2 + cur_b * stride_sb + cur_h * GROUP + offs_h, mask=mask_h, other=0.0)
    noff = tl.maximum(n - sink, 1).to(tl.float32)
    lg = tl.sum(q * kbar[None, :], 1) * sm_scale + tl.sum(q * q, 1) * sig / 2 + tl.log(noff)
    # softmax over (sink, global, local), entry 0; lg is finite, so is the max
    mx = tl.maximum(tl.maximum(ls, lg), ll)
    es = tl.exp(ls - mx)
    rho = es / (es + tl.exp(lg - mx) + tl.exp(ll - mx))
    tl.store(out, tl.where(n > 0, rho, 0.0), mask=mask_h)


def lfps_head_sparsity(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    n: torch.Tensor,
    sink: torch.Tensor,
    local: torch.Tensor,
    kbar: torch.Tensor,
    sigma_hat2: torch.Tensor,
    sm_scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    q_rows: Optional[torch.Tensor] = None,
    block_n: int = 16,
    num_warps: int = 4,
) -> torch.Tensor:
    """ρ per query head, fp32 ``[bs, Hq]`` (the module docstring's formula).

    Args:
        q: ``[bs, Hq, D]``, the KV dtype or fp32; k_pool ``[pool, Hkv, D]`` bf16/fp16;
            req_to_token ``[max_reqs, max_ctx]`` int32; req_pool_idx ``[bs]``.
        n, sink, local: ``[bs]`` int32: keys of the row (the current one included;
            ``<= 0``: ρ = 0, nothing read), its sink tokens and local keys.
        kbar: ``[bs, Hkv, D]`` fp32 (rows may be strided); sigma_hat2 ``[bs, Hq]`` fp32.
        q_rows: ``[bs]`` int: row ``b`` reads the query ``q[q_rows[b]]`` (``q`` then has
            any number of rows): the CUDA-graph path's slots read their batch rows'
            queries in place, no gather.
    """
    args, meta, out = rho_launch_args(q, k_pool, req_to_token, req_pool_idx, n, sink, local, kbar, sigma_hat2,
                                      sm_scale, out=out, q_rows=q_rows, block_n=block_n)
    if out.shape[0] == 0:
        return out
    _lfps_head_sparsity_kernel[(out.shape[0], k_pool.shape[1])](**args, num_warps=num_warps, **meta)
    return out


class RhoFrom(NamedTuple):
    """What ρ is computed from (``lfps_head_sparsity``'s arguments but the row's
    n and sink), for a launch that computes it on the way (``lfps_priority(rho_from=)``)."""

    q: torch.Tensor
    k_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_idx: torch.Tensor
    local: torch.Tensor
    kbar: torch.Tensor
    sigma_hat2: torch.Tensor
    sm_scale: float
    q_rows: Optional[torch.Tensor] = None


def rho_launch_args(q, k_pool, req_to_token, req_pool_idx, n, sink, local, kbar, sigma_hat2, sm_scale, *,
                    out=None, q_rows=None, block_n: int = 16) -> Tuple[dict, dict, torch.Tensor]:
    """(arguments by name, constexprs, out) of ``_head_sparsity`` for rows ``[bs]``
    (``lfps_head_sparsity``'s checks; ``out`` allocated where None). The names are
    ``_lfps_head_sparsity_kernel``'s parameters, which the kernels that compute ρ on
    the way (``lfps_tables._lfps_table_stats_kernel``) share."""
    _, num_kv_heads, head_dim, group = _common_checks(q, k_pool, req_to_token)
    bs = q.shape[0] if q_rows is None else q_rows.shape[0]
    if q_rows is not None:
        assert not q_rows.is_floating_point() and q_rows.is_contiguous()
    for name, t in (("n", n), ("sink", sink), ("local", local), ("req_pool_idx", req_pool_idx)):
        assert t.shape == (bs,) and t.is_contiguous(), f"{name}: [bs]"
    assert kbar.shape == (bs, num_kv_heads, head_dim) and kbar.dtype == torch.float32 and kbar.stride(2) == 1
    assert sigma_hat2.shape == (bs, num_kv_heads * group) and sigma_hat2.dtype == torch.float32
    assert sigma_hat2.stride(1) == 1
    if out is None:
        out = torch.empty((bs, num_kv_heads * group), dtype=torch.float32, device=q.device)
    assert out.shape == (bs, num_kv_heads * group) and out.dtype == torch.float32 and out.stride(1) == 1
    args = dict(Q=q, K_POOL=k_pool, REQ_TO_TOKEN=req_to_token, REQ_POOL_IDX=req_pool_idx, N=n, SINK=sink,
                LOCAL=local, KBAR=kbar, SIGMA_HAT2=sigma_hat2, RHO=out, Q_ROWS=q_rows if q_rows is not None else n,
                sm_scale=float(sm_scale), stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kt=k_pool.stride(0),
                stride_kh=k_pool.stride(1), stride_r2t=req_to_token.stride(0), stride_kbb=kbar.stride(0),
                stride_kbh=kbar.stride(1), stride_sb=sigma_hat2.stride(0), stride_rb=out.stride(0))
    return args, dict(BLOCK_N=block_n, HAS_Q_ROWS=q_rows is not None, **group_tile_meta(q, k_pool)), out
