"""quest / asyncspade / lfps decode inside a real CUDA graph (GPU only): plan_decode,
the device selection (sgl_sparse/query_device.py, lfps's in sgl_sparse/lfps_device.py),
the two-segment kernel, lfps's sink bypass and table update and asyncspade's
next-step prediction captured once on a padding-only batch (as
SGLang captures), then replayed over mixed batches whose rows, lengths and
queries change between replays. Each replay must equal the eager host-grouped
torch path on a twin state: same per-head position sets (asyncspade, lfps: up to
two cutoff ties swapped, see below) and a_len (lfps: its bypass decisions), attention
within bf16 rounding, same selection sizes stored for the next step, lfps's tables
within fp32 rounding. Batches with no query-aware row or one policy's rows only
exercise the conditional nodes (sgl_sparse/graph_gate.py) both ways; a batch of
`full` rows replays the gated graph faster than an ungated capture. Without
conditional nodes, the per-layer replay cost of a `full`-only batch and of live
rows (test_query_aware_replay_cost_per_layer, printed: run with -s)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse import query_store, reference
from sgl_sparse.config import AsyncSpadePolicy, LfpsPolicy, QuestPolicy, SparseServerConfig
from sgl_sparse.decision import plan_decode
from sgl_sparse.policies import MODULES, PolicyId
from sgl_sparse.query_serving import QueryAwareRuntime
from sgl_sparse.query_store import AsyncSpadeStore, LfpsStore, QuestStore
from sgl_sparse.state import SparseState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HKV, G, D, MAXCTX, CAP, ROWS = 4, 4, 128, 1024, 288, 16
SCALE = 1 / math.sqrt(D)
KV = torch.bfloat16
SPECS = {
    1: QuestPolicy(budget=128, recent=32, sink=4),
    2: QuestPolicy(budget=64, recent=64, sink=0),
    3: AsyncSpadePolicy(window=3, budget=200, recent=16, sink=4),
    4: AsyncSpadePolicy(window=4, budget=96, recent=8, sink=2, ridge=0.05),
    5: None,  # full
    6: QuestPolicy(budget=256, recent=16, sink=4),  # covered at first
    # small a: C1 not empty on random data (queryaware.lfps's κ is not normalized by the count)
    7: LfpsPolicy(budget=96, local=6, sink=4, s=16, a=0.05),
    8: LfpsPolicy(budget=48, local=10, sink=2, s=8, a=0.02, eps=0.02, r=0.9),  # heads bypass
}
LENS = {1: 700, 2: 413, 3: 517, 4: 333, 5: 250, 6: 268, 7: 611, 8: 455}


class Twin:
    def __init__(self, use_kernels: bool, specs: dict | None = None, lens: dict | None = None,
                 max_ctx: int = MAXCTX, num_layers: int = 1, index_keys: str = "kv", topk_layers: int = 1,
                 cache_device: str | None = None):
        """cache_device: asyncspade's selection on that GPU (query_aware.asyncspade.cache_device)."""
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(0)
        self.specs, self.lens, self.num_layers = specs or SPECS, lens or LENS, num_layers
        store = {"slots": 4, "max_context": max_ctx, "capacity": CAP, "candidates": 64}
        cfg = SparseServerConfig.model_validate({
            "query_aware": {"quest": store, "asyncspade": {**store, "index_keys": index_keys,
                                                           "topk_layers": topk_layers, "cache_device": cache_device},
                            "lfps": {**store, "candidates": max_ctx}},
            "policies": {"asyncspade": {"window": 4}},
        })
        self.st = SparseState(ROWS, dev, cfg)
        qs = cfg.query_aware
        shape = dict(num_layers=num_layers, num_kv_heads=HKV, head_dim=D, device=dev)
        self.st.query_stores[PolicyId.QUEST] = QuestStore(qs.quest, dtype=KV, **shape)
        cache = None if cache_device is None else query_store.cache_device_for(cache_device, dev)
        self.st.query_stores[PolicyId.ASYNCSPADE] = AsyncSpadeStore(qs.asyncspade, window=4, num_q_heads=HKV * G,
                                                                    dtype=KV, cache_device=cache, **shape)
        self.st.query_stores[PolicyId.LFPS] = LfpsStore(qs.lfps, num_q_heads=HKV * G, **shape)
        self.rt = QueryAwareRuntime(self.st, use_kernels=use_kernels)
        pool = sum(self.lens.values()) + 64 * len(self.lens) + 1
        self.k = torch.randn(pool, HKV, D, generator=gen, device=dev).to(KV)
        self.v = torch.randn(pool, HKV, D, generator=gen, device=dev).to(KV)
        self.r2t = torch.randint(0, pool, (ROWS, max_ctx + 64), generator=gen, device=dev, dtype=torch.int32)
        perm = (torch.randperm(pool - 1, generator=gen, device=dev) + 1).to(torch.int32)
        off = 0
        for r, n in self.lens.items():
            self.r2t[r, : n + 64] = perm[off: off + n + 64]
            off += n + 64

    def admit(self, q_ext):
        rows = list(self.specs)
        inits = [MODULES[s.policy if s is not None else "full"].init_row(s, [], [], (None, None))
                 for s in self.specs.values()]
        admitted = self.st.admit(rows, inits)
        self.rt.plan_extend(rows, [self.lens[r] for r in rows], [self.lens[r] for r in rows], admitted)
        for li in range(self.num_layers):
            self.rt.on_extend(li, q_ext, self.k, self.v, self.r2t, SCALE)


