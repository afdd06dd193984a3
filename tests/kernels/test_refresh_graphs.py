"""The SFI refresh replayed from CUDA graphs (sgl_sparse/selector/graphs.py).

On the CPU (kernels interpreted): the shapes a graph is captured at -- rows padded
by repeating the last one, the bound on positions rounded up -- give exactly the
plain refresh's compact buffers and counts. CUDA graph capture cannot exist on a
CPU, so there `RefreshGraphs._capture` is switched off and every run takes the
padded eager path a graph's first run takes. On the GPU (`gpu` marker): real
captures and replays against the eager refresh, rows and values changing between
replays.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sgl_sparse.kernels import testing as T  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.selector import graphs as G
from sgl_sparse.selector.refresh import refresh


def test_row_buckets_are_at_most_one_and_a_half_times_the_rows():
    buckets = [G.row_bucket(r) for r in range(1, 300)]
    assert buckets[:12] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12]
    for r, b in enumerate(buckets, start=1):
        assert r <= b <= max(2, 1.5 * r)
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 2 * 300 .bit_length()


def test_length_buckets_round_up_within_the_limit():
    L = G.LENGTH_BUCKET
    assert G.length_bucket(1, 1 << 20) == L
    assert G.length_bucket(L, 1 << 20) == L
    assert G.length_bucket(L + 16, 1 << 20) == 2 * L
    assert G.length_bucket(2 * L + 1, 1 << 20) == 3 * L
    assert G.length_bucket(4 * L + 1, 1 << 20) == 6 * L
    assert G.length_bucket(8 * L + 128, 1 << 20) == 12 * L  # 8192 + 128 generated: 12288
    assert G.length_bucket(9_990, 10_000) == 10_000
    assert G.length_bucket(96, 96) == 96
    # at most 1.5x the bound rounded up to L, monotonic, few shapes up to 128K
    buckets = [G.length_bucket(n, 1 << 20) for n in range(1, 131_073, 61)]
    for n, b in zip(range(1, 131_073, 61), buckets):
        assert n <= b <= 1.5 * (-(-n // L) * L)
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 14  # 1024 ... 131072


def test_padding_repeats_the_last_row_and_its_spec():
    assert G.padded([4, 7], ["a", "b"], 4) == ([4, 7, 7, 7], ["a", "b", "b", "b"])
    assert G.padded([4], ["a"], 1) == ([4], ["a"])


def _run(case, rows, n, later, graphs=None):
    case.state.compact.refresh_graphs = graphs
    refresh(case.state, rows, n, case.k_buffer, case.v_buffer, case.req_to_token, case.scaling,
            use_kernels=True, later=later)
    return case.state


def _assert_same(a, b):
    assert torch.equal(a.sel_count, b.sel_count) and torch.equal(a.sel_ready, b.sel_ready)
    assert torch.equal(a.compact.k, b.compact.k) and torch.equal(a.compact.v, b.compact.v)


@pytest.mark.parametrize("logit_len, later", [(96, True), (0, True), (0, False)],
                         ids=["stored_logits", "keys_w1", "first_slow_step"])
@pytest.mark.parametrize("rows, n", [([1, 2, 3], 90), ([2, 3], 61), ([3], 33)])
def test_padded_bucketed_refresh_equals_the_plain_one(monkeypatch, logit_len, later, rows, n):
    """Rows padded with 2 repeats of the last, the bound rounded up to the widest
    req_to_token row: bit-identical compact buffers, counts and ready flags."""
    monkeypatch.setattr(G.RefreshGraphs, "_capture", lambda self, *a, **kw: None)
    monkeypatch.setattr(G, "row_bucket", lambda r: r + 2)
    monkeypatch.setattr(G, "LENGTH_BUCKET", 48)  # 33 -> 48, 61 -> 96 (2 x 48, the limit), 90 -> 96
    make = lambda: T.make_sfi_refresh_case(  # noqa: E731
        3, logit_len=logit_len, prompt_queries={1: 2, 2: 2, 3: 1}, seed=len(rows))
    later_rows = set(rows) if later else set()
    plain = _run(make(), rows, n, later_rows)
    graphs = G.RefreshGraphs(torch.device("cpu"))
    padded = _run(make(), rows, n, later_rows, graphs)
    _assert_same(padded, plain)
    assert int(plain.sel_ready[torch.tensor(rows)].sum()) == len(rows)
    assert len(graphs) == 0 and graphs.captures == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("logit_len", [96, 0], ids=["stored_logits", "keys"])
def test_gpu_replayed_refreshes_equal_eager_ones(logit_len, caplog):
    """Real captures (each logged): each shape's first run eager (then captured), later runs replayed
    with other rows and new values in the state; every result equals the eager
    refresh's on the same state."""
    caplog.set_level(logging.INFO, logger=G.__name__)

    def make():
        return T.make_sfi_refresh_case(3, logit_len=logit_len, prompt_queries={1: 2, 2: 2, 3: 1},
                                       slow_step=False, device="cuda", seed=11)

    graphed, eager = make(), make()
    graphs = G.RefreshGraphs(torch.device("cuda"))
    captured = []
    graphs.on_capture = lambda: captured.append(len(graphs))  # the server's metrics counter
    gen = torch.Generator(device="cuda")
    # (rows, bound, later): the first slow step, then later ones of one, two, three rows.
    steps = [([1, 2, 3], 90, set()), ([1, 2, 3], 90, {1, 2, 3}), ([2], 61, {2}), ([3], 33, {3}),
             ([1, 3], 90, {1, 3}), ([1, 2, 3], 90, {1, 2, 3}), ([2], 61, {2}), ([1, 2], 90, {1, 2})]
    for i, (rows, n, later) in enumerate(steps):
        # New slow-step values between refreshes, the same in both states.
        for case in (graphed, eager):
            gen.manual_seed(i)
            store = case.state.compact
            store.q.copy_(torch.randn(store.q.shape, generator=gen, device="cuda"))
            if store.logits is not None:
                store.logits.copy_(torch.randn(store.logits.shape, generator=gen, device="cuda"))
            case.state.sel_ready.zero_()
        _run(graphed, rows, n, later, graphs)
        _run(eager, rows, n, later)
        torch.cuda.synchronize()
        _assert_same(graphed.state, eager.state)
    # Keys (rows bucket, window, largest budget and Soft-NMS radius; rows 1-3 have
    # (20, 2), (9, 1), (12, 2)): steps 1-5 capture, 6-8 replay steps 2, 3 and 5's.
    assert graphs.enabled and graphs.captures == len(graphs) == 5 and graphs.replays == 3
    assert captured == [0, 1, 2, 3, 4]  # once per capture, before the graph is kept
    logged = [r.getMessage() for r in caplog.records if "SFI refresh graph captured" in r.getMessage()]
    assert len(logged) == 5 and "3 rows, 96 positions" in logged[0], logged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_beyond_the_cap_are_dropped_oldest_first():
    case = T.make_sfi_refresh_case(2, logit_len=96, slow_step=False, device="cuda")
    graphs = G.RefreshGraphs(torch.device("cuda"), max_graphs=2)
    for rows in ([1], [1, 2], [1, 2, 3], [1]):
        _run(case, rows, 90, set(rows), graphs)
    assert graphs.captures == 4 and len(graphs) == 2 and graphs.replays == 0
