"""The locust load test (loadtest/), headless against a real SGLang CPU server.

Unit tests of the pure parts (specs, stream parsing, aggregation, thresholds) need
nothing but this checkout. The server tests run locust as a subprocess with the
Python named by ``SGL_SPARSE_LOCUST_PYTHON`` (.ci/run makes a small venv with the
``loadtest`` extra: locust's gevent/flask stack stays out of SGLang's environment),
or with this interpreter if it has locust; they skip only when neither exists.
They check: no unexpected failure, every invalid-metadata request answered 400,
per-policy TTFT/TPOT entries in locust's CSV, client aborts, and no sgl_sparse
request state left on the server after the traffic.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "loadtest"))

from sparseload.mix import (  # noqa: E402
    Deck, SpecError, case_label, parse_length, parse_policy_mix, parse_scenarios, parse_threshold,
)
from sparseload.prompts import PromptFactory, TokenRatio  # noqa: E402
from sparseload.results import Results, check_thresholds, format_table, percentile  # noqa: E402
from sparseload.sse import GenOptions, StreamParser, build_request  # noqa: E402

# first_version_only: the scenarios and their client are ours; the server's streaming
# /generate they load is test_server_e2e's, run under every version (tests/ci_legs.py)
pytestmark = pytest.mark.first_version_only

LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
LOCUST_PYTHON_ENV = "SGL_SPARSE_LOCUST_PYTHON"
# Windows far below the sequence lengths, so that the sparse decode path (not the
# dense fallback for a covering window) serves these requests.
MIX = ["full", "streaming:window=32:sink=4", "sadas:window=32:sink=4"]


# ---- pure parts -------------------------------------------------------------------
def test_policy_mix_compact_json_and_new_policies_without_code():
    mix = parse_policy_mix("full,streaming:window=64:sink=4@2,sfi:budget=2048:recent=256:t_max=0.5,default")
    assert [(e.label, e.sparse, e.weight) for e in mix] == [
        ("full", {"policy": "full"}, 1),
        ("streaming:window=64:sink=4", {"policy": "streaming", "window": 64, "sink": 4}, 2),
        ("sfi:budget=2048:recent=256:t_max=0.5", {"policy": "sfi", "budget": 2048, "recent": 256, "t_max": 0.5}, 1),
        ("default", None, 1),  # no metadata: the server's default policy
    ]
    js = parse_policy_mix('[{"sparse": {"policy": "sadas", "window": 8}, "weight": 3}, "full", {"policy": "x"}]')
    assert [(e.label, e.weight) for e in js] == [("sadas:window=8", 3), ("full", 1), ("x", 1)]
    for bad in ("", "full,full", "streaming:window", "full@-1", "[1,", "full@0"):
        with pytest.raises(SpecError):
            parse_policy_mix(bad)


def test_scenarios_lengths_thresholds():
    assert parse_scenarios("qa=2,invalid") == {"qa": 2, "cot": 0, "mixed": 0, "invalid": 1, "abort": 0}
    with pytest.raises(SpecError, match="unknown scenario"):
        parse_scenarios("qa=1,chat=1")
    r = parse_length("10-20", "--x")
    assert (r.lo, r.hi) == (10, 20) and all(10 <= r.draw(random.Random(i)) <= 20 for i in range(50))
    with pytest.raises(SpecError):
        parse_length("20-10", "--x")
    labels = ["full", "streaming:window=64:sink=4"]
    t = parse_threshold("40,streaming:window=64:sink=4=25.5", "--t", labels)  # labels contain '='
    assert t.for_label("full") == 40 and t.for_label("streaming:window=64:sink=4") == 25.5
    with pytest.raises(SpecError, match="not a label"):
        parse_threshold("sadas=3", "--t", labels)
    assert case_label({"policy": "sadas", "window": "64"}) != case_label({"policy": "sadas", "window": 64})


def test_deck_keeps_exact_proportions_per_cycle():
    deck = Deck([("a", 3), ("b", 1)], random.Random(0))
    for _ in range(5):
        cycle = [deck.draw() for _ in range(4)]
        assert sorted(cycle) == ["a", "a", "a", "b"]


def test_prompts_follow_the_token_ratio():
    ratio = TokenRatio(4.0)
    f = PromptFactory(ratio)
    rng = random.Random(0)
    qa = f.long_context_qa(rng, 1000)
    assert 3900 <= len(qa.chat_user) <= 4100 and "access code for vault" in qa.text
    cot = f.chain_of_thought(rng, 300)
    assert cot.text.endswith("<think>\n") and "<think>" not in cot.chat_user
    ratio.observe(len(qa.text), 2000)  # the server counted twice as many tokens
    assert ratio.value < 4.0
    ratio.set_calibrated(2000, 1000)
    ratio.observe(1, 1000)  # a measured ratio is not moved by usage samples
    assert ratio.value == 2.0
    assert f.long_context_qa(random.Random(1), 50).text != f.long_context_qa(random.Random(2), 50).text


def _feed(parser: StreamParser, events: list[Any], t0: float = 0.0, dt: float = 0.01) -> None:
    for i, e in enumerate(events):
        parser.feed(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()), t0 + (i + 1) * dt)
        parser.feed(b"", t0 + (i + 1) * dt)


def test_stream_parsing_and_tpot_from_server_token_counts():
    # /v1/completions: 4 tokens in 3 chunks (one chunk carries two), usage at the end
    p = StreamParser("completions", t_sent=0.0)
    _feed(p, [{"choices": [{"text": "a", "finish_reason": None}], "usage": None},
              {"choices": [{"text": "bc", "finish_reason": None}], "usage": None},
              {"choices": [{"text": "d", "finish_reason": "length"}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}, b"[DONE]"])
    assert p.problem(4) is None
    assert p.ttft_ms() == pytest.approx(10.0) and p.tpot_ms() == pytest.approx((30 - 10) / 3)
    assert (p.prompt_tokens, p.completion_tokens) == (7, 4)
    # chat: the role chunk without content is not a token
    c = StreamParser("chat", t_sent=0.0)
    _feed(c, [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "x"}}]},
              {"choices": [{"delta": {"reasoning_content": "y"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, b"[DONE]"])
    assert c.problem(2) is None and c.ttft_ms() == pytest.approx(20.0) and c.tpot_ms() == pytest.approx(10.0)
    # running counts (continuous_usage_stats): a token that decodes to no text still
    # arrives; the usage-only summary after the last token does not
    u = StreamParser("completions", t_sent=0.0)
    _feed(u, [{"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}},
              {"choices": [{"text": ""}], "usage": {"completion_tokens": 2}},
              {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
              {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, b"[DONE]"])
    assert u.problem(3) is None and u.token_chunks == 3 and u.tpot_ms() == pytest.approx(10.0)
    # /generate: cumulative meta_info counts
    g = StreamParser("generate", t_sent=0.0)
    _feed(g, [{"text": "a", "meta_info": {"prompt_tokens": 5, "completion_tokens": 1, "finish_reason": None}},
              {"text": "ab", "meta_info": {"prompt_tokens": 5, "completion_tokens": 3, "finish_reason": None}},
              {"text": "abc", "meta_info": {"prompt_tokens": 5, "completion_tokens": 3,
                                             "finish_reason": {"type": "length", "length": 3}}}, b"[DONE]"])
    assert g.problem(3) is None and g.token_chunks == 2 and g.tpot_ms() == pytest.approx(5.0)
    # the native endpoint's in-stream rejection, a truncated stream, a server abort
    bad = StreamParser("generate", t_sent=0.0)
    _feed(bad, [{"error": {"message": "custom_params.sparse.window: ...", "code": 400}}, b"[DONE]"])
    assert bad.error_code == 400 and "in-stream error 400" in bad.problem(3)
    cut = StreamParser("completions", t_sent=0.0)
    _feed(cut, [{"choices": [{"text": "a"}]}])
    assert cut.problem(None) == "stream ended without [DONE]"
    ab = StreamParser("generate", t_sent=0.0)
    _feed(ab, [{"meta_info": {"completion_tokens": 1, "finish_reason": {"type": "abort", "message": "oom"}}},
               b"[DONE]"])
    assert "oom" in ab.problem(None)
    short = StreamParser("completions", t_sent=0.0)
    _feed(short, [{"choices": [{"text": "a", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}, b"[DONE]"])
    assert "!= max_tokens 8" in short.problem(8) and short.problem(None) is None


def test_request_bodies_carry_the_policy_where_sglang_reads_it():
    prompt = PromptFactory(TokenRatio()).chain_of_thought(random.Random(0), 40)
    sparse = {"policy": "streaming", "window": 64}
    path, body = build_request("generate", prompt, 16, sparse, GenOptions())
    assert path == "/generate" and body["stream"] is True
    assert body["sampling_params"]["custom_params"] == {"sparse": sparse}
    assert body["sampling_params"]["max_new_tokens"] == 16 and body["sampling_params"]["ignore_eos"] is True
    for ep in ("chat", "completions"):
        path, body = build_request(ep, prompt, 16, sparse, GenOptions())
        assert body["custom_params"] == {"sparse": sparse} and body["stream_options"]["include_usage"] is True
    _, body = build_request("chat", prompt, 16, None, GenOptions())
    assert "custom_params" not in body


def test_results_percentiles_thresholds_and_worker_merge():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None
    worker_a, worker_b, master = Results(), Results(), Results()
    for i in range(10):
        worker_a.completed("full", "qa", ttft_ms=10, tpot_ms=10 + i, e2e_ms=100, prompt_tokens=50, output_tokens=8)
    worker_b.failed("full", "cot", "HTTP 500: boom")
    worker_b.rejected('{"policy":"nope"}', "HTTP 400")
    worker_b.aborted("full", "abort", 3)
    for w in (worker_a, worker_b):
        master.merge(json.loads(json.dumps(w.drain())))  # what travels worker -> master
    assert not worker_a.policies and not worker_b.rejections  # drained
    s = master.summary(10.0, order=["full"])
    assert s["totals"] == {"requests": 13, "completed": 10, "failed": 1, "aborted": 1,
                           "rejected_as_expected": 1, "invalid_not_rejected": 0, "errors": 1}
    assert s["policies"]["full"]["tpot_ms"]["p50"] == 14.5
    assert s["policies"]["full"]["output_tokens_per_s"] == pytest.approx(8.3)
    assert s["scenario_lengths"]["qa"] == {"completed": 10, "prompt_tokens_mean": 50, "output_tokens_mean": 8}
    none = parse_threshold(None, "--x")
    assert check_thresholds(s, ["full"], max_error_rate=0.1, tpot_p50=none, tpot_p95=none, ttft_p95=none) == []
    v = check_thresholds(s, ["full", "sadas"], max_error_rate=0.05, tpot_p50=parse_threshold("14", "--x"),
                         tpot_p95=none, ttft_p95=none)
    assert len(v) == 3 and v[0].startswith("error rate") and "TPOT p50 14.5" in v[1] and "no TPOT samples" in v[2]
    table = format_table(s)
    assert "full" in table and "HTTP 500: boom" in table and '{"policy":"nope"}: HTTP 400 x1' in table


# ---- against a real server ---------------------------------------------------------
def _locust_python() -> str:
    path = os.environ.get(LOCUST_PYTHON_ENV)
    if path:
        if not os.access(path, os.X_OK):
            pytest.fail(f"{LOCUST_PYTHON_ENV}={path} is not an executable Python")
        return path
    if importlib.util.find_spec("locust") is not None:
        return sys.executable
    pytest.skip(f"locust is not installed in this environment and {LOCUST_PYTHON_ENV} is not set "
                "(python -m venv V && V/bin/pip install '.[loadtest]' && export "
                f"{LOCUST_PYTHON_ENV}=V/bin/python; .ci/run does this)")


# Session-scoped like the shared server it guards: pytest sets up session fixtures before
# module ones, and in the order asked, so without locust the tests skip before the
# shared server is started for them.
@pytest.fixture(scope="session")
def locust_python() -> str:
    return _locust_python()


@pytest.fixture(scope="module")
def server(locust_python, sparse_server):
    """The session's shared sgl_sparse server (tests/shared_servers.py)."""
    return sparse_server