def _capture(step) -> torch.cuda.CUDAGraph:
    """`step` run once eagerly on a side stream (compiles the kernels; padding rows
    change no state), then captured, as SGLang's graph runner does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, n: int, warmup: int) -> float:
    """Mean time of one replay over `n` back-to-back replays (CUDA events)."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def layer_step(rows: list[int], layers: int, lens: dict | None = None, max_ctx: int = MAXCTX):
    """`layers` x select + finish of one store layer (a layer's cost each) on a
    padding-only batch, and what then admits the twin and writes the batch `rows`
    (0: padding) into the step's inputs. Returns (twin, step, place, rows_t, lens_t,
    out); out["plan"]: the last step's plan. Also bench/kernels/profile_query_aware_layer.py's."""
    dev = torch.device("cuda")
    bs, lens = len(rows), lens or LENS
    twin = Twin(use_kernels=True, lens=lens, max_ctx=max_ctx)
    rows_t = torch.zeros(bs, dtype=torch.int64, device=dev)
    lens_t = torch.ones(bs, dtype=torch.int32, device=dev)
    tok_t = torch.ones(bs, dtype=torch.int64, device=dev)
    q = torch.randn(bs, HKV * G, D, device=dev).to(KV)
    o = torch.zeros(bs, HKV * G, D, dtype=KV, device=dev)
    twin.rt.plan_step([0] * bs, [1] * bs, dev, graphed=True)
    out = {}

    def step():
        plan = plan_decode(twin.st, rows_t, tok_t, lens_t, (None, None), num_kv_heads=HKV)
        for _ in range(layers):
            lp = twin.rt.select(0, plan, q, twin.k, twin.r2t, rows_t, lens_t, SCALE)
            twin.rt.finish(0, lp, q, o, twin.k, twin.r2t, rows_t, lens_t, SCALE)
        out["plan"] = lp

    def place():
        twin.admit(torch.randn(sum(lens.values()), HKV * G, D, device=dev).to(KV))
        for b, r in enumerate(rows):
            rows_t[b] = r
            lens_t[b] = lens[r] + 1 if r else 1

    twin.keep = (q, o, tok_t)  # the step's inputs live as long as the twin
    return twin, step, place, rows_t, lens_t, out


def _capture_layers(rows: list[int], layers: int, gated: bool, lens: dict | None = None, max_ctx: int = MAXCTX,
                    only: frozenset | None = None):
    """layer_step's step captured with the conditional nodes on or off
    (graph_gate.ENABLED), with the blocks of the policies `only` alone (None: all;
    graph_variants' `qa_<policy>`), then the rows placed. Returns (twin, graph,
    rows_t, lens_t, out). A graph replays over its twin's tensors: keep the twin alive."""
    from sgl_sparse import graph_gate

    twin, step, place, rows_t, lens_t, out = layer_step(rows, layers, lens, max_ctx)
    saved = graph_gate.ENABLED
    graph_gate.ENABLED = gated
    twin.rt.device.only = only
    try:
        graph = _capture(step)
    finally:
        graph_gate.ENABLED = saved
        twin.rt.device.only = None
    place()
    return twin, graph, rows_t, lens_t, out


