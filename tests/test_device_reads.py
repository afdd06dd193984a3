"""Metric values from the device observed without a synchronize and without waiting
for later work (sgl_sparse/device_reads.py): lfps's scored fraction, read when its
requests are released (lfps_scored.ScoredFractionReads), and the
Selector's refresh duration (metrics.time_selector).

In a subprocess (the real SchedulerMetrics registers its series in the process's
default Prometheus registry, once). On CUDA the forward stream is still busy at the
release -- as under SGLang's overlap scheduler, which releases finished requests while
the next forward runs -- and adds to a released slot after its busy stretch: the read
must be ordered after that add (on the forward stream, not the releasing one), must
not block the host, and must be observed without another forward. A timed refresh is
observed once its work has run, with no later refresh."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.sglang_independent

SNIPPET = r"""
import json, sys, time
import torch
from prometheus_client import REGISTRY
from sgl_sparse.config import SparseServerConfig
from sgl_sparse.metrics import SchedulerMetrics
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.lfps_scored import ScoredFractionReads
from sgl_sparse.query_store import LfpsStore
from sgl_sparse.state import SparseState

dev = torch.device(sys.argv[1])
cfg = SparseServerConfig.model_validate(
    {"query_aware": {"lfps": {"slots": 4, "max_context": 64, "capacity": 16, "candidates": 64}}})
st = SparseState(8, dev, cfg)
store = LfpsStore(cfg.query_aware.lfps, num_layers=1, num_kv_heads=2, num_q_heads=4, head_dim=16, device=dev)
st.query_stores[PolicyId.LFPS] = store
st.metrics = SchedulerMetrics("m")
rt = ScoredFractionReads(st)  # as the backend holds it
rt.warm()  # as the backend's start-up does (CUDA): the timed read below is a steady-state one
# per slot and KV head: (|C1| scored, positions past the sinks), summed over steps
store.scored[1] = torch.tensor([[3.0, 100.0], [1.0, 100.0]], dtype=torch.float64)  # 4 / 200
store.scored[2] = torch.tensor([[0.0, 50.0], [0.0, 50.0]], dtype=torch.float64)  # 0 / 100
store.scored[3] = torch.tensor([[9.0, 9.0], [9.0, 9.0]], dtype=torch.float64)  # not released
out = {}

def sample(name):
    return REGISTRY.get_sample_value("sglang_sparse_lfps_scored_fraction_" + name, {"model_name": "m"})

forward = torch.cuda.Stream() if dev.type == "cuda" else None
if forward is not None:
    # Everything the busy stretch launches is made and run once before it: a pageable
    # host-to-device copy, or a kernel's first launch (CUDA's lazy module loading),
    # inside it would make the host wait for the sleep, and the release would then
    # find the forward done (session 35: the count observed at the release, twice).
    add = torch.tensor([6.0, 0.0], dtype=torch.float64, device=dev)
    store.scored[1, 0].clone().add_(add)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        rt.note_forward(False)  # a forward begins on its own stream
        torch.cuda._sleep(400_000_000)  # still running at the release (~0.2 s)
        store.scored[1, 0] += add  # its last step's add
t0 = time.perf_counter()
rt.read([1, 2])  # the release, from the scheduler's (default) stream
out["host_s"] = time.perf_counter() - t0
out["count_at_release"] = sample("count")
if forward is not None:
    out["observed"] = rt.wait_idle(30)
out["count"], out["sum"] = sample("count"), sample("sum")
out["left"] = store.scored.sum((1, 2)).tolist()

# The Selector's refresh duration: ~0.1 s of device work inside the timed block
def refresh_sample(name):
    return REGISTRY.get_sample_value("sglang_sparse_selector_refresh_duration_seconds_" + name, {"model_name": "m"})

with st.metrics.time_selector(dev, rows=3):
    if forward is not None:
        torch.cuda._sleep(200_000_000)
    else:
        time.sleep(0.1)
# the histogram's child for "m" exists from its first observation on: None before it
out["refresh_count_at_exit"] = refresh_sample("count") or 0.0
if forward is not None:
    out["refresh_observed"] = st.metrics._selector_reads.wait_idle(30)
out["refresh_count"], out["refresh_s"] = refresh_sample("count"), refresh_sample("sum")
print(json.dumps(out))
"""


def _run(device: str) -> dict:
    res = subprocess.run([sys.executable, "-c", SNIPPET, device], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_cpu_values_are_observed_at_once():
    out = _run("cpu")
    assert out["count_at_release"] == 2.0  # no event to wait for: observed in the release
    assert out["sum"] == pytest.approx(0.02, rel=1e-12)
    assert out["left"] == [0.0, 0.0, 0.0, 36.0]  # the released slots start their next request at 0
    assert out["refresh_count_at_exit"] == 1.0 and 0.1 <= out["refresh_s"] < 1.0  # wall clock


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_reads_in_the_forward_streams_order_without_waiting():
    out = _run("cuda")
    assert out["host_s"] < 0.1, out  # enqueued, not waited for: the forward stream sleeps ~0.2 s
    assert out["count_at_release"] == 0.0, out  # its copy had not completed yet
    assert out["observed"] and out["count"] == 2.0, out  # observed by DeviceReads' thread, no forward
    # slot 1 read after its last add, ordered on the forward stream: (4 + 6) / 200
    assert out["sum"] == pytest.approx(0.05, rel=1e-12), out
    assert out["left"] == [0.0, 0.0, 0.0, 36.0], out
    # the refresh: not complete when its block exits, observed once it is (~0.1 s of sleep)
    assert out["refresh_count_at_exit"] == 0.0 and out["refresh_observed"], out
    assert out["refresh_count"] == 1.0 and 0.05 < out["refresh_s"] < 1.0, out


def test_release_hands_lfps_slots_to_the_read_and_survives_its_failure(caplog):
    """state.release calls on_lfps_released with the released lfps requests' slots (and
    only theirs), under its lock; a read that raises is logged, and the release still
    frees the slot for the next request."""
    from sgl_sparse.config import LfpsPolicy, SparseServerConfig
    from sgl_sparse.policies import MODULES
    from sgl_sparse.policies.base import PolicyId
    from sgl_sparse.state import SparseState

    cfg = SparseServerConfig.model_validate({"query_aware": {"lfps": {"slots": 2, "max_context": 64}}})
    st = SparseState(8, "cpu", cfg)
    lfps = MODULES["lfps"].init_row(LfpsPolicy(budget=8), [], [], (None, None))
    full = MODULES["full"].init_row(None, [], [], (None, None))
    st.admit([3, 5, 6], [lfps, full, lfps])
    slots = {r: st._active[r].slot for r in (3, 6)}
    assert sorted(slots.values()) == [0, 1]  # both lfps slots taken
    seen = []
    st.on_lfps_released = seen.append
    st.release([5, 3])
    assert seen == [[slots[3]]]  # the full row has no slot to read

    def fail(_slots):
        raise RuntimeError("read failed")

    st.on_lfps_released = fail
    with caplog.at_level("ERROR"):
        st.release([6])
    assert "scored fraction" in caplog.text and "read failed" in caplog.text
    st.on_lfps_released = None
    st.admit([4, 7], [lfps, lfps])  # both slots free again: none lost to the failed read
    assert {st._active[r].slot for r in (4, 7)} == {0, 1}
    assert all(st._active[r].policy is PolicyId.LFPS for r in (4, 7))
