"""quest / asyncspade / lfps through the serving glue on CPU, without a server:
state rows and store slots, the step decision, per-layer selection, the reference
attention over per-head position sets, and the stores kept current as keys are
written (extend chunks, a radix prefix hit, decode steps)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse import reference
from sgl_sparse.config import (AsyncSpadePolicy, LfpsPolicy, QuestPolicy, SparseConfigError,
                               SparseServerConfig, parse_request_policy)
from sgl_sparse.decision import plan_decode
from sgl_sparse.policies import MODULES, PolicyId
from sgl_sparse.query_serving import QueryAwareRuntime, lfps_knobs
from sgl_sparse.query_store import AsyncSpadeStore, LfpsStore, QuestStore
from sgl_sparse.queryaware import asyncspade as aspd
from sgl_sparse.queryaware import lfps as lfps_math
from sgl_sparse.state import SparseState
from tests.test_quest import ref_positions

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

HKV, D, MAXCTX, CAP = 2, 16, 256, 96
SCALE = 1 / math.sqrt(D)


class Sim:
    """One layer of a decode loop, driven the way SparseAttnBackend drives it."""

    def __init__(self, group: int, slots: int = 4, seed: int = 0, aspd_window: int = 4):
        self.gen = torch.Generator().manual_seed(seed)
        self.group = group
        store = {"slots": slots, "max_context": MAXCTX, "capacity": CAP, "candidates": MAXCTX}
        self.cfg = SparseServerConfig.model_validate({
            "query_aware": {p: store for p in ("quest", "asyncspade", "lfps")},
            "policies": {"asyncspade": {"window": aspd_window}},
        })
        self.st = SparseState(10, "cpu", self.cfg)
        qs = self.cfg.query_aware
        shape = dict(num_layers=1, num_kv_heads=HKV, head_dim=D, device=torch.device("cpu"))
        hq = HKV * group
        self.st.query_stores[PolicyId.QUEST] = QuestStore(qs.quest, dtype=torch.float32, **shape)
        self.st.query_stores[PolicyId.ASYNCSPADE] = AsyncSpadeStore(
            qs.asyncspade, window=aspd_window, num_q_heads=hq, dtype=torch.float32, **shape)
        self.st.query_stores[PolicyId.LFPS] = LfpsStore(qs.lfps, num_q_heads=hq, **shape)
        self.rt = QueryAwareRuntime(self.st)
        self.k = torch.randn(2000, HKV, D, generator=self.gen)
        self.v = torch.randn(2000, HKV, D, generator=self.gen)
        self.r2t = torch.zeros(10, 300, dtype=torch.int32)
        self.next_slot = 1

    def alloc(self, row: int, n: int, share_with: int | None = None) -> None:
        if share_with is not None:
            self.r2t[row] = self.r2t[share_with]
            return
        self.r2t[row, :n] = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int32)
        self.next_slot += n

    def admit(self, rows, specs, lens, ext=None, q=None):
        inits = [MODULES[s.policy].init_row(s, [], [], (None, None)) if s is not None
                 else MODULES["full"].init_row(None, [], [], (None, None)) for s in specs]
        admitted = self.st.admit(rows, inits)
        ext = ext or lens
        if q is None:
            q = torch.randn(sum(ext), HKV * self.group, D, generator=self.gen)
        self.rt.plan_extend(rows, lens, ext, admitted)
        self.rt.on_extend(0, q, self.k, self.v, self.r2t, SCALE)
        return q

    def step(self, rows, lens, q=None):
        """Decode step with sequence lengths `lens` (the new key already in the pool)."""
        rows_t, lens_t = torch.tensor(rows), torch.tensor(lens)
        if q is None:
            q = torch.randn(len(rows), HKV * self.group, D, generator=self.gen)
        plan = plan_decode(self.st, rows_t, torch.ones(len(rows), dtype=torch.long), lens_t, (None, None),
                           num_kv_heads=HKV)
        self.rt.plan_step(rows, lens, torch.device("cpu"))
        lplan = self.rt.select(0, plan, q, self.k, self.r2t, rows_t, lens_t, SCALE) if self.rt.groups else plan
        o = torch.full_like(q, float("nan"))
        reference.decode_attention(q, o, self.k, self.v, self.r2t, rows_t, lplan, SCALE, self.group > 1)
        if self.rt.groups:
            self.rt.finish(0, lplan, q, o, self.k, self.r2t, rows_t, lens_t, SCALE)
        return q, o, lplan

    def keys(self, row, n):
        return self.k[self.r2t[row, :n].long()]


def attend64(q, k, v, keep_per_head, group):
    """q [Hq, D]; k/v [n, Hkv, D]; per KV head the positions attended."""
    out = []
    for h, keep in enumerate(keep_per_head):
        if keep is None:  # a head not checked here
            out.append(torch.zeros(group, v.shape[-1], dtype=torch.float64))
            continue
        idx = torch.tensor(keep)
        qh = q[h * group:(h + 1) * group].double()
        p = torch.softmax(qh @ k[idx, h].double().T * SCALE, -1)
        out.append(p @ v[idx, h].double())
    return torch.cat(out)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_quest_decode_attends_exactly_the_selected_pages(group):
    """Ragged batch: quest rows (one admitted over two chunks, i.e. the second with
    a cached prefix), a covering quest row (dense) and a full row. Each step attends
    sink + the Top pages of this query + recent, from bounds kept current as keys
    are written; float64 reference from the keys themselves."""
    sim = Sim(group, seed=group)
    specs = {1: QuestPolicy(budget=32, recent=9, sink=4), 2: QuestPolicy(budget=48, recent=20, sink=0),
             3: QuestPolicy(budget=256, recent=16), 4: None}
    lens = {1: 75, 2: 103, 3: 60, 4: 50}
    for r, n in lens.items():
        sim.alloc(r, n + 30)
    # row 2: a chunk of 40, then the rest with those 40 as prefix (bounds of the
    # prefix pages come from the pool, as for a radix-cache hit)
    sim.admit([2], [specs[2]], [40])
    sim.admit([1, 2, 3, 4], [specs[r] for r in (1, 2, 3, 4)], [75, 103, 60, 50], ext=[75, 63, 60, 50])
    rows = [1, 2, 3, 4]
    for t in range(20):  # crosses page boundaries (75 -> 95, 103 -> 123)
        cur = [lens[r] + 1 + t for r in rows]
        q, o, plan = sim.step(rows, cur)
        assert plan.a_slot.tolist() == [-2, -2, -1, -1]
        for b, (r, n) in enumerate(zip(rows, cur)):
            spec = specs[r]
            if spec is None or spec.sink + spec.budget + spec.recent >= n:
                keep = [list(range(n))] * HKV
            else:
                b_start = n - spec.recent
                a = ref_positions(q[b], sim.keys(r, n), n, spec.sink, b_start, spec.budget, group)
                keep = [a[h] + list(range(b_start, n)) for h in range(HKV)]
                assert plan.a_len_per_head[b].tolist() == [len(x) for x in a]
            ref = attend64(q[b], sim.keys(r, n), sim.v[sim.r2t[r, :n].long()], keep, group)
            torch.testing.assert_close(o[b].double(), ref, rtol=1e-5, atol=1e-5)


def _twin_rows(sim, spec, n):
    """Rows 1 (spec) and 2 (full) over the same pool slots."""
    sim.alloc(1, n + 10)
    sim.alloc(2, n + 10, share_with=1)
    sim.admit([1, 2], [spec, None], [n, n])


@pytest.mark.parametrize("spec", [
    QuestPolicy(budget=64, recent=16, sink=4),
    AsyncSpadePolicy(budget=64, recent=16, sink=4),
    LfpsPolicy(budget=64, local=6, sink=4),
])
def test_budget_covering_the_sequence_is_exactly_full(spec):
    sim = Sim(4, seed=3)
    n = 70  # sink + budget + recent >= n for the first steps
    _twin_rows(sim, spec, n)
    for t in range(3):
        q1 = torch.randn(1, HKV * 4, D, generator=sim.gen)
        q, o, plan = sim.step([1, 2], [n + 1 + t] * 2, q=torch.cat([q1, q1]))
        assert plan.a_slot.tolist() == [-1, -1] and plan.b_start.tolist() == [0, 0]
        assert torch.equal(o[0], o[1])


@pytest.mark.parametrize("spec", [
    QuestPolicy(budget=64, recent=16, sink=4, min_saving=0.5),
    AsyncSpadePolicy(budget=64, recent=16, sink=4, min_saving=0.5),
    LfpsPolicy(budget=64, local=15, sink=4, min_saving=0.5),
])
def test_min_saving_keeps_the_row_dense_until_a_sparse_step_pays(spec):
    """min_saving 0.5: past the budget's reach (84 keys) but within twice it the row
    is dense, exactly `full` (device plan and host routing alike, the host saying
    why); past 168 keys it is indexed."""
    init = MODULES[spec.policy].init_row(spec, [], [], (None, None))
    assert init.dense_until == 168
    sim = Sim(4, seed=5)
    n = 100
    _twin_rows(sim, spec, n)
    seen = []
    sim.st.metrics = type("M", (), {"on_step": lambda self, pp, fb: seen.append(dict(fb)),
                                    "on_admit": lambda self, p: None, "on_release": lambda self, p, r: None})()
    for t in range(3):
        q1 = torch.randn(1, HKV * 4, D, generator=sim.gen)
        q, o, plan = sim.step([1, 2], [n + 1 + t] * 2, q=torch.cat([q1, q1]))
        assert plan.a_slot.tolist() == [-1, -1] and plan.b_start.tolist() == [0, 0]
        assert torch.equal(o[0], o[1])
        sim.st.set_step_rows([1], [n + 1 + t], [[]])
        assert sim.st.take_step_kernel_rows() == [0]
    assert seen[0] == {(spec.policy, "saving_below_minimum"): 1}
    _, _, plan = sim.step([1], [169])
    assert plan.a_slot.tolist() == [-2]
    sim.st.set_step_rows([1], [169], [[]])
    assert sim.st.take_step_kernel_rows() == [1]


def test_asyncspade_first_step_dense_then_the_predicted_selection():
    sim = Sim(2, seed=5, aspd_window=4)
    spec = AsyncSpadePolicy(window=3, budget=24, recent=8, sink=2)
    n0 = 90
    sim.alloc(1, n0 + 10)
    qp = sim.admit([1], [spec], [n0])
    history = [qp[-j] for j in range(4, 0, -1)]  # the prompt's last W + 1 = 4 queries
    prev = None
    for t in range(5):
        n = n0 + 1 + t
        q, o, plan = sim.step([1], [n])
        if t == 0:
            assert plan.a_slot.tolist() == [-1] and plan.b_start.tolist() == [0]  # no prediction yet
        else:
            assert plan.a_slot.tolist() == [-2]
            pos = plan.a_pos[0, :, : int(plan.a_len_per_head[0, 0])]
            assert torch.equal(pos, prev)
            keep = [pos[h].tolist() + list(range(n - spec.recent, n)) for h in range(HKV)]
            ref = attend64(q[0], sim.keys(1, n), sim.v[sim.r2t[1, :n].long()], keep, 2)
            torch.testing.assert_close(o[0].double(), ref, rtol=1e-5, atol=1e-5)
        # what the next step must attend: predicted from the last W + 1 queries
        history.append(q[0])
        win = torch.stack(history[-(spec.window + 1):])[None]
        q_hat = aspd.predict_next_query(win, torch.tensor([win.shape[1]]), spec.ridge)
        keys = sim.keys(1, n)[None]
        s = aspd.score_positions(q_hat, keys, torch.tensor([n]), torch.tensor([spec.sink]),
                                 torch.tensor([n + 1 - spec.recent]), SCALE)
        top, cnt = aspd.select_topk(s, torch.tensor([spec.budget]), spec.budget)
        assert cnt.tolist() == [[spec.budget] * HKV]
        prev = torch.cat([torch.arange(spec.sink).expand(HKV, -1), top[0]], dim=-1).int()
        assert (prev < n + 1 - spec.recent).all()


def test_lfps_step_uses_the_tables_and_updates_them():
    """The runtime's selection equals queryaware.lfps on a twin state built from the
    same prompt queries; bypassed heads output V̄; tables updated by Eq. (10)."""
    group = 2
    sim = Sim(group, seed=11)
    spec = LfpsPolicy(budget=12, local=6, sink=4, s=8, a=0.2, eps=0.999)
    n0 = 120
    sim.alloc(1, n0 + 10)
    # Attention with a pattern (random keys give flat tables, where Eq. 8 passes no
    # candidate): keys at a few positions align with every query.
    u = torch.randn(D, generator=sim.gen)
    u = 3 * u / u.norm()
    hot = [20, 21, 57, 90]
    sim.k[sim.r2t[1, hot].long()] = u
    qdir = lambda m: torch.randn(m, HKV * group, D, generator=sim.gen) * 0.3 + u  # noqa: E731
    qp = sim.admit([1], [spec], [n0], q=qdir(n0))
    knobs = lfps_knobs(spec)
    twin = lfps_math.init_tables(qp[-spec.s:][None], sim.keys(1, n0)[None], sim.v[sim.r2t[1, :n0].long()][None],
                                 torch.tensor([n0]), SCALE, MAXCTX, knobs)
    slot = int(sim.st.slot[1])
    store = sim.st.query_stores[PolicyId.LFPS]
    torch.testing.assert_close(store.ver[0, slot], twin.ver[0].float())
    for t in range(4):
        n = n0 + 1 + t
        q = qdir(1)
        keys = sim.keys(1, n)[None]
        res = lfps_math.step(twin, q, keys, torch.tensor([n]), torch.tensor([spec.budget]), spec.budget,
                             MAXCTX, SCALE, knobs)
        _, o, plan = sim.step([1], [n], q=q)
        assert plan.a_slot.tolist() == [-2]
        b_start = n - spec.local - 1
        for h in range(HKV):
            sel = res.positions[0, h, : res.counts[0, h]].tolist()
            want = list(range(spec.sink)) + [p for p in sel if p < b_start]
            if bool(res.bypass[0, h]):
                torch.testing.assert_close(o[0, h * group:(h + 1) * group],
                                           store.vbar[0, slot, h].expand(group, -1))
                continue
            got = plan.a_pos[0, h, : plan.a_len_per_head[0, h]].tolist()
            assert got == want
            ref = attend64(q[0], keys[0], sim.v[sim.r2t[1, :n].long()], [None] * h + [want + list(range(b_start, n))], group)
            torch.testing.assert_close(o[0, h * group:(h + 1) * group].double(), ref[h * group:(h + 1) * group],
                                       rtol=1e-5, atol=1e-5)
        assert (res.counts > 0).any() and not res.bypass.all()  # the check above saw a selection
        lfps_math.update_tables(twin, res, torch.tensor([n]), knobs)
        torch.testing.assert_close(store.ver[0, slot], twin.ver[0].float())
        torch.testing.assert_close(store.sla[0, slot], twin.sla[0].float())


def test_lfps_sink_bypass_outputs_the_mean_value():
    """eps close to 0: every head bypasses (Step 1) and outputs V̄, tables unchanged."""
    sim = Sim(2, seed=13)
    spec = LfpsPolicy(budget=12, local=6, sink=4, s=8, eps=1e-6)
    sim.alloc(1, 140)
    sim.admit([1], [spec], [120])
    store, slot = sim.st.query_stores[PolicyId.LFPS], int(sim.st.slot[1])
    before = store.ver[0, slot].clone()
    _, o, plan = sim.step([1], [121])
    assert plan.a_len_per_head[0].tolist() == [0, 0]
    torch.testing.assert_close(o[0], store.vbar[0, slot].repeat_interleave(2, dim=0))
    assert torch.equal(store.ver[0, slot], before)


def test_store_slots_no_free_slot_long_context_and_release():
    sim = Sim(1, slots=1)
    spec = QuestPolicy(budget=16, recent=8, sink=0)
    for r in (1, 2):
        sim.alloc(r, 280)
    sim.admit([1, 2], [spec, spec], [100, 100])
    assert sim.st.slot[[1, 2]].tolist() == [0, -1]
    assert sim.st.query_slots_in_use() == {"quest": 1, "asyncspade": 0, "lfps": 0}
    _, _, plan = sim.step([1, 2], [101, 101])
    assert plan.a_slot.tolist() == [-2, -1]  # no slot: dense
    _, _, plan = sim.step([1], [MAXCTX + 1])
    assert plan.a_slot.tolist() == [-1]  # longer than the store: dense
    # host twin: routing and fallback reasons, retention bound
    sim.st.set_step_rows([1, 2], [101, 101], [[], []])
    sim.st.set_step_rows([1], [MAXCTX + 1], [[]])
    stats = sim.st.request_stats(1)
    assert stats["policy"] == "quest" and stats["decode_steps"] == 2
    assert stats["mean_retention"] == pytest.approx(((16 + 8) / 101 + 1) / 2)
    sim.st.release([1, 2])
    assert sim.st.query_slots_in_use()["quest"] == 0
    sim.admit([3], [spec], [50])
    assert int(sim.st.slot[3]) == 0


def test_host_fallback_reasons():
    cfg = SparseServerConfig.model_validate({"query_aware": {"quest": {"slots": 1, "max_context": 64},
                                                              "asyncspade": {"slots": 1}}})
    st = SparseState(8, "cpu", cfg)
    seen = []
    st.metrics = type("M", (), {"on_step": lambda self, pp, fb: seen.append(dict(fb)),
                                "on_admit": lambda self, p: None, "on_release": lambda self, p, r: None})()
    q = MODULES["quest"].init_row(QuestPolicy(budget=16, recent=4), [], [], (None, None))
    a = MODULES["asyncspade"].init_row(AsyncSpadePolicy(budget=16, recent=4), [], [], (None, None))
    st.admit([1, 2, 3], [q, q, a])
    routes = []
    for rows, lens in (([1, 2, 3], [30, 30, 30]), ([1, 3], [70, 31]), ([1, 3], [20, 32])):
        st.set_step_rows(rows, lens, [[]] * len(rows))
        routes.append(st.take_step_kernel_rows())
    # 1: the two-segment kernel (indexed); 0: the stock dense kernel
    assert routes == [[1, 0, 0], [0, 1], [0, 1]]
    assert seen == [{("quest", "no_store_slot"): 1, ("asyncspade", "prediction_pending"): 1},
                    {("quest", "context_exceeds_store"): 1},
                    {("quest", "budget_covers_sequence"): 1}]


def test_request_validation_names_the_field():
    server = SparseServerConfig.model_validate({"query_aware": {"quest": {"capacity": 100}}})
    ok = parse_request_policy({"policy": "quest", "budget": 64}, server)
    assert (ok.budget, ok.sink, ok.recent) == (64, 4, 64)
    for raw, field in [
        ({"policy": "quest", "budget": 40}, "budget"),  # not a multiple of 16
        ({"policy": "quest", "budget": 112}, "budget"),  # sink + budget > capacity
        ({"policy": "quest", "recent": 0}, "recent"),
        ({"policy": "asyncspade", "window": 5}, "window"),  # > the server's ring
        ({"policy": "asyncspade", "ridge": 0.0}, "ridge"),
        ({"policy": "lfps", "r": 1.0}, "r"),
        ({"policy": "lfps", "eps": 1.5}, "eps"),
        ({"policy": "lfps", "a": -0.2}, "a"),
        ({"policy": "lfps", "s": 0}, "s"),
        ({"policy": "lfps", "local": 0}, "local"),
    ]:
        with pytest.raises(SparseConfigError) as e:
            parse_request_policy(raw, server)
        assert f"custom_params.sparse.{field}" in str(e.value), (raw, str(e.value))
        assert e.value.reason == field


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_plan_through_the_two_segment_kernel_equals_reference(dtype):
    """The CUDA path's data flow on CPU: a mixed batch's layer plan (indexed quest and
    lfps rows, a streaming row, a full row, a covering quest row) through the Triton
    kernel (interpreted, `a_pos`) equals the reference attention."""
    from sgl_sparse.kernels import two_segment_decode
    from sgl_sparse.policies import RowInit

    group = 4
    sim = Sim(group, seed=21)
    lens = {1: 150, 2: 131, 3: 90, 4: 64, 5: 70}
    for r, n in lens.items():
        sim.alloc(r, n + 5)
    sim.admit([1, 2, 4, 5], [QuestPolicy(budget=32, recent=8), LfpsPolicy(budget=16, local=6, eps=0.999, s=8),
                             None, QuestPolicy(budget=64, recent=16)], [150, 131, 64, 70])
    sim.st.admit([3], [RowInit(PolicyId.STREAMING, window=16, sink=4)])
    rows = [1, 2, 3, 4, 5]
    rows_t = torch.tensor(rows)
    cur = [lens[r] + 1 for r in rows]
    lens_t = torch.tensor(cur)
    plan = plan_decode(sim.st, rows_t, torch.ones(5, dtype=torch.long), lens_t, (None, None), num_kv_heads=HKV)
    assert plan.a_slot.tolist() == [-2, -2, -1, -1, -1]
    sim.rt.plan_step(rows, cur, torch.device("cpu"))
    q = torch.randn(5, HKV * group, D, generator=sim.gen)
    lplan = sim.rt.select(0, plan, q, sim.k, sim.r2t, rows_t, lens_t, SCALE)
    assert lplan.a_len_per_head[2].tolist() == [4, 4]  # the streaming row's sink, kept
    k, v, qd = sim.k.to(dtype), sim.v.to(dtype), q.to(dtype)
    ref = torch.full_like(qd, float("nan"))
    reference.decode_attention(qd, ref, k, v, sim.r2t, rows_t, lplan, SCALE, True)
    no_compact = k.new_zeros((1, HKV, 1, D))
    out = two_segment_decode(qd, no_compact, no_compact, lplan.a_slot, lplan.a_len_per_head, k, v, sim.r2t,
                             rows_t, lplan.b_start, lplan.b_end, SCALE, a_pos=lplan.a_pos, num_splits=2,
                             block_n=16, min_split_len=16)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 5e-3), err


def test_int4_index_keys_need_a_head_dim_of_64_or_more():
    """Start-up stops with the field named (the backend raises it while building the
    stores) instead of a kernel failing to compile at the first decode step."""
    from sgl_sparse.config import AsyncSpadeStoreConfig
    from sgl_sparse.query_store import AsyncSpadeStore

    cfg = AsyncSpadeStoreConfig(slots=1, max_context=64, capacity=16, index_keys="int4")
    shape = dict(window=2, num_layers=1, num_kv_heads=1, num_q_heads=2, dtype=torch.float16,
                 device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"query_aware\.asyncspade\.index_keys: 'int4'.*head_dim.*32"):
        AsyncSpadeStore(cfg, head_dim=32, **shape)
    store = AsyncSpadeStore(cfg, head_dim=64, **shape)
    assert store.kq.shape[-1] == 32 and store.ksmooth.shape == (1, 1, 1, 64) and store.ksmooth.eq(1).all()