@pytest.mark.parametrize("in_place,remote", [(False, False), (True, False), (True, True)])
def test_capture_once_replay_mixed_batches(in_place, remote, monkeypatch):
    """in_place: query_store.ASPD_LISTS_IN_PLACE, asyncspade's rows read by the decode
    from the store (what the side stream wrote the step before) instead of copied:
    their outputs are checked against the oracle's, their lists not (after the replay
    the store holds the next step's). remote: asyncspade's selection on a second GPU
    (query_aware.asyncspade.cache_device cuda:1), its streams forked from and joined to
    the captured stream, its kernels reading and writing this GPU's tensors (peer
    access): the same checks."""
    if remote and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU (nvidia-h200-x2)")
    from sgl_sparse import query_store
    from sgl_sparse.kernels import two_segment_decode

    monkeypatch.setattr(query_store, "ASPD_LISTS_IN_PLACE", in_place)

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    ref, gph = Twin(use_kernels=False), Twin(use_kernels=True, cache_device="cuda:1" if remote else None)
    assert gph.st.query_stores[PolicyId.ASYNCSPADE].remote == remote
    bs = 8
    rows_t = torch.zeros(bs, dtype=torch.int64, device=dev)  # padding-only, as SGLang captures
    lens_t = torch.ones(bs, dtype=torch.int32, device=dev)
    tok_t = torch.ones(bs, dtype=torch.int64, device=dev)
    q = torch.zeros(bs, HKV * G, D, dtype=KV, device=dev)
    o = torch.zeros(bs, HKV * G, D, dtype=KV, device=dev)
    no_compact = torch.zeros(1, HKV, 1, D, dtype=KV, device=dev)
    rt = gph.rt
    rt.plan_step([0] * bs, [1] * bs, dev, graphed=True)
    out = {}

    def step():
        plan = plan_decode(gph.st, rows_t, tok_t, lens_t, (None, None), num_kv_heads=HKV)
        lp = rt.select(0, plan, q, gph.k, gph.r2t, rows_t, lens_t, SCALE)
        two_segment_decode(q, no_compact, no_compact, lp.a_slot, lp.a_len_per_head, gph.k, gph.v, gph.r2t, rows_t,
                           lp.b_start, lp.b_end, SCALE, max_kv_len=MAXCTX + CAP, out=o, **lp.indexed_lists())
        rt.finish(0, lp, q, o, gph.k, gph.r2t, rows_t, lens_t, SCALE)
        out["plan"] = lp

    graph = _capture(step)
    lp = out["plan"]
    assert (lp.a_lists is not None) == in_place

    q_ext = torch.randn(sum(LENS.values()), HKV * G, D, generator=gen, device=dev).to(KV)
    ref.admit(q_ext)
    gph.admit(q_ext)
    # batches without a query-aware row, or with one policy's rows only: the other
    # policies' gated blocks (sgl_sparse/graph_gate.py) are skipped in those replays
    batches = [[5, 0, 0, 0, 0, 0, 0, 0], [1, 3, 5, 7, 0, 0, 0, 0], [1, 6, 5, 0, 0, 0, 0, 0],
               [3, 4, 0, 0, 0, 0, 0, 0], [8, 5, 0, 0, 0, 0, 0, 0], [4, 2, 6, 1, 3, 5, 8, 0],
               [5, 0, 0, 0, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 8, 7]]
    cur = dict(LENS)
    indexed = set()
    for batch in batches:
        for _ in range(6):
            rows = [r for r in batch if r]
            for r in rows:  # a request gains one key per step it is decoded in
                cur[r] += 1
            lens = [cur[r] for r in rows]
            qn = torch.randn(len(rows), HKV * G, D, generator=gen, device=dev).to(KV)
            # the eager oracle: host-grouped torch path, reference attention
            rr, ll = torch.tensor(rows, device=dev), torch.tensor(lens, dtype=torch.int32, device=dev)
            p_ref = plan_decode(ref.st, rr, tok_t[: len(rows)], ll, (None, None), num_kv_heads=HKV)
            ref.rt.plan_step(rows, lens, dev)
            lp_ref = ref.rt.select(0, p_ref, qn, ref.k, ref.r2t, rr, ll, SCALE) if ref.rt.active() else p_ref
            o_ref = torch.zeros_like(qn)
            reference.decode_attention(qn, o_ref, ref.k, ref.v, ref.r2t, rr, lp_ref, SCALE, True)
            if ref.rt.active():
                ref.rt.finish(0, lp_ref, qn, o_ref, ref.k, ref.r2t, rr, ll, SCALE)
            # the replay: inputs written in place, no host planning
            rows_t.zero_()
            rows_t[: len(rows)] = rr
            lens_t.fill_(1)
            lens_t[: len(rows)] = ll
            q.zero_()
            q[: len(rows)] = qn
            graph.replay()
            lp = out["plan"]  # the captured plan's tensors (eager: this step's)
            torch.cuda.synchronize()
            for b in range(len(rows)):
                assert int(lp.a_slot[b]) == int(lp_ref.a_slot[b])
                if int(lp_ref.a_slot[b]) != -2:
                    continue
                indexed.add(rows[b])
                if in_place and SPECS[rows[b]].policy == "asyncspade":
                    assert int(lp.a_lists.rows[b]) == gph.st.row_init(rows[b]).slot
                    continue
                assert torch.equal(lp.a_len_per_head[b], lp_ref.a_len_per_head[b])
                # asyncspade's kernel scores a fp32 q_hat as two bf16 parts (~16 bits),
                # lfps's candidates are scored by tl.dot (the torch path: an fp32 einsum,
                # other summation order): a key tied with the Top-K cutoff to that
                # precision may swap places
                slack = 2 if SPECS[rows[b]].policy in ("asyncspade", "lfps") else 0
                for h in range(HKV):
                    n_a = int(lp_ref.a_len_per_head[b, h])
                    got = set(lp.a_pos[b, h, :n_a].tolist())
                    want = set(lp_ref.a_pos[b, h, :n_a].tolist())
                    assert len(got) == n_a and len(got - want) <= slack, (rows[b], h, sorted(got ^ want))
                    # what the decode gathers from: the same lists as pool slots
                    pos = lp.a_pos[b, h, :n_a].long()
                    assert torch.equal(lp.a_slots[b, h, :n_a], gph.r2t[int(rows_t[b])][pos])
            torch.testing.assert_close(o[: len(rows)].float(), o_ref.float(), rtol=3e-2, atol=3e-2)
            for r in rows:
                s = ref.st.row_init(r).slot
                if SPECS[r] is not None and SPECS[r].policy == "asyncspade":
                    a, g_ = ref.st.query_stores[PolicyId.ASYNCSPADE], gph.st.query_stores[PolicyId.ASYNCSPADE]
                    assert torch.equal(a.sel_count[0, s], g_.sel_count[0, s])
                if SPECS[r] is not None and SPECS[r].policy == "lfps":
                    a, g_ = ref.st.query_stores[PolicyId.LFPS], gph.st.query_stores[PolicyId.LFPS]
                    for ta, tb in zip(a.true_tables(0, s), g_.true_tables(0, s)):
                        torch.testing.assert_close(ta, tb, rtol=1e-4, atol=1e-5)
    assert indexed == {1, 2, 3, 4, 6, 7, 8}


