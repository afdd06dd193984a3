"""The SFI Selector against a float64 transcription of ALGORITHMS.md §1, one request
and one KV head at a time with plain Python/numpy loops (no shared code with the
vectorized implementation), each step separately and end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sgl_sparse.config import SfiPolicy
from sgl_sparse.selector import core

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent


# ---- the formulas, written out ---------------------------------------------------
def ref_evidence(logits, lo, hi, nq, beta):
    """logits [G, w, N] of one KV head -> e over A = [lo, hi)."""
    G, w, N = logits.shape
    u = np.zeros(N)
    for i in range(nq):
        p = np.zeros(N)
        for g in range(G):
            z = logits[g, i, lo:hi]
            ez = np.exp(z - z.max())
            p[lo:hi] += ez / ez.sum() / G
        u += p ** beta / nq
    e = u ** (1.0 / beta)
    return e / e.sum()


def lower_median(x):
    return float(np.sort(x)[(len(x) - 1) // 2])


def ref_prior(norms, lo, hi, k):
    N = len(norms)
    a = norms[lo:hi]
    med = lower_median(a)
    mad = lower_median(np.abs(a - med))
    pi = np.zeros(N)
    for j in range(lo, hi):
        z = max(0.0, (norms[j] - med) / mad) if mad > 0 else 0.0
        g = (1 + z * z) ** -0.5
        x = (j - lo) / (hi - 1 - lo) if hi - 1 - lo > 0 else 1.0
        f = math.exp(-k.alpha * x ** k.kappa) * (1 - x + k.eps) ** k.zeta
        pi[j] = g * f
    return pi / pi.sum()


def ref_fuse(e, pi, c):
    d = e - pi
    den = float(d @ d)
    lam = min(max(float(e @ d) / den, 0.0), c) if den > 0 else 0.0
    return (1 - lam) * e + lam * pi


def ref_nms(s, lo, hi, gamma, radius):
    out = np.full_like(s, -np.inf)
    for j in range(lo, hi):
        m = max(s[k] for k in range(max(lo, j - radius), min(hi, j + radius + 1)))
        out[j] = s[j] - gamma * (m - s[j])
    return out


def ref_exclusivity(s_heads, lo, hi, eta, tau):
    out = np.full_like(s_heads, -np.inf)
    for j in range(lo, hi):
        col = s_heads[:, j] / tau
        rho = np.exp(col - col.max())
        rho /= rho.sum()
        out[:, j] = s_heads[:, j] + eta * np.log(rho)
    return out


def ref_refined(logits, norms, lo, hi, nq, k):
    """One request: logits [H, G, w, N], norms [H, N] -> refined scores [H, N]."""
    H = logits.shape[0]
    s = np.full((H, logits.shape[-1]), -np.inf)
    for h in range(H):
        e = ref_evidence(logits[h], lo, hi, nq, k.beta)
        pi = ref_prior(norms[h], lo, hi, k)
        q = ref_fuse(e, pi, k.clip)
        sh = np.full_like(q, -np.inf)
        sh[lo:hi] = np.log(q[lo:hi] + k.eps)
        s[h] = ref_nms(sh, lo, hi, k.nms_gamma, k.nms_radius)
    return ref_exclusivity(s, lo, hi, k.excl_eta, k.excl_tau)


# ---- random problems ---------------------------------------------------------------
def _problem(seed, r=3, H=3, G=2, w=2, N=41, specs=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, H, G, w, N, generator=g, dtype=torch.float64) * 3
    norms = torch.rand(r, H, N, generator=g, dtype=torch.float64) * 4 + 1
    norms[:, :, 5] = 40.0  # an outlier key norm: must be down-weighted
    lo = torch.tensor([4, 0, 2][:r])
    hi = torch.tensor([N - 8, N, 9][:r])  # ragged A_t, one of them the whole range
    nq = torch.tensor([w, 1, w][:r])
    qmask = torch.arange(w)[None, :] < nq[:, None]
    specs = specs or [SfiPolicy(), SfiPolicy(beta=1.0, alpha=2.0, zeta=1.0, nms_radius=3),
                      SfiPolicy(clip=1.0, excl_eta=1.0, excl_tau=0.5, nms_radius=0)][:r]
    knobs = core.SelectorKnobs.from_specs(specs, "cpu", torch.float64)
    return logits, norms, lo, hi, nq, qmask, specs, knobs


def _close(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert not np.isnan(a).any() and not np.isnan(b).any()
    fin = np.isfinite(b)
    assert (np.isfinite(a) == fin).all()
    err = np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-300)
    assert err < 1e-10, err


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_step_matches_the_formulas(seed):
    logits, norms, lo, hi, nq, qmask, specs, k = _problem(seed)
    allowed = core.candidate_mask(lo, hi, logits.shape[-1])
    e = core.evidence(logits, allowed, qmask, k.beta)
    pi = core.prior(norms, allowed, lo, hi, k)
    fused = core.fuse(e, pi, k.clip)
    s = core.log_scores(fused, allowed, k.eps)
    nms = core.soft_nms(s, allowed, k.nms_gamma, k.nms_radius, k.nms_radius_max)
    for b, spec in enumerate(specs):
        a, z = int(lo[b]), int(hi[b])
        for h in range(logits.shape[1]):
            e_ref = ref_evidence(logits[b, h].numpy(), a, z, int(nq[b]), spec.beta)
            pi_ref = ref_prior(norms[b, h].numpy(), a, z, spec)
            q_ref = ref_fuse(e_ref, pi_ref, spec.clip)
            _close(e[b, h], e_ref)
            _close(pi[b, h], pi_ref)
            _close(fused[b, h], q_ref)
            s_in = s[b, h].numpy()
            _close(nms[b, h], ref_nms(s_in, a, z, spec.nms_gamma, spec.nms_radius))
        ex = core.exclusivity(nms, allowed, k.excl_eta, k.excl_tau)
        _close(ex[b], ref_exclusivity(nms[b].numpy(), a, z, spec.excl_eta, spec.excl_tau))
    # the outlier key (position 5) gets a lower prior than its neighbours
    assert (pi[0, :, 5] < pi[0, :, 6]).all()


@pytest.mark.parametrize("seed", [3, 4])
def test_end_to_end_top_k(seed):
    logits, norms, lo, hi, nq, qmask, specs, k = _problem(seed)
    budget = torch.tensor([7, 100, 3])
    pos, count = core.select(logits, norms, lo, hi, qmask, budget, k, k_max=100)
    assert pos.shape == (3, 3, 100)
    for b, spec in enumerate(specs):
        a, z = int(lo[b]), int(hi[b])
        ref = ref_refined(logits[b].numpy(), norms[b].numpy(), a, z, int(nq[b]), spec)
        want = min(int(budget[b]), z - a)
        assert int(count[b]) == want
        for h in range(3):
            got = pos[b, h, :want].tolist()
            assert got == sorted(got) and len(set(got)) == want
            assert all(a <= p < z for p in got)
            expect = set(np.argsort(-ref[h], kind="stable")[:want].tolist())
            assert set(got) == expect


def test_single_query_evidence_is_the_group_mean_probability():
    logits, norms, lo, hi, _, _, specs, k = _problem(5, w=1)
    qmask = torch.ones(3, 1, dtype=torch.bool)
    allowed = core.candidate_mask(lo, hi, logits.shape[-1])
    e = core.evidence(logits, allowed, qmask, k.beta)
    lg = logits.masked_fill(~allowed[:, :, None, None, :], float("-inf"))
    p = torch.softmax(lg, -1).mean(2)[:, :, 0]
    torch.testing.assert_close(e, p, rtol=1e-12, atol=1e-15)


def test_float32_serving_dtype_agrees_with_float64():
    logits, norms, lo, hi, nq, qmask, specs, k64 = _problem(6)
    k32 = core.SelectorKnobs.from_specs(specs, "cpu", torch.float32)
    s64 = core.refined_scores(logits, norms, lo, hi, qmask, k64)
    s32 = core.refined_scores(logits.float(), norms.float(), lo, hi, qmask, k32)
    fin = torch.isfinite(s64)
    assert torch.equal(fin, torch.isfinite(s32)) and not s32.isnan().any()
    assert ((s32.double() - s64)[fin].abs().max() / s64[fin].abs().max()) < 1e-5


@pytest.mark.parametrize("budget", [5, 30, 60])
def test_unordered_top_k_keeps_the_same_positions(budget):
    """With every budget >= k the top-k needs no ordering: same kept positions."""
    g = torch.Generator().manual_seed(budget)
    n = 41
    lo, hi = torch.tensor([4, 0, 2, 7]), torch.tensor([33, n, 9, 7])  # ragged, one empty
    s = torch.randn(4, 3, n, generator=g).masked_fill(~core.candidate_mask(lo, hi, n), float("-inf"))
    b = torch.full((4,), budget)
    k_max = budget
    sorted_pos, sorted_count = core.top_k_positions(s, lo, hi, b, k_max)
    fast_pos, fast_count = core.top_k_positions(s, lo, hi, b, k_max, k_min=budget)
    assert torch.equal(sorted_count, fast_count) and fast_count.tolist() == [min(budget, 29), min(budget, n), min(budget, 7), 0]
    assert torch.equal(sorted_pos, fast_pos)


@pytest.mark.parametrize("budget,k_max", [(0, 4), (5, 5), (30, 40), (60, 60)])
def test_top_k_kernel_matches_the_torch_path(budget, k_max):
    """The Triton top-k over [lo, hi) (kernels/topk_range.py, the CUDA path) against the
    torch path: the same positions (no ties in random scores), ascending, 0 after count."""
    g = torch.Generator().manual_seed(budget + 7)
    n = 41
    lo, hi = torch.tensor([4, 0, 2, 7, 40]), torch.tensor([33, n, 9, 7, 3])  # ragged, empty, hi < lo
    s = torch.randn(5, 3, n, generator=g).masked_fill(~core.candidate_mask(lo, hi, n), float("-inf"))
    b = torch.tensor([budget, budget, budget + 1, budget, budget]).clamp(max=k_max)
    ref_pos, ref_count = core.top_k_positions(s, lo, hi, b, k_max, use_kernel=False)
    pos, count = core.top_k_positions(s, lo, hi, b, k_max, use_kernel=True)
    assert torch.equal(count, ref_count) and pos.dtype == ref_pos.dtype == torch.int64
    assert torch.equal(pos, ref_pos)
