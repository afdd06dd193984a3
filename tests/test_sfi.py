"""SFI's decode pipeline on CPU, without a server: the slow/fast trigger (device and
host replay), the refresh after a slow step, and the fast step's attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sgl_sparse import reference
from sgl_sparse.compact import CompactStore
from sgl_sparse.config import SfiPolicy, SparseServerConfig
from sgl_sparse.decision import plan_decode
from sgl_sparse.policies import sfi
from sgl_sparse.selector import core
from sgl_sparse.selector.refresh import refresh, window_logits_torch
from sgl_sparse.state import SparseState

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

DOT = 9  # a sentence-ending id in these tests
VOCAB = 32


def _table():
    t = np.zeros(VOCAB, dtype=bool)
    t[DOT] = True
    return t


def _state(rows, specs, slots=4, **compact):
    cfg = SparseServerConfig.model_validate({"compact": {"slots": slots, **compact}})
    st = SparseState(8, "cpu", cfg)
    st.set_trigger_table(_table())
    inits = [sfi.init_row(s, [], [], (None, None)) for s in specs]
    st.admit(rows, inits)
    return st


def test_trigger_fires_on_exactly_the_expected_steps():
    """Slow: first step, after a sentence end, and after t_max fast steps in a row."""
    spec = SfiPolicy(t_max=3)
    st = _state([1], [spec])
    stream = [5, 6, DOT, 7, 8, 1, 2, 3, 4, DOT, DOT, 5]
    expect = [1, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0]  # step t reads y_{t-1} = stream[t]
    got = []
    for t, tok in enumerate(stream):
        plan = plan_decode(st, torch.tensor([1]), torch.tensor([tok]), torch.tensor([100 + t]), (None, None))
        got.append(int(plan.q_save_slot[0] >= 0))
    assert got == expect
    # The host replays the same rule from the generated ids, with the overlap
    # scheduler's lag: at step k it knows ids up to k - 1.
    m = sfi.HostMirror(st.row_init(1), base=0)
    host = []
    for k in range(len(stream)):
        host += [int(s) for s, _ in m.advance(stream[:k], _table())]
        m.launched_lens.append(100 + k)
    host += [int(s) for s, _ in m.advance(stream, _table())]
    assert host == expect


def test_triggers_off_pins_the_slow_ratio():
    st = _state([2], [SfiPolicy(t_max=31, sentence_triggers=False)])
    slow = 0
    for t in range(320):
        plan = plan_decode(st, torch.tensor([2]), torch.tensor([DOT]), torch.tensor([50 + t]), (None, None))
        slow += int(plan.q_save_slot[0] >= 0)
    assert slow == 10  # 1/32


@pytest.mark.parametrize("groups", [1, 4, 7, 100])
def test_refresh_groups_spread_the_budget_refreshes_of_a_batch(groups):
    """refresh_groups: 14 requests admitted in one batch (t_max 7, triggers off)
    refresh one group per step after their common first step (groups 1: all 14
    together every 8 steps; more groups than t_max act as t_max); no request ever
    goes more than t_max fast steps without a slow one, and the host's replay
    agrees with the device row by row."""
    n, t_max, steps = 14, 7, 64
    rows = list(range(1, n + 1))
    spec = SfiPolicy(t_max=t_max, sentence_triggers=False, refresh_groups=groups)
    cfg = SparseServerConfig.model_validate({"compact": {"slots": n}})
    st = SparseState(n + 1, "cpu", cfg)
    st.set_trigger_table(_table())
    st.admit(rows, [sfi.init_row(spec, [], [], (None, None)) for _ in rows])
    slow = np.zeros((steps, n), dtype=bool)
    for t in range(steps):
        plan = plan_decode(st, torch.tensor(rows), torch.full((n,), 5), torch.full((n,), 100 + t), (None, None))
        slow[t] = (plan.q_save_slot >= 0).numpy()
    assert slow[0].all()  # every request's first decode step is slow
    g = min(groups, t_max)
    per_step = slow[1:].sum(axis=1)
    assert per_step.max() == -(-n // g)
    assert len({t % (t_max + 1) for t in np.flatnonzero(per_step) + 1}) == g  # g refresh steps a period
    phases = sorted(int(st.refresh_phase[r]) for r in rows)
    assert phases == sorted((i % g) * (t_max + 1) // g for i in range(n)) and max(phases) < t_max
    for j, r in enumerate(rows):
        at = np.flatnonzero(slow[:, j])
        assert np.diff(at).max() <= t_max + 1  # the refresh budget holds
        m = sfi.HostMirror(st.row_init(r), base=0)
        m.launched_lens.extend([100 + t for t in range(steps)])
        host = [s for s, _ in m.advance([5] * steps, _table())]
        assert host == slow[:, j].tolist()
    # Over a long generation the slow ratio stays 1 / (t_max + 1): the phase only
    # shortens the first interval.
    assert slow[8:].sum() == pytest.approx(n * (steps - 8) / (t_max + 1), abs=n)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_host_knows_ahead_which_pinned_steps_are_slow(lag):
    """HostMirror.next_step: without triggers the slowness of the step about to
    launch -- with `lag` launched steps not yet evaluated (SGLang's overlap
    scheduler: 1) -- is the device's, exactly; with triggers every step may be slow."""
    t_max, steps = 5, 40
    for groups in (1, 3):
        spec = SfiPolicy(t_max=t_max, sentence_triggers=False, refresh_groups=groups)
        cfg = SparseServerConfig.model_validate({"compact": {"slots": 3}})
        st = SparseState(4, "cpu", cfg)
        st.set_trigger_table(_table())
        st.admit([1, 2, 3], [sfi.init_row(spec, [], [], (None, None)) for _ in range(3)])
        device = [[bool(x) for x in (plan_decode(st, torch.tensor([1, 2, 3]), torch.full((3,), 5),
                                                 torch.full((3,), 100 + t), (None, None)).q_save_slot >= 0)]
                  for t in range(steps)]
        for j, r in enumerate((1, 2, 3)):
            m = sfi.HostMirror(st.row_init(r), base=0)
            for t in range(steps):
                m.advance([5] * max(0, t - lag), _table())  # ids of the steps before t - lag known
                may, surely = m.next_step()
                assert surely == may == device[t][j], (groups, r, t)
                m.launched_lens.append(100 + t)
    m = sfi.HostMirror(sfi.init_row(SfiPolicy(t_max=t_max), [], [], (None, None)), base=0)
    m.advance([], _table())
    assert m.next_step() == (True, True)  # the first step: slow either way
    m.launched_lens.append(100)
    m.advance([5], _table())
    assert m.next_step() == (True, False)  # sentence triggers: may be, not surely


