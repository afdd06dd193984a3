"""bench/kernels/probe_balanced_launch.py --smoke: the plain and the balanced launch of
the slow step's partition give the same output bit for bit on the CPU interpreter
(with and without the slow step's stores), and so do a fast step's launches as served
(``--rows sparse``: the heuristic's splits, and the balanced grid with the step's
shares; ``--variants``: the balanced one split-major, and gated with its plain
twin), so the next GPU lease's Nsight Compute call profiles launches that do the same
work."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent


@pytest.mark.parametrize("side_effects", [True, False])
def test_smoke_the_two_launches_agree(tmp_path, monkeypatch, side_effects):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/probe_balanced_launch.py")
    out = tmp_path / "p.json"
    argv = ["--smoke", "--out", str(out)] + ([] if side_effects else ["--no-side-effects"])
    assert mod.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["outputs_equal"] and doc["side_effects"] == side_effects and doc["splits"] == 3
    # dense rows at the same split count: the same partition, bit for bit
    assert doc["outputs_bitwise_equal"] and max(doc["max_rel_diff"].values()) == 0.0, doc["max_rel_diff"]


def test_smoke_a_fast_step_s_launches_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/probe_balanced_launch.py")
    out = tmp_path / "p.json"
    assert mod.main(["--smoke", "--rows", "sparse", "--variants", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["outputs_equal"] and doc["rows"] == "sparse" and not doc["side_effects"]
    assert set(doc["us"]) == {"plain", "balanced", "split_major", "gated"} == set(doc["max_rel_diff"])
    assert max(doc["max_rel_diff"].values()) < 2e-2