def test_full_batches_skip_the_gated_work():
    """A graph captured with the conditional nodes, replayed on a batch without a
    query-aware row, skips the selection's kernels: its replay is much cheaper
    than the same capture without them (SGLANG_SPARSE_GRAPH_CONDITIONALS=0), and a
    quest row entering the batch runs them again (a_len filled)."""
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        pytest.skip(f"torch {torch.__version__} has no CUDA-graph conditional nodes (the H100 image's 2.11: "
                    "the captured path then runs every block, bench/README 'Session 6')")
    layers = 8
    full_only = [5, 0, 0, 0, 0, 0, 0, 0]  # a `full` request; the rest padding
    tw_on, g_on, *_ = _capture_layers(full_only, layers, gated=True)  # both twins stay alive: their graphs replay
    twin, g_off, *_ = _capture_layers(full_only, layers, gated=False)
    t_on, t_off = (1e3 * _replay_ms(g, n=50, warmup=5) for g in (g_on, g_off))
    print(f"full-only batch, {layers} layers of select+finish: gated {t_on:.1f} us, ungated {t_off:.1f} us per replay")
    assert t_on < 0.5 * t_off, (t_on, t_off)

    # the gated graph still serves a quest row
    del tw_on, g_on, twin, g_off
    twin, g_on, rows_t, lens_t, out = _capture_layers([5, 1, 0, 0, 0, 0, 0, 0], layers, gated=True)
    g_on.replay()
    torch.cuda.synchronize()
    lp = out["plan"]
    assert int(lp.a_slot[1]) == -2 and int(lp.a_len_per_head[1].min()) > 0
    assert int(lp.a_slot[0]) != -2