def _run_locust(python: str, url: str, out: Path, run_time: str, *args: str,
                env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        python, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "-t", run_time, "--stop-timeout", "60", "--only-summary",
        "--csv", str(out / "run"), "--html", str(out / "run.html"), "--summary-json", str(out / "summary.json"),
        "--policy-mix", ",".join(MIX), "--seed", "0",
        # Sized for the tiny CPU model: prompts of a few hundred tokens, a few dozen out.
        "--qa-prompt-tokens", "300-400", "--qa-output-tokens", "8",
        "--cot-prompt-tokens", "128", "--cot-output-tokens", "48",
        "--mixed-prompt-tokens", "256", "--mixed-output-tokens", "24",
        *args,
    ]
    # The locust interpreter is another venv: none of this one's paths.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(env_extra or {})
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    print(f"locust {run_time}: {time.monotonic() - t0:.1f}s wall\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    with open(out / "run_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return proc, rows


def _count(rows: list[dict], col: str = "Request Count", **match: str) -> int:
    return sum(int(r[col]) for r in rows if all(r[k] == v for k, v in match.items()))


def _sparse_state(url: str) -> dict:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    states = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert states, "the scheduler reports no sgl_sparse state"
    return states[0]


@pytest.mark.server
@pytest.mark.timeout(600)
def test_scenarios_selected_by_tags_and_env(server, locust_python, tmp_path):
    """LOCUST_SCENARIOS keeps qa and invalid, --tags keeps invalid: only 400s are sent."""
    proc, rows = _run_locust(locust_python, server.url, tmp_path, "4s", "-u", "2", "-r", "2", "--tags", "invalid",
                             env_extra={"LOCUST_SCENARIOS": "qa=1,invalid=1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    types = {r["Type"] for r in rows if r["Name"] != "Aggregated"}
    assert types == {"POST", "REJECT"}, types
    assert _count(rows, Type="REJECT") > 0
    assert _count(rows, "Failure Count", Name="Aggregated") == 0


@pytest.mark.server
@pytest.mark.timeout(600)
def test_headless_run_all_scenarios_no_failures_no_leak(server, locust_python, tmp_path):
    proc, rows = _run_locust(
        locust_python, server.url, tmp_path, "30s", "-u", "4", "-r", "4",
        "--scenarios", "qa=2,cot=2,mixed=2,invalid=1,abort=1", "--max-error-rate", "0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sgl-sparse per-policy summary" in proc.stdout + proc.stderr

    # locust's CSV: zero failures anywhere, per-policy entries for every policy
    assert _count(rows, "Failure Count", Name="Aggregated") == 0
    with open(tmp_path / "run_failures.csv", newline="") as f:
        assert list(csv.DictReader(f)) == []
    for label in MIX:
        for kind in ("TTFT", "TPOT", "E2E"):
            assert _count(rows, Type=kind, Name=label) > 0, (kind, label)
    assert _count(rows, Type="ABORT") > 0

    # every invalid-metadata request was answered 400 (and counted as such, not as a failure)
    invalid_sent = sum(int(r["Request Count"]) for r in rows if r["Type"] == "POST" and "[invalid " in r["Name"])
    rejected = _count(rows, Type="REJECT")
    assert rejected > 0 and rejected == invalid_sent
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["totals"]["errors"] == 0 and summary["invalid_not_rejected"] == {}
    assert summary["totals"]["rejected_as_expected"] == rejected
    assert {how for h in summary["rejections"].values() for how in h} <= {"HTTP 400", "in-stream 400"}
    assert set(summary["policies"]) == set(MIX)
    assert "TPOT" in (tmp_path / "run.html").read_text()

    # no per-request sgl_sparse state left once the traffic (and the aborts) are through
    deadline = time.monotonic() + 60
    while (state := _sparse_state(server.url))["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.5)  # an abort reaches the scheduler asynchronously
    assert state["active_requests"] == 0 and not state["active_by_policy"], state
    assert server.alive()
