"""query_device (quest / asyncspade / lfps on the Triton kernels, over their store
slots, knobs read by row on the device) against the host-grouped torch path, its oracle.

Twin simulations over the same pool, requests and queries: one runtime on the
torch path, one on the device path (the Triton interpreter here). Random mixed
batches: quest and asyncspade rows with different knobs, an lfps row, a full row, a quest row covered by its budget at first, a padding row
(request row 0); GQA; ragged lengths, not multiples of 16. Each step: the same
per-head position sets and a_len, the same attention output, the same stores.
Then the device path replayed the way a CUDA graph replays it: no host planning
between steps, inputs changed in place, no host sync and the same tensor shapes.
asyncspade with index keys: the scoring pass's top-digit histograms feed the Top-K
(query_device.TOPK_HIST_FROM_SCORES: int8 copies by default) in every int8 test here,
as on serving's rows; the same selections with it off, and with it on for 4-bit copies.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_sparse import query_device, query_serving, reference
from sgl_sparse.config import AsyncSpadePolicy, LfpsPolicy, QuestPolicy, SparseServerConfig
from sgl_sparse.decision import plan_decode
from sgl_sparse.policies import MODULES, PolicyId
from sgl_sparse.policies.base import QUERY_AWARE_IDS
from sgl_sparse.query_serving import QueryAwareRuntime, lfps_knobs
from sgl_sparse.query_store import AsyncSpadeStore, LfpsStore, QuestStore
from sgl_sparse.queryaware import lfps as lfps_math
from sgl_sparse.state import SparseState
from tests.bench_scripts import load_bench_script

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent
# the module (sgl_sparse.kernels exports its function under the same name)
topk_mod = importlib.import_module("sgl_sparse.kernels.topk_range")
token_scores_mod = importlib.import_module("sgl_sparse.kernels.token_scores")

HKV, D, MAXCTX, CAP = 2, 16, 160, 80


@pytest.fixture(autouse=True)
def _topk_hist_from_scores(monkeypatch):
    """asyncspade's rows here (MAXCTX scores) would take topk_range's register-row
    kernel, where h_top does not apply (topk_range.takes_htop), and serving's 32K+
    ones the block-walking kernel it feeds: taken here too, so that the index-key
    tests run the scoring pass's histograms into the Top-K, as serving does."""
    monkeypatch.setattr(topk_mod, "takes_htop", functools.partial(topk_mod.takes_htop, one_block=False))
SCALE = 1 / math.sqrt(D)
KV = torch.float16

SPECS = {
    1: QuestPolicy(budget=32, recent=9, sink=4),
    2: QuestPolicy(budget=16, recent=20, sink=0),
    3: QuestPolicy(budget=32, recent=16, sink=4),  # covers its first steps
    4: AsyncSpadePolicy(window=3, budget=24, recent=8, sink=2),
    5: AsyncSpadePolicy(window=4, budget=40, recent=5, sink=3, ridge=0.05),
    6: LfpsPolicy(budget=12, local=6, sink=4, s=8),
    7: None,  # full
}
LENS = {1: 75, 2: 103, 3: 45, 4: 90, 5: 61, 6: 70, 7: 50}


class Twin:
    """One layer of a decode loop over fp16 KV, driven as SparseAttnBackend drives it
    (specs / lens: request row -> policy / prompt length; store: query_aware overrides)."""

    def __init__(self, group: int, use_kernels: bool, seed: int = 0, specs: dict | None = None,
                 lens: dict | None = None, store: dict | None = None, index_keys: str = "kv",
                 num_layers: int = 1, aspd: dict | None = None, cache_device: torch.device | None = None):
        """cache_device: asyncspade's selection tensors there, as on a cache GPU (the
        store's remote path: query_aware.asyncspade.cache_device set)."""
        gen = torch.Generator().manual_seed(seed)
        self.group = group
        # 4-bit copies are scored as two dots over D/2 channels: int8 dots take K >= 32 on a GPU
        self.d = 64 if index_keys == "int4" else D
        self.num_layers = num_layers
        self.specs, self.lens = specs or SPECS, lens or LENS
        store = {"slots": 4, "max_context": MAXCTX, "capacity": CAP, "candidates": MAXCTX, **(store or {})}
        cfg = SparseServerConfig.model_validate({
            "query_aware": {"quest": store, "lfps": store,
                            "asyncspade": {**store, "index_keys": index_keys, **(aspd or {})}},
            "policies": {"asyncspade": {"window": 4}},
        })
        self.st = SparseState(12, "cpu", cfg)
        qs = cfg.query_aware
        shape = dict(num_layers=num_layers, num_kv_heads=HKV, head_dim=self.d, device=torch.device("cpu"))
        hq = HKV * group
        self.st.query_stores[PolicyId.QUEST] = QuestStore(qs.quest, dtype=KV, **shape)
        aspd_cfg = qs.asyncspade
        if cache_device is not None:
            aspd_cfg = aspd_cfg.model_copy(update={"cache_device": "cuda:1"})
        self.st.query_stores[PolicyId.ASYNCSPADE] = AsyncSpadeStore(aspd_cfg, window=4, num_q_heads=hq,
                                                                    dtype=KV, cache_device=cache_device, **shape)
        self.st.query_stores[PolicyId.LFPS] = LfpsStore(qs.lfps, num_q_heads=hq, **shape)
        self.rt = QueryAwareRuntime(self.st, use_kernels=use_kernels)
        self.store_list_rows = 0  # rows whose lists the decode read from the store (ASPD_LISTS_IN_PLACE)
        self.k = torch.randn(2000, HKV, self.d, generator=gen).to(KV)
        self.v = torch.randn(2000, HKV, self.d, generator=gen).to(KV)
        # unused entries point at real keys: reading them is a wrong answer
        self.r2t = torch.randint(0, 2000, (12, MAXCTX + 40), generator=gen, dtype=torch.int32)
        perm = torch.randperm(1999, generator=gen).to(torch.int32) + 1
        off = 0
        for r, n in self.lens.items():
            self.r2t[r, : n + 40] = perm[off: off + n + 40]
            off += n + 40

    def admit(self, q_ext: torch.Tensor) -> None:
        rows = list(self.specs)
        inits = [MODULES[s.policy if s is not None else "full"].init_row(s, [], [], (None, None))
                 for s in self.specs.values()]
        admitted = self.st.admit(rows, inits)
        lens = [self.lens[r] for r in rows]
        self.rt.plan_extend(rows, lens, lens, admitted)
        for li in range(self.num_layers):  # every layer over the same KV, its own queries
            self.rt.on_extend(li, q_ext.roll(li, 0), self.k, self.v, self.r2t, SCALE)

    def step(self, rows: list[int], lens: list[int], q: torch.Tensor, graphed: bool = False):
        o, plans = self.step_layers(rows, lens, [q], graphed)
        return o[0], plans[0]

    def step_layers(self, rows: list[int], lens: list[int], qs: list[torch.Tensor], graphed: bool = False):
        """One decode step through layers 0..len(qs) - 1, layer li's queries qs[li]:
        per layer (attention output, plan)."""
        rows_t, lens_t = torch.tensor(rows), torch.tensor(lens, dtype=torch.int32)
        plan = plan_decode(self.st, rows_t, torch.ones(len(rows), dtype=torch.long), lens_t, (None, None),
                           num_kv_heads=HKV)
        self.rt.plan_step(rows, lens, torch.device("cpu"), graphed=graphed)
        outs, plans = [], []
        for li, q in enumerate(qs):
            lplan = self.rt.select(li, plan, q, self.k, self.r2t, rows_t, lens_t, SCALE) if self.rt.active() else plan
            if lplan.a_lists is not None:  # asyncspade's rows read the store in place (ASPD_LISTS_IN_PLACE)
                _check_store_lists(lplan, self.r2t, rows_t)
                self.store_list_rows += int((lplan.a_lists.rows >= 0).sum())
                lplan = lplan.materialized()
            if lplan.a_slots is not None:
                _check_slots(lplan, self.r2t, rows_t)
            o = torch.zeros(q.shape[0], q.shape[1], self.d, dtype=torch.float32)
            reference.decode_attention(q, o, self.k, self.v, self.r2t, rows_t, lplan, SCALE, self.group > 1)
            if self.rt.active():
                self.rt.finish(li, lplan, q, o, self.k, self.r2t, rows_t, lens_t, SCALE)
            outs.append(o)
            plans.append(lplan)
        return outs, plans