def test_asyncspade_selection_overlaps_the_main_stream():
    """asyncspade's next-step selection (scoring every key with q_hat, Top-K) runs
    on side streams forked after each layer's prediction and joined after the
    last layer (sgl_sparse/query_device.py). Captured pipeline of 8 layers, each a
    stand-in for the layer's other work on the main stream (a batch-8 GEMM over
    48 MB of weights) plus select + finish, 4 asyncspade rows at 16K: the replay
    with one side stream must not be slower than with the selection on the main
    stream, and every variant must leave the same selections in the store. Timed
    and printed for the KV cache's keys and for int8 index keys (steady state: the
    copies filled, one position copied a replay), each on the main stream, one
    side stream and two (ASPD_SIDE_STREAMS: layers alternating) -- the A/B that
    decides that switch's default and measures index_keys at layer level -- and,
    for int8 keys, with the Top-K of 4 and of all 8 layers in one launch
    (`topk_layers`): the same selections, and their times."""
    from sgl_sparse import query_device

    dev = torch.device("cuda")
    layers, n = 8, 16000
    # sink + budget within the stores' capacity (CAP), as the server's request
    # validation guarantees; the scoring reads all ~16K keys whatever the budget
    spec = AsyncSpadePolicy(window=4, budget=CAP - 32, recent=64, sink=4)
    specs = {1: spec, 2: spec, 3: spec, 4: spec, 5: None}
    lens = {r: n + 7 * r for r in specs}
    w = torch.randn(2048, 12288, device=dev).to(KV)

    def build(sides: int, index_keys: str = "kv", with_main: bool = True, with_aspd: bool = True,
              topk_layers: int = 1, join_end: bool = False):
        saved = query_device.ASPD_SIDE_STREAM, query_device.ASPD_SIDE_STREAMS
        query_device.ASPD_SIDE_STREAM, query_device.ASPD_SIDE_STREAMS = sides > 0, max(sides, 1)
        try:
            twin = Twin(use_kernels=True, specs=specs, lens=lens, max_ctx=n + 256, num_layers=layers,
                        index_keys=index_keys, topk_layers=topk_layers)
        finally:
            query_device.ASPD_SIDE_STREAM, query_device.ASPD_SIDE_STREAMS = saved
        gen = torch.Generator(device=dev).manual_seed(3)
        twin.admit(torch.randn(sum(lens.values()), HKV * G, D, generator=gen, device=dev).to(KV))
        rows = [1, 2, 3, 4, 5, 0, 0, 0]
        rows_t = torch.tensor(rows, device=dev)
        lens_t = torch.tensor([lens[r] + 1 if r else 1 for r in rows], dtype=torch.int32, device=dev)
        tok_t = torch.ones(8, dtype=torch.int64, device=dev)
        q = torch.randn(8, HKV * G, D, generator=gen, device=dev).to(KV)
        o = torch.zeros(8, HKV * G, D, dtype=KV, device=dev)
        x = torch.randn(8, 2048, device=dev).to(KV)
        twin.keep = (x, q, o, rows_t, lens_t, tok_t)  # the graph's inputs live as long as the twin
        twin.rt.plan_step([0] * 8, [1] * 8, dev, graphed=True)
        # join_end: the side streams joined after the step's main work, as SGLang's capture
        # tail hook does with SGLANG_SPARSE_ASPD_JOIN_AFTER_FORWARD=1
        twin.rt.device.join_after_forward = join_end

        def step():
            plan = plan_decode(twin.st, rows_t, tok_t, lens_t, (None, None), num_kv_heads=HKV)
            for li in range(layers):
                if with_aspd:
                    lp = twin.rt.select(li, plan, q, twin.k, twin.r2t, rows_t, lens_t, SCALE)
                    twin.rt.finish(li, lp, q, o, twin.k, twin.r2t, rows_t, lens_t, SCALE)
                if with_main:
                    for _ in range(4):
                        torch.mm(x, w)
            if join_end:
                twin.rt.device.join_pending()

        graph = _capture(step)
        store = twin.st.query_stores[PolicyId.ASYNCSPADE]
        if store.index_keys:
            # every replay scores the same range: a counter one below it (what the
            # previous step of a decode leaves) makes it copy one position, not all
            graph.replay()
            torch.cuda.synchronize()
            store.filled.copy_(store.filled.amax(-1, keepdim=True) - 1)
        return twin, graph

    def replay_ms(graph):
        return _replay_ms(graph, n=20, warmup=3)

    def selects_as_main(twin, main):
        """The twin's store holds the selections the main-stream path made (`main`:
        counts, totals, each (layer, slot, head)'s sorted positions)."""
        a = twin.st.query_stores[PolicyId.ASYNCSPADE]
        assert torch.equal(a.sel_count, main[0]) and torch.equal(a.total, main[1])
        assert [sorted(a.sel_pos[li, s, h, :int(a.sel_count[li, s, h])].tolist())
                for li in range(layers) for s in range(4) for h in range(HKV)] == main[2]

    # each graph replays over its twin's tensors: keep the twin alive while it does
    tw_main, g_main = build(0, with_aspd=False)
    t_main = replay_ms(g_main)
    del tw_main, g_main
    t_aspd, t, sel = {}, {}, {}
    for keys in ("kv", "int8"):
        tw, g = build(0, keys, with_main=False)
        t_aspd[keys] = replay_ms(g)
        del tw, g
        variants = [(sides, 1) for sides in (0, 1, 2)]
        if keys == "int8":
            variants += [(sides, tl) for tl in (4, layers) for sides in (0, 1, 2)]
        for sides, tl in variants:
            tw, g = build(sides, keys, topk_layers=tl)
            t[keys, sides, tl] = replay_ms(g)
            a = tw.st.query_stores[PolicyId.ASYNCSPADE]
            sel[keys, sides, tl] = (a.sel_count.clone(), a.total.clone(),
                                    [sorted(a.sel_pos[li, s, h, :int(a.sel_count[li, s, h])].tolist())
                                     for li in range(layers) for s in range(4) for h in range(HKV)])
            del tw, g
        serial = t[keys, 0, 1]
        for sides, tl in variants:
            hidden = (serial - t[keys, sides, tl]) / max(min(t_main, t_aspd[keys]), 1e-9)
            print(f"{layers} layers, {keys} keys, Top-K of {tl} layer(s) a launch: main work {t_main:.3f} ms, "
                  f"asyncspade select+finish {t_aspd[keys]:.3f} ms; serial {serial:.3f} ms, {sides} side "
                  f"stream(s) {t[keys, sides, tl]:.3f} ms: {hidden:.0%} of the shorter phase hidden")
        # int8, Top-K of 4 layers a launch, one side stream: joined after the step's main work
        # (ASPD_JOIN_AFTER_FORWARD), selecting as the main stream does
        if keys == "int8":
            tw, g = build(1, keys, topk_layers=4, join_end=True)
            t_end = replay_ms(g)
            selects_as_main(tw, sel[keys, 0, 1])
            print(f"{layers} layers, int8 keys, Top-K of 4 layers a launch, 1 side stream joined after the main "
                  f"work: {t_end:.3f} ms (joined in the last layer: {t[keys, 1, 4]:.3f} ms)")
            del tw, g
        assert t[keys, 1, 1] <= 1.02 * serial, (keys, t[keys, 1, 1], serial)
        for sides, tl in variants:
            count, total, sets = sel[keys, sides, tl]
            assert torch.equal(count, sel[keys, 0, 1][0]) and torch.equal(total, sel[keys, 0, 1][1])
            assert sets == sel[keys, 0, 1][2], (keys, sides, tl)


