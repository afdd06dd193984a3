"""bench/kernels/bench_stream_overlap.py --smoke --cache-device cpu: the script's
step runs on the CPU interpreter in every mode, the cache rank's included (the
selection on a replica of its inputs, the layer's queries and the step's new keys
sent over, a finished group's selections sent back; and peer: its kernels reading
and writing the main device's tensors in place), and the selections that come back
are the main device's own bit for bit, so the next two-GPU lease's timing call
does not fail on the script or time a selection that differs."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent


def test_smoke_the_cache_device_selects_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/bench_stream_overlap.py")
    out = tmp_path / "s.json"
    assert mod.main(["--smoke", "--cache-device", "cpu", "--shapes", "t4", "--priorities", "default",
                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["check_ok"] and doc["cache_equal"] is True and doc["cache_device"] == "cpu"
    (row,) = doc["results"]
    assert {"main_ms", "side_ms", "both_ms", "cache_ms", "main_cache_ms", "peer_ms", "main_peer_ms"} <= set(row)


def test_a_cache_device_must_be_a_second_one(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_bench_script("kernels/bench_stream_overlap.py")
    assert mod.main(["--smoke", "--cache-device", "meta", "--shapes", "t4"]) == 2
    assert "--cache-device meta" in capsys.readouterr().err
