"""bench/gpu/server_compare.py's reading of /metrics: the per-row figures the GPU
tables print (slow ratio, retention, the share of steps served dense, host time per
step, Selector runs per step and rows per run, the balanced-splits share of decode
forwards, refresh-graph captures, compiles while serving).
Not marked sglang_independent: the script imports `requests`, whose version may differ
between the SGLang venvs."""

from __future__ import annotations

import argparse
import random

import pytest

from tests.bench_scripts import load_bench_script
from tests.forked_runs import Run, run_forked

server_compare = load_bench_script("gpu/server_compare.py")


def _text(steps: float, slow: float, attended: float, cached: float, serving: float, prep_s: float,
          forwards: float, runs: float, rows: float, balanced: float = 0.0, captures: float = 0.0,
          fallback: float = 3.0, scored: tuple[float, float] = (0.0, 0.0), launched: float = 0.0,
          qa_balanced: float = 0.0) -> str:
    m = 'model_name="/root/model"'
    return "\n".join([
        "# HELP sglang_sparse_decode_steps_total Request decode steps, by policy.",
        f'sglang_sparse_decode_steps_total{{{m},policy="sfi"}} {steps}',
        f'sglang_sparse_decode_steps_total{{{m},policy="full"}} 999.0',
        f'sglang_sparse_slow_steps_total{{{m},policy="sfi"}} {slow}',
        f'sglang_sparse_attended_tokens_total{{{m},policy="sfi"}} {attended}',
        f'sglang_sparse_cached_tokens_total{{{m},policy="sfi"}} {cached}',
        f'sglang_sparse_dense_fallback_steps_total{{{m},policy="sfi",reason="selection_pending"}} 3.0',
        f'sglang_sparse_dense_fallback_steps_total{{{m},policy="sfi",reason="context_exceeds_store"}} {fallback}',
        f'sglang_sparse_kernel_compiles_total{{{m},phase="startup"}} 44.0',
        f'sglang_sparse_kernel_compiles_total{{{m},phase="serving"}} {serving}',
        f"sglang_sparse_decode_prepare_duration_seconds_sum{{{m}}} {prep_s}",
        f"sglang_sparse_decode_prepare_duration_seconds_count{{{m}}} {forwards}",
        f'sglang_sparse_selector_refresh_duration_seconds_bucket{{{m},le="0.01"}} {runs}',
        f"sglang_sparse_selector_refresh_duration_seconds_count{{{m}}} {runs}",
        f"sglang_sparse_selector_refresh_duration_seconds_sum{{{m}}} {runs * 0.003}",
        f"sglang_sparse_selector_refreshed_rows_total{{{m}}} {rows}",
        f'sglang_sparse_decode_forwards_total{{{m},path="kernel_balanced"}} {balanced}',
        f'sglang_sparse_decode_forwards_total{{{m},path="qa_quest_kernel_balanced"}} {qa_balanced}',
        f'sglang_sparse_decode_forwards_total{{{m},path="kernel"}} {forwards - balanced - qa_balanced}',
        f'sglang_sparse_decode_forwards_total{{{m},path="dense"}} 0.0',
        f"sglang_sparse_refresh_graph_captures_total{{{m}}} {captures}",
        f"sglang_sparse_balanced_launches_total{{{m}}} {launched}",
        f'sglang_sparse_lfps_scored_fraction_bucket{{{m},le="0.05"}} {scored[1]}',
        f"sglang_sparse_lfps_scored_fraction_sum{{{m}}} {scored[0]}",
        f"sglang_sparse_lfps_scored_fraction_count{{{m}}} {scored[1]}",
        *_step_histogram(steps),
    ])


def _step_histogram(steps: float) -> list[str]:
    """The decode-step histogram of a server whose steps (all but the first of the 356
    counted here) took 3 ms, one in 50 of them 12 ms, split over two mix labels."""
    m = 'model_name="/root/model"'
    slow = steps // 50
    fast = steps - slow
    out = []
    for mix, share in (("sparse", 0.75), ("mixed", 0.25)):
        for le, cum in (("0.0025", 0.0), ("0.003", fast), ("0.01", fast), ("0.0115", fast), ("0.013", steps),
                        ("+Inf", steps)):
            out.append(f'sglang_sparse_decode_step_duration_seconds_bucket{{{m},mix="{mix}",le="{le}"}} {cum * share}')
    return out