def _check_slots(plan, r2t: torch.Tensor, rows_t: torch.Tensor) -> None:
    """The pool slots the producers wrote beside the positions (what the decode
    gathers from): the positions mapped through the row's req_to_token."""
    for b in torch.nonzero(plan.indexed()).flatten().tolist():
        for h in range(HKV):
            n = int(plan.a_len_per_head[b, h])
            assert torch.equal(plan.a_slots[b, h, :n], r2t[int(rows_t[b])][plan.a_pos[b, h, :n].long()]), (b, h)


def _check_store_lists(plan, r2t: torch.Tensor, rows_t: torch.Tensor) -> None:
    """ASPD_LISTS_IN_PLACE: the rows naming a store row are asyncspade's INDEXED ones,
    and the store's pool slots are its positions' (what the decode reads instead)."""
    st = plan.a_lists
    rows = st.rows.tolist()
    assert all(r < 0 or bool(plan.indexed()[b]) for b, r in enumerate(rows)), rows
    for b, r in enumerate(rows):
        if r < 0:
            continue
        for h in range(HKV):
            n = int(st.count[r, h])
            assert torch.equal(st.slots[r, h, :n], r2t[int(rows_t[b])][st.pos[r, h, :n].long()]), (b, h)


def _sets(plan, b: int) -> list[list[int]]:
    if plan.a_pos is None:
        return []
    return [sorted(plan.a_pos[b, h, : int(plan.a_len_per_head[b, h])].tolist()) for h in range(HKV)]


def _rows_of(twin: Twin, policy: str) -> list[int]:
    return [r for r, s in twin.specs.items() if s is not None and s.policy == policy]


def _same_stores(a: Twin, b: Twin) -> None:
    qa, qb = a.st.query_stores[PolicyId.QUEST], b.st.query_stores[PolicyId.QUEST]
    for r in _rows_of(a, "quest"):
        s = a.st.row_init(r).slot
        assert s == b.st.row_init(r).slot
        assert torch.equal(qa.kmin[0, s], qb.kmin[0, s]) and torch.equal(qa.kmax[0, s], qb.kmax[0, s])
    la, lb = a.st.query_stores[PolicyId.LFPS], b.st.query_stores[PolicyId.LFPS]
    for r in _rows_of(a, "lfps"):
        s = a.st.row_init(r).slot
        assert s == b.st.row_init(r).slot
        # the same updates; w_i from the same logits summed in another order: fp32 rounding apart
        # (the device path's tables are stored over their scale: LfpsStore.tscale)
        for ta, tb in zip(la.true_tables(0, s), lb.true_tables(0, s)):
            torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-6)
    sa, sb = a.st.query_stores[PolicyId.ASYNCSPADE], b.st.query_stores[PolicyId.ASYNCSPADE]
    for r in _rows_of(a, "asyncspade"):
        s = a.st.row_init(r).slot
        assert torch.equal(sa.ring[0, s], sb.ring[0, s]) and torch.equal(sa.total[0, s], sb.total[0, s])
        assert torch.equal(sa.sel_count[0, s], sb.sel_count[0, s])
        for h in range(HKV):
            c = int(sa.sel_count[0, s, h])
            assert sorted(sa.sel_pos[0, s, h, :c].tolist()) == sorted(sb.sel_pos[0, s, h, :c].tolist())


# int8 / int4 at group 1 and 4 here; GQA 2 in the replay test below, 1/4/8 in
# tests/kernels/test_index_keys.py
@pytest.mark.parametrize("group,index_keys", [(1, "kv"), (4, "kv"), (1, "int8"), (4, "int4")])
def test_device_path_matches_the_torch_path(group, index_keys):
    """index_keys int8 / int4: the torch path quantizes the keys on the fly at every
    step, the device path scores its slot copies (all quantized at the first step, one
    new position a step after): the same selections, and copies equal to the keys'
    (int4: under the channel smoothing both read from the store, set at extend)."""
    gen = torch.Generator().manual_seed(100 + group)
    ref = Twin(group, use_kernels=False, index_keys=index_keys)
    dev = Twin(group, use_kernels=True, index_keys=index_keys)
    assert ref.rt.device is None and dev.rt.device is not None
    q_ext = torch.randn(sum(LENS.values()), HKV * group, dev.d, generator=gen).to(KV)
    ref.admit(q_ext)
    dev.admit(q_ext)
    # batch order shuffled, a padding row (request row 0, length 1) in the middle;
    # 12 steps cross page boundaries, row 3 turns indexed at n = 53
    indexed = compare_steps(ref, dev, [5, 1, 7, 3, 0, 4, 2, 6], 12, gen)
    assert {r for _, r, _ in indexed} == {1, 2, 3, 4, 5, 6}
    if index_keys != "kv":
        _copies_are_the_keys(dev, lambda r: dev.lens[r] + 12)


@pytest.mark.parametrize("topk_layers", [1, 2])
def test_asyncspade_lists_read_in_place_select_as_copied(monkeypatch, topk_layers):
    """ASPD_LISTS_IN_PLACE: asyncspade's store keeps its selections' pool slots too
    (one Top-K a layer, or a group's), and the device path hands the decode its
    store rows instead of copying them into the step's (gather_selection): the same
    position sets, lengths and attention as the torch path; the store's slots are
    its positions' (_check_store_lists); and the rows read in place were there."""
    from sgl_sparse import query_store

    monkeypatch.setattr(query_store, "ASPD_LISTS_IN_PLACE", True)
    gen = torch.Generator().manual_seed(300 + topk_layers)
    ref = Twin(2, use_kernels=False, num_layers=3, aspd={"topk_layers": topk_layers})
    dev = Twin(2, use_kernels=True, num_layers=3, aspd={"topk_layers": topk_layers})
    assert dev.st.query_stores[PolicyId.ASYNCSPADE].sel_slot is not None
    q_ext = torch.randn(sum(LENS.values()), HKV * 2, dev.d, generator=gen).to(KV)
    ref.admit(q_ext)
    dev.admit(q_ext)
    rows = [5, 1, 4, 0, 6, 7]
    for t in range(3):
        lens = [dev.lens[r] + 1 + t if r else 1 for r in rows]
        qs = [torch.randn(len(rows), HKV * 2, dev.d, generator=gen).to(KV) for _ in range(3)]
        outs_ref, plans_ref = ref.step_layers(rows, lens, qs)
        outs_dev, plans_dev = dev.step_layers(rows, lens, qs)
        for li in range(3):
            for b, r in enumerate(rows):
                if int(plans_ref[li].a_slot[b]) == -2:
                    assert _sets(plans_ref[li], b) == _sets(plans_dev[li], b), (t, li, r)
                    assert torch.equal(plans_ref[li].a_len_per_head[b], plans_dev[li].a_len_per_head[b])
            torch.testing.assert_close(outs_dev[li], outs_ref[li], rtol=2e-3, atol=2e-3)
    # asyncspade's rows 4 and 5 from their second step on (the first is dense), every layer
    assert dev.store_list_rows == 2 * 2 * 3, dev.store_list_rows


