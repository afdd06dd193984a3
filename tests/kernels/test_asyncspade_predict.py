"""kernels/asyncspade_predict.py (ring push + next-query prediction in one launch)
against its float64 reference (queryaware.asyncspade's ring_push_window +
predict_next_query): the ring and totals bit for bit (the pushed query rounded to
the ring's dtype, bf16 / fp16 / fp32), q_hat within a relative error bound and
always finite. Ring slots outside each row's window hold NaN. Totals before the
push 0, 1, W-2, W-1, W, > W (the ring wrapped), ragged across rows; rows a
subset of the ring's (permuted, one skipped with -1), q rows permuted; per-row
ridge; per-row window caps 0, 1, 2, < W; W = 1 (the last query), 2 (one window
size), the default 5 and the bound 33; D not a power of two."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse.kernels.asyncspade_predict import asyncspade_predict, asyncspade_predict_ref, make_arrivals

#: q_hat's relative error against float64 (per row and head). fp32 math on a
#: ridge system whose condition number is at most 1 + (W - 1) / ridge (a few
#: thousand here): the torch fp32 chain lands at ~1e-7 .. 3e-6 on these cases.
REL_TOL = 5e-5


def _ring(gen, r, w, hq, d, dtype, totals):
    """Queries where a row has pushed them (slot s holds its s-th), NaN elsewhere."""
    ring = torch.randn(r, w, hq, d, generator=gen)
    # correlated queries, as a model's are (and a less trivial ridge system)
    ring = ring + 2.0 * torch.randn(r, 1, hq, d, generator=gen)
    unused = torch.arange(w)[None, :] >= totals[:, None]
    ring[unused] = float("nan")
    return ring.to(dtype)


def _check(ring, total, q, rows, ridge, q_rows=None, cap=None):
    """The kernel and the float64 reference from the same state: same ring and
    totals after, q_hat within REL_TOL, finite, zero where skipped. -> q_hat."""
    ring_k, total_k = ring.clone(), total.clone()
    ring_r, total_r = ring.clone(), total.clone()
    arrivals = make_arrivals(ring.shape[0], ring.device)
    out = asyncspade_predict(ring_k, total_k, q, rows, ridge, q_rows=q_rows, count_cap=cap, arrivals=arrivals)
    ref = asyncspade_predict_ref(ring_r, total_r, q, rows, ridge, q_rows=q_rows, count_cap=cap,
                                 compute_dtype=torch.float64)
    assert torch.equal(total_k, total_r)
    same = (ring_k == ring_r) | (ring_k.isnan() & ring_r.isnan())
    assert bool(same.all()), same.logical_not().nonzero()[:5]
    assert not arrivals.any()  # given back zeroed
    assert bool(torch.isfinite(out).all())
    assert bool((out[rows < 0] == 0).all())
    err = (out.double() - ref).norm(dim=-1)
    scale = ref.norm(dim=-1)
    assert bool((err <= REL_TOL * scale).all()), (err / scale.clamp(min=1e-300)).max()
    return out


@pytest.mark.parametrize("w,hq,d,dtype,capped", [
    (5, 4, 24, torch.bfloat16, True),  # the default window (4 + 1), D not a power of two
    (5, 3, 16, torch.float16, False),
    (9, 2, 32, torch.float32, True),
    (33, 1, 16, torch.bfloat16, True),  # the config's bound: window 32
    (2, 2, 16, torch.float32, True),  # one window size
    (1, 2, 16, torch.float16, False),  # no history: the last query
])
def test_matches_float64_reference(w, hq, d, dtype, capped):
    gen = torch.Generator().manual_seed(w * 100 + d)
    before = [0, 1, w - 2, w - 1, w, w + 3, 3 * w + 1]  # pushes so far, per ring row
    before = torch.tensor([max(t, 0) for t in before])
    r = before.shape[0] + 1
    totals = torch.cat([before, torch.tensor([5])])  # ring row r-1: never served here
    ring = _ring(gen, r, w, hq, d, dtype, totals)
    rows = torch.tensor([3, 0, 6, -1, 5, 1, 4, 2])  # ring rows, not 0..S-1; one skipped
    s = rows.shape[0]
    q = torch.randn(s + 2, hq, d, generator=gen) * 2.0
    q_rows = torch.randperm(s + 2, generator=gen)[:s]
    ridge = (torch.rand(s, 1, generator=gen) * 0.05 + 0.005)
    cap = torch.tensor([w, 0, 1, w, 2, max(w - 1, 0), w + 4, 3]) if capped else None
    out = _check(ring, totals, q, rows, ridge, q_rows=q_rows, cap=cap)
    if capped:
        assert bool((out[1] == 0).all())  # cap 0: nothing to predict from
    # a window of one query (cap 1 / ring row 0, which had pushed nothing) predicts
    # that query, as rounded into the ring
    one = 2 if capped else 1
    assert torch.equal(out[one], q[q_rows[one]].to(dtype).float())

def test_steps_through_the_wrap():
    """One push per step from empty rings (all NaN) to twice around: every count
    1 .. W and the wrap, rows with different totals at each step, a scalar ridge,
    and one arrivals tensor reused by every launch (as the serving path does)."""
    gen = torch.Generator().manual_seed(7)
    r, w, hq, d = 4, 4, 2, 16
    ring = torch.full((r, w, hq, d), float("nan"), dtype=torch.bfloat16)
    total = torch.zeros(r, dtype=torch.int64)
    ring_ref, total_ref = ring.clone(), total.clone()
    arrivals = make_arrivals(r, "cpu")
    rows_a, rows_b = torch.tensor([2, 0]), torch.tensor([0, 3, -1])  # row 0 pushed twice per step
    for step in range(2 * w + 1):
        for rows in (rows_a, rows_b):
            q = torch.randn(rows.shape[0], hq, d, generator=gen) + 1.0
            out = asyncspade_predict(ring, total, q, rows, 0.02, arrivals=arrivals)
            ref = asyncspade_predict_ref(ring_ref, total_ref, q, rows, 0.02, compute_dtype=torch.float64)
            assert torch.equal(total, total_ref) and not arrivals.any()
            assert bool(torch.isfinite(out).all())
            err = (out.double() - ref).norm(dim=-1)
            assert bool((err <= REL_TOL * ref.norm(dim=-1)).all()), step
    assert total.tolist() == [2 * (2 * w + 1), 0, 2 * w + 1, 2 * w + 1]
    same = (ring == ring_ref) | (ring.isnan() & ring_ref.isnan())
    assert bool(same.all())


def test_skipped_rows_change_nothing():
    ring = torch.randn(3, 5, 2, 16)
    total = torch.tensor([4, 9, 0])
    out = torch.full((2, 2, 16), 7.0)
    res = asyncspade_predict(ring.clone(), total, torch.randn(2, 2, 16), torch.tensor([-1, -3]), 0.01, out=out)
    assert res is out and not out.any()
    assert total.tolist() == [4, 9, 0]
    with pytest.raises(AssertionError):
        asyncspade_predict(ring.double(), total, torch.randn(2, 2, 16), torch.tensor([0, 1]), 0.01)
    with pytest.raises(AssertionError):
        asyncspade_predict(ring, total.int(), torch.randn(2, 2, 16), torch.tensor([0, 1]), 0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("w", [5, 17, 33])
def test_asyncspade_predict_gpu(w):
    """Serving shape (64 slots + scratch, 32 query heads, D = 128, bf16 ring): eager
    against float64, then captured in a CUDA graph and replayed: each replay
    pushes once and predicts as the reference does."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(w)
    r, hq, d, s = 65, 32, 128, 64
    totals = torch.randint(0, 3 * w, (r,), generator=gen, device=dev)
    ring = torch.randn(r, w, hq, d, generator=gen, device=dev) + 2.0 * torch.randn(r, 1, hq, d, generator=gen,
                                                                                        device=dev)
    ring[torch.arange(w, device=dev)[None, :] >= totals[:, None]] = float("nan")
    ring = ring.bfloat16()
    rows = torch.randperm(r - 1, generator=gen, device=dev)[:s]
    rows[::5] = -1  # slots without a request this step
    q = torch.randn(s, hq, d, generator=gen, device=dev).bfloat16()
    ridge = torch.rand(s, generator=gen, device=dev) * 0.05 + 0.005
    cap = torch.randint(0, w + 1, (s,), generator=gen, device=dev)
    _check(ring, totals, q, rows, ridge, cap=cap)

    arrivals = make_arrivals(r, dev)
    out = torch.empty(s, hq, d, device=dev)
    ring_g, total_g = ring.clone(), totals.clone()
    ring_r, total_r = ring.clone(), totals.clone()
    asyncspade_predict(ring_g.clone(), total_g.clone(), q, rows, ridge, count_cap=cap, arrivals=arrivals, out=out)
    torch.cuda.synchronize()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        asyncspade_predict(ring_g, total_g, q, rows, ridge, count_cap=cap, arrivals=arrivals, out=out)
    ring_g.copy_(ring)
    total_g.copy_(totals)  # the capture ran nothing
    for _ in range(3):
        q.copy_(torch.randn(s, hq, d, generator=gen, device=dev))
        graph.replay()
        ref = asyncspade_predict_ref(ring_r, total_r, q, rows, ridge, count_cap=cap, compute_dtype=torch.float64)
        torch.cuda.synchronize()
        assert torch.equal(total_g, total_r) and not arrivals.any()
        assert bool(torch.isfinite(out).all())
        err = (out.double() - ref).norm(dim=-1)
        assert bool((err <= REL_TOL * ref.norm(dim=-1)).all())
