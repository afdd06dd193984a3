"""AsyncSpade (ALGORITHMS.md §4; papers/004_cd64eef20ca11f33.txt): predict the next
query from a window of recent queries, score the keys with it, keep the Top-K.

Pure torch on the inputs' device: no host sync, no loop over rows or heads, no
shape that depends on data (ragged rows are handled by masks and fixed maximum
sizes), so every function below can be captured in a CUDA graph.

State per layer (owned by the serving path)
-------------------------------------------
    ring  [R, W, Hq, D]  the last W queries of each request row (any float dtype);
                         the query pushed as a row's s-th (0-based) lives in slot s % W
    total [R] int64      queries pushed into the row since its window was (re)set

`W` is the buffer length *including* the newest query Q_t, which is the target of
the fit (as in the paper's Algorithm 1: Q_hist = Q_cache[:, :, :W-1], q_prev =
Q_cache[:, :, -1]); the regression windows are therefore k = 1 .. W-1, i.e. a
buffer of W+1 gives the paper's window size W.

Call sequence, per layer
------------------------
    prefill end:   ring_load(ring, total, rows, last_prompt_queries, n_valid)
    decode step t, once q_t ([bs, Hq, D]) is computed:
        window, count = ring_push_window(ring, total, q_t, rows)  # push, then chronological window
        q_hat = predict_next_query(window, count)               # [bs, Hq, D] fp32
        scores = score_positions(q_hat, keys, n, lo, hi, scale) # or the GQA kernel
        pos, cnt = select_topk(scores, budget, k_max)           # used at step t+1
The key of token t+1 does not exist when the selection is made; the serving path
adds its local window (and sink) to `pos` itself, as for every other policy.
Rows with count == 0 get q_hat = 0 (nothing to predict from; the caller should
not use a sparse selection for them); count == 1 predicts the last query.

`overlap_ratio` / `topk_overlap` give the paper's Eq. (1) metric between a
predicted selection and the exact one of the true next query.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_sparse.queryaware._dtypes import compute_dtype

_NEG_INF = float("-inf")

#: Ridge strength relative to the mean squared norm of the row's valid queries
#: [ours]: the paper leaves eps of Eq. (2) unspecified; a relative eps makes the fit
#: invariant to the query scale (Eq. (2) with eps = RIDGE_EPS * mean |Q|^2).
RIDGE_EPS = 1e-2


# ---- the query window ---------------------------------------------------------------
def ring_push(ring: torch.Tensor, total: torch.Tensor, q: torch.Tensor,
              rows: Optional[torch.Tensor] = None) -> None:
    """Append q [bs, Hq, D] to the rows `rows` [bs] (default 0..bs-1) in place:
    slot total % W, then total += 1. Index-put only: no sync, graph-capturable."""
    W = ring.shape[1]
    if rows is None:
        rows = torch.arange(q.shape[0], device=ring.device)
    t = total[rows]
    ring[rows, t % W] = q.to(ring.dtype)
    total[rows] = t + 1


def ring_load(ring: torch.Tensor, total: torch.Tensor, rows: torch.Tensor,
              window: torch.Tensor, count: torch.Tensor) -> None:
    """Set rows from a right-aligned chronological window [bs, W, Hq, D] whose last
    `count` [bs] entries are valid (e.g. the last prompt queries at prefill end)."""
    W = ring.shape[1]
    c = count.to(torch.int64).clamp(0, W)
    slot = torch.arange(W, device=ring.device)
    # the j-th valid query (window index W-c+j) goes to slot j; slot m reads window
    # index (m - c) mod W, which for m >= c is a left-pad entry (never read back)
    src = (slot[None, :] - c[:, None]) % W
    idx = src[:, :, None, None].expand(-1, -1, *window.shape[2:])
    ring[rows] = torch.gather(window.to(ring.dtype), 1, idx)
    total[rows] = c


def ring_window(ring: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ring [bs, W, Hq, D], total [bs] -> (window [bs, W, Hq, D] oldest..newest with
    the newest query at index W-1, count [bs] = min(total, W) valid at the right)."""
    W = ring.shape[1]
    t = total.to(torch.int64)
    src = (t[:, None] - W + torch.arange(W, device=ring.device)[None, :]) % W
    idx = src[:, :, None, None].expand(-1, -1, *ring.shape[2:])
    return torch.gather(ring, 1, idx), t.clamp(max=W)


