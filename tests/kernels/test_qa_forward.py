"""kernels/qa_forward.py (the query-aware per-forward tensors in one launch) against
the torch ops it replaces (query_device.RowKnobs / SlotRows / _QuestForward /
_AspdForward, lfps_device.LfpsForward): random SparseState columns and batches,
padding rows (request row 0), rows of no query-aware policy, sequences past the
store, no plan a_slot, an empty batch, and stores present or not."""

from __future__ import annotations

import types

import pytest
import torch

from sgl_sparse.decision import DecodePlan
from sgl_sparse.policies import PolicyId
from sgl_sparse.policies import query_aware
from sgl_sparse.query_device import QueryAwareDevice

pytestmark = pytest.mark.sglang_independent

ROWS, SLOTS = 24, 5
QUEST_FIELDS = ("rpi", "n", "slot_live", "sink", "b_start", "first", "last", "slot_sel", "last_sel", "pages",
                "out_row", "k")
ASPD_FIELDS = ("slot", "push", "count_cap", "ridge", "sink", "next_b", "hi", "rpi", "budget", "src")
LFPS_FIELDS = ("row", "rpi", "n", "sink", "local", "budget", "b_start", "zero", "r", "eps", "a", "c_max")


def _device(gen, stores=("quest", "asyncspade", "lfps")) -> QueryAwareDevice:
    """A QueryAwareDevice over a state of random columns and slot-count-only stores
    (the per-forward tensors read nothing else of a store)."""
    from sgl_sparse.lfps_device import LfpsDevice

    st = types.SimpleNamespace()
    st.policy = torch.randint(0, 7, (ROWS,), generator=gen).to(torch.int8)
    for name in ("sink", "budget", "window", "qa_window"):
        setattr(st, name, torch.randint(0, 70, (ROWS,), generator=gen, dtype=torch.int32))
    st.max_context = torch.randint(40, 200, (ROWS,), generator=gen, dtype=torch.int32)
    for name in ("qa_ridge", "lfps_r", "lfps_eps", "lfps_a"):
        setattr(st, name, torch.rand(ROWS, generator=gen))
    # each policy's requests hold distinct slots (a slot belongs to one request), some none
    # other policies' rows may hold a slot of their own store (SFI's compact slots)
    st.slot = torch.randint(-1, SLOTS, (ROWS,), generator=gen, dtype=torch.int32)
    for p in (PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS):
        rows = (st.policy == int(p)).nonzero().flatten()
        perm = torch.randperm(max(SLOTS + 3, rows.numel()), generator=gen)[: rows.numel()]
        st.slot[rows] = torch.where(perm < SLOTS, perm, -1).to(torch.int32)
    st.policy[0], st.slot[0] = 0, -1  # the padding row: full, no slot
    cfg = types.SimpleNamespace(slots=SLOTS, candidates=37, max_context=160, capacity=80)
    st.query_stores = {}
    if "quest" in stores:
        st.query_stores[PolicyId.QUEST] = types.SimpleNamespace(cfg=cfg, max_pages=10)
    if "asyncspade" in stores:
        st.query_stores[PolicyId.ASYNCSPADE] = types.SimpleNamespace(
            cfg=cfg, scratch_slot=SLOTS, ring=torch.empty(1, SLOTS + 1, 4, 2, 16), rows=SLOTS + 1,
            topk_layers=3)  # the group Top-K's tiled rows (_AspdGroupRows) built by both paths
    dev = QueryAwareDevice.__new__(QueryAwareDevice)  # the per-forward state only
    dev.state, dev.cap = st, 80
    dev.quest = st.query_stores.get(PolicyId.QUEST)
    dev.aspd = st.query_stores.get(PolicyId.ASYNCSPADE)
    dev.lfps = LfpsDevice(types.SimpleNamespace(cfg=cfg)) if "lfps" in stores else None
    dev._side_pending, dev._plan, dev.only = False, None, None
    return dev


