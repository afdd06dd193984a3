"""Quest's math (sgl_sparse/policies/quest.py) against float64 loops written from the
paper's definitions, on random ragged inputs."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.policies import quest

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

PAGE = 16


def ref_bounds(keys, n, h, p):
    page = keys[p * PAGE: min(p * PAGE + PAGE, n), h].double()
    return page.min(0).values, page.max(0).values


def ref_score(q, keys, n, h, p, group):
    """max over the group's query heads of sum_d max(q_d kmin_d, q_d kmax_d)."""
    lo, hi = ref_bounds(keys, n, h, p)
    best = -math.inf
    for g in range(group):
        qd = q[h * group + g].double()
        terms = [max(a * b, a * c) for a, b, c in zip(qd.tolist(), lo.tolist(), hi.tolist())]
        best = max(best, math.fsum(terms))
    return best


def ref_positions(q, keys, n, sink, b_start, budget, group):
    """Per KV head: sink positions, then the Top budget/16 candidate pages' positions
    clipped to [sink, b_start), ascending."""
    hkv = keys.shape[1]
    out = []
    for h in range(hkv):
        cand = [p for p in range(-(-n // PAGE)) if p * PAGE + PAGE > sink and p * PAGE < b_start]
        ranked = sorted(cand, key=lambda p: -ref_score(q, keys, n, h, p, group))[: budget // PAGE]
        pos = list(range(min(sink, b_start)))
        pos += sorted(j for p in ranked for j in range(p * PAGE, p * PAGE + PAGE) if sink <= j < b_start)
        out.append(pos)
    return out


def test_page_bounds_ragged_length():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 70):
        keys = torch.randn(n + 5, 3, 8, generator=gen)
        lo, hi = quest.page_bounds(keys, n, max_pages=8)
        for h in range(3):
            for p in range(-(-n // PAGE)):
                rl, rh = ref_bounds(keys, n, h, p)
                assert torch.equal(lo[h, p].double(), rl) and torch.equal(hi[h, p].double(), rh)
            assert torch.isinf(lo[h, -(-n // PAGE):]).all()  # pages past n: never candidates


@pytest.mark.parametrize("group", [1, 4, 8])
def test_scores_and_selection_match_float64(group):
    gen = torch.Generator().manual_seed(group)
    hkv, d = 2, 16
    # (n, sink, recent, budget): ragged lengths, none a multiple of 16 but one; the
    # last row has b_start <= sink (no candidate page: A = the sink positions only)
    # and one has sink 0.
    rows = [(75, 4, 9, 32), (130, 0, 20, 48), (48, 3, 12, 16), (21, 4, 19, 32)]
    bs = len(rows)
    P = -(-max(r[0] for r in rows) // PAGE)
    q = torch.randn(bs, hkv * group, d, generator=gen, dtype=torch.float64)
    keys = [torch.randn(r[0], hkv, d, generator=gen, dtype=torch.float64) for r in rows]
    kmin = torch.stack([quest.page_bounds(k, r[0], P)[0] for k, r in zip(keys, rows)]).double()
    kmax = torch.stack([quest.page_bounds(k, r[0], P)[1] for k, r in zip(keys, rows)]).double()
    scores = quest.page_scores(q, kmin, kmax)
    assert scores.dtype == torch.float64
    for b, (n, *_rest) in enumerate(rows):
        for h in range(hkv):
            for p in range(-(-n // PAGE)):
                assert scores[b, h, p].item() == pytest.approx(ref_score(q[b], keys[b], n, h, p, group), rel=1e-12)
    t = lambda i: torch.tensor([r[i] for r in rows])  # noqa: E731
    n, sink, recent, budget = t(0), t(1), t(2), t(3)
    b_start = n - recent
    cap = 64
    pos, cnt = quest.select_positions(scores, sink, b_start, budget, cap)
    for b, (nb, sb, _, bud) in enumerate(rows):
        want = ref_positions(q[b], keys[b], nb, sb, int(b_start[b]), bud, group)
        for h in range(hkv):
            got = pos[b, h, : cnt[b, h]].tolist()
            assert got == want[h], (b, h)
            assert all(x < int(b_start[b]) for x in got)
            assert pos[b, h, cnt[b, h]:].eq(0).all()
    assert cnt[3].tolist() == [2, 2]  # b_start = 2 <= sink: the sink below b_start only


def test_empty_selection_without_sink_or_candidates():
    scores = torch.randn(1, 2, 4)
    pos, cnt = quest.select_positions(scores, torch.tensor([0]), torch.tensor([0]), torch.tensor([32]), 40)
    assert cnt.tolist() == [[0, 0]] and pos.eq(0).all()
