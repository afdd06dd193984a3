"""LFPS against a float64 transcription of the paper's equations (papers/001 Eqs.
4-10, ALGORITHMS.md §3), one row and one KV head at a time with plain numpy loops.
The reference keeps both tables in the paper's position form (Φ_sla(i) <- r
Φ_sla(i-1) + ...), never the implementation's relative-offset storage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sgl_sparse.queryaware import lfps

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

KN = lfps.LfpsKnobs(s=6, r=0.95, eps=0.85, a=0.2, n_local=6, n_sink=2)


# ---- the formulas, written out ---------------------------------------------------
def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


class RefRow:
    """One request row: position-form tables per KV head, priors per head."""

    def __init__(self, q_last, keys, values, n, scale, M, kn):
        # q_last [s, Hq, D] (prompt indices n-s .. n-1), keys/values [n_max, Hkv, D]
        s, Hq, D = q_last.shape
        Hkv = keys.shape[1]
        G = Hq // Hkv
        ns, r = kn.n_sink, kn.r
        self.kn, self.scale, self.G = kn, scale, G
        qs = {n - s + j: q_last[j] for j in range(s) if n - s + j >= ns}
        c = 1.0 / (2 * max(len(qs), 1) * (1 - r))
        self.ver = np.zeros((Hkv, M))
        self.sla = np.zeros((Hkv, M))
        for h in range(Hkv):
            w = {}  # w[t][i], Eq. 4's w^(t)_i over non-sink keys i <= t
            for t, qt in qs.items():
                p = np.zeros(n)
                for g in range(G):
                    z = np.array([scale * qt[h * G + g] @ keys[i, h] for i in range(ns, t + 1)])
                    p[ns:t + 1] += softmax(z) / G
                w[t] = p
            for i in range(M):
                for j in range(1, s + 1):
                    if n - j not in w:
                        continue
                    if i < n:
                        self.ver[h, i] += c * w[n - j][i]
                    x = i - j + 1
                    if 0 <= x < n:
                        self.sla[h, i] += c * w[n - j][x]
        self.kbar = keys[ns:n].mean(0)  # [Hkv, D]
        self.vbar = values[ns:n].mean(0)
        ql = q_last[s - 1]
        self.sig = np.zeros(Hq)
        for hq in range(Hq):
            z = np.array([scale * ql[hq] @ keys[i, hq // G] for i in range(ns, n)])
            self.sig[hq] = z.var() / (ql[hq] @ ql[hq])

    def rho(self, q, keys, n):
        kn, sc, G = self.kn, self.scale, self.G
        out = []
        for hq in range(q.shape[0]):
            h = hq // G
            ws = sum(math.exp(sc * q[hq] @ keys[i, h]) for i in range(kn.n_sink))
            wg = math.exp(sc * q[hq] @ self.kbar[h] + (q[hq] @ q[hq]) * self.sig[hq] / 2) * (n - kn.n_sink)
            t = n - 1
            wl = sum(math.exp(sc * q[hq] @ keys[i, h]) for i in range(max(kn.n_sink, t - kn.n_local), t))
            out.append(ws / (ws + wg + wl))
        return np.array(out)

    def step(self, q, keys, n, budget):
        """-> per KV head: (bypass, C1 set, C2 sorted list, weights on C2) and the update."""
        kn, sc, G = self.kn, self.scale, self.G
        Hkv = keys.shape[1]
        rho = self.rho(q, keys, n)
        res = []
        for h in range(Hkv):
            bypass = rho[h * G:(h + 1) * G].mean() > kn.eps
            if bypass:
                res.append((True, set(), [], []))
                continue
            V = list(range(kn.n_sink, n))
            ver, sla = self.ver[h], self.sla[h]

            def tau_mean(x):
                xv = np.array([x[i] for i in V])
                m = xv.mean()
                m2 = ((xv - m) ** 2).sum()
                m4 = ((xv - m) ** 4).sum()
                kap = m4 / m2 ** 2 if m2 > 0 else 0.0
                return (kn.a * m / kap if kap > 0 else math.inf), m

            tv, mv = tau_mean(ver)
            ts, ms = tau_mean(sla)
            c0 = {i for i in V if ver[i] > tv or sla[i] > ts}  # Eq. 7
            c1 = {i + d for i in c0 for d in (-1, 0, 1, 2)
                  if (i + d) in V and (ver[i + d] > mv or sla[i + d] > ms)}  # Eq. 9
            logit = {j: [sc * q[h * G + g] @ keys[j, h] for g in range(G)] for j in c1}
            order = sorted(c1, key=lambda j: -max(logit[j]))
            c2 = sorted(order[:budget])
            if c2:
                wts = np.mean([softmax(np.array([logit[j][g] for j in c2])) for g in range(G)], axis=0)
            else:
                wts = np.array([])
            res.append((False, c1, c2, wts))
        return res

    def update(self, res, n):
        """Eq. 10 in position form; skipped for bypassed heads and empty C2, where the
        slash table still moves with the sequence (its diagonals are relative
        offsets: [ours] in the implementation, mirrored here)."""
        r = self.kn.r
        for h, (bypass, _, c2, wts) in enumerate(res):
            if bypass or not c2:
                self.sla[h] = np.concatenate([[0.0], self.sla[h][:-1]])
                continue
            c = 1.0 / (2 * len(c2))
            w = np.full(self.ver.shape[1], c)
            for j, x in zip(c2, wts):
                w[j] = x
            self.ver[h] = r * self.ver[h] + w - c
            shifted = np.concatenate([[0.0], self.sla[h][:-1]])
            self.sla[h] = r * shifted + w - c


# ---- problems -----------------------------------------------------------------------
def _problem(seed, G, bs=3, Hkv=2, D=16, n_max=61, M=72, s=6):
    """Keys with a few 'hot' positions along a direction u and queries leaning on u,
    so the attention has vertical structure; row 1 has sink keys aligned with u
    strongly enough to make its heads bypass."""
    g = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    u = torch.randn(D, generator=g, dtype=torch.float64)
    u /= u.norm()
    keys = torch.randn(bs, n_max, Hkv, D, generator=g, dtype=torch.float64)
    hot = torch.randint(3, 40, (bs, Hkv, 5), generator=g)
    for b in range(bs):
        for h in range(Hkv):
            keys[b, hot[b, h], h] += 3.0 * u
    keys[1, :KN.n_sink] += 25.0 * u  # sink-dominated row
    values = torch.randn(bs, n_max, Hkv, D, generator=g, dtype=torch.float64)
    qs = torch.randn(bs, 40, Hq, D, generator=g, dtype=torch.float64) * 0.5 + 1.5 * u
    n0 = torch.tensor([37, 29, 5])  # ragged prompts, row 2 shorter than s + n_sink
    q_last = torch.stack([qs[b, int(n0[b]) - s:int(n0[b])] if int(n0[b]) >= s else
                          torch.cat([torch.full((s - int(n0[b]), Hq, D), float("nan"), dtype=torch.float64),
                                     qs[b, :int(n0[b])]]) for b in range(bs)])
    return keys, values, qs, q_last, n0, M


def _views(state, n, n_max):
    ver, sla, valid = lfps.table_views(state.ver, state.sla, n, n_max, KN.n_sink)
    return ver, sla, valid


@pytest.mark.parametrize("seed,G", [(0, 1), (1, 4), (2, 8)])
def test_init_matches_eq4_and_priors(seed, G):
    keys, values, qs, q_last, n0, M = _problem(seed, G)
    scale = 0.25
    st = lfps.init_tables(q_last, keys, values, n0, scale, M, KN)  # NaN in row 2's unused slots
    n_max = keys.shape[1]
    # the first decode step sees n0 + 1 keys; its view of the tables is Φ^(0)
    ver, sla, valid = _views(st, n0 + 1, n_max)
    for b in range(3):
        n = int(n0[b])
        s_rows = np.nan_to_num(q_last[b].numpy())
        ref = RefRow(s_rows, keys[b].numpy(), values[b].numpy(), n, scale, M, KN)
        for h in range(keys.shape[2]):
            pos = range(KN.n_sink, n + 1)
            np.testing.assert_allclose(ver[b, h, list(pos)].numpy(), ref.ver[h, list(pos)], rtol=1e-10, atol=1e-13)
            np.testing.assert_allclose(sla[b, h, list(pos)].numpy(), ref.sla[h, list(pos)], rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(st.kbar[b].numpy(), ref.kbar, rtol=1e-10)
        np.testing.assert_allclose(st.vbar[b].numpy(), ref.vbar, rtol=1e-10)
        np.testing.assert_allclose(st.sigma_hat2[b].numpy(), ref.sig, rtol=1e-9)
        # Eq. 15: both tables sum to 0.5 / (1 - r) after init
        np.testing.assert_allclose(st.ver[b].sum(-1).numpy(), 0.5 / (1 - KN.r), rtol=1e-10)
        np.testing.assert_allclose(st.sla[b].sum(-1).numpy(), 0.5 / (1 - KN.r), rtol=1e-10)
    assert not any(torch.isnan(getattr(st, f)).any() for f in ("ver", "sla", "kbar", "vbar", "sigma_hat2"))


@pytest.mark.parametrize("seed,G", [(3, 1), (4, 4), (5, 8)])
def test_decode_steps_match_the_reference(seed, G):
    """Several decode steps: ρ/bypass, C1, C2, weights, scored fraction and the
    updated tables, against the position-form reference."""
    keys, values, qs, q_last, n0, M = _problem(seed, G)
    scale = 0.25
    n_max, Hkv = keys.shape[1], keys.shape[2]
    st = lfps.init_tables(torch.nan_to_num(q_last), keys, values, n0, scale, M, KN)
    refs = [RefRow(np.nan_to_num(q_last[b].numpy()), keys[b].numpy(), values[b].numpy(), int(n0[b]), scale, M, KN)
            for b in range(3)]
    budget = torch.tensor([4, 16, 3])  # 16 = k_max: all of C1 when it fits
    seen_nonempty = seen_bypass = False
    for step_i in range(5):
        n = n0 + 1 + step_i
        q = qs[torch.arange(3), (n - 1).clamp(max=39)]
        res = lfps.step(st, q, keys, n, budget, k_max=16, c_max=n_max, scale=scale, knobs=KN)
        assert res.positions.shape == (3, Hkv, 16) and not res.weights.isnan().any()
        for b in range(3):
            rb = refs[b].step(q[b].numpy(), keys[b].numpy(), int(n[b]), int(budget[b]))
            for h, (byp, c1, c2, wts) in enumerate(rb):
                assert bool(res.bypass[b, h]) == byp
                cnt = int(res.counts[b, h])
                assert cnt == len(c2)
                assert res.positions[b, h, :cnt].tolist() == c2
                np.testing.assert_allclose(res.weights[b, h, :cnt].numpy(), wts, rtol=1e-10, atol=1e-14)
                assert abs(float(res.scored_frac[b, h]) - len(c1) / (int(n[b]) - KN.n_sink)) < 1e-6
                seen_nonempty |= cnt > 0
                seen_bypass |= byp
            refs[b].update(rb, int(n[b]))
        lfps.update_tables(st, res, n, KN)
        ver, sla, _ = _views(st, n + 1, n_max)
        for b in range(3):
            pos = list(range(KN.n_sink, min(int(n[b]) + 1, n_max)))
            for h in range(Hkv):
                np.testing.assert_allclose(ver[b, h, pos].numpy(), refs[b].ver[h, pos], rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(sla[b, h, pos].numpy(), refs[b].sla[h, pos], rtol=1e-9, atol=1e-12)
    assert seen_nonempty and seen_bypass


def test_candidate_cap_and_budget_cover_everything():
    """c_max < |C1|: the c_max highest-table candidates are scored; budget >= |C1|
    selects all of C1; a flat table gives empty candidate sets (no NaN)."""
    keys, values, qs, q_last, n0, M = _problem(6, 4)
    scale = 0.25
    n_max = keys.shape[1]
    st = lfps.init_tables(torch.nan_to_num(q_last), keys, values, n0, scale, M, KN)
    n = n0 + 1
    q = qs[torch.arange(3), n - 1]
    full = lfps.step(st, q, keys, n, torch.full((3,), 1000), k_max=n_max, c_max=n_max, scale=scale, knobs=KN)
    ver, sla, valid = _views(st, n, n_max)
    _, c1 = lfps.candidates(ver, sla, valid, KN.a)
    for b in range(3):
        for h in range(2):
            if not bool(full.bypass[b, h]):
                want = torch.nonzero(c1[b, h]).flatten().tolist()
                assert full.positions[b, h, : int(full.counts[b, h])].tolist() == want
    assert (full.counts > 3).any()  # the cap below really truncates
    capped = lfps.step(st, q, keys, n, torch.full((3,), 1000), k_max=n_max, c_max=3, scale=scale, knobs=KN)
    assert (capped.counts <= 3).all() and (capped.counts == torch.minimum(full.counts, torch.tensor(3))).all()
    for b in range(3):
        for h in range(2):
            c = int(capped.counts[b, h])
            if c:
                prio = (ver + sla)[b, h]
                chosen = capped.positions[b, h, :c].long()
                others = [j for j in torch.nonzero(c1[b, h]).flatten().tolist() if j not in chosen.tolist()]
                assert all(prio[chosen].min() >= prio[j] for j in others)
    flat = lfps.LfpsState(ver=torch.ones_like(st.ver), sla=torch.zeros_like(st.sla), kbar=st.kbar,
                          vbar=st.vbar, sigma_hat2=st.sigma_hat2)
    res = lfps.step(flat, q, keys, n, torch.full((3,), 5), k_max=8, c_max=20, scale=scale, knobs=KN)
    assert (res.counts == 0).all() and (res.scored_frac == 0).all() and not res.weights.isnan().any()
    before = flat.ver.clone()
    lfps.update_tables(flat, res, n, KN)  # |C2| = 0: no update, no NaN
    assert torch.equal(flat.ver, before)


def test_float32_agrees_and_rows_index_the_state():
    keys, values, qs, q_last, n0, M = _problem(7, 4)
    scale = 0.25
    st64 = lfps.init_tables(torch.nan_to_num(q_last), keys, values, n0, scale, M, KN)
    st32 = lfps.init_tables(torch.nan_to_num(q_last).float(), keys.float(), values.float(), n0, scale, M, KN)
    assert st32.ver.dtype == torch.float32
    assert (st32.ver.double() - st64.ver).abs().max() < 1e-5 * st64.ver.abs().max()
    # a bigger preallocated state, rows scattered
    big = lfps.LfpsState(ver=torch.zeros(6, 2, M, dtype=torch.float64), sla=torch.zeros(6, 2, M, dtype=torch.float64),
                         kbar=torch.zeros(6, 2, 16, dtype=torch.float64), vbar=torch.zeros(6, 2, 16, dtype=torch.float64),
                         sigma_hat2=torch.zeros(6, 8, dtype=torch.float64))
    rows = torch.tensor([5, 0, 3])
    lfps.init_tables(torch.nan_to_num(q_last), keys, values, n0, scale, M, KN, out=big, rows=rows)
    n = n0 + 1
    q = qs[torch.arange(3), n - 1]
    a = lfps.step(st64, q, keys, n, torch.tensor([4, 4, 4]), 8, 40, scale, KN)
    b = lfps.step(big, q, keys, n, torch.tensor([4, 4, 4]), 8, 40, scale, KN, rows=rows)
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))
    lfps.update_tables(st64, a, n, KN)
    lfps.update_tables(big, b, n, KN, rows=rows)
    torch.testing.assert_close(big.ver[rows], st64.ver)
    torch.testing.assert_close(big.sla[rows], st64.sla)
    assert (big.ver[[1, 2, 4]] == 0).all()
