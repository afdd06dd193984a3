"""
AsyncSpade's next-query prediction in one launch
================================================

``asyncspade_predict(ring, total, q, rows, ridge)``: per row of ``rows``, push
``q`` into the row's query ring (slot ``total % W``, then ``total += 1``) and
predict the next query ``q_hat [S, Hq, D]`` fp32 exactly as
``sgl_sparse.queryaware.asyncspade`` does (``ring_push_window`` then
``predict_next_query``; :func:`asyncspade_predict_ref` is that chain). On the
CUDA-graph path (``query_device``) it replaces ~35 small torch ops per layer
(ring push, window gather, masking, Gram matrix, ``cholesky_ex``,
``solve_triangular``, cumsum, masked softmax, averaging over the valid window
sizes) with one launch.

One program per (row, query head), grid ``(S, Hq)``; the window is small
(``W = policies.asyncspade.window + 1 <= 33``), so the whole ridge fit lives in
registers: the window as two ``[P_PAD, BLOCK_D]`` tiles (P = W - 1) and the
``P x P`` system as ``[P_PAD, P_PAD]`` tiles, rows and columns taken out with
``tl.where`` masks inside loops over ``P``. fp32 math throughout.

The math (``assembled_weights``' docstring): newest first, history row i is
``Q_{t-1-i}`` and the target ``Q_t``; ``M = H H^T + lam I`` with
``lam = ridge * mean |Q|^2`` over the row's valid queries (floored at
``sqrt(tiny)``) is factored once, ``M = L L^T``; with ``y = L^-1 H Q_t`` the
size-k fit is ``omega^(k)_j = sum_{i<k} (L^-1)_{ij} y_i`` (a cumsum over i),
``w^(k) = softmax_{j<k}(omega^(k))``, and ``q_hat`` is the mean over the valid
``k <= min(P, count - 1)`` of ``sum_j w^(k)_j Q_{t-j}``; ``count == 1``: the last
query, ``count == 0``: zeros.

Ring slots outside the row's window (never written, or older than the
request's own window, ``count_cap``) may hold anything, NaN included: they are
masked loads (never read), so nothing of them reaches any sum. The pushed
query is rounded to the ring's dtype and the prediction uses that rounded
value, as the reference does (it reads the query back from the ring).

``total += 1`` in one launch: every program of a row reads the row's total
(the push slot), so none may write it before all have read it. Each program
arrives on a per-row counter (``arrivals``, all 0 between launches) after its
read; the last of the row's ``Hq`` programs writes ``total + 1`` and resets
the counter (the last-arriver pattern of ``two_segment_decode``'s fused
merge; the ordering argument is in the kernel). Rows must therefore be
distinct; a negative row skips its push and gets ``q_hat = 0`` (slots without
a request in ``query_device``).

CUDA-graph capturable: grid from shapes only, no host sync, knobs (``ridge``,
``count_cap``) read on the device.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._utils import needs_bf16_rtne, next_pow2

__all__ = ["asyncspade_predict", "asyncspade_predict_ref", "make_arrivals"]

#: sqrt of float32's smallest normal: the reference's floor on lam for fp32 math,
#: which keeps an all-zero (empty) row's system non-singular.
_LAM_FLOOR = float(torch.finfo(torch.float32).tiny) ** 0.5


@triton.jit
def _round_bf16_rtne(x):
    """fp32 -> the nearest bf16 (ties to even), still fp32: the interpreter's own
    conversion truncates (_utils.needs_bf16_rtne); the following .to(bf16) is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_of(x, offs_p, i):
    """Row i of a [P_PAD, N] tile -> [N]."""
    return tl.sum(tl.where(offs_p[:, None] == i, x, 0.0), 0)


@triton.jit
def _col_of(x, offs_p, j):
    """Column j of a [N, P_PAD] tile -> [N]."""
    return tl.sum(tl.where(offs_p[None, :] == j, x, 0.0), 1)