@pytest.mark.parametrize("max_ctx", [MAXCTX, 32768])
def test_query_aware_replay_cost_per_layer(max_ctx):
    """What the captured query-aware path costs per layer where no conditional node
    can skip it (graph_gate off: torch 2.11, the H100 image, captures every block):
    `layers` x select + finish of quest + asyncspade + lfps (4 slots each) replayed
    for a `full`-only batch and for a batch with a live row of each policy. Prints
    both; the `full`-only batch must cost well under the live one, as it can only
    when the programs of slots without a row return at once. On the H100 (session 8,
    bench/results/gpu_tests_h100_session8_qa_early_exit.log) full-only / live was
    33 / 92 us at max_context 1024 and 116 / 180 us at 32768 (20 / 96 and 37 / 181
    once the split Top-K returned at once for empty slots); the path before the
    early-exit kernels (since removed) had 354 / 441 and 496 / 547, ratios of 0.80
    and 0.91, which the bound below rejects."""
    batches = {"full-only": [5, 0, 0, 0, 0, 0, 0, 0], "live q+a+l": [1, 3, 7, 5, 0, 0, 0, 0]}
    lens = {r: n + 7 * r for r, n in LENS.items()} if max_ctx > MAXCTX else LENS
    layers, us = 8, {}
    for name, rows in batches.items():
        twin, graph, *_ = _capture_layers(rows, layers, gated=False, lens=lens, max_ctx=max_ctx)
        us[name] = 1e3 * _replay_ms(graph, n=30, warmup=5) / layers
        del graph, twin
    full, live = us["full-only"], us["live q+a+l"]
    print(f"max_context {max_ctx}: {full:8.1f} us per layer full-only, {live:8.1f} us live q+a+l "
          f"({full / live:.2f})")
    assert full < 0.75 * live, us


