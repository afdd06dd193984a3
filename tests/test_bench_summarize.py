"""bench/gpu/summarize.py: the roofline column of the end-to-end tables, by policy,
against hand arithmetic: windows attend window + sink, SFI its budget + recent + sink
on fast steps and everything on slow ones (pinned or measured ratio), full everything;
quest / asyncspade / lfps get no roofline (step_ceiling.py is their tool)."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench_script

pytestmark = pytest.mark.sglang_independent

summarize = load_bench_script("gpu/summarize.py")
from shapes import SHAPES  # noqa: E402  (bench/gpu, on the path load_bench_script puts it)

SFI = {"policy": "sfi", "budget": 2048, "recent": 256, "sink": 4}


def _results(tmp_path, cases):
    """A server_compare.py JSON: 32768 x 8, out_len 128, one sgl_sparse case per entry."""
    runs = [{"backend": "sgl_sparse", "cases": [
        {"ctx": 32768, "batch": 8, "policy": p, "sparse": sp, "out_len": 128} for p, sp, _ in cases]}]
    rows = [{"ctx": 32768, "batch": 8, "policy": p, "stock_tok_s": 600.0, "tok_s": 1200.0, "ratio": 2.0,
             "slow_step_ratio": slow} for p, _, slow in cases]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"runs": runs, "compare": [{"backend": "sgl_sparse", "rows": rows}]}))
    return str(path)


def _by_hand(attended, shape="qwen3-1.7b", weights=3.4e9):
    n, kv = 32768 + 64, SHAPES[shape].kv_bytes_per_token()
    return (8 * n * kv + weights) / (8 * attended * kv + weights)


def test_roofline_by_policy(tmp_path, capsys):
    n = 32768 + 64
    cases = [("full", {"policy": "full"}, None), ("streaming:2048", {"policy": "streaming", "window": 2048}, None),
             ("sfi-pinned", {**SFI, "sentence_triggers": False, "t_max": 31}, 0.0315),
             ("sfi", SFI, 0.05), ("quest", {"policy": "quest"}, None), ("asyncspade", {"policy": "asyncspade"}, None)]
    got = {r["policy"]: roof for r, roof in summarize.rows([_results(tmp_path, cases)])}
    assert got["full"] == pytest.approx(1.0)
    assert got["streaming:2048"] == pytest.approx(_by_hand(2052))
    assert got["sfi-pinned"] == pytest.approx(_by_hand(31 / 32 * 2308 + n / 32))  # the pinned 1/32, not 0.0315
    assert got["sfi"] == pytest.approx(_by_hand(0.95 * 2308 + 0.05 * n))  # natural: the measured ratio
    assert got["quest"] is None and got["asyncspade"] is None
    # a mixed row (server_compare's 'A+B', dealt round-robin): its members' mean; a
    # member without a fixed count leaves the row without a roofline
    pinned = {**SFI, "sentence_triggers": False, "t_max": 31}
    mixed = {r["policy"]: roof for r, roof in summarize.rows([_results(tmp_path, [
        ("full+sfi-pinned", [{"policy": "full"}, pinned], 0.0315), ("full+quest", [{"policy": "full"},
                                                                                  {"policy": "quest"}], None)])])}
    assert mixed["full+sfi-pinned"] == pytest.approx(_by_hand((n + 31 / 32 * 2308 + n / 32) / 2))
    assert mixed["full+quest"] is None
    # another shape: its KV bytes per token and its own weight bytes
    four = dict((r["policy"], roof) for r, roof in summarize.rows([_results(tmp_path, cases[1:2])], "qwen3-4b"))
    assert four["streaming:2048"] == pytest.approx(
        _by_hand(2052, "qwen3-4b", SHAPES["qwen3-4b"].weight_bytes_per_step()))
    summarize.main([_results(tmp_path, cases)])
    table = capsys.readouterr().out.splitlines()
    quest = next(line for line in table if "| quest |" in line)
    assert quest.endswith("| 2.000 | - | - |")
    full = next(line for line in table if "| full |" in line)
    assert full.endswith("| 1.00x | - |")
