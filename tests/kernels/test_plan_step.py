"""kernels/plan_step.py against decision.plan_decode's tensor ops (its oracle):
the same plan and the same state updates on random mixed-policy batches."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse.decision import plan_decode
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.state import SparseState

THINK, END, VOCAB = 7, 8, 50
# Every policy: the fused plan must implement each one plan_decode knows.
KERNEL_POLICIES = list(PolicyId)
COLUMNS = tuple(c for c in ("policy", "window", "sink", "think", "latch", "budget", "t_max", "triggers",
                            "since_slow", "slot", "sel_ready", "sel_count", "saved_n", "prompt_q", "fresh",
                            "keep_prompt", "prompt_n", "refresh_phase", "max_context", "qa_steps",
                            "dense_until")
                if hasattr(SparseState(2, "cpu"), c))


def _random_state(g: torch.Generator, rows: int) -> SparseState:
    st = SparseState(rows, "cpu")
    ri = lambda lo, hi: torch.randint(lo, hi, (rows,), generator=g)  # noqa: E731
    rb = lambda: torch.rand(rows, generator=g) < 0.5  # noqa: E731
    pol = torch.tensor(KERNEL_POLICIES, dtype=torch.int8)[ri(0, len(KERNEL_POLICIES))]
    st.policy.copy_(pol)
    st.window.copy_(ri(0, 32))
    st.sink.copy_(ri(0, 8))
    st.think.copy_(rb())
    st.latch.copy_(rb())
    st.budget.copy_(ri(1, 32))
    st.t_max.copy_(ri(0, 12))
    st.triggers.copy_(rb())
    st.since_slow.copy_(ri(0, 8))
    st.slot.copy_(ri(-1, 4))
    st.sel_ready.copy_(rb())
    st.sel_count.copy_(ri(0, 70))
    st.saved_n.copy_(ri(0, 200))
    st.prompt_q.copy_(ri(0, 32))
    st.fresh.copy_(rb())
    st.keep_prompt.copy_(rb())
    st.prompt_n.copy_(ri(0, 200))
    st.refresh_phase.copy_(ri(0, 12))  # a fresh row's slow step restarts its count here
    if "max_context" in COLUMNS:  # query-aware policies' store bound and step count
        st.max_context.copy_(ri(0, 400))
        st.qa_steps.copy_(ri(0, 3))
        # min_saving's bound: from below the reach (sink + budget + window) to past n
        st.dense_until.copy_(ri(0, 220))
    for name in COLUMNS:  # row 0: CUDA-graph padding, all zero (FULL)
        getattr(st, name)[0] = 0
    st.slot[0] = -1
    table = torch.rand(VOCAB, generator=g) < 0.3
    st.set_trigger_table(table.numpy())
    return st


def _clone(st: SparseState) -> SparseState:
    out = SparseState(st.num_rows, "cpu")
    for name in COLUMNS:
        getattr(out, name).copy_(getattr(st, name))
    out.set_trigger_table(st.trigger_table_host)
    return out


@pytest.mark.parametrize("bs,hkv,seed", [(1, 1, 0), (5, 2, 1), (37, 8, 2), (200, 5, 3)])
def test_plan_step_matches_plan_decode(bs, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    rows_total = 64
    ref_state = _random_state(g, rows_total)
    # Distinct live rows, then CUDA-graph padding slots pointing at row 0.
    live = min(bs, rows_total - 1)
    rows = torch.randperm(rows_total - 1, generator=g)[:live] + 1
    rows = torch.cat([rows, torch.zeros(bs - live, dtype=torch.int64)])
    if live >= 2:  # make sure an SFI fast step on its compact slot and an SFI slow step are in
        fast, slow = int(rows[0]), int(rows[1])
        for r, since in ((fast, 0), (slow, 9)):
            for name, v in (("policy", int(PolicyId.SFI)), ("since_slow", since), ("t_max", 9), ("triggers", 0),
                            ("sel_ready", 1), ("slot", 1), ("sink", 2), ("budget", 5), ("window", 3),
                            ("sel_count", 7)):
                getattr(ref_state, name)[r] = v
    ker_state = _clone(ref_state)
    # Tokens: think markers, trigger / non-trigger ids, out-of-vocabulary ids.
    tok = torch.tensor([THINK, END, 0, VOCAB + 3])[torch.randint(0, 4, (bs,), generator=g)]
    tok = torch.where(torch.rand(bs, generator=g) < 0.5, torch.randint(0, VOCAB, (bs,), generator=g), tok)
    seq = torch.randint(1, 300, (bs,), generator=g)
    seq[:2] = 100

    ref = plan_decode(ref_state, rows, tok, seq, (THINK, END), num_kv_heads=hkv, use_kernel=False)
    got = plan_decode(ker_state, rows.int(), tok, seq.int(), (THINK, END), num_kv_heads=hkv, use_kernel=True)

    for f in ("a_len", "b_start", "b_end", "a_slot", "q_save_slot", "a_len_per_head"):
        assert torch.equal(getattr(got, f).long(), getattr(ref, f).long()), f
    for name in COLUMNS:
        assert torch.equal(getattr(ker_state, name), getattr(ref_state, name)), name
    if live >= 2:
        assert ref.a_slot[0] == 1 and ref.a_len[0] == 7 and ref.b_start[0] == 97
        assert ref.q_save_slot[1] == 1 and ref.b_start[1] == 0


def test_plan_step_without_think_ids():
    g = torch.Generator().manual_seed(4)
    ref_state = _random_state(g, 16)
    ker_state = _clone(ref_state)
    rows = torch.arange(1, 16)
    tok = torch.randint(0, VOCAB, (15,), generator=g)
    seq = torch.randint(1, 100, (15,), generator=g)
    ref = plan_decode(ref_state, rows, tok, seq, (None, None), num_kv_heads=4, use_kernel=False)
    got = plan_decode(ker_state, rows, tok, seq, (None, None), num_kv_heads=4, use_kernel=True)
    assert torch.equal(got.a_len, ref.a_len) and torch.equal(got.b_start, ref.b_start)
    for name in COLUMNS:
        assert torch.equal(getattr(ker_state, name), getattr(ref_state, name)), name
