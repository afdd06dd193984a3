"""bench/kernels/bench_lfps_finish.py --smoke: the script runs end to end on the CPU
interpreter and its own check holds (every chunk count, with the tables' decay or
the lazy one, updates the true tables as one program a row does, a bypassed head's
output alike), so the next GPU lease's timing
call does not fail on the script."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent


def test_smoke_checks_every_chunk_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/bench_lfps_finish.py")
    out = tmp_path / "f.json"
    assert mod.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["kv"], r["chunks"], r["lazy"]) for r in rows} == {
        (k, c, lazy) for k in ("fp8_e4m3", "bf16") for c in (1, 2, 3) for lazy in (False, True)}
    assert all(r["ok"] for r in rows) and sum(r["default"] for r in rows) == 4