def test_one_policy_graph_serves_its_rows_for_less():
    """A batch whose query-aware rows are all quest replays graph_variants' `qa_quest`
    graph (QueryAwareDevice.only): captured without asyncspade's and lfps's blocks
    (without conditional nodes, torch 2.11, each costs its launches at every replay),
    it gives the quest rows the same selections as the graph with every policy's
    blocks, for less per layer. Prints both (run with -s); at 32768 x 1 end to end the
    `qa` graph ran 780 kernels a step against stock's 383 (bench/README, "Session 18")."""
    layers, rows = 8, [1, 2, 5, 0, 0, 0, 0, 0]  # two quest rows, a full row, padding
    lens = {r: n + 7 * r for r, n in LENS.items()}
    got, us = {}, {}
    for name, only in (("qa", None), ("qa_quest", frozenset({PolicyId.QUEST}))):
        torch.manual_seed(5)  # the same queries (layer_step draws them) for both graphs
        twin, graph, rows_t, lens_t, out = _capture_layers(rows, layers, gated=False, lens=lens, max_ctx=32768,
                                                           only=only)
        graph.replay()
        torch.cuda.synchronize()
        lp = out["plan"]
        got[name] = [(lp.a_len_per_head[b].clone(), [sorted(lp.a_pos[b, h, :int(lp.a_len_per_head[b, h])].tolist())
                                                     for h in range(HKV)]) for b in (0, 1)]
        us[name] = 1e3 * _replay_ms(graph, n=30, warmup=5) / layers
        del graph, twin
    print(f"quest rows, max_context 32768: {us['qa']:.1f} us per layer with every policy's blocks, "
          f"{us['qa_quest']:.1f} us with quest's alone")
    for (len_a, sets_a), (len_b, sets_b) in zip(got["qa"], got["qa_quest"]):
        assert torch.equal(len_a, len_b) and sets_a == sets_b and int(len_a.min()) > 0
    assert us["qa_quest"] < us["qa"], us
