"""bench/kernels/profile_lfps_extend.py --smoke: the script runs the served lfps
extend (plan_extend, then on_extend at a prompt's last chunk) end to end on the CPU,
and its own check holds (each row's tables, K̄, V̄ and σ̂² equal init_tables on that
row alone, over a bf16 and an e4m3 pool), so that the next GPU lease's profiling
call does not fail on the script."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent


def test_smoke_checks_each_row_against_init_tables(tmp_path):
    mod = load_bench_script("kernels/profile_lfps_extend.py")
    out = tmp_path / "e.json"
    assert mod.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["kv"], r["rows"], r["n"]) for r in rows] == [("bf16", 2, 300), ("fp8_e4m3", 2, 300)]
    assert all(r["ok"] and r["bytes"] > 0 and r["ops"] == [] for r in rows)