def ring_push_window(ring: torch.Tensor, total: torch.Tensor, q: torch.Tensor,
                     rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_push(ring, total, q, rows)` then `ring_window(ring[rows], total[rows])`,
    the window read in one gather from the totals just written (the host-grouped
    serving path's per-layer sequence; kernels/asyncspade_predict.py fuses it with
    predict_next_query on the CUDA-graph path)."""
    W = ring.shape[1]
    t = total[rows]
    ring.index_put_((rows, t % W), q.to(ring.dtype))
    t = t + 1
    total[rows] = t
    offs = torch.arange(W, device=ring.device) - W
    return ring[rows[:, None], (t[:, None] + offs) % W], t.clamp(max=W)


# ---- next-query prediction ----------------------------------------------------------
def _masked_window(window: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[bs, W, Hq, D] -> [bs, Hq, W, D] in the compute dtype, left-pad slots zeroed so
    garbage (even NaN) there cannot leak into any sum."""
    W = window.shape[1]
    slots = torch.arange(W, device=window.device)
    ok = slots[None, :] >= (W - count.to(torch.int64))[:, None]
    x = torch.where(ok[:, :, None, None], window.to(compute_dtype(window)), 0.0)
    return x.permute(0, 2, 1, 3)


def assembled_weights(window: torch.Tensor, count: torch.Tensor,
                      ridge_eps: float | torch.Tensor = RIDGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-window-size softmax weights of Eqs. (2)-(3).

    window [bs, W, Hq, D] (chronological, newest at W-1, valid at the right), count [bs]
    -> (w [bs, Hq, W-1 (k), W-1 (j)], k_valid [bs, W-1]).

    For k = 1..W-1: regressors Q_{t-k}..Q_{t-1} (slots W-1-k..W-2), target Q_t
    (slot W-1). Closed-form ridge on the k x k Gram matrix (ALGORITHMS.md's practical
    solver: the softmax inside Eq. (2) is dropped for the fit and applied after):
        omega^(k) = (R_k R_k^T + lam I)^-1 R_k Q_t,   w^(k) = softmax(omega^(k))
    Entry w[..., k-1, j] weights history slot j (0 outside the size-k window).
    ridge_eps: a float, or a [bs, 1] tensor (per-row request knobs, read on the
    device by the CUDA-graph serving path).
    k_valid: the window of size k needs k+1 valid queries (k <= count - 1).

    All k from ONE factorization: ordered newest first, the size-k window is the
    leading k x k block of the full (W-1) x (W-1) system M = G + lam I. With
    M = L L^T, the leading block factors as L_k L_k^T and (L_k)^-1 is the leading
    block of L^-1, so with y = L^-1 b:  omega^(k)_j = sum_{i<k} (L^-1)_{ij} y_i,
    a cumulative sum over i. This needs lam to be the same for every k:
    lam = ridge_eps * mean |Q|^2 over the row's valid queries [ours: the paper leaves
    eps unspecified; a relative eps makes the fit invariant to the query scale].

    Sign [ours, follows §4.2's text]: the appendix's Algorithm 1 line 16 writes
    softmax(-G^-1 b); the text (Eqs. 2-3) and ALGORITHMS.md weight by +omega, which
    is what makes the query most similar to Q_t weigh most.
    """
    return _assembled_weights(_masked_window(window, count), count, ridge_eps)


def _assembled_weights(x: torch.Tensor, count: torch.Tensor,
                       ridge_eps: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """assembled_weights on the masked window x [bs, Hq, W, D] (_masked_window's)."""
    bs, Hq, W, D = x.shape
    P = W - 1
    kk = torch.arange(P, device=x.device)  # newest-first history index / window size - 1
    cnt = count.to(torch.int64)
    hist = x[:, :, :P].flip(-2)  # newest first: row i = Q_{t-1-i}
    target = x[:, :, P]
    gram = hist @ hist.transpose(-1, -2)  # [bs, Hq, P, P]
    rhs = (hist @ target[..., None])[..., 0]  # [bs, Hq, P]
    sq = (x * x).sum(-1)  # [bs, Hq, W], 0 on the pad slots
    lam = ridge_eps * sq.sum(-1) / cnt.clamp(min=1)[:, None].to(x.dtype)
    # the floor keeps an all-zero (empty) row's system non-singular
    lam = lam.clamp(min=torch.finfo(x.dtype).tiny ** 0.5)
    eye = torch.eye(P, device=x.device, dtype=x.dtype)
    M = gram + lam[..., None, None] * eye  # SPD by construction
    # *_ex variants: no error check, hence no host sync
    L = torch.linalg.cholesky_ex(M).L
    Linv = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)
    y = (Linv @ rhs[..., None])[..., 0]  # [bs, Hq, P]
    omega = torch.cumsum(Linv * y[..., :, None], dim=-2)  # [.., k-1, j] = omega^(k)_j
    # [k-1, j]: only j < k (newest-first index) is in the size-k window
    w = torch.softmax(omega.masked_fill(kk[None, :] > kk[:, None], _NEG_INF), dim=-1)
    w = w.flip(-1)  # back to chronological history slots
    k_valid = (kk + 1)[None, :] <= (cnt - 1)[:, None]
    return w, k_valid


def predict_next_query(window: torch.Tensor, count: torch.Tensor,
                       ridge_eps: float | torch.Tensor = RIDGE_EPS) -> torch.Tensor:
    """Q_hat_{t+1} [bs, Hq, D] (float32, or float64 for float64 input) from window [bs, W, Hq, D] / count [bs].

    Eq. (4) per window size, Q_hat^(k) = sum_{i=1..k} w^(k)_{t-i} Q_{t+1-i} (the
    weights fit on slots t-k..t-1 applied to the window shifted by one), then
    Eq. (5): the mean over the m = min(W-1, count-1) valid k. count == 1 (m = 0):
    the last query; count == 0: zeros.
    """
    W = window.shape[1]
    x = _masked_window(window, count)
    last = x[:, :, W - 1]  # [bs, Hq, D]
    if W == 1:
        return last
    w, k_valid = _assembled_weights(x, count, ridge_eps)
    m = k_valid.sum(-1)  # [bs]
    # Average the weights over valid k first: (1/m) sum_k w^(k) @ S == the mean of
    # the k estimates, with a single matmul against the shifted window S.
    wk = (w * k_valid[:, None, :, None]).sum(2) / m.clamp(min=1)[:, None, None]  # [bs, Hq, P]
    shifted = x[:, :, 1:]  # slot j of the history <-> slot j+1: Q_{t-i} -> Q_{t+1-i}
    pred = (wk[:, :, None, :] @ shifted)[:, :, 0]
    return torch.where((m > 0)[:, None, None], pred, last)


# ---- scoring and Top-K --------------------------------------------------------------
def allowed_positions(n: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_max: int) -> torch.Tensor:
    """[bs, n_max] mask of the scored positions: lo <= j < min(hi, n)."""
    pos = torch.arange(n_max, device=n.device)[None, :]
    top = torch.minimum(hi, n)[:, None]
    return (pos >= lo[:, None]) & (pos < top)


def score_positions(q_hat: torch.Tensor, keys: torch.Tensor, n: torch.Tensor, lo: torch.Tensor,
                    hi: torch.Tensor, scale: float) -> torch.Tensor:
    """CPU/reference path of the scoring kernel: s[b, h, j] = max over the G query heads
    of KV head h (query heads h*G .. h*G+G-1, the usual GQA layout) of
    scale * q_hat . k_j, on lo <= j < min(hi, n); -inf elsewhere.

    q_hat [bs, Hq, D], keys [bs, n_max, Hkv, D] -> [bs, Hkv, n_max] float32 (float64 for float64 input).
    """
    bs, Hq, D = q_hat.shape
    n_max, Hkv = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    cdt = torch.promote_types(compute_dtype(q_hat), compute_dtype(keys))
    q = q_hat.to(cdt).reshape(bs, Hkv, G, D)
    k = keys.to(cdt).permute(0, 2, 3, 1)  # [bs, Hkv, D, n_max]
    s = (q @ k).amax(dim=2) * scale  # [bs, Hkv, n_max]
    ok = allowed_positions(n, lo, hi, n_max)[:, None, :]
    return s.masked_fill(~ok, _NEG_INF)


def score_index_positions(qq: torch.Tensor, qs: torch.Tensor, kq: torch.Tensor, kscale: torch.Tensor,
                          n: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
    """score_positions over int8 copies of the query and the keys (`index_keys: int8`,
    kernels/index_keys.py): s[b, h, j] = max_g ((qq[b, g] . kq[b, j, h]) * qs[b, g]) *
    kscale[b, j, h] * scale on the allowed positions, -inf elsewhere. The device
    kernel's fp32 operations in its order (the integer dots are exact in fp32), so
    both give the same scores. qq [bs, Hq, D] int8, qs [bs, Hq], kq [bs, n_max, Hkv, D]
    int8, kscale [bs, n_max, Hkv]."""
    bs, Hq, D = qq.shape
    n_max, Hkv = kq.shape[1], kq.shape[2]
    dots = qq.float().reshape(bs, Hkv, Hq // Hkv, D) @ kq.float().permute(0, 2, 3, 1)  # [bs, Hkv, G, n_max]
    s = (dots * qs.reshape(bs, Hkv, -1, 1)).amax(dim=2) * kscale.transpose(1, 2) * scale
    ok = allowed_positions(n, lo, hi, n_max)[:, None, :]
    return s.masked_fill(~ok, _NEG_INF)


def select_topk(scores: torch.Tensor, budget: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level Top-K per KV head.

    scores [bs, Hkv, n_max] (finite exactly on the allowed positions), budget [bs]
    -> (positions [bs, Hkv, k_max] int32, ascending in the first `count` entries and
    0 after, count [bs, Hkv] int32 = min(budget, finite scores in the row, k_max)).
    `k_max` is a host-known bound (>= every budget) so no shape depends on data.
    """
    n_max = scores.shape[-1]
    k = min(k_max, n_max)
    finite = torch.isfinite(scores).sum(-1)
    count = torch.minimum(budget.to(torch.int64)[:, None], finite).clamp(max=k)
    idx = torch.topk(scores, k, dim=-1, sorted=True).indices
    keep = torch.arange(k, device=scores.device)[None, None, :] < count[..., None]
    # Ascending positions in the kept prefix: sequential reads when gathering KV.
    big = torch.iinfo(torch.int64).max
    pos = torch.sort(torch.where(keep, idx, big), dim=-1).values
    pos = torch.where(keep, pos, 0)
    if k < k_max:
        pos = torch.nn.functional.pad(pos, (0, k_max - k))
    return pos.to(torch.int32), count.to(torch.int32)


def overlap_ratio(pred_pos: torch.Tensor, pred_count: torch.Tensor, exact_pos: torch.Tensor,
                  exact_count: torch.Tensor, n_max: int) -> torch.Tensor:
    """Eq. (1): |S(q_pred) ∩ S(q_true)| / |S| per (row, KV head), |S| = exact_count.

    positions [bs, Hkv, K] with the first `count` [bs, Hkv] entries valid -> [bs, Hkv]
    float32. An empty exact set counts as full overlap (nothing to miss) [ours].
    Membership via a [bs, Hkv, n_max] mark, not a K x K comparison (K ~ 2048).
    """
    K = pred_pos.shape[-1]
    ar = torch.arange(K, device=pred_pos.device)[None, None, :]
    pv = ar < pred_count[..., None]
    ev = ar < exact_count[..., None]
    mark = torch.zeros(*pred_pos.shape[:2], n_max + 1, device=pred_pos.device, dtype=torch.float32)
    # invalid entries go to the extra slot n_max, which is never looked up
    mark.scatter_(-1, torch.where(pv, pred_pos.long(), n_max), 1.0)
    hit = torch.gather(mark, -1, torch.where(ev, exact_pos.long(), n_max)) * ev
    denom = exact_count.float()
    return torch.where(denom > 0, hit.sum(-1) / denom.clamp(min=1), 1.0)


def topk_overlap(q_pred: torch.Tensor, q_true: torch.Tensor, keys: torch.Tensor, n: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, scale: float, budget: torch.Tensor,
                 k_max: int) -> torch.Tensor:
    """Overlap ratio [bs, Hkv] of the Top-K chosen by q_pred vs by the true next query."""
    n_max = keys.shape[1]
    pp, pc = select_topk(score_positions(q_pred, keys, n, lo, hi, scale), budget, k_max)
    ep, ec = select_topk(score_positions(q_true, keys, n, lo, hi, scale), budget, k_max)
    return overlap_ratio(pp, pc, ep, ec, n_max)