def test_row_figures_are_the_differences_over_the_timed_batches():
    before = server_compare.parse_metrics(_text(100, 4, 1e4, 1e5, 1, 0.5, 100, 2, 40, balanced=10, captures=5,
                                                scored=(0.03, 1), launched=3))
    # the balanced forwards: kernel_balanced and a query-aware balanced twin's (64 + 10)
    after = server_compare.parse_metrics(_text(356, 12, 3.56e4, 3.56e5, 3, 0.62, 356, 10, 72, balanced=64,
                                               captures=7, fallback=67, scored=(0.23, 5), launched=19,
                                               qa_balanced=10))
    assert after[("sglang_sparse_kernel_compiles_total", "phase=startup")] == 44
    assert after[("sglang_sparse_decode_forwards_total", "path=kernel_balanced")] == 64
    assert server_compare.sparse_stats(before, after, "sfi") == {
        "decode_steps": 256, "slow_step_ratio": round(8 / 256, 4), "retention": 0.1, "dense_fallback_share": 0.25,
        "dense_fallback_unplanned_share": 0.25,  # context_exceeds_store's 64; selection_pending's unchanged
        "prepare_ms_per_step": round(1e3 * 0.12 / 256, 3),
        "selector_runs_per_step": round(8 / 256, 4), "selector_rows_per_run": 4.0,
        "balanced_forward_share": 0.25, "balanced_launch_share": 0.0625,  # 16 of 256 forwards
        "refresh_graph_captures": 2, "compiles_while_serving": 2,
        "lfps_scored_fraction": 0.05,  # (0.23 - 0.03) / (5 - 1) requests
        # 256 steps in the window, 5 of them (356 // 50 - 100 // 50) in the (11.5, 13] ms
        # bucket: p99 at rank 253.44 falls there, interpolated; p50 in (2.5, 3]
        "server_steps": 256, "server_step_ms_p50": round(2.5 + 0.5 * 128 / 251, 3),
        "server_step_ms_p99": round(11.5 + 1.5 * (253.44 - 251) / 5, 3)}
    assert server_compare.sparse_stats(before, before, "sfi") == {}  # no decode step: no row figures


def test_a_second_sparse_server_takes_its_own_config():
    """BACKENDS=flashinfer,sgl_sparse,sgl_sparse@B.yaml: the A/B of a server-wide setting."""
    assert server_compare.split_env("sgl_sparse@b.yaml+SGLANG_SPARSE_X=0+Y=a=b") == (
        "sgl_sparse@b.yaml", {"SGLANG_SPARSE_X": "0", "Y": "a=b"})
    assert server_compare.split_env("flashinfer") == ("flashinfer", {})
    with pytest.raises(ValueError, match="'\\+X' is not NAME=VALUE"):
        server_compare.split_env("sgl_sparse+X")
    assert server_compare.split_backend("sgl_sparse") == ("sgl_sparse", None)
    assert server_compare.split_backend("sgl_sparse@bench/gpu/b.yaml") == ("sgl_sparse", "bench/gpu/b.yaml")
    extra = "--sparse-config a.yaml --foo 1"
    assert server_compare.sparse_flags(extra, None) == extra.split()
    assert server_compare.sparse_flags(extra, "b.yaml") == ["--sparse-config", "b.yaml", "--foo", "1"]
    assert server_compare.sparse_flags("", "b.yaml") == ["--sparse-config", "b.yaml"]
    assert server_compare.log_name("sgl_sparse@bench/gpu/b.yaml") == "server-sgl_sparse_bench_gpu_b.yaml.log"


def test_the_warm_up_batch_crosses_a_prefill_chunk():
    """Sessions 50/51 lost stock's wall-clock figure at 3072 x 64 to a JIT build inside
    its prefill-only timing: one warm-up prompt of 3072 tokens never crossed a chunk."""
    warm = server_compare.warm_requests
    assert warm(3072, 64, "--disable-prefill-cuda-graph") == 4  # the third prompt already crosses 8192
    assert warm(2048, 64, "") == 6 and warm(32768, 8, "") == 2 and warm(130000, 4, "") == 2
    assert warm(2048, 3, "") == 3 and warm(100, 1, "") == 1  # never more than the batch
    assert warm(3072, 64, "--chunked-prefill-size 4096") == 3 and warm(3072, 64, "--chunked-prefill-size=-1") == 1