def test_step_balance_asks_for_balanced_splits_when_a_slow_step_may_sit_among_fast_ones():
    """SparseState.step_balance: a kernel-only step holding an SFI row that may be slow
    beside rows that surely are not (pinned refresh groups, sentence triggers, a
    window row) balances; every row fast, every row slow (one refresh group's
    aligned step) or a single kernel row does not."""
    t_max = 3
    cfg = SparseServerConfig.model_validate({"compact": {"slots": 4}})

    def run(specs, steps, extra=()):
        st = SparseState(6, "cpu", cfg)
        st.set_trigger_table(_table())
        rows = list(range(1, len(specs) + 1))
        st.admit(rows, [sfi.init_row(s, [], [], (None, None)) for s in specs])
        for r, init in extra:
            st.admit([r], [init])
            rows.append(r)
        out, toks = [], [[] for _ in rows]
        for t in range(steps):
            st.set_step_rows(rows, [9000 + t] * len(rows), toks)
            out.append(st.step_balance())
            dense_keys.append(st.step_dense_keys())
            toks = [tk + [5] for tk in toks]  # the step's id arrives before the next
        return out

    dense_keys: list[int] = []

    pinned = SfiPolicy(t_max=t_max, sentence_triggers=False, budget=8, recent=8, sink=2, refresh_groups=1)
    # one group: every row slow together (step 0, then every t_max + 1): never mixed;
    # those steps' keys (step_dense_keys) are the rows' lengths, 0 on the others
    assert run([pinned] * 3, 12) == [False] * 12
    slow_steps = [t for t, k in enumerate(dense_keys) if k]
    assert slow_steps and slow_steps[0] == 0 and len(slow_steps) < 12
    assert all(dense_keys[t] == 3 * (9000 + t) for t in slow_steps)
    dense_keys.clear()
    # two groups: a group's slow step beside the other group's fast ones
    grouped = pinned.model_copy(update={"refresh_groups": 2})
    got = run([grouped] * 4, 12)
    assert got[0] is False and any(got[1:]) and not all(got[1:])
    # sentence triggers: any step may be slow (until t_max makes every row surely slow)
    natural = SfiPolicy(t_max=31, budget=8, recent=8, sink=2)
    dense_keys.clear()
    assert run([natural] * 2, 6)[1:] == [True] * 5
    assert dense_keys[0] == 2 * 9000 and not any(dense_keys[1:])  # the first step surely slow, then may be
    dense_keys.clear()
    assert run([natural], 6) == [False] * 6  # one kernel row: nothing to balance
    assert not any(dense_keys)
    from sgl_sparse.policies import streaming
    from sgl_sparse.config import StreamingPolicy
    window = streaming.init_row(StreamingPolicy(window=16, sink=2), [], [], (None, None))
    # every pinned row slow at step 0 but a window row beside them: balanced
    dense_keys.clear()
    assert run([pinned] * 2, 2, extra=[(5, window)])[0] is True
    assert dense_keys[0] == 0  # not every kernel row dense