@pytest.mark.parametrize("topk_layers,index_keys", [(5, "kv"), (2, "int8")])
def test_asyncspade_topk_over_layer_groups_selects_as_per_layer(topk_layers, index_keys):
    """`topk_layers`: one Top-K launch over the rows of a group of layers (of 5: one
    group of every layer; of 2: the last group shorter, the size not dividing them)
    stores every layer the selection its own launch stores, and the same attention
    follows (int8 index keys: each group's Top-K reads its layers' histograms from
    their scoring launches). Groups of 2 over the KV cache's keys are not run (~75 s
    in the interpreter): the uneven groups are int8's case, the KV keys' scoring into
    a group's rows of 5's."""
    layers, group = 5, 2
    gen = torch.Generator().manual_seed(31 + topk_layers)
    one = Twin(group, use_kernels=True, num_layers=layers, aspd={"topk_layers": 1}, index_keys=index_keys)
    grouped = Twin(group, use_kernels=True, num_layers=layers, aspd={"topk_layers": topk_layers},
                   index_keys=index_keys)
    s1, s2 = (t.st.query_stores[PolicyId.ASYNCSPADE] for t in (one, grouped))
    assert s1.scores is None and s2.scores.shape == (topk_layers, 4, HKV, MAXCTX)
    q_ext = torch.randn(sum(LENS.values()), HKV * group, D, generator=gen).to(KV)
    one.admit(q_ext)
    grouped.admit(q_ext)
    rows = [5, 1, 7, 4, 0, 2]
    slots = [one.st.row_init(r).slot for r in _rows_of(one, "asyncspade")]
    for t in range(3):  # the first step dense, then two selected with the step before's predictions
        lens = [LENS[r] + 1 + t if r else 1 for r in rows]
        qs = [torch.randn(len(rows), HKV * group, D, generator=gen).to(KV) for _ in range(layers)]
        o1, _ = one.step_layers(rows, lens, qs)
        o2, _ = grouped.step_layers(rows, lens, qs)
        for li in range(layers):
            assert torch.equal(o1[li], o2[li]), (t, li)
        assert torch.equal(s1.sel_count, s2.sel_count)
        kept = torch.arange(CAP) < s1.sel_count[..., None]
        assert torch.equal(torch.where(kept, s1.sel_pos, -1), torch.where(kept, s2.sel_pos, -1)), t
    # selections were made, and differ between layers (their rows were not mixed up)
    assert all(int(s1.sel_count[li, s].min()) > 0 for li in range(layers) for s in slots)
    assert not torch.equal(s1.sel_pos[0, slots[0]], s1.sel_pos[layers - 1, slots[0]])
    if index_keys != "kv":  # the Top-Ks left every histogram zeroed for the next step
        assert s2.htop.shape == (topk_layers, 4, HKV, 64) and not s1.htop.any() and not s2.htop.any()


def _decode_alike(a: Twin, b: Twin, layers: int, steps: int, gen: torch.Generator, check=None):
    """Admit both twins with the same prompt queries, then decode `steps` steps of a
    mixed batch (a padding row among them) with the same queries: at every step every
    layer's attention output is finite and the same in both; check(t, plans_a,
    plans_b) after each step. Returns the last step's plans."""
    q_ext = torch.randn(sum(LENS.values()), HKV * a.group, a.d, generator=gen).to(KV)
    a.admit(q_ext)
    b.admit(q_ext)
    rows = [5, 1, 7, 4, 0, 2]
    for t in range(steps):
        lens = [LENS[r] + 1 + t if r else 1 for r in rows]
        qs = [torch.randn(len(rows), HKV * a.group, a.d, generator=gen).to(KV) for _ in range(layers)]
        o1, p1 = a.step_layers(rows, lens, qs)
        o2, p2 = b.step_layers(rows, lens, qs)
        for li in range(layers):
            assert torch.isfinite(o1[li]).all() and torch.equal(o1[li], o2[li]), (t, li)
        if check is not None:
            check(t, p1, p2)
    return p1, p2


def test_asyncspade_on_a_cache_device_selects_as_on_the_serving_one():
    """query_aware.asyncspade.cache_device: the store's selection tensors (copies,
    scores, histograms) and the Top-K's own output and scratch on the cache device,
    allocated with the store (nothing allocated per call: a graph captured on the
    serving GPU cannot own another GPU's), the Top-K unsplit: the same selections and
    attention as on the serving device. Here both devices are the CPU (the remote path's
    code, not a second GPU's streams: tests/kernels/test_query_device_graph.py runs
    that on two GPUs)."""
    layers, group = 2, 2
    gen = torch.Generator().manual_seed(47)
    aspd = {"topk_layers": 2}
    here = Twin(group, use_kernels=True, num_layers=layers, aspd=aspd, index_keys="int4")
    there = Twin(group, use_kernels=True, num_layers=layers, aspd=aspd, index_keys="int4",
                 cache_device=torch.device("cpu"))
    s1, s2 = (t.st.query_stores[PolicyId.ASYNCSPADE] for t in (here, there))
    assert not s1.remote and s2.remote and s1.topk_out is None
    # the serving device pays for the ring and the selections only
    selection = (s2.kq, s2.kscale, s2.filled, s2.ksmooth, s2.scores, s2.htop, s2.topk_out, s2.topk_scratch)
    assert {id(t) for t in s2.cache_tensors()} == {id(t) for t in selection}
    assert not {id(t) for t in s2.tensors()} & {id(t) for t in selection}
    assert s2.topk_out.shape == (2 * 4, HKV, CAP) and s2.topk_scratch.shape == (2 * 4, HKV, MAXCTX)

    def check(t, p1, p2):
        kept = torch.arange(CAP) < s1.sel_count[..., None]
        assert torch.equal(s1.sel_count, s2.sel_count), t
        assert torch.equal(torch.where(kept, s1.sel_pos, -1), torch.where(kept, s2.sel_pos, -1)), t

    _decode_alike(here, there, layers, 3, gen, check)
    # the Top-K wrote through the store's own output, which the serving store has none of
    assert int(s2.sel_count.max()) > 0 and s2.topk_out.any() and not s2.htop.any()


