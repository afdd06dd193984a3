"""bench/gpu/profile_decode.py's trace summary: a step's kernels on two streams
(asyncspade's side stream beside the main one) -- each stream's kernel time, the
time any kernel ran, and the concurrent time, from a trace in the torch
profiler's format."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent

profile_decode = load_bench_script("gpu/profile_decode.py")


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, "device": 0}}


def test_two_streams_busy_union_and_concurrency(tmp_path):
    # two steps of 10 ms (times in us): main stream 0-6 and 10-16 ms, side stream 4-9
    # and 15-19.5 ms (2 + 1 ms beside the main one), plus a CPU op the summary ignores
    events = [_kernel("gemm", 0, 6000, 7), _kernel("scores", 4000, 5000, 9), _kernel("gemm", 10000, 6000, 7),
              _kernel("scores", 15000, 4500, 9), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5e4}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = profile_decode.summarize(str(path), steps=2)
    assert s["span_ms_per_step"] == pytest.approx(9.75)
    assert s["gpu_busy_ms_per_step"] == pytest.approx(10.75)
    assert s["stream_busy_ms_per_step"] == {"7": pytest.approx(6.0), "9": pytest.approx(4.75)}
    assert s["any_busy_ms_per_step"] == pytest.approx(9.25)
    assert s["concurrent_ms_per_step"] == pytest.approx(1.5)
    assert [r["name"] for r in s["top"]] == ["gemm", "scores"]
    assert s["kernels_per_step"] == 2.0


def test_main_chain_gaps_by_length_and_timeline(tmp_path):
    # the main chain (every kernel but the side stream's, by name) on two stream ids, as a
    # graph replay reports them: per step of 1000 us, kernels at 0, 102 and 322 us of
    # 100 us each (gaps of 2 and 120 us), the next step at 1000 (a 578 us gap: the host
    # or a join); the side stream's scoring and Top-K beside it, not counted
    events = []
    for step in range(3):
        t = step * 1000
        events += [_kernel("gemm", t, 100, 7), _kernel("norm", t + 102, 100, 8),
                   _kernel("_two_segment_decode_stage1", t + 322, 100, 7),
                   _kernel("_token_scores_kernel", t + 50, 100, 9), _kernel("_topk_range_kernel", t + 150, 300, 9)]
    events.append(_kernel("gemm", 3000, 100, 7))
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    csv = tmp_path / "timeline.csv"
    s = profile_decode.summarize(str(path), steps=3, timeline=(1, str(csv)))
    g = s["main_chain_gaps"]
    assert g["0-5us"] == {"ms_per_step": pytest.approx(0.002), "per_step": 1.0}
    assert g["5-50us"] == {"ms_per_step": 0.0, "per_step": 0.0}
    assert g[">=50us"]["per_step"] == 2.0  # 120 and 578 us a step
    assert g[">=50us"]["ms_per_step"] == pytest.approx(0.698)
    assert g["long"][:2] == [{"us": 120.0, "after": "norm", "before": "_two_segment_decode_stage1"},
                             {"us": 578.0, "after": "_two_segment_decode_stage1", "before": "gemm"}]
    assert len(g["long"]) == 6
    # one step's span (3100 us / 3) from the trace's middle (1550 us): the kernels starting in [1550, 2583)
    lines = csv.read_text().splitlines()
    assert lines[0] == "stream,start_us,dur_us,name"
    rows = [line.split(",") for line in lines[1:]]
    assert [(r[0], r[3]) for r in rows] == [("7", "gemm"), ("9", "_token_scores_kernel"), ("8", "norm"),
                                            ("9", "_topk_range_kernel"), ("7", "_two_segment_decode_stage1")]
    assert float(rows[0][1]) == pytest.approx(2000 - 1550)