def _batch(gen, bs: int, with_a_slot: bool = True):
    # distinct request rows, padding (row 0) repeated at the end
    real = torch.randperm(ROWS - 1, generator=gen)[: bs - min(2, bs // 3)] + 1
    rpi = torch.cat([real, torch.zeros(bs - real.numel(), dtype=torch.long)])
    seq = torch.randint(1, 220, (bs,), generator=gen, dtype=torch.int32)
    b_start = torch.randint(0, 150, (bs,), generator=gen, dtype=torch.int32)
    a_slot = None
    if with_a_slot:
        a_slot = torch.where(torch.rand(bs, generator=gen) < 0.7, query_aware.INDEXED, -1).to(torch.int32)
    plan = DecodePlan(a_len=torch.zeros(bs, dtype=torch.int32), b_start=b_start, b_end=seq.clone(), a_slot=a_slot)
    return plan, rpi, seq


def _same(a, b, name):
    a = a.squeeze(-1) if a.dim() == 2 else a
    b = b.squeeze(-1) if b.dim() == 2 else b
    if a.is_floating_point() or b.is_floating_point():
        assert torch.equal(a.float(), b.float()), name
    else:
        assert torch.equal(a.long(), b.long()), (name, a, b)


def _compare(dev, plan, rpi, seq):
    dev._fwd_quest = dev._fwd_aspd = dev._fwd_lfps = None
    dev._on = {}
    dev._forward_torch(plan, rpi, seq)
    ref = {"quest": dev._fwd_quest, "asyncspade": dev._fwd_aspd, "lfps": dev._fwd_lfps}
    ref_on = dict(dev._on)
    dev._fwd_quest = dev._fwd_aspd = dev._fwd_lfps = None
    dev._on = {}
    dev._forward_fused(plan, rpi, seq)
    got = {"quest": dev._fwd_quest, "asyncspade": dev._fwd_aspd, "lfps": dev._fwd_lfps}
    assert dev._on.keys() == ref_on.keys()
    for key, fields in (("quest", QUEST_FIELDS), ("asyncspade", ASPD_FIELDS), ("lfps", LFPS_FIELDS)):
        r, g = ref[key], got[key]
        assert (r is None) == (g is None), key
        if r is None:
            continue
        for name in fields:
            if name == "k":
                assert r.k == g.k
            else:
                _same(g.src if name == "src" else getattr(g, name), getattr(r, name), f"{key}.{name}")
        # the slot -> row map the per-layer kernels read, and the flag's source
        _same(g.sr.b_any, r.sr.b_any, f"{key}.b_any")
        _same(g.sr.b, r.sr.b, f"{key}.b")
        _same(g.valid, r.sr.valid, f"{key}.valid")
        if key == "asyncspade":  # the group Top-K's rows, tiled from the fields above
            for name in ("sink", "hi", "budget", "next_b", "push"):
                _same(g.group.__dict__[name], r.group.__dict__[name], f"{key}.group.{name}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bs", [0, 1, 2, 3, 8, 19])
def test_fields_match_the_torch_ops(seed, bs):
    gen = torch.Generator().manual_seed(seed)
    dev = _device(gen)
    for with_a_slot in (True, False):
        plan, rpi, seq = _batch(gen, bs, with_a_slot)
        _compare(dev, plan, rpi, seq)


@pytest.mark.parametrize("stores", [("quest",), ("asyncspade",), ("lfps",), ("quest", "lfps")])
def test_some_stores(stores):
    gen = torch.Generator().manual_seed(11)
    dev = _device(gen, stores)
    plan, rpi, seq = _batch(gen, 8)
    _compare(dev, plan, rpi, seq)


def test_batch_larger_than_a_block(monkeypatch):
    # the row scan over several blocks (a block caps at MAX_BLOCK_B rows)
    import sgl_sparse.kernels.qa_forward as qf

    monkeypatch.setattr(qf, "MAX_BLOCK_B", 4)
    gen = torch.Generator().manual_seed(3)
    dev = _device(gen)
    for bs in (5, 13, 21):
        plan, rpi, seq = _batch(gen, bs)
        _compare(dev, plan, rpi, seq)
