"""AsyncSpade's math against a float64 transcription of the paper's equations
(papers/004 Eqs. 1-5, ALGORITHMS.md §4), one row and one head at a time with plain
numpy loops (no code shared with the vectorized implementation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sgl_sparse.queryaware import asyncspade as aspd

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent


# ---- the formulas, written out ---------------------------------------------------
def ref_predict(qs: list, eps: float) -> np.ndarray:
    """qs: the valid queries of one head, oldest first (qs[-1] = Q_t), at most W.

    For k = 1..len(qs)-1: fit Q_t from Q_{t-k}..Q_{t-1} by ridge (Eq. 2 without the
    softmax inside, lam = eps * mean |Q|^2 over qs), w = softmax(omega) (Eq. 3), apply
    w_{t-i} to Q_{t+1-i} (Eq. 4), average the estimates (Eq. 5)."""
    if not qs:
        return None
    t = len(qs) - 1
    ests = []
    for k in range(1, t + 1):
        R = np.stack([qs[t - i] for i in range(1, k + 1)])  # row i-1 = Q_{t-i}
        G = R @ R.T
        lam = eps * np.mean([q @ q for q in qs])
        omega = np.linalg.solve(G + lam * np.eye(k), R @ qs[t])
        w = np.exp(omega - omega.max())
        w /= w.sum()
        ests.append(sum(w[i - 1] * qs[t + 1 - i] for i in range(1, k + 1)))
    if not ests:
        return qs[t].copy()
    return sum(ests) / len(ests)


def ref_scores(q_hat, keys, n, lo, hi, scale):
    """q_hat [Hq, D], keys [n_max, Hkv, D] of one row -> [Hkv, n_max]."""
    Hq = q_hat.shape[0]
    n_max, Hkv = keys.shape[0], keys.shape[1]
    G = Hq // Hkv
    out = np.full((Hkv, n_max), -np.inf)
    for h in range(Hkv):
        for j in range(lo, min(hi, n)):
            out[h, j] = max(scale * float(q_hat[h * G + g] @ keys[j, h]) for g in range(G))
    return out


def _close(a, b, tol):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert not np.isnan(a).any() and not np.isnan(b).any()
    fin = np.isfinite(b)
    assert (np.isfinite(a) == fin).all()
    if fin.any():
        err = np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-300)
        assert err < tol, err


def _window(seed, bs, W, Hq, D, counts, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, W, Hq, D, generator=g, dtype=dtype) * 2 + 0.5
    for b, c in enumerate(counts):
        x[b, : W - c] = float("nan")  # left-pad garbage must never leak
    return x, torch.tensor(counts)


# ---- prediction ---------------------------------------------------------------------
@pytest.mark.parametrize("seed,W,Hq", [(0, 6, 4), (1, 5, 8), (2, 2, 1), (3, 9, 2)])
def test_prediction_matches_the_equations(seed, W, Hq):
    D = 11
    counts = [0, 1, 2, min(3, W), W, max(W - 1, 0)]
    x, cnt = _window(seed, len(counts), W, Hq, D, counts)
    q_hat = aspd.predict_next_query(x, cnt, ridge_eps=0.05)
    assert q_hat.shape == (len(counts), Hq, D) and q_hat.dtype == torch.float64
    for b, c in enumerate(counts):
        for h in range(Hq):
            qs = [x[b, j, h].numpy() for j in range(W - c, W)]
            want = ref_predict(qs, 0.05)
            if want is None:
                assert (q_hat[b, h] == 0).all()
            else:
                _close(q_hat[b, h], want, 1e-10)


def test_weights_are_softmax_over_the_window_only():
    x, cnt = _window(4, 3, 7, 2, 9, [7, 4, 2])
    w, k_valid = aspd.assembled_weights(x, cnt)
    P = 6
    assert k_valid.tolist() == [[True] * 6, [True] * 3 + [False] * 3, [True] + [False] * 5]
    assert not w.isnan().any()
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, P, dtype=torch.float64))
    for k in range(1, P + 1):  # size-k window: the k most recent history slots
        assert (w[:, :, k - 1, : P - k] == 0).all() and (w[:, :, k - 1, P - k:] > 0).all()


def test_single_and_no_query_windows():
    x, cnt = _window(5, 3, 1, 2, 4, [1, 0, 1])
    q_hat = aspd.predict_next_query(x, cnt)
    torch.testing.assert_close(q_hat[0], x[0, 0])
    assert (q_hat[1] == 0).all()
    x, cnt = _window(6, 2, 4, 2, 4, [1, 1])
    torch.testing.assert_close(aspd.predict_next_query(x, cnt), x[:, -1])


def test_float32_agrees_with_float64():
    counts = [8, 5, 3, 1]
    x, cnt = _window(7, 4, 8, 4, 16, counts)
    q64 = aspd.predict_next_query(x, cnt)
    q32 = aspd.predict_next_query(x.float(), cnt)
    assert q32.dtype == torch.float32 and not q32.isnan().any()
    assert ((q32.double() - q64).abs().max() / q64.abs().max()) < 1e-4
    qbf = aspd.predict_next_query(x.bfloat16(), cnt)  # the serving dtype: computed in fp32
    assert qbf.dtype == torch.float32 and not qbf.isnan().any()


# ---- the ring -------------------------------------------------------------------------
def test_ring_push_window_and_load():
    R, W, Hq, D = 4, 5, 2, 3
    ring = torch.full((R, W, Hq, D), float("nan"))
    total = torch.zeros(R, dtype=torch.int64)
    hist = {r: [] for r in range(R)}
    g = torch.Generator().manual_seed(8)
    pushes = [[0, 1, 2, 3], [0, 2], [0, 2, 3], [0], [0, 3], [0, 2], [0, 2], [0]]  # ragged
    for rows in pushes:
        q = torch.randn(len(rows), Hq, D, generator=g)
        aspd.ring_push(ring, total, q, torch.tensor(rows))
        for i, r in enumerate(rows):
            hist[r].append(q[i])
    rows = torch.tensor([3, 0, 2, 1])
    win, cnt = aspd.ring_window(ring[rows], total[rows])
    for i, r in enumerate(rows.tolist()):
        c = min(len(hist[r]), W)
        assert int(cnt[i]) == c
        for j in range(c):
            torch.testing.assert_close(win[i, W - c + j], hist[r][len(hist[r]) - c + j])
    # loading the same windows into a fresh ring reproduces them
    ring2 = torch.zeros_like(ring)
    total2 = torch.zeros_like(total)
    aspd.ring_load(ring2, total2, rows, win, cnt)
    win2, cnt2 = aspd.ring_window(ring2[rows], total2[rows])
    assert torch.equal(cnt2, cnt)
    ok = torch.arange(W)[None, :] >= (W - cnt)[:, None]
    torch.testing.assert_close(win2[ok], win[ok])


def test_ring_push_window_is_push_then_window():
    R, W, Hq, D = 4, 5, 2, 3
    g = torch.Generator().manual_seed(9)
    ring_a = torch.full((R, W, Hq, D), float("nan"))
    total_a = torch.zeros(R, dtype=torch.int64)
    ring_b, total_b = ring_a.clone(), total_a.clone()
    for rows in [[0, 1, 2, 3], [0, 2], [3, 0, 2], [0], [1, 3], [0, 2], [2, 0], [0], [0, 1]]:  # ragged
        rows = torch.tensor(rows)
        q = torch.randn(len(rows), Hq, D, generator=g)
        aspd.ring_push(ring_a, total_a, q, rows)
        win_a, cnt_a = aspd.ring_window(ring_a[rows], total_a[rows])
        win_b, cnt_b = aspd.ring_push_window(ring_b, total_b, q, rows)
        assert torch.equal(cnt_b, cnt_a) and torch.equal(total_b, total_a)
        assert torch.equal(ring_b.isnan(), ring_a.isnan())
        torch.testing.assert_close(ring_b.nan_to_num(), ring_a.nan_to_num(), rtol=0, atol=0)
        ok = torch.arange(W)[None, :] >= (W - cnt_a)[:, None]  # the valid, right-aligned entries
        assert not win_b[ok].isnan().any()
        torch.testing.assert_close(win_b[ok], win_a[ok], rtol=0, atol=0)


# ---- scoring, Top-K, overlap ---------------------------------------------------------
@pytest.mark.parametrize("G", [1, 4, 8])
def test_scores_match_the_group_max(G):
    g = torch.Generator().manual_seed(10 + G)
    bs, Hkv, D, n_max = 4, 2, 8, 37
    q = torch.randn(bs, Hkv * G, D, generator=g, dtype=torch.float64)
    keys = torch.randn(bs, n_max, Hkv, D, generator=g, dtype=torch.float64)
    n = torch.tensor([37, 20, 5, 0])
    lo = torch.tensor([4, 0, 2, 0])
    hi = torch.tensor([30, 37, 9, 10])  # hi > n for row 2: clipped to n
    s = aspd.score_positions(q, keys, n, lo, hi, 0.3)
    assert s.shape == (bs, Hkv, n_max)
    for b in range(bs):
        _close(s[b], ref_scores(q[b].numpy(), keys[b].numpy(), int(n[b]), int(lo[b]), int(hi[b]), 0.3), 1e-12)


def test_select_topk_against_sorting():
    g = torch.Generator().manual_seed(20)
    bs, Hkv, n_max = 5, 3, 41
    n = torch.tensor([41, 41, 17, 0, 41])
    lo = torch.tensor([0, 3, 0, 0, 40])
    hi = torch.tensor([41, 33, 41, 41, 41])
    ok = aspd.allowed_positions(n, lo, hi, n_max)[:, None, :]
    s = torch.randn(bs, Hkv, n_max, generator=g).masked_fill(~ok, float("-inf"))
    budget = torch.tensor([7, 100, 17, 5, 3])  # >= length, == length, empty, single
    pos, cnt = aspd.select_topk(s, budget, k_max=100)
    assert pos.shape == (bs, Hkv, 100) and pos.dtype == torch.int32 and cnt.dtype == torch.int32
    for b in range(bs):
        length = int(ok[b, 0].sum())
        want = min(int(budget[b]), length)
        for h in range(Hkv):
            assert int(cnt[b, h]) == want
            got = pos[b, h, :want].tolist()
            assert got == sorted(got)
            expect = set(np.argsort(-s[b, h].numpy(), kind="stable")[:want].tolist())
            assert set(got) == expect
            assert (pos[b, h, want:] == 0).all()
    assert set(pos[1, 0, : int(cnt[1, 0])].tolist()) == set(range(3, 33))  # budget >= length: all
    pos, cnt = aspd.select_topk(s, budget.clamp(max=4), k_max=4)  # k_max < n_max
    assert pos.shape == (bs, Hkv, 4) and cnt[:, 0].tolist() == [4, 4, 4, 0, 1]


def test_overlap_ratio_is_set_intersection():
    g = torch.Generator().manual_seed(30)
    bs, Hkv, n_max, K = 3, 2, 50, 12
    pp = torch.stack([torch.stack([torch.randperm(n_max, generator=g)[:K] for _ in range(Hkv)]) for _ in range(bs)])
    ep = torch.stack([torch.stack([torch.randperm(n_max, generator=g)[:K] for _ in range(Hkv)]) for _ in range(bs)])
    outside = [p for p in range(n_max) if p not in pp[0, 0].tolist()][:6]
    ep[0, 0] = torch.cat([pp[0, 0, 3:9], torch.tensor(outside)])  # exactly half shared
    cnt = torch.tensor([[12, 12], [7, 0], [12, 3]], dtype=torch.int32)
    r = aspd.overlap_ratio(pp.int(), cnt, ep.int(), cnt, n_max)
    for b in range(bs):
        for h in range(Hkv):
            c = int(cnt[b, h])
            want = len(set(pp[b, h, :c].tolist()) & set(ep[b, h, :c].tolist())) / c if c else 1.0
            assert abs(float(r[b, h]) - want) < 1e-7
    assert abs(float(r[0, 0]) - 0.5) < 1e-7
    assert float(aspd.overlap_ratio(pp.int(), cnt, pp.int(), cnt, n_max).min()) == 1.0


# ---- the predictor works ------------------------------------------------------------
def test_predictor_beats_the_last_query_on_a_smooth_trajectory():
    """Queries = mean + a state following a fixed linear recurrence (a slow rotation,
    z <- A z) + white noise: the predicted next query is closer to the truth than
    the last query, and its Top-K of random keys overlaps the true next query's
    Top-K more than the last query's does, and highly."""
    g = torch.Generator().manual_seed(40)
    bs, W, Hkv, G, D, n_max, T = 4, 9, 2, 4, 32, 300, 40
    Hq = Hkv * G
    mu = torch.randn(bs, Hq, D, generator=g) * 2.0
    skew = torch.randn(D, D, generator=g) / D ** 0.5
    A = torch.linalg.matrix_exp(0.02 * (skew - skew.T))  # orthogonal: a slow rotation
    z = torch.randn(bs, Hq, D, generator=g) * 2.0
    qs = []
    for _ in range(T + 1):
        z = z @ A.T
        qs.append(mu + z + torch.randn(bs, Hq, D, generator=g) * 0.8)
    ring = torch.zeros(bs, W, Hq, D)
    total = torch.zeros(bs, dtype=torch.int64)
    keys = torch.randn(bs, n_max, Hkv, D, generator=g)
    n = torch.full((bs,), n_max)
    lo, hi = torch.zeros(bs, dtype=torch.int64), n.clone()
    budget = torch.full((bs,), 30)
    err_pred, err_last, ov_pred, ov_last = [], [], [], []
    for t in range(T):
        aspd.ring_push(ring, total, qs[t])
        if t < W:
            continue
        win, cnt = aspd.ring_window(ring, total)
        q_hat = aspd.predict_next_query(win, cnt)
        truth = qs[t + 1]
        err_pred.append((q_hat - truth).norm(dim=-1).mean())
        err_last.append((qs[t] - truth).norm(dim=-1).mean())
        ov_pred.append(aspd.topk_overlap(q_hat, truth, keys, n, lo, hi, D ** -0.5, budget, 30).mean())
        ov_last.append(aspd.topk_overlap(qs[t], truth, keys, n, lo, hi, D ** -0.5, budget, 30).mean())
    e_p, e_l = torch.stack(err_pred).mean(), torch.stack(err_last).mean()
    o_p, o_l = torch.stack(ov_pred).mean(), torch.stack(ov_last).mean()
    assert e_p < 0.85 * e_l, (e_p, e_l)  # measured 0.79
    assert o_p > o_l + 0.03 and o_p > 0.7, (o_p, o_l)  # measured 0.755 vs 0.692
