"""sglang_sparse_balanced_launches_total (sgl_sparse/balanced_launches.py): the balanced
forwards whose device gate ran the balanced launch, counted on the device by the step
and read every READ_EVERY balanced forwards without a synchronize.

In a subprocess (the real SchedulerMetrics registers its series in the process's
default Prometheus registry, once); on CPU, and on CUDA where there is one (the
copies on a forward stream, observed by DeviceReads' thread)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.sglang_independent

SNIPPET = r"""
import json, os, random, sys
if sys.argv[1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
import torch
from prometheus_client import REGISTRY
from sgl_sparse import balanced_launches
from sgl_sparse.kernels.balance_step import step_balance
from sgl_sparse.metrics import SchedulerMetrics

dev = torch.device(sys.argv[1])
count = balanced_launches.BalancedLaunchCount(SchedulerMetrics("m"), dev)
count.warm()
rng = random.Random(3)
# 32768 x 8 over fp8: compact rows alike (the gate closed), or one dense row among them (open)
n = torch.full((8,), 32768, dtype=torch.int32, device=dev)
alike = (torch.full((8, 8), 2052, dtype=torch.int32, device=dev), n - 256, n)
dense = (alike[0].clone(), alike[1].clone(), n)
dense[0][0], dense[1][0] = 0, 0
ran = 0
for i in range(3 * balanced_launches.READ_EVERY + 5):
    balanced, capture = rng.random() < 0.8, i in (7, 8)
    count.note_forward(balanced, capture)  # the host, before the step is enqueued
    if balanced or capture:  # the step's gate launch adds its gate (a capture's warm-up runs too)
        want = int(rng.random() < 0.3) if not capture else 1
        ran += want if not capture else 0  # a capture's: not a served forward's
        _, gate = step_balance(*(dense if want else alike), None, 8, 33280, 132, True, count=count.counter())
        assert int(gate[0]) == want, (i, want)
assert count.wait_idle(10.0)
before_flush = REGISTRY.get_sample_value("sglang_sparse_balanced_launches_total", {"model_name": "m"})
count.read()  # what the next READ_EVERY-th balanced forward would do
assert count.wait_idle(10.0)
after = REGISTRY.get_sample_value("sglang_sparse_balanced_launches_total", {"model_name": "m"})
print(json.dumps({"ran": ran, "before_flush": before_flush, "after": after}))
"""


def _run(device: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SNIPPET, device], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_gate_s_balanced_launches_are_counted_from_the_device(device):
    """Reads every READ_EVERY balanced forwards (not a capture's, not an unbalanced
    one's) observe the gates added before them, a capture's eager warm-up's add not
    counted; one more read observes them all."""
    got = _run(device)
    assert got["ran"] > 0
    assert 0 < got["before_flush"] <= got["ran"]
    assert got["after"] == got["ran"]
