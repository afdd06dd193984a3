"""bench/gpu/timeline_steps.py: a profile timeline cut into decode steps at the LM
head's GEMM, the slow steps broken down by kernel -- on hand-made rows and on the
committed 130000 x 4 sfi-pinned timeline (session 33: one slow step, then the
refresh step)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.bench_scripts import BENCH, load_bench_script

pytestmark = pytest.mark.sglang_independent

timeline_steps = load_bench_script("gpu/timeline_steps.py")


def _write(path: Path, rows: list[tuple[int, float, float, str]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stream", "start_us", "dur_us", "name"])
        w.writerows(rows)


def test_steps_cut_at_the_lm_head_and_slow_steps_broken_down(tmp_path):
    rows = []
    t = 0.0
    for step in range(5):
        dur = 9000.0 if step == 3 else 1000.0  # step 3: a 9 ms attention launch
        rows += [(13, t, dur, "_two_segment_decode_stage1"), (13, t + dur, 100.0, "nvjet_sm90_tst_384x8_lmhead")]
        t += dur + 200.0
    rows.append((13, t, 50.0, "_two_segment_decode_stage1"))  # a partial step: dropped
    path = tmp_path / "t.csv"
    _write(path, list(reversed(rows)))  # any order: sorted by start
    out = timeline_steps.summarize(str(path), "nvjet_sm90_tst_384x8", 1.5, 5)
    assert out["steps"] == 5 and out["median_step_ms"] == pytest.approx(1.1)
    (slow,) = out["slow_steps"]
    assert slow["step"] == 3 and slow["span_ms"] == pytest.approx(9.1) and slow["busy_ms"] == pytest.approx(9.1)
    assert slow["above_median_ms"] == pytest.approx(8.0)
    assert slow["kernels"][0] == {"name": "_two_segment_decode_stage1", "ms": 9.0, "calls": 1}
    with pytest.raises(SystemExit, match="no step boundary"):
        timeline_steps.summarize(str(path), "no_such_kernel", 1.5, 5)


def test_the_committed_130k_burst():
    path = BENCH / "results" / "profile_decode_h200_130000x4_fp8_sfi_pinned_timeline_s33.csv.gz"
    out = timeline_steps.summarize(str(path), "nvjet_sm90_tst_384x8", 3.0, 3)
    assert out["steps"] == 32 and 2.0 < out["median_step_ms"] < 3.0
    slow, refresh = out["slow_steps"]
    assert refresh["step"] == slow["step"] + 1
    # the slow step: dense attention of every row; the next: the Selector's refresh
    assert slow["kernels"][0]["name"] == "_two_segment_decode_stage1" and slow["kernels"][0]["calls"] == 28
    assert refresh["kernels"][0]["name"] == "_selector_stats_split"
    assert slow["span_ms"] > 10 and refresh["span_ms"] > 10