@triton.jit
def _asyncspade_predict_kernel(
    RING,  # [R, W, Hq, D] any float dtype, stride 1 along D
    TOTAL,  # [R] int64: queries pushed into the row
    ARRIVALS,  # [R] int32: all 0 between launches
    Q,  # [B, Hq, D]
    ROWS,  # [S] int: ring row of each program row (< 0: skipped)
    Q_ROWS,  # [S] int: q row of each program row (HAS_Q_ROWS)
    RIDGE,  # [S] fp32 (row stride stride_e)
    CAP,  # [S] int: the row's window cap, count = min(total, W, cap) (HAS_CAP)
    OUT,  # [S, Hq, D] fp32
    stride_rr,
    stride_rw,
    stride_rh,
    stride_qb,
    stride_qh,
    stride_e,
    stride_ob,
    stride_oh,
    W: tl.constexpr,
    P_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    LAM_FLOOR: tl.constexpr,
    BF16_RTNE: tl.constexpr,
):
    P: tl.constexpr = W - 1
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out_ptr = OUT + cur_s.to(tl.int64) * stride_ob + cur_h * stride_oh + offs_d
    row = tl.load(ROWS + cur_s).to(tl.int64)
    if row >= 0:
        if HAS_Q_ROWS:
            q_row = tl.load(Q_ROWS + cur_s).to(tl.int64)
        else:
            q_row = cur_s.to(tl.int64)
        ring = RING + row * stride_rr + cur_h * stride_rh
        t = tl.load(TOTAL + row)
        # Rounded to the ring's dtype first: the reference predicts from the ring.
        q = tl.load(Q + q_row * stride_qb + cur_h * stride_qh + offs_d, mask=mask_d, other=0.0)
        if BF16_RTNE:
            q = _round_bf16_rtne(q.to(tl.float32))
        q = q.to(RING.dtype.element_ty)
        tl.store(ring + (t % W) * stride_rw + offs_d, q, mask=mask_d)
        n = t + 1
        count = tl.minimum(n, W)
        if HAS_CAP:
            count = tl.minimum(count, tl.load(CAP + cur_s).to(tl.int64))
        count = tl.maximum(count, 0)
        # total += 1 once per row, after all Hq programs of the row read it. Each
        # program's read of TOTAL is ordered before its arrival (bar.sync, then
        # the release half of the acq_rel RMW, cumulative over the CTA); the
        # arrivals on one counter form a release sequence, so the program that
        # reads Hq - 1 (exactly one: the RMWs are totally ordered) acquires every
        # earlier arrival, and its store of TOTAL cannot be seen by any of their
        # reads. It resets the counter too: nobody touches it after the last
        # arrival, and the next launch on the stream runs after this one.
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVALS + row, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.store(TOTAL + row, n)
            tl.store(ARRIVALS + row, 0)

        x0 = tl.where(mask_d & (count > 0), q.to(tl.float32), 0.0)  # Q_t
        result = x0
        if P > 0:
            offs_p = tl.arange(0, P_PAD)
            # Newest first. H row i = Q_{t-1-i} (the regressors), S row j = Q_{t-j}
            # (the window shifted by one, which the weights apply to); both read
            # the ring at slots != t % W, so never the slot pushed above. Slots
            # outside the window are masked loads: garbage or NaN is never read.
            h_ok = (offs_p < count - 1)[:, None] & mask_d[None, :]
            h_slot = tl.where(offs_p < P, t - 1 - offs_p + W, 0) % W
            H = tl.load(ring + h_slot[:, None] * stride_rw + offs_d[None, :], mask=h_ok, other=0.0).to(tl.float32)
            s_ok = ((offs_p >= 1) & (offs_p < count) & (offs_p < P))[:, None] & mask_d[None, :]
            s_slot = tl.where(offs_p < P, t - offs_p + W, 0) % W
            S = tl.load(ring + s_slot[:, None] * stride_rw + offs_d[None, :], mask=s_ok, other=0.0).to(tl.float32)
            S = tl.where((offs_p == 0)[:, None], x0[None, :], S)

            sq = tl.sum(tl.sum(H * H, 1), 0) + tl.sum(x0 * x0, 0)  # 0 on the masked slots
            lam = tl.load(RIDGE + cur_s * stride_e).to(tl.float32) * sq / tl.maximum(count, 1).to(tl.float32)
            lam = tl.maximum(lam, LAM_FLOOR)

            rows_i = offs_p[:, None]
            cols_j = offs_p[None, :]
            # M = H H^T + lam I (padding rows of H are 0: the padded block is lam I)
            M = tl.where(rows_i == cols_j, lam, 0.0)
            for j in range(P):
                col = tl.sum(H * _row_of(H, offs_p, j)[None, :], 1)
                M += tl.where(cols_j == j, col[:, None], 0.0)
            b = tl.sum(H * x0[None, :], 1)  # H Q_t

            # Cholesky M = L L^T, right-looking: column k of L, then the trailing update.
            A = M
            L = tl.zeros([P_PAD, P_PAD], dtype=tl.float32)
            for k in range(P):
                col = _col_of(A, offs_p, k)
                akk = tl.sum(tl.where(offs_p == k, col, 0.0), 0)
                lk = tl.where(offs_p >= k, col / tl.sqrt(akk), 0.0)
                L = tl.where(cols_j == k, lk[:, None], L)
                A -= lk[:, None] * lk[None, :]
            # L^-1 by forward substitution, a row at a time:
            # Linv[i, :] = (e_i - sum_{m<i} L[i, m] Linv[m, :]) / L[i, i]
            Linv = tl.zeros([P_PAD, P_PAD], dtype=tl.float32)
            for i in range(P):
                li = _row_of(L, offs_p, i)
                lii = tl.sum(tl.where(offs_p == i, li, 0.0), 0)
                acc = tl.sum(tl.where(offs_p < i, li, 0.0)[:, None] * Linv, 0)
                r = (tl.where(offs_p == i, 1.0, 0.0) - acc) / lii
                Linv = tl.where(rows_i == i, r[None, :], Linv)
            y = tl.sum(Linv * b[None, :], 1)
            # omega[k-1, j] = omega^(k)_j: all window sizes from the one factorization
            omega = tl.cumsum(Linv * y[:, None], 0)
            in_win = (cols_j <= rows_i) & (cols_j < P)  # j < k (every row keeps j = 0)
            omega = tl.where(in_win, omega, float("-inf"))
            e = tl.where(in_win, tl.exp(omega - tl.max(omega, 1)[:, None]), 0.0)
            w = e / tl.sum(e, 1)[:, None]
            m = tl.maximum(tl.minimum(count - 1, P), 0)  # valid window sizes: k <= m
            # tl.where, not a product: a window size past the row's queries never counts
            wk = tl.sum(tl.where((offs_p < m)[:, None], w, 0.0), 0) / tl.maximum(m, 1).to(tl.float32)
            pred = tl.sum(wk[:, None] * S, 0)
            result = tl.where(m > 0, pred, x0)
        tl.store(out_ptr, result, mask=mask_d)
    else:
        tl.store(out_ptr, tl.zeros([BLOCK_D], dtype=tl.float32), mask=mask_d)