def test_a_later_extend_chunk_keeps_its_refresh_phase():
    spec = SfiPolicy(t_max=5, refresh_groups=3)
    st = _state([1, 2, 3], [spec, spec, SfiPolicy(t_max=5, refresh_groups=1)])  # one group: no phase
    assert [int(st.refresh_phase[r]) for r in (1, 2, 3)] == [0, 2, 0]
    st.admit([2], [sfi.init_row(spec, [], [], (None, None))])  # its next chunk
    assert int(st.refresh_phase[2]) == 2 and st.row_init(2).refresh_phase == 2
    st.release([2])
    st.admit([2], [sfi.init_row(spec, [], [], (None, None))])  # a new request
    assert int(st.refresh_phase[2]) == 4


def test_selector_knobs_gathered_from_the_state_equal_the_specs():
    """The refresh reads each row's knobs from SparseState.sfi_knobs (written at
    admission): the same float32 values as from_specs, rows repeated per layer, each
    knob's tensor 16-byte aligned whatever the row count (one Triton variant)."""
    g = torch.Generator().manual_seed(5)
    specs = [SfiPolicy(beta=float(torch.rand(1, generator=g)) + 0.1, alpha=float(torch.rand(1, generator=g)) * 3,
                       kappa=1.5 + i, zeta=0.25 * i, clip=0.01 * (i + 1), nms_gamma=0.3, nms_radius=i * 3,
                       excl_eta=0.1 * i, excl_tau=2.0, eps=1e-9) for i in range(3)]
    st = _state([2, 5, 7], specs)
    st.admit([4], [sfi.init_row(SfiPolicy(), [], [], (None, None))])
    rows, layers = [7, 2, 4, 5], 3
    from_table = core.SelectorKnobs.from_table(st.sfi_knobs, torch.tensor(rows * layers), 6)
    chosen = [specs[2], specs[0], SfiPolicy(), specs[1]]
    from_specs = core.SelectorKnobs.from_specs(chosen * layers, "cpu", torch.float32)
    assert from_table.nms_radius_max == 6
    for name in core.KNOB_NAMES:
        a, b = getattr(from_table, name), getattr(from_specs, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for m in (1, 5, 12):
        knobs = core.SelectorKnobs.from_table(st.sfi_knobs, torch.tensor([2] * m), 0)
        assert all(getattr(knobs, f).data_ptr() % 16 == 0 for f in core.KNOB_NAMES)


def _pool(rows_lens, hkv, d, gen):
    total = sum(n for _, n in rows_lens) + 3
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    r2t = torch.zeros(8, 256, dtype=torch.int32)
    perm = torch.randperm(total, generator=gen)
    off = 0
    for r, n in rows_lens:
        r2t[r, :n] = perm[off: off + n].int()
        off += n
    return k, v, r2t


@pytest.mark.parametrize("group,selections", [(1, "packed"), (4, "packed"), (4, "slot_lists")])
def test_slow_step_refresh_then_fast_step_attention(group, selections):
    """Slow step (dense) -> Selector + pack -> the fast step attends exactly
    sink + Top-K of the refined scores + recent, per KV head; segment A packed, or
    as the rows' pool slots read in place (`compact.selections`)."""
    gen = torch.Generator().manual_seed(group)
    hkv, d, layers = 2, 16, 2
    rows_lens = [(1, 120), (3, 77), (5, 40)]
    specs = [SfiPolicy(budget=10, recent=8, sink=2, w_prefill=4),
             SfiPolicy(budget=6, recent=5, sink=0, nms_radius=1, w_prefill=4),
             SfiPolicy(budget=64, recent=8, sink=4, w_prefill=4)]  # covers: stays dense
    st = _state([r for r, _ in rows_lens], specs, capacity=70)
    k, v, r2t = _pool(rows_lens, hkv, d, gen)
    st.compact = CompactStore(slots=4, capacity=70, num_layers=layers, num_kv_heads=hkv,
                              num_q_heads=hkv * group, head_dim=d, dtype=torch.float32,
                              pool_size=k.shape[0], prompt_queries=3, device=torch.device("cpu"),
                              selections=selections)
    for layer in range(layers):
        st.compact.knorm[layer] = k.norm(dim=-1) * (1 + layer)
    store = st.compact
    rows = torch.tensor([r for r, _ in rows_lens])
    lens = torch.tensor([n for _, n in rows_lens])
    # Prompt queries saved at prefill for request 0 (2 of them) -> w = 3 there.
    st.prompt_q[1] = 2
    store.q_prompt[:, int(st.slot[1]), :2] = torch.randn(layers, 2, hkv * group, d, generator=gen)

    plan = plan_decode(st, rows, torch.tensor([1, 1, 1]), lens, (None, None), num_kv_heads=hkv)
    assert plan.q_save_slot.tolist() == st.slot[rows].tolist()  # first step: slow
    assert plan.attended().tolist() == lens.tolist()  # slow = dense
    q = torch.randn(layers, 3, hkv * group, d, generator=gen)
    for layer in range(layers):
        store.q[layer, plan.q_save_slot.long()] = q[layer]
    refresh(st, [1, 3], int(lens.max()), lambda i: k, lambda i: v, r2t, 1 / math.sqrt(d))
    assert st.sel_ready[[1, 3]].all() and not st.sel_ready[5]
    # sink + min(budget, |A|)
    assert st.sel_count[[1, 3]].tolist() == [2 + 10, 0 + 6]

    # Fast step one token later.
    lens2 = lens + 1
    plan2 = plan_decode(st, rows, torch.tensor([1, 1, 1]), lens2, (None, None), num_kv_heads=hkv)
    assert (plan2.q_save_slot < 0).all()
    assert plan2.a_slot[:2].tolist() == st.slot[[1, 3]].tolist() and plan2.a_slot[2] == -1
    assert plan2.attended().tolist() == [12 + 8, 6 + 5, 41]
    for layer in range(layers):
        qf = torch.randn(3, hkv * group, d, generator=gen)
        out = torch.full_like(qf, float("nan"))
        segment_a = (dict(compact_lists=store.lists[layer]) if store.slot_lists
                     else dict(compact_k=store.k[layer], compact_v=store.v[layer]))
        reference.decode_attention(qf, out, k, v, r2t, rows, plan2, 1 / math.sqrt(d), group > 1, **segment_a)
        for b, ((r, n), spec) in enumerate(zip(rows_lens, specs)):
            n2 = n + 1
            if b == 2:  # budget covers the sequence: dense
                keep = [list(range(n2))] * hkv
            else:
                lo, hi = spec.sink, n - spec.recent
                w = 3 if b == 0 else 1
                qwin = torch.cat([q[layer, b, None], store.q_prompt[layer, int(st.slot[r]), : w - 1]])[None]
                qpos = torch.tensor([[n - 1 - i for i in range(w)]])
                logits = window_logits_torch(qwin.double(), k.double(), r2t[r, None, :n].long(), qpos,
                                             1 / math.sqrt(d))
                knobs = core.SelectorKnobs.from_specs([spec], "cpu", torch.float64)
                s = core.refined_scores(logits, (k.norm(dim=-1) * (1 + layer))[r2t[r, :n].long()].T[None].double(),
                                        torch.tensor([lo]), torch.tensor([hi]), torch.ones(1, w, dtype=torch.bool), knobs)
                top = s[0].topk(spec.budget, dim=-1).indices
                keep = [sorted(range(spec.sink)) + sorted(top[h].tolist()) + list(range(n2 - spec.recent, n2))
                        for h in range(hkv)]
            for h in range(hkv):
                slots_ = r2t[r, keep[h]].long()
                qh = qf[b, h * group:(h + 1) * group]
                att = torch.softmax(qh @ k[slots_, h].T / math.sqrt(d), -1) @ v[slots_, h]
                torch.testing.assert_close(out[b, h * group:(h + 1) * group], att, rtol=1e-4, atol=1e-5)


def test_budget_covering_the_sequence_is_exactly_dense():
    st = _state([1, 2], [SfiPolicy(budget=100, recent=10, sink=4), SfiPolicy()])
    for t in range(5):
        plan = plan_decode(st, torch.tensor([1, 2]), torch.tensor([3, 3]), torch.tensor([114, 900]),
                           (None, None), num_kv_heads=2)
        assert int(plan.a_len[0]) == 0 and int(plan.b_start[0]) == 0 and int(plan.b_end[0]) == 114


def test_no_free_compact_slot_is_served_dense_and_slots_are_recycled():
    st = _state([1, 2], [SfiPolicy(budget=4, recent=2), SfiPolicy(budget=4, recent=2)], slots=1)
    assert st.slot[[1, 2]].tolist() == [0, -1]
    assert st.compact_slots_in_use() == 1
    st.release([1])
    assert st.compact_slots_in_use() == 0
    st.admit([3], [sfi.init_row(SfiPolicy(), [], [], (None, None))])
    assert int(st.slot[3]) == 0


def test_host_accounting_and_refresh_queue():
    """set_step_rows: routing, slow-step counts, and which rows need the Selector."""
    st = _state([1], [SfiPolicy(budget=8, recent=4, sink=2, t_max=2)])
    toks: list[int] = []
    routes, refreshes = [], []
    for k in range(7):
        st.set_step_rows([1], [100 + k], [list(toks)])
        routes.append(st.take_step_kernel_rows()[0])
        refreshes.append(sorted(st.take_refresh()[0]))
        toks.append(DOT if k == 2 else 5)  # step k's input id, known after step k launched
    assert routes == [1] * 7
    # Slow: step 0 (first), step 2 (reads DOT), step 5 (t_max fast steps before it);
    # the host learns each one step after launching it, in time for the next step.
    assert refreshes == [[], [1], [], [1], [], [], [1]]
    stats = st.request_stats(1)
    assert stats["policy"] == "sfi" and stats["decode_steps"] == 6
    assert stats["slow_step_ratio"] == pytest.approx(3 / 6)


@pytest.mark.parametrize("min_saving, until", [(0.0, 14), (0.5, 28), (0.6, 35)])
def test_min_saving_keeps_a_request_dense_until_a_sparse_step_pays(min_saving, until):
    """Up to dense_until (sink + budget + recent over 1 - min_saving) an SFI request is
    routed to the stock kernel and runs no Selector, its steps counted dense; past it
    the next slow step queues a refresh and the request takes the sparse kernel."""
    spec = SfiPolicy(budget=8, recent=4, sink=2, t_max=2, sentence_triggers=False, min_saving=min_saving)
    assert sfi.init_row(spec, [], [], (None, None)).dense_until == until
    st = _state([1], [spec])
    toks: list[int] = []
    routes, refreshes, lens = [], [], []
    for k in range(12):
        n = 24 + k
        st.set_step_rows([1], [n], [list(toks)])
        routes.append(st.take_step_kernel_rows()[0])
        refreshes.append(sorted(st.take_refresh()[0]))
        lens.append(n)
        toks.append(5)
    # 2 = the stock kernel attends (and ours only records); 1 = our kernel
    assert routes == [2 if n <= until else 1 for n in lens]
    # slow steps 0, 3, 6, 9 (t_max 2, no triggers), each known to the host a step
    # later: a refresh follows those longer than dense_until
    assert refreshes == [[1] if k - 1 in (0, 3, 6, 9) and lens[k - 1] > until else [] for k in range(12)]
    assert st.request_stats(1)["slow_step_ratio"] == pytest.approx(4 / 11)


@pytest.mark.parametrize("keep,use_kernels", [(False, False), (True, False), (True, True)])
def test_prompt_evidence_every_keeps_the_prompt_queries_at_later_slow_steps(keep, use_kernels):
    """prompt_evidence "every" [ours]: a later slow step's Selector window is its own
    query plus the prompt's saved queries at their prompt positions (and the host
    never marks the row as a one-query refresh); "first" (ALGORITHMS.md) drops them."""
    gen = torch.Generator().manual_seed(7 + keep)
    hkv, d, layers, r, n0 = 2, 16, 1, 1, 90
    spec = SfiPolicy(budget=12, recent=6, sink=2, w_prefill=4, prompt_evidence="every" if keep else "first")
    st = _state([r], [spec], capacity=20)
    k, v, r2t = _pool([(r, n0 + 12)], hkv, d, gen)
    st.compact = CompactStore(slots=4, capacity=20, num_layers=layers, num_kv_heads=hkv, num_q_heads=hkv * 2,
                              head_dim=d, dtype=torch.float32, pool_size=k.shape[0], prompt_queries=3,
                              device=torch.device("cpu"))
    store, slot = st.compact, int(st.slot[r])
    store.knorm[0] = k.norm(dim=-1)
    st.prompt_q[r] = 3
    store.q_prompt[:, slot, :3] = torch.randn(layers, 3, hkv * 2, d, generator=gen)
    rows = torch.tensor([r])
    # step 0: first (slow); step 10 reads DOT: slow again, with prompt-to-now keys in A
    toks = [5] * 10 + [DOT]
    for t, tok in enumerate(toks):
        plan = plan_decode(st, rows, torch.tensor([tok if t else 1]), torch.tensor([n0 + t]), (None, None),
                           num_kv_heads=hkv)
        if plan.q_save_slot[0] >= 0:
            store.q[0, slot] = torch.randn(hkv * 2, d, generator=gen)
            refresh(st, [r], n0 + t, lambda i: k, lambda i: v, r2t, 1 / math.sqrt(d), use_kernels=use_kernels,
                    later=() if t == 0 or keep else [r])
    n = n0 + 10  # the later slow step's length
    assert int(st.prompt_n[r]) == n0 and int(st.saved_n[r]) == n
    assert int(st.prompt_q[r]) == (3 if keep else 0)
    w = 4 if keep else 1
    qwin = torch.cat([store.q[0, slot, None], store.q_prompt[0, slot, : w - 1]])[None]
    qpos = torch.tensor([[n - 1] + [n0 - 1 - i for i in range(1, w)]])
    logits = window_logits_torch(qwin.double(), k.double(), r2t[r, None, :n].long(), qpos, 1 / math.sqrt(d))
    knobs = core.SelectorKnobs.from_specs([spec], "cpu", torch.float64)
    s = core.refined_scores(logits, k.norm(dim=-1)[r2t[r, :n].long()].T[None].double(),
                            torch.tensor([spec.sink]), torch.tensor([n - spec.recent]),
                            torch.ones(1, w, dtype=torch.bool), knobs)
    top = s[0].topk(spec.budget, dim=-1).indices
    for h in range(hkv):
        want = list(range(spec.sink)) + sorted(top[h].tolist())
        got = store.k[0, slot, h, : len(want)]
        torch.testing.assert_close(got, k[r2t[r, want].long(), h])
    # The host's replay: with "every" a later slow step is never a one-query refresh.
    m = sfi.HostMirror(st.row_init(r), base=0)
    for j in range(len(toks)):
        m.launched_lens.append(n0 + j)
    m.advance([1] + toks[1:] + [5], _table())
    assert m.refresh_n == n and m.refresh_later == (not keep)


def test_refresh_bound_is_rounded_to_16_within_its_limits():
    """selector.refresh._padded_bound: one Triton class for every refresh (the kernel
    path's selections match the float64 formulas at unrounded lengths: above)."""
    from sgl_sparse.selector.refresh import _padded_bound

    assert _padded_bound(32769, 140000, None) == 32784
    assert _padded_bound(32769, 140000, 32770) == 32770  # no further than the stored logits
    assert _padded_bound(97, 96, None) == 96  # nor the req_to_token row
    assert _padded_bound(64, 96, None) == 64 and _padded_bound(1, 96, None) == 16