@pytest.mark.parametrize("index_keys", ["kv", "int4"])
def test_short_scoring_programs_select_as_persistent(monkeypatch, index_keys):
    """`score_blocks_per_program`: one scoring program per block (the most programs)
    instead of persistent ones walking their share of a row: the same scores, hence
    the same selections and attention, step after step (int4: with the Top-K's
    histograms added up from every program)."""
    layers, group = 2, 2
    gen = torch.Generator().manual_seed(47)
    # one persistent program a (slot, KV head) walks every block (the interpreter's 4
    # "SMs" over 4 slots x 2 heads), against one program a block
    base = Twin(group, use_kernels=True, num_layers=layers, index_keys=index_keys,
                aspd={"score_programs_per_sm": 1, "score_blocks_per_program": 0})
    short = Twin(group, use_kernels=True, num_layers=layers, index_keys=index_keys,
                 aspd={"score_blocks_per_program": 1})  # the default is 4: the most programs here
    # the launches' programs a (slot, KV head): one a block, against one persistent program
    launches = []

    def spy(n_max, block_n, *args, **kw):
        programs = real(n_max, block_n, *args, **kw)
        launches.append((kw["blocks_per_program"], programs, -(-n_max // block_n)))
        return programs

    real = token_scores_mod.scoring_programs
    monkeypatch.setattr(token_scores_mod, "scoring_programs", spy)
    sa, sb = (t.st.query_stores[PolicyId.ASYNCSPADE] for t in (base, short))

    def same_selections(t, *_):
        assert torch.equal(sa.sel_count, sb.sel_count)
        kept = torch.arange(CAP) < sa.sel_count[..., None]
        assert torch.equal(torch.where(kept, sa.sel_pos, -1), torch.where(kept, sb.sel_pos, -1)), t

    _decode_alike(base, short, layers, 4, gen, same_selections)
    slots = [base.st.row_init(r).slot for r in _rows_of(base, "asyncspade")]
    assert all(int(sa.sel_count[li, s].min()) > 0 for li in range(layers) for s in slots)
    assert {b for b, _, _ in launches} == {0, 1}
    assert all(programs == (blocks if b == 1 else 1) and blocks > 1 for b, programs, blocks in launches)


@pytest.mark.parametrize("index_keys", ["int8", "int4"])
def test_topk_hist_from_scores_counts_for_int8_copies_by_default(index_keys):
    """With SGLANG_SPARSE_TOPK_HIST_FROM_SCORES unset the scoring pass counts the
    Top-K's histograms from int8 copies, not from 4-bit ones (where the count costs
    the pass more than the Top-K saves: query_device's measurements)."""
    assert query_device.TOPK_HIST_FROM_SCORES == frozenset({8})
    twin = Twin(2, use_kernels=True, num_layers=2, aspd={"topk_layers": 2}, index_keys=index_keys)
    assert twin.rt.device._aspd_hist(0) == (index_keys == "int8")


@pytest.mark.parametrize("index_keys,topk_layers", [("int8", 2), ("int4", 1)])
def test_topk_hist_from_scores_selects_as_without(monkeypatch, index_keys, topk_layers):
    """TOPK_HIST_FROM_SCORES (read at import: the module constant patched): the same
    decode steps with the scoring pass's histograms fed to the Top-K and without store
    the same selections bit for bit, over 3 layers (groups of 2: the last one shorter;
    or per layer); with it every Top-K got h_top, and left it zeroed."""
    layers, group = 3, 2
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("h_top") is not None)
        return real(*args, **kw)

    real = topk_mod.topk_range
    monkeypatch.setattr(topk_mod, "topk_range", spy)
    stores = {}
    for on in (False, True):
        monkeypatch.setattr(query_device, "TOPK_HIST_FROM_SCORES", frozenset({8, 4}) if on else frozenset())
        gen = torch.Generator().manual_seed(77)
        twin = Twin(group, use_kernels=True, num_layers=layers, aspd={"topk_layers": topk_layers},
                    index_keys=index_keys)
        twin.admit(torch.randn(sum(LENS.values()), HKV * group, twin.d, generator=gen).to(KV))
        rows = [5, 1, 7, 4, 0, 2]
        store = twin.st.query_stores[PolicyId.ASYNCSPADE]
        calls.clear()
        for t in range(3):
            lens = [LENS[r] + 1 + t if r else 1 for r in rows]
            qs = [torch.randn(len(rows), HKV * group, twin.d, generator=gen).to(KV) for _ in range(layers)]
            twin.step_layers(rows, lens, qs)
            assert not store.htop.any(), (on, t)
        # on: each step's asyncspade Top-Ks (one a group) and no other took h_top
        assert sum(calls) == (3 * -(-layers // topk_layers) if on else 0), (on, calls)
        stores[on] = store
    a, b = stores[False], stores[True]
    assert torch.equal(a.sel_count, b.sel_count) and a.sel_count.any()
    kept = torch.arange(CAP) < a.sel_count[..., None]
    assert torch.equal(torch.where(kept, a.sel_pos, -1), torch.where(kept, b.sel_pos, -1))


def _copies_are_the_keys(twin: Twin, n_of) -> None:
    """Each asyncspade slot's int8 copies equal quantize_keys of its keys on [sink, hi),
    hi the last step's scored bound (n + 1 - recent), which its counter holds; 4-bit
    copies unpack to the smoothed codes, under the smoothing of the slot's prompt."""
    from sgl_sparse.kernels.index_keys import channel_smoothing, quantize_keys, smoothed_codes, unpack_int4

    store = twin.st.query_stores[PolicyId.ASYNCSPADE]
    for r in _rows_of(twin, "asyncspade"):
        s, spec, n = twin.st.row_init(r).slot, twin.specs[r], n_of(r)
        hi = n + 1 - spec.recent
        assert int(store.filled[0, s, hi % 2]) == hi, (r, store.filled[0, s])
        keys = twin.k[twin.r2t[r, spec.sink:hi].long()]
        if store.ksmooth is None:
            kq, ks = quantize_keys(keys)
            got = store.kq[0, s, :, spec.sink:hi]
        else:
            f = channel_smoothing(twin.k[twin.r2t[r, :LENS[r]].long()])  # the prompt's keys
            assert torch.equal(store.ksmooth[0, s], f) and not f.eq(1).all(), r
            kq, ks = smoothed_codes(keys, f)
            got = unpack_int4(store.kq[0, s, :, spec.sink:hi])
        assert torch.equal(got, kq.transpose(0, 1)), r
        assert torch.equal(store.kscale[0, s, :, spec.sink:hi], ks.T), r


def compare_steps(ref: Twin, dev: Twin, rows: list[int], steps: int, gen: torch.Generator) -> list[tuple]:
    """Decode `rows` (0: a padding row of length 1) for `steps` steps on both twins,
    one key per step, the same random queries, and check every step: the same
    plan, per-head position sets and a_len of the indexed rows, attention output
    and stores. Returns (step, row, a_len [Hkv]) of each indexed row's step."""
    indexed = []
    for t in range(steps):
        lens = [dev.lens[r] + 1 + t if r else 1 for r in rows]
        q = torch.randn(len(rows), HKV * dev.group, dev.d, generator=gen).to(KV)
        o_ref, p_ref = ref.step(rows, lens, q)
        o_dev, p_dev = dev.step(rows, lens, q)
        assert torch.equal(p_ref.a_slot, p_dev.a_slot)
        for b, r in enumerate(rows):
            if int(p_ref.a_slot[b]) == -2:
                indexed.append((t, r, p_dev.a_len_per_head[b]))
                assert _sets(p_ref, b) == _sets(p_dev, b), (t, r)
                assert torch.equal(p_ref.a_len_per_head[b], p_dev.a_len_per_head[b]), (t, r)
        # fp16 attention, same sets summed in another order: fp16 rounding apart
        torch.testing.assert_close(o_dev, o_ref, rtol=2e-3, atol=2e-3)
        _same_stores(ref, dev)
    return indexed


class _Watch(TorchDispatchMode):
    """Every aten op's output shapes, and any host read of device data."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(t), int(t)
            self.syncs += 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.shapes.append((str(func), tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        return out


@pytest.mark.parametrize("index_keys", ["kv", "int8", "int4"])
def test_device_path_replays_without_host_planning(index_keys):
    """Steps 2.. reuse step 1's host planning (as a CUDA-graph replay does), with
    other lengths and queries written into the same input buffers: the selections
    still equal the torch path's, the device path reads nothing back to the host,
    and it issues the same ops with the same shapes every step (int8 index keys:
    the copies filled by the same launch whether a step copies every position or one)."""
    group = 2
    gen = torch.Generator().manual_seed(7)
    ref = Twin(group, use_kernels=True, index_keys=index_keys)
    dev = Twin(group, use_kernels=True, index_keys=index_keys)
    ref.rt = QueryAwareRuntime(ref.st, use_kernels=False)
    q_ext = torch.randn(sum(LENS.values()), HKV * group, dev.d, generator=gen).to(KV)
    ref.admit(q_ext)
    dev.admit(q_ext)
    rows = [1, 4, 0, 5, 2, 7, 6, 0]  # padded to a captured size of 8
    bs = len(rows)
    rows_t = torch.tensor(rows)
    lens_t = torch.ones(bs, dtype=torch.int32)
    q = torch.zeros(bs, HKV * group, dev.d, dtype=KV)
    dev.rt.plan_step(rows, [1] * bs, torch.device("cpu"), graphed=True)  # "capture" time: once
    assert dev.rt.device_active and not dev.rt.groups
    rt = dev.rt
    shapes = []
    for t in range(4):
        lens = [LENS[r] + 1 + t if r else 1 for r in rows]  # one key per step, as decode writes
        lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(bs, HKV * group, dev.d, generator=gen).to(KV))
        o_ref, p_ref = ref.step(rows, lens, q.clone())
        plan = plan_decode(dev.st, rows_t, torch.ones(bs, dtype=torch.long), lens_t, (None, None), num_kv_heads=HKV)
        with _Watch() as w:
            lplan = rt.select(0, plan, q, dev.k, dev.r2t, rows_t, lens_t, SCALE)
        # the lists this step's decode reads (in the store where ASPD_LISTS_IN_PLACE),
        # before finish's next-step Top-K writes the store's next ones
        seen = lplan.materialized()
        with _Watch() as w_finish:
            o = torch.zeros(bs, HKV * group, dev.d, dtype=torch.float32)
            rt.finish(0, lplan, q, o, dev.k, dev.r2t, rows_t, lens_t, SCALE)
        assert w.syncs == 0 and w_finish.syncs == 0
        shapes.append(w.shapes + w_finish.shapes)
        for b, r in enumerate(rows):
            if r and int(p_ref.a_slot[b]) == -2:
                assert _sets(p_ref, b) == _sets(seen, b), (t, r)
                assert torch.equal(p_ref.a_len_per_head[b], seen.a_len_per_head[b])
        _same_stores(ref, dev)
    assert len(shapes[0]) > 10 and all(s == shapes[0] for s in shapes[1:])
    if index_keys != "kv":
        _copies_are_the_keys(dev, lambda r: LENS[r] + 4)


def test_extend_builds_no_tensor_from_host_values_per_layer():
    """on_extend runs at every layer of every prefill chunk. A tensor built there from
    host values is, on a GPU, a copy from pageable memory that waits for the stream:
    one per row and layer stalled the host behind the GPU through the prefill
    (bench/README, session 20). Its slots and counts are views of plan_extend's one
    copy per forward; what it computes is the same (the other tests' stores)."""
    gen = torch.Generator().manual_seed(3)
    twin = Twin(2, use_kernels=True)
    rows = list(twin.specs)
    inits = [MODULES[s.policy if s is not None else "full"].init_row(s, [], [], (None, None))
             for s in twin.specs.values()]
    admitted = twin.st.admit(rows, inits)
    lens = [twin.lens[r] for r in rows]
    q_ext = torch.randn(sum(lens), HKV * 2, D, generator=gen).to(KV)
    with _Watch() as w:
        twin.rt.plan_extend(rows, lens, lens, admitted)
    per_forward = sum("lift_fresh" in f for f, _ in w.shapes)
    assert per_forward == 1, w.shapes  # the rows' slots, lengths and ring counts at once
    assert {e.policy for e in twin.rt.extend_rows} >= {PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS}
    with _Watch() as w:
        for _ in range(3):  # layers
            twin.rt.on_extend(0, q_ext, twin.k, twin.v, twin.r2t, SCALE)
    assert not [f for f, _ in w.shapes if "lift_fresh" in f] and w.syncs == 0


def test_when_the_device_path_runs():
    """Eager forwards run it only for batches holding quest / asyncspade / lfps rows
    (no host groups then); a forward that may be a CUDA-graph capture or replay
    always runs it, whatever the batch. Without kernels lfps rows are host groups."""
    twin = Twin(2, use_kernels=True)
    twin.admit(torch.randn(sum(LENS.values()), HKV * 2, D).to(KV))
    rt = twin.rt
    rt.plan_step([7, 0], [LENS[7] + 1, 1], torch.device("cpu"))
    assert not rt.active()
    for r in (6, 4):
        rt.plan_step([7, r], [LENS[7] + 1, LENS[r] + 1], torch.device("cpu"))
        assert rt.device_active and not rt.groups
    rt.plan_step([7, 0], [LENS[7] + 1, 1], torch.device("cpu"), graphed=True)
    assert rt.device_active and rt.active()
    host = Twin(2, use_kernels=False)
    host.admit(torch.randn(sum(LENS.values()), HKV * 2, D).to(KV))
    host.rt.plan_step([7, 6], [LENS[7] + 1, LENS[6] + 1], torch.device("cpu"))
    assert not host.rt.device_active and [g.policy for g in host.rt.groups] == [PolicyId.LFPS]



def test_idle_steps_keep_the_device_path_in_captured_graphs():
    """With no live query-aware request the backend skips the host planning
    (SparseState.has_active), yet a forward that may be captured must still carry
    the device path: a graph captured then is replayed when such requests come."""
    twin = Twin(2, use_kernels=True)  # nothing admitted
    assert not twin.st.has_active(QUERY_AWARE_IDS)
    for graphed in (False, True):
        twin.rt.plan_idle_step(graphed)
        assert twin.rt.active() == graphed and not twin.rt.groups
    twin.admit(torch.randn(sum(LENS.values()), HKV * 2, D).to(KV))
    assert twin.st.has_active(QUERY_AWARE_IDS)


def test_ops_per_layer_stay_few():
    """The per-forward work (knobs, slot -> row maps, masks) runs at a forward's
    first layer only: the further layers issue only their own ops (each op is a
    GPU kernel in a captured decode step, 28 layers a step). Measured by
    bench/kernels/count_query_device_ops.py: 205 glue ops on every layer before,
    63 on a further layer / 177 on the first after, 64 / 178 with the shared
    ring_push_window (+ 7 Triton launches), 11 / 119 with asyncspade's push and
    prediction in one kernel (kernels/asyncspade_predict.py; + 8 launches); with an
    lfps row on the device path too (sgl_sparse/lfps_device.py): 159 / 326 + 13
    launches (lfps alone: ~148 ops, mostly the table thresholds and candidates over
    [slots, Hkv, max_context], + 5 launches); lfps's table work in Triton kernels
    whose programs of slots without a row return at once (kernels/lfps_tables.py):
    12 / 162 + 15 launches (lfps alone: 2 ops + 7 launches); quest's and
    asyncspade's selections copied to their batch rows by one launch each
    (kernels/gather_selection.py): 4 / 158 + 17 launches; quest's and the next
    asyncspade selection written by expand_selection straight into the batch rows /
    the store (out_rows): 2 / 157 + 16 launches; the slots' queries read in place
    by the kernels (q_rows), no gather: 0 / 155 + 16; the per-forward tensors of
    all three policies in one launch (kernels/qa_forward.py): 0 / 0 + 16 / 17; the
    indexed lists mapped to pool slots for the decode (kernels/indexed_slots.py):
    0 / 0 + 17 / 18; the slots written by the lists' producers in the same pass
    (gather_selection / expand_selection / lfps_select_out): 0 / 0 + 16 / 17; lfps's
    priorities in three launches whose programs each take a chunk of a row (the
    single program a row was latency-bound) and a fourth listing C1 where it fits
    its budget (topk_range then skips those rows): 0 / 0 + 19 / 20; lfps's finish in
    two launches over chunks of a row (one program a row walked C2's gathered keys
    twice, latency-bound: 176 us a layer at 32768 x 8, session 35): 0 / 0 + 20 / 21;
    the tables' sums and central sums in one pass (each chunk's moments merged):
    0 / 0 + 19 / 20; ρ in that launch (a program of each row): 0 / 0 + 18 / 19;
    asyncspade's decode reading its selections in the store (ASPD_LISTS_IN_PLACE, no
    copy of its lists into the batch rows): 0 / 0 + 17 / 18."""
    mod = load_bench_script("kernels/count_query_device_ops.py")
    res = mod.count()
    assert res["other"].total <= 2, dict(res["other"].ops)
    assert res["first"].total <= 2, dict(res["first"].ops)
    assert sum(res["other"].launches.values()) == 17
    assert res["first"].launches["_qa_forward_kernel"] == 1 and sum(res["first"].launches.values()) == 18
    assert "_gather_selection_kernel" not in res["other"].launches
    assert "_indexed_pool_slots_kernel" not in res["other"].launches
    # no `t[idx] = scalar` (on CUDA a host->device copy that waits for the stream)
    assert res["first"].host_scalar_writes == 0 and res["other"].host_scalar_writes == 0


@pytest.mark.parametrize("policy", ["quest", "asyncspade", "lfps"])
def test_one_policy_graph_runs_that_policy_alone(policy):
    """A decode graph captured for batches whose query-aware rows are all of one policy
    (graph_variants' `qa_<policy>`: QueryAwareDevice.only) runs that policy's blocks
    alone: its rows get the torch path's selections, attention and stores, step after
    step; the other policies' stores are not touched (their rows are not in the
    batch); each layer launches that policy's kernels only."""
    pid = PolicyId[policy.upper()]
    gen = torch.Generator().manual_seed(11)
    ref, dev = Twin(2, use_kernels=False), Twin(2, use_kernels=True)
    q_ext = torch.randn(sum(LENS.values()), HKV * 2, D, generator=gen).to(KV)
    ref.admit(q_ext)
    dev.admit(q_ext)
    dev.rt.device.only = frozenset({pid})
    others = {p: [t.clone() for t in _store_tensors(dev.st.query_stores[p])]
              for p in QUERY_AWARE_IDS if p != pid}
    rows = _rows_of(dev, policy) + [7, 0]  # + a full row and a padding row
    indexed = compare_steps(ref, dev, rows, 6, gen)
    assert {r for _, r, _ in indexed} == set(_rows_of(dev, policy)) - {3}  # row 3 is covered for 8 steps
    for p, before in others.items():
        assert all(torch.equal(a, b) for a, b in zip(before, _store_tensors(dev.st.query_stores[p]))), p

    mod = load_bench_script("kernels/count_query_device_ops.py")

    def narrow(twin):
        twin.rt.device.only = frozenset({pid})

    every = mod.count_forward(rows=mod.MIXED)["other"].launches
    alone = mod.count_forward(rows=rows, prepare=narrow)["other"].launches
    assert 0 < sum(alone.values()) < sum(every.values())
    assert set(alone) <= set(every)
    mine = {"quest": {"_quest_bounds_decode_kernel", "_quest_page_scores_kernel"},
            "asyncspade": {"_asyncspade_predict_kernel", "_token_scores_kernel"},
            "lfps": {"_lfps_priority_kernel", "_lfps_finish_stats_kernel", "_lfps_finish_update_kernel"}}
    for p, kernels in mine.items():
        assert (kernels <= set(alone)) == (p == policy), (p, dict(alone))


def _store_tensors(store) -> list[torch.Tensor]:
    return [v for v in vars(store).values() if isinstance(v, torch.Tensor)]


def test_quest_extend_bounds_in_one_launch_equal_the_torch_loop():
    """With kernels, quest's rows of an extend forward are bounded in one
    quest_bounds_update launch a layer (pages of [0, n), as the torch loop rebuilds
    them row by row). Two chunks, the first after a radix-style prefix on one row,
    lengths not multiples of a page; every bound equal to the loop's, and slots of
    no row untouched."""
    gen = torch.Generator().manual_seed(11)
    stores = []
    for use_kernels in (True, False):
        twin = Twin(2, use_kernels=use_kernels, num_layers=2)
        rows = list(twin.specs)
        inits = [MODULES[s.policy if s is not None else "full"].init_row(s, [], [], (None, None))
                 for s in twin.specs.values()]
        store = twin.st.query_stores[PolicyId.QUEST]
        store.kmin.fill_(7.0)
        store.kmax.fill_(-7.0)
        # chunk 1: 37 tokens each, row 2 with 21 more before them (a prefix hit); chunk 2: the rest
        first = {r: 37 + (21 if r == 2 else 0) for r in rows}
        for lens, ext in (([first[r] for r in rows], [37] * len(rows)),
                          ([twin.lens[r] for r in rows], [twin.lens[r] - first[r] for r in rows])):
            admitted = twin.st.admit(rows, inits)
            twin.rt.plan_extend(rows, lens, ext, admitted)
            assert (twin.rt._quest_extend is not None) == use_kernels
            q = torch.randn(sum(ext), HKV * 2, D, generator=gen).to(KV)
            for li in range(2):
                twin.rt.on_extend(li, q, twin.k, twin.v, twin.r2t, SCALE)
        stores.append(store)
    kern, loop = stores
    assert torch.equal(kern.kmin, loop.kmin) and torch.equal(kern.kmax, loop.kmax)
    used = sorted({i.slot for i in twin.st._active.values() if i.policy == PolicyId.QUEST})
    assert len(used) == 3
    free = [s for s in range(kern.kmin.shape[1]) if s not in used]
    assert free and bool((kern.kmin[:, free] == 7.0).all())


def _plan_chunk(twin: Twin, specs: dict, chunk: dict, prefill_end: dict | None = None) -> list[int]:
    """Admit a chunk's rows (row -> (sequence length, queries)) and plan its extend;
    the rows' query counts, in order. prefill_end: row -> its prompt's length
    (RowInit.prefill_end; none: every chunk is taken as the last)."""
    rows = list(chunk)
    inits = [MODULES[specs[r].policy if specs[r] is not None else "full"].init_row(specs[r], [], [], (None, None))
             for r in rows]
    if prefill_end is not None:
        inits = [dataclasses.replace(i, prefill_end=prefill_end[r]) for r, i in zip(rows, inits)]
    admitted = twin.st.admit(rows, inits)
    ext = [chunk[r][1] for r in rows]
    twin.rt.plan_extend(rows, [chunk[r][0] for r in rows], ext, admitted)
    return ext


def _lfps_extend_row_by_row(rt: QueryAwareRuntime, li: int, q3: torch.Tensor, k_cache, v_cache, req_to_token,
                            scale: float, v_scale) -> None:
    """lfps's extend a row at a time, as on_extend ran it before its LfpsExtend calls:
    each row's own keys [0, n) and last s queries, init_tables on a batch of one."""
    store = rt.stores[PolicyId.LFPS]
    for e in rt.extend_rows:
        if e.policy != PolicyId.LFPS:
            continue
        locs = req_to_token[e.req_row, : e.n].long()
        knobs = lfps_knobs(e.spec)
        s = min(knobs.s, e.q_end - e.q_start)
        values = v_cache[locs][None]
        if v_scale is not None:
            values = values.float() * v_scale
        lfps_math.init_tables(q3[e.q_end - s: e.q_end][None], k_cache[locs][None], values, torch.tensor([e.n]),
                              scale, store.cfg.max_context, knobs, out=store.layer(li), rows=torch.tensor([e.slot]))
        store.tscale[li, e.slot].fill_(1.0)
        store.shift[li, e.slot, :, 0] = store.ver[li, e.slot, :, : e.n].mean(-1)
        store.shift[li, e.slot, :, 1] = store.sla[li, e.slot, :, : e.n].mean(-1)


@pytest.mark.parametrize("cap", ["default", "split", "one_row"])
@pytest.mark.parametrize("kv", [torch.float16, torch.float8_e4m3fn])
def test_lfps_extend_in_calls_equals_the_row_loop(monkeypatch, cap, kv):
    """lfps's rows of an extend forward are initialized by one init_tables call per
    knobs and s, each row's keys padded to the call's longest (LfpsExtend), in calls
    whose logits stay within LFPS_EXTEND_BYTES. Two knob sets, lengths not multiples
    of 16, prompts shorter than s (then s = the chunk's queries: a call of their own),
    a radix-style prefix and a second chunk shorter than s; the pool slots past each
    row's n hold NaN / inf, as an fp8 cache's may (the padding reads none of them).
    Every table, prior, scale and shift equal to the row-by-row loop's, no NaN, the
    slots of no row untouched."""
    monkeypatch.setattr(importlib.import_module("sgl_sparse.kernels.lfps_tables"), "STATS_POWER_SUMS", True)
    hq = HKV * 2
    a, b = LfpsPolicy(budget=12, local=6, sink=4, s=8), LfpsPolicy(budget=12, local=3, sink=2, s=6, r=0.9, a=0.3)
    caps = {"default": query_serving.LFPS_EXTEND_BYTES, "one_row": 1,
            "split": 2 * 70 * hq * 8 * 4 - 1}  # 2 rows of a's s = 8 up to n_max 70
    monkeypatch.setattr(query_serving, "LFPS_EXTEND_BYTES", caps[cap])
    specs = {1: a, 2: a, 3: a, 9: a, 10: a, 4: b, 5: b, 8: b, 6: QuestPolicy(budget=16, recent=9, sink=4), 7: None}
    # row -> (sequence length, queries) of each chunk. Row 2: 21 tokens of a prefix hit
    # before its first 37; rows 3 and 5 shorter than s, row 1's second chunk too; rows
    # 9, 8 and 10 padded in their last chunk (those of 2 and 5 are overwritten by the next)
    chunks = [{1: (70, 70), 2: (58, 37), 3: (5, 5), 4: (61, 61), 5: (3, 3), 8: (33, 33), 9: (45, 45),
               6: (37, 37), 7: (37, 37)},
              {1: (75, 5), 2: (103, 45), 10: (30, 30), 5: (12, 9), 6: (50, 13), 7: (40, 3)}]
    second = [(5, [75]), (8, [103, 30]), (6, [12])]
    expect = {  # (s, n) of each call, of each chunk
        "default": [[(8, [70, 58, 45]), (5, [5]), (6, [61, 33]), (3, [3])], second],
        "split": [[(8, [70]), (8, [58, 45]), (5, [5]), (6, [61, 33]), (3, [3])],
                  [(5, [75]), (8, [103]), (8, [30]), (6, [12])]],
        "one_row": [[(8, [70]), (8, [58]), (8, [45]), (5, [5]), (6, [61]), (6, [33]), (3, [3])],
                    [(5, [75]), (8, [103]), (8, [30]), (6, [12])]],
    }[cap]
    gen = torch.Generator().manual_seed(5)
    width = MAXCTX + 40
    k = torch.randn(12 * width + 1, HKV, D, generator=gen)
    v = torch.randn(12 * width + 1, HKV, D, generator=gen)
    # each request row its own pool slots, those past its n included (where the NaN go)
    r2t = (torch.randperm(12 * width, generator=gen) + 1).to(torch.int32).view(12, width)
    kscale, vscale = (None, None) if kv == torch.float16 else (0.5, 0.25)
    scale = SCALE * (kscale or 1.0)
    stores, plans = [], []
    for batched in (True, False):
        twin = Twin(2, use_kernels=False, specs=specs, lens={r: c[0] for r, c in chunks[0].items()},
                    store={"slots": 10}, num_layers=2)
        store = twin.st.query_stores[PolicyId.LFPS]
        assert store.shift is not None
        for t in (store.ver, store.sla, store.kbar, store.vbar, store.sigma_hat2, store.shift):
            t.fill_(7.0)
        store.tscale.fill_(3.0)
        gen = torch.Generator().manual_seed(6)
        for chunk in chunks:
            ext = _plan_chunk(twin, specs, chunk)
            if batched:
                plans.append([(c.knobs.s, c.n.tolist()) for c in twin.rt._lfps_extend])
            else:
                twin.rt._lfps_extend = []  # on_extend skips the lfps rows: the loop runs them
            # the chunk's keys written; past each row's n, anything at all
            kc, vc = k.clone(), v.clone()
            for r, (n, _) in chunk.items():
                kc[r2t[r, n:].long()] = vc[r2t[r, n:].long()] = float("nan")
                kc[r2t[r, n::3].long()] = float("inf")
            kc, vc = kc.to(kv), vc.to(kv)
            q = torch.randn(sum(ext), hq, D, generator=gen).to(KV)
            for li in range(2):
                v_scale = vscale if li == 1 else None  # layer 0's values as stored
                twin.rt.on_extend(li, q.roll(li, 0), kc, vc, r2t, scale, v_scale)
                if not batched:
                    _lfps_extend_row_by_row(twin.rt, li, q.roll(li, 0), kc, vc, r2t, scale, v_scale)
        stores.append(store)
    assert plans == expect
    got, want = stores
    fields = ("ver", "sla", "kbar", "vbar", "sigma_hat2", "tscale", "shift")
    for f in fields:
        assert not getattr(got, f).isnan().any(), f
        torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=2e-6, atol=1e-7, msg=f)
    used = sorted({twin.st.row_init(r).slot for r, s in specs.items() if s is not None and s.policy == "lfps"})
    assert len(used) == 8 and bool((got.tscale[:, used] == 1.0).all())
    free = [s for s in range(got.ver.shape[1]) if s not in used]
    assert free and all(bool((getattr(got, f)[:, free] == (3.0 if f == "tscale" else 7.0)).all()) for f in fields)


def _aspd_extend_row_by_row(rt: QueryAwareRuntime, li: int, q3: torch.Tensor, k_cache, req_to_token) -> None:
    """asyncspade's extend a row at a time, as on_extend ran it before its AspdExtend:
    a zeroed window with the chunk's last c queries at its right end, ring_load on a
    batch of one, then the slot's index copies reset and smoothed from its keys [0, n)."""
    from sgl_sparse.kernels.index_keys import channel_smoothing
    from sgl_sparse.queryaware import asyncspade as aspd

    store = rt.stores[PolicyId.ASYNCSPADE]
    for e in rt.extend_rows:
        if e.policy != PolicyId.ASYNCSPADE:
            continue
        locs = req_to_token[e.req_row, : e.n].long()
        w = store.ring.shape[2]
        c = rt._ring_take(e)
        win = q3.new_zeros((1, w, *q3.shape[1:]))
        win[0, w - c:] = q3[e.q_end - c: e.q_end]
        aspd.ring_load(store.ring[li], store.total[li], torch.tensor([e.slot]), win, torch.tensor([c]))
        with store.cache_writes(k_cache.device):
            if store.index_keys:
                store.filled[li, e.slot] = 0
            if store.ksmooth is not None:
                store.ksmooth[li, e.slot] = channel_smoothing(k_cache[locs])


@pytest.mark.parametrize("ring_window", [4, 9])
@pytest.mark.parametrize("index_keys,cap,kv", [
    ("kv", "default", torch.float16), ("int8", "default", torch.float16), ("int4", "default", torch.float16),
    ("int4", "split", torch.float16), ("int4", "one_row", torch.float16), ("int4", "split", torch.float8_e4m3fn),
])
def test_aspd_extend_in_calls_equals_the_row_loop(monkeypatch, ring_window, index_keys, cap, kv):
    """asyncspade's rows of an extend forward are initialized together (AspdExtend):
    one ring_load a layer over windows gathered from the forward's queries, the
    slots' index copies reset by one index_fill_, their smoothing (int4) over keys
    padded to the call's longest, in calls within ASPD_EXTEND_BYTES. Rings of W = 5
    and 10 (rows of other knob windows too), chunks of fewer, as many and more
    queries than W, lengths not multiples of 16, a radix-style prefix and a second
    chunk, among quest / lfps / full rows; the pool slots past each row's n hold NaN
    / inf (as an fp8 cache's may) and the chunk's queries its ring does not take are
    NaN (the windows' left pad reads none of them). Every ring, total, filled and
    smoothing equal to the row-by-row loop's, bit for bit, every other store tensor
    too, no NaN, the slots of no row untouched."""
    hq = HKV * 2
    d = 64 if index_keys == "int4" else D
    row_bytes = HKV * d * 4
    caps = {"default": query_serving.ASPD_EXTEND_BYTES, "one_row": 1, "split": 2 * 70 * row_bytes - 1}
    monkeypatch.setattr(query_serving, "ASPD_EXTEND_BYTES", caps[cap])
    specs = {1: AsyncSpadePolicy(window=3, budget=24, recent=8, sink=2),
             2: AsyncSpadePolicy(window=4, budget=40, recent=5, sink=3, ridge=0.05),
             3: AsyncSpadePolicy(window=2, budget=16, recent=4, sink=1),
             4: AsyncSpadePolicy(window=4, budget=24, recent=8, sink=2),
             5: AsyncSpadePolicy(window=1, budget=24, recent=8, sink=2),
             9: AsyncSpadePolicy(window=3, budget=24, recent=8, sink=2),
             10: AsyncSpadePolicy(window=4, budget=24, recent=8, sink=2),
             11: AsyncSpadePolicy(window=2, budget=24, recent=8, sink=2),
             6: QuestPolicy(budget=16, recent=9, sink=4), 8: LfpsPolicy(budget=12, local=6, sink=4, s=8), 7: None}
    # row -> (sequence length, queries) of each chunk. Row 2: 21 tokens of a prefix hit
    # before its first 37; rows 3 and 5 take fewer queries than either ring (5: than
    # W = 10 only), row 1's second chunk as many as W = 5; rows 10 and 11 join in the
    # second, row 11 empty (no key, no query: its smoothing 1, as channel_smoothing's)
    chunks = [{1: (70, 70), 2: (58, 37), 3: (3, 3), 4: (61, 61), 5: (7, 7), 9: (45, 45), 6: (37, 37),
               8: (33, 33), 7: (37, 37)},
              {1: (75, 5), 2: (103, 45), 10: (30, 30), 11: (0, 0), 5: (12, 5), 6: (50, 13), 8: (40, 7),
               7: (40, 3)}]
    lens_of = [[70, 61, 58, 45, 7, 3], [103, 75, 30, 12]]  # each chunk's asyncspade rows of keys, longest first
    expect = {  # the smoothing calls' row lengths, of each chunk
        "default": [[ns] for ns in lens_of],
        "one_row": [[[n] for n in ns] for ns in lens_of],
        "split": [[[70], [61, 58], [45, 7, 3]], [[103], [75], [30, 12]]],
    }[cap]
    gen = torch.Generator().manual_seed(5)
    width = MAXCTX + 40
    k = torch.randn(12 * width + 1, HKV, d, generator=gen) * 3.0
    v = torch.randn(12 * width + 1, HKV, d, generator=gen)
    r2t = (torch.randperm(12 * width, generator=gen) + 1).to(torch.int32).view(12, width)
    stores, plans, loads = [], [], []
    real_load = query_serving.aspd.ring_load

    def counted_load(*a, **kw):
        loads[-1] += 1
        return real_load(*a, **kw)

    monkeypatch.setattr(query_serving.aspd, "ring_load", counted_load)
    for batched in (True, False):
        twin = Twin(2, use_kernels=False, specs=specs, lens={r: c[0] for r, c in chunks[0].items()},
                    store={"slots": 10}, num_layers=2, index_keys=index_keys)
        old = twin.st.query_stores[PolicyId.ASYNCSPADE]
        store = AsyncSpadeStore(old.cfg, window=ring_window, num_layers=2, num_kv_heads=HKV, num_q_heads=hq,
                                head_dim=d, dtype=KV, device=torch.device("cpu"))
        twin.st.query_stores[PolicyId.ASYNCSPADE] = store  # the runtime's stores (the same dict)
        assert twin.rt.stores[PolicyId.ASYNCSPADE] is store and store.ring.shape[2] == ring_window + 1
        assert (store.ksmooth is not None) == (index_keys == "int4") and store.index_keys == (index_keys != "kv")
        for st in twin.st.query_stores.values():  # torch.empty's among them: alike in both
            for t in _store_tensors(st):
                t.zero_()
        store.ring.fill_(7.0)
        store.total.fill_(99)
        if store.index_keys:
            store.filled.fill_(5)
        if store.ksmooth is not None:
            store.ksmooth.fill_(3.0)
        gen = torch.Generator().manual_seed(6)
        for chunk in chunks:
            ext = _plan_chunk(twin, specs, chunk)
            if batched:
                a = twin.rt._aspd_extend
                plans.append([c.valid.sum(1).tolist() for c in a.smooth])
                assert all(c.n_max == c.valid.shape[1] == int(c.valid.sum(1)[0]) for c in a.smooth)
                assert (a.empty is not None and a.empty.tolist() == [twin.st.row_init(11).slot]) == (
                    11 in chunk and index_keys == "int4")
            else:
                twin.rt._aspd_extend = None  # on_extend skips the asyncspade rows: the loop runs them
            kc = k.clone()
            for r, (n, _) in chunk.items():
                kc[r2t[r, n:].long()] = float("nan")
                kc[r2t[r, n::3].long()] = float("inf")
            kc = kc.to(kv)
            q = torch.randn(sum(ext), hq, d, generator=gen).to(KV)
            # the queries no ring takes: NaN (a window reading one would carry it)
            for e in twin.rt.extend_rows:
                if e.policy == PolicyId.ASYNCSPADE:
                    q[e.q_start: e.q_end - twin.rt._ring_take(e)] = float("nan")
            for li in range(2):
                ql = q if li == 0 else -q  # each layer its own queries, NaN where layer 0's are
                loads.append(0)
                vc = v.to(kv)
                with _Watch() as w:
                    twin.rt.on_extend(li, ql, kc, vc, r2t, SCALE)
                if batched:  # every row of the forward at once; device ops only: no host value, no sync
                    assert loads[-1] == 1
                    assert w.syncs == 0 and not [f for f, _ in w.shapes if "lift_fresh" in f]
                else:
                    _aspd_extend_row_by_row(twin.rt, li, ql, kc, r2t)
                    assert loads[-1] == sum(e.policy == PolicyId.ASYNCSPADE for e in twin.rt.extend_rows)
        stores.append(twin.st.query_stores)
    assert plans == (expect if index_keys == "int4" else [[], []])
    got, want = (s[PolicyId.ASYNCSPADE] for s in stores)
    for f in ("ring", "total", "filled", "ksmooth"):
        t = getattr(got, f)
        if t is None:
            continue
        assert not t.isnan().any(), f
        assert torch.equal(t, getattr(want, f)), f
    for p in QUERY_AWARE_IDS:  # everything else written (or not) alike
        for a, b in zip(_store_tensors(stores[0][p]), _store_tensors(stores[1][p])):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), p
    used = sorted({twin.st.row_init(r).slot for r, s in specs.items() if s is not None and s.policy == "asyncspade"})
    assert len(used) == 8
    free = [s for s in range(got.ring.shape[1]) if s not in used]
    assert free and bool((got.ring[:, free] == 7.0).all()) and bool((got.total[:, free] == 99).all())
    assert bool((got.total[:, used] <= ring_window + 1).all())
    if got.index_keys:
        free_side = [s for s in range(got.filled.shape[1]) if s not in used]
        assert bool((got.filled[:, used] == 0).all()) and bool((got.filled[:, free_side] == 5).all())
    if got.ksmooth is not None:
        assert bool((got.ksmooth[:, free_side] == 3.0).all()) and not bool((got.ksmooth[:, used] == 3.0).any())
        assert bool((got.ksmooth[:, twin.st.row_init(11).slot] == 1.0).all())



# The store tensors holding a prompt's state, by policy (each [layers, slots, ...]), and
# asyncspade's query ring, which every chunk feeds
PROMPT_STATE = {PolicyId.QUEST: ("kmin", "kmax"), PolicyId.ASYNCSPADE: ("filled", "ksmooth"),
                PolicyId.LFPS: ("ver", "sla", "kbar", "vbar", "sigma_hat2", "tscale")}


@pytest.mark.parametrize("use_kernels", [True, False])
def test_prompt_state_built_at_the_prompts_last_chunk_only(use_kernels):
    """A prompt prefilled in chunks builds its stores' prompt state (quest's page
    bounds, lfps's tables, asyncspade's index copies reset and smoothing) at its last
    chunk only (RowInit.prefill_end): an earlier chunk leaves its slot as it was and
    only feeds asyncspade's query ring, whose last chunk (2 queries, fewer than W)
    takes the earlier ones from it. Beside them a prompt admitted whole is built at
    once. After the last chunk every store tensor equals that of building at every
    chunk (prefill_end 0: each chunk taken as the last, as before), bit for bit. The
    state counts the rows still waiting, and a release drops them."""
    specs = {1: SPECS[1], 3: SPECS[3], 4: SPECS[4], 6: SPECS[6], 7: None}
    lens = {1: 75, 3: 45, 4: 90, 6: 70, 7: 50}
    waiting = {1: PolicyId.QUEST, 4: PolicyId.ASYNCSPADE, 6: PolicyId.LFPS}
    chunks = [{1: (37, 37), 3: (45, 45), 4: (88, 88), 6: (37, 37), 7: (37, 37)},  # row 3 whole
              {1: (75, 38), 4: (90, 2), 6: (70, 33), 7: (50, 13)}]

    def stores(twin) -> dict[str, torch.Tensor]:
        """Every state tensor of the stores (asyncspade's: not its decode's scratch)."""
        out = {}
        for p in QUERY_AWARE_IDS:
            st = twin.st.query_stores[p]
            out.update({f"{p.name}.{i}": t.clone() for i, t in enumerate(st.tensors()) if p != PolicyId.ASYNCSPADE})
            fields = (*PROMPT_STATE[p], "ring", "total", "kq", "kscale", "sel_pos", "sel_count")
            out.update({f"{p.name}.{f}": getattr(st, f).clone() for f in fields if hasattr(st, f)})
        return out

    def run(last_only: bool):
        twin = Twin(2, use_kernels=use_kernels, specs=specs, lens=lens, index_keys="int4", num_layers=2)
        for p, fields in PROMPT_STATE.items():  # the slots' previous owners' state
            for f in fields:
                getattr(twin.st.query_stores[p], f).fill_(3)
        gen = torch.Generator().manual_seed(8)
        snaps = []
        for chunk in chunks:
            before = stores(twin)
            ext = _plan_chunk(twin, specs, chunk, lens if last_only else None)
            assert [e.last for e in twin.rt.extend_rows] == [
                not last_only or chunk[e.req_row][0] == lens[e.req_row] for e in twin.rt.extend_rows]
            q = torch.randn(sum(ext), HKV * 2, twin.d, generator=gen).to(KV)
            for li in range(2):
                twin.rt.on_extend(li, q.roll(li, 0), twin.k, twin.v, twin.r2t, SCALE)
            snaps.append((before, stores(twin), twin.st.prompts_pending()))
        return twin, snaps

    twin, got = run(True)
    _, every = run(False)
    slot = {r: twin.st.row_init(r).slot for r in (1, 3, 4, 6)}
    # the first chunk: rows 1, 4 and 6 wait (7 is full): their slots' prompt state as
    # before it; row 3's built; asyncspade's ring loaded as at every chunk
    before, after, pending = got[0]
    assert pending == 3 and every[0][2] == 0
    for r, p in waiting.items():
        for f in PROMPT_STATE[p]:
            assert torch.equal(after[f"{p.name}.{f}"][:, slot[r]], before[f"{p.name}.{f}"][:, slot[r]]), (p, f)
            assert not torch.equal(every[0][1][f"{p.name}.{f}"][:, slot[r]], before[f"{p.name}.{f}"][:, slot[r]])
    for f in PROMPT_STATE[PolicyId.QUEST]:
        assert torch.equal(after[f"QUEST.{f}"][:, slot[3]], every[0][1][f"QUEST.{f}"][:, slot[3]])
    assert torch.equal(after["ASYNCSPADE.ring"], every[0][1]["ASYNCSPADE.ring"])
    assert not torch.equal(after["ASYNCSPADE.ring"], before["ASYNCSPADE.ring"])
    # the last chunk: every store tensor as built at every chunk
    after, pending = got[1][1], got[1][2]
    assert pending == 0
    assert after.keys() == every[1][1].keys()
    for name, t in after.items():
        assert torch.equal(t, every[1][1][name]), name
    # a release drops a waiting row
    twin.st.mark_prompt_chunks([1, 6], [])
    assert twin.st.prompts_pending() == 2
    twin.st.release([1, 6])
    assert twin.st.prompts_pending() == 0
