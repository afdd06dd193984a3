"""bench/kernels/bench_decode.py --smoke --slow-step: the script runs end to end on
the CPU interpreter over an fp8 cache, every row's output matches the reference
(the slow step at the heuristic's splits, and balanced as the backend launches it),
so the next GPU lease's timing call does not fail on the script."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent


def test_smoke_times_the_served_slow_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/bench_decode.py")
    out = tmp_path / "d.json"
    assert mod.main(["--smoke", "--slow-step", "--no-indexed", "--no-fused", "--kv-dtype", "fp8_e4m3",
                     "--slow-step-rounds", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert not doc["failures"]
    assert all(r["rel_err"] < 2e-2 for r in rows if "rel_err" in r)  # NaN fails the comparison too
    slow = [r for r in rows if r["kernel"] == "ours_dense_slow_step"]
    assert {(r["ctx"], r["bs"]) for r in slow} == {(c, b) for c in (96, 160) for b in (1, 2)}
    balanced = [r for r in rows if r["kernel"] == "ours_dense_slow_step_balanced"]
    # batch 1 does not balance; batch 2 does, each request's share within the grid
    assert {(r["ctx"], r["bs"]) for r in balanced} == {(96, 2), (160, 2)}
    # each case times the served launch and one difference from it a row
    for c in (96, 160):
        names = [r["variant"] for r in balanced if r["ctx"] == c]
        assert "balanced as served" in names and len(names) == len(set(names)) == 9, names
        assert all(len(r["rounds_us"]) == 2 for r in balanced)
    # the plain launches among them carry no per-request splits
    assert all((r["row_splits"] is None) == r["variant"].startswith("plain") for r in balanced)
    assert all(len(r["row_splits"]) == 2 and all(1 <= s for s in r["row_splits"]) for r in balanced
               if r["row_splits"] is not None)
