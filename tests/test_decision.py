"""Per-step decisions of full / streaming / sadas, against hand-written expectations."""

import pytest
import torch

from sgl_sparse.config import SadasPolicy, SparseServerConfig, StreamingPolicy
from sgl_sparse.decision import plan_decode
from sgl_sparse.policies import MODULES, PolicyId, RowInit
from sgl_sparse.policies import sadas
from sgl_sparse.state import SparseState

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

THINK, END = 7, 8
IDS = (THINK, END)


def _state(rows_inits):
    st = SparseState(16, "cpu")
    st.admit([r for r, _ in rows_inits], [i for _, i in rows_inits])
    return st


def test_mixed_batch_plan():
    st = _state([
        (3, RowInit(PolicyId.FULL)),
        (5, RowInit(PolicyId.STREAMING, window=10, sink=4)),
        (1, RowInit(PolicyId.SADAS, window=6, sink=2)),
        (9, RowInit(PolicyId.STREAMING, window=100, sink=4)),  # window >= length
        (2, RowInit(PolicyId.STREAMING, window=3, sink=0)),
    ])
    rows = torch.tensor([3, 5, 1, 9, 2])
    seq = torch.tensor([50, 37, 20, 30, 12])
    plan = plan_decode(st, rows, torch.tensor([1, 2, 3, 4, 5]), seq, IDS)
    assert plan.b_end.tolist() == [50, 37, 20, 30, 12]
    assert plan.b_start.tolist() == [0, 27, 14, 0, 9]
    assert plan.a_len.tolist() == [0, 4, 2, 0, 0]
    assert plan.attended().tolist() == [50, 14, 8, 30, 3]


def test_sink_never_overlaps_window():
    st = _state([(1, RowInit(PolicyId.STREAMING, window=5, sink=4))])
    for n in range(1, 12):
        p = plan_decode(st, torch.tensor([1]), torch.tensor([0]), torch.tensor([n]), IDS)
        a, b0, b1 = int(p.a_len[0]), int(p.b_start[0]), int(p.b_end[0])
        assert a <= b0 <= b1 == n
        assert a + (b1 - b0) == min(n, 9)


def test_sadas_latch_follows_paper_equations():
    """S_t and F_t from y_{t-1}; window until the first </think>, full forever after."""
    st = _state([(4, RowInit(PolicyId.SADAS, window=3, sink=1))])
    stream = [1, THINK, 2, 3, END, 4, THINK, 5]
    expect_windowed = [True, True, True, True, False, False, False, False]
    expect_think = [False, True, True, True, False, False, True, True]
    n = 10
    for tok, win, th in zip(stream, expect_windowed, expect_think):
        p = plan_decode(st, torch.tensor([4]), torch.tensor([tok]), torch.tensor([n]), IDS)
        assert (int(p.b_start[0]) > 0) == win, tok
        assert bool(st.think[4]) == th
        n += 1
    assert bool(st.latch[4])


def test_padding_row_zero_is_inert():
    st = _state([(2, RowInit(PolicyId.SADAS, window=3))])
    before = [t.clone() for t in (st.policy, st.think, st.latch)]
    p = plan_decode(st, torch.tensor([2, 0, 0]), torch.tensor([END, END, THINK]), torch.tensor([9, 1, 1]), IDS)
    assert p.b_start.tolist() == [0, 0, 0]  # row 2 latched by END, padding dense
    assert int(st.policy[0]) == 0 and not bool(st.think[0]) and not bool(st.latch[0])
    assert torch.equal(before[0], st.policy)


def test_sadas_init_row_from_tokens():
    spec = SadasPolicy(window=4)
    r = sadas.init_row(spec, [1, 2, 3], [], IDS)
    assert (r.think, r.latch) == (False, False)  # F_0 = 0: window mode
    r = sadas.init_row(spec, [1, THINK, 2], [], IDS)
    assert (r.think, r.latch) == (True, False)
    r = sadas.init_row(spec, [1, THINK, 2, END, 3], [], IDS)  # thinking off in template
    assert (r.think, r.latch) == (False, True)
    r = sadas.init_row(spec, [1, THINK], [5, 6, END, THINK, 2], IDS)  # retracted, re-admitted
    assert (r.think, r.latch) == (True, True)


def test_each_policy_module_builds_rows():
    assert MODULES["full"].init_row(None, [], [], IDS).policy == PolicyId.FULL
    r = MODULES["streaming"].init_row(StreamingPolicy(window=9, sink=2), [], [], IDS)
    assert (r.policy, r.window, r.sink) == (PolicyId.STREAMING, 9, 2)


def test_release_tracks_active_rows():
    st = _state([(1, RowInit(PolicyId.FULL)), (2, RowInit(PolicyId.SADAS)), (3, RowInit(PolicyId.SADAS))])
    assert st.active_by_policy() == {"full": 1, "sadas": 2}
    st.release([2, 1])
    assert st.active_count() == 1
    st.release_all()
    assert st.active_count() == 0


def test_host_routing_sends_only_windowed_rows_to_the_kernel():
    """Dense-this-step rows go to the stock kernel: exact stock output, no overhead."""
    st = SparseState(16, "cpu", config=SparseServerConfig(think_start_id=THINK, think_end_id=END))
    st.admit([1, 2, 3, 4, 5], [
        RowInit(PolicyId.FULL),
        RowInit(PolicyId.STREAMING, window=10, sink=4),
        RowInit(PolicyId.STREAMING, window=100, sink=4),  # covers the sequence
        RowInit(PolicyId.SADAS, window=10, sink=4),
        RowInit(PolicyId.SADAS, window=10, sink=4, latch=True),
    ])
    st.set_step_rows([1, 2, 3, 4, 5], [50, 50, 50, 50, 50], [[], [], [], [1, 2], []])
    assert st.take_step_kernel_rows() == [0, 1, 0, 1, 0]
    assert st.take_step_kernel_rows() is None  # consumed once
    st.set_step_rows([2, 4], [14, 51], [[], [1, 2, END]])  # window+sink == n: dense; SADAS latched
    assert st.take_step_kernel_rows() == [0, 0]
    st.set_step_rows([4], [52], [[1, 2, END, 5]])
    assert st.take_step_kernel_rows() == [0]
