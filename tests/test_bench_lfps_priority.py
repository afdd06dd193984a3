"""bench/kernels/bench_lfps_priority.py --smoke: the script runs end to end on the CPU
interpreter and its own checks hold (every chunk count gives the priorities of one
program a row; C1 listed by the priorities' launches equals topk_range's), so the next GPU lease's timing call does not fail on the script."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

# Kernels only, no SGLang: the background leg (157 s on the interpreter, which ran in
# both SGLang versions' legs, on CI's critical path, until session 38).
pytestmark = pytest.mark.sglang_independent


def test_smoke_checks_every_chunk_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/bench_lfps_priority.py")
    out = tmp_path / "p.json"
    assert mod.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    rows = [r for r in results if "chunks" in r]
    assert {r["chunks"] for r in rows} == {1, 2, 3} and all(r["ok"] for r in rows)
    assert [r["chunks"] for r in rows if r["tree_merge"]] == [3]  # the tree merge's check
    assert sum(r["default"] for r in rows) == 1 and all(0 < r["finite_share"] < 1 for r in rows)
    c0 = [r for r in results if "c0" in r]  # the C1 pass's reads, A/B (the same priorities)
    assert len(c0) == 2 * len({r["case"] for r in rows}) and all(r["ok"] for r in c0)
    stages = [r for r in results if "stage" in r]  # the C1 stage before / now (the same C1: main's check)
    assert [r["stage"] for r in stages] == ["c1-stage before", "c1-stage now"] and stages[1]["listed_share"] == 1.0
    # the statistics two ways (Pébay's merges, power sums): the same priorities, the
    # rounding at a threshold apart
    stats = [r for r in results if "statistics" in r]
    assert [r["statistics"] for r in stats] == ["statistics by Pébay merges", "statistics by power sums"]
    assert all(r["ok"] for r in stats) and stats[0]["differing_entries"] == 0, stats