def test_the_kv_cache_dtype_among_the_extra_flags():
    """The summary records the servers' KV cache dtype (results over fp8 and bf16 side by side)."""
    assert server_compare.kv_cache_dtype("--disable-prefill-cuda-graph --kv-cache-dtype fp8_e4m3") == "fp8_e4m3"
    assert server_compare.kv_cache_dtype("--kv-cache-dtype=fp8_e5m2 --tp-size 2") == "fp8_e5m2"
    assert server_compare.kv_cache_dtype("--disable-prefill-cuda-graph") == "auto"
    assert server_compare.kv_cache_dtype("--kv-cache-dtype") == "auto"


def test_both_servers_capture_decode_graphs_up_to_the_cases_largest_batch(tmp_path):
    """graph_flags: the cases' largest batch by default, SGLang's list on request, the
    extra flags' own graph settings untouched; SGLang's own parser takes the result."""
    flags = server_compare.graph_flags
    assert flags("--disable-prefill-cuda-graph", "32768x8", "auto") == ["--cuda-graph-max-bs-decode", "8"]
    assert flags("", "8192x32,32768x1,2048x64", "auto") == ["--cuda-graph-max-bs-decode", "64"]
    assert flags("", "8192x32", "16") == ["--cuda-graph-max-bs-decode", "16"]
    assert flags("", "8192x32", "sglang") == []
    for own in ("--cuda-graph-max-bs 4", "--cuda-graph-max-bs=4", "--cuda-graph-max-bs-decode 4", "--cuda-graph-bs 1 2 4",
                "--cuda-graph-bs-decode 1 2", "--disable-cuda-graph", "--cuda-graph-backend-decode disabled"):
        assert flags(own, "8192x32", "auto") == [], own
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit, match="--graph-max-bs"):
            flags("", "8192x32", bad)
    # SGLang's own parser (imported in a forked child, as the CPU stand-ins need)
    code = ("import argparse, sys\nfrom sglang.srt.server_args import ServerArgs\n"
            "p = argparse.ArgumentParser()\nServerArgs.add_cli_args(p)\n"
            "print(p.parse_args(['--model-path', 'm', *sys.argv[1:]]).cuda_graph_max_bs_decode)\n")
    out, = run_forked([Run(args=["-c", *flags("", "32768x8,2048x64", "auto")], cwd=tmp_path, code=code)],
                      preload=["sglang.srt.server_args"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "64"


def test_slow_bursts_find_the_slow_step_and_its_refresh():
    """A pinned SFI trace (session 32, 130000 x 4: a slow step, then the step carrying
    its refresh, every 32 steps): bursts of two, their steps' times apart, the fast
    steps' median; one request's burst at its trace's end still counts."""
    fast = [2.3, 2.4, 2.5, 2.2] * 8
    a = fast[:31] + [19.0, 18.0] + fast[:31] + [19.2, 25.0] + fast[:5]
    b = fast[:31] + [18.8, 18.2] + fast[:31] + [19.4]
    got = server_compare.slow_bursts([a, b])
    assert got["burst_steps_mean"] == 1.75 and got["burst_ms_by_position"] == [19.1, 20.4]
    assert got["bursts_per_100_steps"] == round(100 * 4 / (len(a) + len(b)), 2)
    assert 2.2 <= got["fast_ms_p50"] <= 2.5
    assert server_compare.slow_bursts([fast]) == {"fast_ms_p50": 2.35, "bursts_per_100_steps": 0.0,
                                                  "burst_steps_mean": 0, "burst_ms_by_position": []}
    assert server_compare.slow_bursts([]) == {}


def test_fast_steps_leave_out_the_steps_just_above_them():
    """Natural sfi's trace: fast steps with a slow row's steps (1.4x, 55% of them) among them, under
    slow_bursts' 2x cut. fast_steps takes each step's median over the requests (one
    request's late chunk out), then the steps near the fastest: the fast steps' own
    median, not the mixture's."""
    rng = random.Random(3)
    steps = [2.6 + rng.uniform(-0.05, 0.05) if i % 20 < 9 else 3.6 + rng.uniform(-0.1, 0.1) for i in range(300)]
    trace = [[t + rng.uniform(-0.02, 0.02) for t in steps] for _ in range(8)]
    trace[0][10] = 9.0  # one request's late chunk: the step's median keeps it out
    for ts in trace:  # and the clients' flushes at the end (several tokens in one chunk)
        ts[-5:] = [0.1] * 5
    got = server_compare.fast_steps(trace)
    assert 2.58 <= got["fast_step_ms_p50"] <= 2.62 and got["fast_step_share"] == 0.45
    assert server_compare.slow_bursts(trace)["fast_ms_p50"] > 2.9  # the mixture's median
    assert server_compare.fast_steps([]) == {} and server_compare.fast_steps([[]]) == {}


def test_parse_policy_windows_named_runs_and_knob_overrides():
    parse = server_compare.parse_policy
    assert parse("full") == ("full", {"policy": "full"})
    assert parse("streaming:2048") == ("streaming", {"policy": "streaming", "window": 2048})
    assert parse("sfi-pinned") == ("sfi-pinned", server_compare.NAMED["sfi-pinned"])
    # knobs: the load test's spelling, values as JSON; the label keeps them apart
    assert parse("lfps:a=0.001:s=16") == (
        "lfps:a=0.001:s=16", {"policy": "lfps", "a": 0.001, "s": 16})
    label, meta = parse("sfi-pinned:budget=1024:sentence_triggers=true")
    assert label == "sfi-pinned:budget=1024:sentence_triggers=true"
    assert meta == {**server_compare.NAMED["sfi-pinned"], "budget": 1024, "sentence_triggers": True}
    assert server_compare.NAMED["sfi-pinned"]["budget"] == 2048  # the named run is not changed


def test_a_mixed_row_deals_its_policies_round_robin_and_counts_its_sparse_member():
    """POLICIES='full+sfi-pinned': a batch of both (graph variant `mixed`), request j
    taking member j mod 2; the row's counters are sfi's, over the half of the requests
    that carry it."""
    label, pol = server_compare.parse_row("full+sfi-pinned:min_saving=0")
    assert label == "full+sfi-pinned:min_saving=0"
    assert pol == [{"policy": "full"}, {**server_compare.NAMED["sfi-pinned"], "min_saving": 0}]
    assert [server_compare.request_meta(pol, j)["policy"] for j in range(5)] == ["full", "sfi", "full", "sfi", "full"]
    assert server_compare.counted_policy(pol) == ("sfi", 2.0)
    assert server_compare.counted_policy([{"policy": "full"}, {"policy": "quest"}, {"policy": "quest"}]) == (
        "quest", 1.5)
    # a single policy and stock are unchanged
    assert server_compare.parse_row("sfi-pinned") == server_compare.parse_policy("sfi-pinned")
    single = server_compare.parse_row("quest")[1]
    assert server_compare.request_meta(single, 3) == single and server_compare.members(single) == [single]
    assert server_compare.request_meta(None, 0) is None and server_compare.members(None) == []
    assert server_compare.counted_policy(None) == ("", 1) and server_compare.counted_policy(single) == ("quest", 1.0)
    # a member's query-aware store is checked like a single row's
    qa = {"query_aware": {"quest": {"max_context": 4096}}}
    assert server_compare.store_shortfalls(qa, "full+quest", "4000x64", 512) == [
        "query_aware.quest.max_context 4096 < 4512 (the longest case's prompt + --out-len)"]


def test_a_run_past_a_query_aware_store_is_refused_before_any_server_starts(tmp_path):
    """A case whose prompt plus --out-len passes query_aware.<policy>.max_context would
    time the dense kernel under the policy's name (session 37's lfps row at 130000 x 4:
    a store of 130304, 512 tokens out, 41% of the steps dense): refused, the field named."""
    short = server_compare.store_shortfalls
    qa = {"query_aware": {"lfps": {"max_context": 130304}, "quest": {"max_context": 130560}}}
    assert short(qa, "lfps,quest", "130000x4", 512) == [
        "query_aware.lfps.max_context 130304 < 130512 (the longest case's prompt + --out-len)"]
    assert short(qa, "lfps:a=0.001,full", "130000x4", 128) == []  # 130128 fits
    assert short(qa, "quest,sfi-pinned,full", "32768x8,130000x4", 512) == []
    assert short(None, "lfps", "130000x4", 512) == [] and short({"query_aware": {}}, "lfps", "8x1", 9) == []

    cfg = tmp_path / "c.yaml"
    cfg.write_text("query_aware:\n  lfps: {slots: 4, max_context: 130304}\n")
    args = argparse.Namespace(backends=f"flashinfer,sgl_sparse@{cfg}+SGLANG_SPARSE_X=1",
                              sparse_extra="", policies="lfps", cases="130000x4", out_len=512)
    with pytest.raises(SystemExit, match=r"c\.yaml: query_aware\.lfps\.max_context 130304 < 130512"):
        server_compare.check_stores(args)
    args.out_len = 128
    server_compare.check_stores(args)  # fits: no exit
    args.backends, args.sparse_extra = "sgl_sparse", f"--sparse-config {cfg}"
    args.out_len = 512
    with pytest.raises(SystemExit):
        server_compare.check_stores(args)


def test_the_bench_configs_hold_the_runs_they_are_made_for():
    """The 130000 x 4 query-aware config serves 512 generated tokens sparse to the end
    (the GPU rows' OUT_LEN=512)."""
    import yaml

    from tests.bench_scripts import BENCH

    with open(BENCH / "gpu" / "sparse_config_130k4_qa.yaml") as f:
        cfg = yaml.safe_load(f)
    assert server_compare.store_shortfalls(cfg, "quest,asyncspade,lfps", "130000x4", 512) == []


def test_an_ab_of_two_sparse_servers_compares_each_policy_with_its_own_row():
    # session 45: the first server of an A/B ran sfi and sfi-pinned; keyed by shape alone,
    # every row was compared with sfi-pinned's
    rows = [{"ctx": 8192, "batch": 32, "policy": p, "decode_tok_s": t}
            for p, t in (("sfi", 7206.3), ("sfi-pinned", 7781.6))]
    other = {"ctx": 8192, "batch": 32, "policy": "sfi", "decode_tok_s": 7357.6}
    assert server_compare.base_case(rows, other)["decode_tok_s"] == 7206.3
    stock = [{"ctx": 8192, "batch": 32, "policy": "stock", "decode_tok_s": 3000.0},
             {"ctx": 32768, "batch": 8, "policy": "stock", "decode_tok_s": 900.0}]
    assert server_compare.base_case(stock, other)["decode_tok_s"] == 3000.0


def test_a_port_something_answers_on_is_refused_before_a_server_starts():
    """Session 55: a stale server answered on the new one's port, and every row measured it."""
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(SystemExit, match=f"port {port} already answers"):
            server_compare.check_port_free(port)
    server_compare.check_port_free(port)  # closed again: free


def test_the_pool_sglang_logged_and_a_batch_it_cannot_hold():
    """The line SGLang's scheduler logs once its pool is sized (as on the H200, session 55)."""
    log = ("[2026-12-03 10:13:25] Capture target decode CUDA graph end. elapsed=101.71 s\n"
           "[2026-12-03 10:13:25] max_total_num_tokens=1010664, chunked_prefill_size=8192, max_prefill_tokens=16384, "
           "max_running_requests=3696, context_len=140000, available_gpu_mem=25.09 GB\n")
    pool = server_compare.kv_pool_tokens(log)
    assert pool == 1010664
    assert server_compare.kv_pool_tokens("no pool line yet") is None
    assert server_compare.pool_shortfall(pool, 32768, 8, 512) is None  # 266240 tokens fit
    assert server_compare.pool_shortfall(76552, 8192, 32, 512) == 32 * 8704 - 76552
    assert server_compare.pool_shortfall(None, 8192, 32, 512) is None  # unknown: not flagged


def test_a_row_of_a_batch_the_pool_cannot_hold_says_so():
    from types import SimpleNamespace
    a = argparse.Namespace(interleave=False, repeats=2, out_len=512)
    short = SimpleNamespace(res={"kv_pool_tokens": 76552})
    row = server_compare._timed_row(a, short, "stock", None, 8192, 32, 2.0, [17.6, 17.7], {}, {})
    assert row["pool_shortfall"] == 32 * 8704 - 76552
    assert row["decode_tok_s"] == round(32 * 511 / (17.65 - 2.0), 1)
    roomy = SimpleNamespace(res={"kv_pool_tokens": 1010664})
    assert server_compare._timed_row(a, roomy, "stock", None, 8192, 32, 2.0, [6.4], {}, {})["pool_shortfall"] is None


def test_step_quantiles_follow_histogram_quantile():
    """server_compare.step_quantiles against Prometheus' interpolation, by hand: an
    empty window gives nothing, and a rank past the last finite bound gives that bound."""
    q = server_compare.step_quantiles
    k = lambda le: ("sglang_sparse_decode_step_duration_seconds_bucket", le)  # noqa: E731
    after = {k("0.002"): 10.0, k("0.004"): 90.0, k("0.01"): 99.0, k("+Inf"): 100.0}
    assert q({}, after) == {"server_steps": 100, "server_step_ms_p50": 3.0,  # 2 + 2 * (50 - 10) / 80
                            "server_step_ms_p99": 10.0}
    assert q(after, after) == {}
    tail = {k("0.002"): 0.0, k("0.004"): 0.0, k("0.01"): 0.0, k("+Inf"): 100.0}
    assert q({}, tail)["server_step_ms_p99"] == 10.0