def make_arrivals(rows: int, device) -> torch.Tensor:
    """Zeroed per-row arrival counters for :func:`asyncspade_predict`: allocate
    once (outside CUDA-graph capture) for the ring's rows and pass the same
    tensor to every call on the stream; each launch leaves it all zero again."""
    return torch.zeros(max(1, rows), dtype=torch.int32, device=device)


def _num_warps(p_pad: int, block_d: int) -> int:
    # Latency-bound: a chain of ~3P small reductions. Few warps keep them within
    # a warp (shuffles, no shared-memory round trips) while the [P_PAD, BLOCK_D]
    # window tiles stay at <= 32 fp32 registers per thread each. Not tuned on a GPU.
    return max(1, min(4, (p_pad * block_d) // 1024))


def asyncspade_predict(
    ring: torch.Tensor,
    total: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    ridge: Union[float, torch.Tensor],
    *,
    q_rows: Optional[torch.Tensor] = None,
    count_cap: Optional[torch.Tensor] = None,
    arrivals: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """Push ``q`` into the rings of ``rows`` and predict the next query.

    Args:
        ring: ``[R, W, Hq, D]`` bf16/fp16/fp32, stride 1 along ``D`` (updated in place).
        total: ``[R]`` int64, contiguous: queries pushed per row (updated in place).
        q: ``[B, Hq, D]``, any float dtype, stride 1 along ``D``.
        rows: ``[S]`` int32/int64: the ring row of each output row; distinct
            where ``>= 0``; a negative row is skipped (no push, ``q_hat = 0``).
        ridge: the relative ridge eps, a float or ``[S]`` / ``[S, 1]`` fp32 per row.
        q_rows: ``[S]`` int: the row of ``q`` pushed for each output row
            (default ``0 .. S-1``; then ``B >= S``).
        count_cap: ``[S]`` int: at most this many of the newest queries form the
            window (a request's own window below the ring's); default ``W``.
        arrivals: ``[R]`` int32 zeros (:func:`make_arrivals`); given back zeroed.
            Default: a fresh one (not for CUDA-graph capture: one more op).
        out: ``[S, Hq, D]`` fp32, stride 1 along ``D``.

    Returns:
        ``q_hat [S, Hq, D]`` fp32: ``predict_next_query`` of the row's window
        after the push (count ``min(total, W, count_cap)``).
    """
    r_rows, W, hq, d = ring.shape
    s = rows.shape[0]
    dev = ring.device
    assert ring.dtype in (torch.bfloat16, torch.float16, torch.float32) and ring.stride(3) == 1
    assert total.shape == (r_rows,) and total.dtype == torch.int64 and total.is_contiguous()
    assert q.dim() == 3 and q.shape[1:] == (hq, d) and q.stride(2) == 1 and q.is_floating_point()
    assert rows.dim() == 1 and not rows.is_floating_point()
    if q_rows is not None:
        assert q_rows.shape == (s,) and not q_rows.is_floating_point()
    else:
        assert q.shape[0] >= s, "q: one row per output row without q_rows"
    if count_cap is not None:
        assert count_cap.shape == (s,) and not count_cap.is_floating_point()
    if not isinstance(ridge, torch.Tensor):
        ridge = torch.full((s,), float(ridge), dtype=torch.float32, device=dev)
    assert ridge.shape in ((s,), (s, 1)) and ridge.dtype == torch.float32
    if arrivals is None:
        arrivals = make_arrivals(r_rows, dev)
    assert arrivals.dtype == torch.int32 and arrivals.numel() >= r_rows and arrivals.is_contiguous()
    if out is None:
        out = torch.empty((s, hq, d), dtype=torch.float32, device=dev)
    assert out.shape == (s, hq, d) and out.dtype == torch.float32 and out.stride(2) == 1
    if s == 0 or hq == 0:
        return out
    p_pad = next_pow2(max(W - 1, 1))
    block_d = next_pow2(d)
    _asyncspade_predict_kernel[(s, hq)](
        ring, total, arrivals, q, rows, q_rows if q_rows is not None else rows, ridge,
        count_cap if count_cap is not None else rows, out,
        ring.stride(0), ring.stride(1), ring.stride(2), q.stride(0), q.stride(1), ridge.stride(0),
        out.stride(0), out.stride(1),
        W=W, P_PAD=p_pad, HEAD_DIM=d, BLOCK_D=block_d, HAS_Q_ROWS=q_rows is not None,
        HAS_CAP=count_cap is not None, LAM_FLOOR=_LAM_FLOOR,
        BF16_RTNE=needs_bf16_rtne(ring.dtype),
        num_warps=int(num_warps or _num_warps(p_pad, block_d)),
    )
    return out


def asyncspade_predict_ref(
    ring: torch.Tensor,
    total: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    ridge: Union[float, torch.Tensor],
    *,
    q_rows: Optional[torch.Tensor] = None,
    count_cap: Optional[torch.Tensor] = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`asyncspade_predict` (same in-place updates):
    ``ring_push_window`` then ``predict_next_query`` of ``sgl_sparse.queryaware.asyncspade``,
    the latter in ``compute_dtype`` (default: its own, fp32 for 16-bit rings;
    ``torch.float64`` for tests). Syncs with the host (boolean indexing)."""
    from sgl_sparse.queryaware import asyncspade as aspd

    s, hq, d = rows.shape[0], ring.shape[2], ring.shape[3]
    W = ring.shape[1]
    live = rows >= 0
    qq = q[q_rows] if q_rows is not None else q[:s]
    cdt = compute_dtype or aspd.compute_dtype(ring)
    out = torch.zeros((s, hq, d), dtype=cdt, device=ring.device)
    if not bool(live.any()):
        return out
    window, count = aspd.ring_push_window(ring, total, qq[live], rows[live].long())
    if count_cap is not None:
        count = torch.minimum(count, count_cap[live].long())
    eps = ridge
    if isinstance(ridge, torch.Tensor):
        eps = ridge.reshape(s, 1)[live].to(cdt)
    out[live] = aspd.predict_next_query(window.to(cdt), count.clamp(min=0, max=W), eps)
    return out
