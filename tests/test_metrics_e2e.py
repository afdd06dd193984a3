"""Observability end to end: a real Prometheus scrapes a real SGLang CPU server.

The server (the session's shared one, tests/shared_servers.py: other modules' traffic
may precede this one's) runs `--attention-backend sgl_sparse --enable-metrics`; mixed-policy
traffic (full, streaming, sadas, sfi, and a request refused for its metadata)
goes through it; Prometheus (Debian's `prometheus` binary) scrapes /metrics every
second and evaluates deploy/prometheus's rules every second. Then EVERY PromQL
expression of dashboards/*.json and of the rules (tests/promql_sources.py) is
evaluated through Prometheus's HTTP API and must return at least one finite
sample. The responses' meta_info["sgl_sparse"] are checked on the way.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.promql_sources import RULES, dashboard_exprs, recorded_names, rule_exprs
from tests.server import find_free_port

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    if os.environ.get("SGL_SPARSE_REQUIRE_PROMTOOL") == "1":
        raise RuntimeError("prometheus is required here (apt-get install prometheus)")
    pytest.skip("prometheus not installed (Debian package 'prometheus')", allow_module_level=True)

NEW_TOKENS = 32
# (sparse metadata, expected policy in meta_info); None: the server default (full).
TRAFFIC = [
    (None, "full"),
    ({"policy": "full"}, "full"),
    ({"policy": "streaming", "window": 16, "sink": 4}, "streaming"),
    ({"policy": "streaming", "window": 4096}, "streaming"),  # covers: dense fallback
    ({"policy": "sadas", "window": 16}, "sadas"),
    ({"policy": "sfi", "budget": 16, "recent": 8, "t_max": 4, "min_saving": 0}, "sfi"),
    ({"policy": "sfi", "budget": 24, "recent": 8, "t_max": 8, "min_saving": 0}, "sfi"),
    ({"policy": "sfi", "budget": 2000}, "sfi"),  # covers: dense fallback
    # sparse: its scored fraction, observed at its release
    ({"policy": "lfps", "budget": 16, "local": 8, "sink": 4}, "lfps"),
]
STREAMED = {"policy": "sfi", "budget": 16, "recent": 8, "min_saving": 0}


def _start_prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen, str, Path]:
    # The shipped rules with every group evaluated each second (30 s in production).
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        g["interval"] = "1s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": "sglang", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = find_free_port()
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                return proc, url, log
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"prometheus did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def _query(url: str, expr: str) -> list[dict]:
    r = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _scraped(url: str, expr: str) -> float:
    res = _query(url, expr)
    return float(res[0]["value"][1]) if res else -1.0


def _server_sum(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def stack(sparse_server, tmp_path_factory):
    server = sparse_server
    prom, prom_url, log = _start_prometheus(tmp_path_factory.mktemp("prometheus"), server.port)
    try:
        # Scraping starts a few seconds after start-up (target discovery): the
        # traffic must come after a first scrape, or no rate sees it grow.
        deadline = time.time() + 60
        while _scraped(prom_url, 'up{job="sglang"}') != 1:
            assert time.time() < deadline, f"Prometheus never scraped the server:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield server, prom_url
    finally:
        os.killpg(prom.pid, signal.SIGTERM)  # its own session: only this Prometheus
        prom.wait(timeout=30)


def _generate(url: str, ids: list[int], sparse) -> requests.Response:
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if sparse is not None:
        sp["custom_params"] = {"sparse": sparse}
    return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=300)


def _generate_stream(url: str, ids: list[int], sparse) -> dict:
    """A streamed request (SGLang measures inter-token latency on streams only);
    returns its last chunk."""
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "custom_params": {"sparse": sparse}}
    last = None
    with requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True},
                       stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                last = json.loads(line[5:])
    return last


@pytest.fixture(scope="module")
def traffic(stack):
    """Two rounds of the mixed batch (steps in a row for the step histogram, two
    TPOT observations per policy), one rejected request; returns the responses."""
    server, prom_url = stack
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 300) for _ in range(rng.randrange(120, 240))] for _ in TRAFFIC]
    responses, streams = [], []
    for _ in range(2):  # series born in round 1 are scraped, then grow in round 2
        with cf.ThreadPoolExecutor(len(TRAFFIC) + 1) as ex:
            streamed = ex.submit(_generate_stream, server.url, prompts[0], STREAMED)
            responses += list(ex.map(lambda a: _generate(server.url, *a), zip(prompts, [s for s, _ in TRAFFIC])))
            streams.append(streamed.result())
        assert _generate(server.url, prompts[0], {"policy": "streaming", "window": 0}).status_code == 400
        time.sleep(2)
    # Prometheus has the traffic once it scraped the final counters.
    time.sleep(1)  # the scheduler writes its last samples just after the responses
    want = _server_sum(server.url, "sglang_sparse_decode_steps_total")
    deadline = time.time() + 60
    while _scraped(prom_url, "sum(sglang_sparse_decode_steps_total)") < want or \
            _scraped(prom_url, "sum(sglang_sparse_rejected_requests_total)") < 2:
        assert time.time() < deadline, "Prometheus never scraped the traffic"
        time.sleep(0.5)
    time.sleep(3)  # a few rule evaluations over the scraped samples
    return responses, streams


def test_meta_info_reports_policy_slow_ratio_and_retention(traffic):
    responses, streams = traffic
    for last in streams:  # the final chunk of a stream carries the summary once
        (summary,) = last["meta_info"]["sgl_sparse"]
        assert summary["policy"] == "sfi" and 0 < summary["mean_retention"] < 1
    for resp, (sparse, policy) in zip(responses, TRAFFIC * 2):
        assert resp.status_code == 200, resp.text
        info = resp.json()["meta_info"]
        (summary,) = info["sgl_sparse"]
        assert summary["policy"] == policy, sparse
        # Counted by the state as decode batches reach the host: the first token comes
        # from prefill, and SFI evaluates a step once its input id arrives (one later).
        assert NEW_TOKENS - 3 <= summary["decode_steps"] <= NEW_TOKENS, summary
        assert 0 < summary["time_per_output_token_s"] < 10
        retention = summary["mean_retention"]
        if policy == "full" or (sparse or {}).get("window") == 4096 or (sparse or {}).get("budget") == 2000:
            assert retention == 1.0, (sparse, summary)
        else:
            assert 0 < retention < 1, (sparse, summary)
        if policy == "sfi":
            assert 0 < summary["slow_step_ratio"] <= 1, summary
        else:
            assert summary["slow_step_ratio"] is None


def test_every_dashboard_and_rule_expression_returns_data(stack, traffic):
    _, prom_url = stack
    exprs = list(dashboard_exprs("1m")) + list(rule_exprs())
    assert len(exprs) > 40
    empty = []
    for where, expr in exprs:
        values = [float(s["value"][1]) for s in _query(prom_url, expr)]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{where}: {expr} -> {values}")
    assert not empty, "expressions without a finite sample:\n" + "\n".join(empty)
    # The rule engine itself recorded every recording rule.
    for name in recorded_names():
        assert _query(prom_url, name), f"Prometheus recorded nothing for {name}"


def test_labels_are_bounded(stack, traffic):
    _, prom_url = stack
    series = requests.get(prom_url + "/api/v1/series", params={"match[]": '{__name__=~"sglang_sparse_.*"}'},
                          timeout=30).json()["data"]
    allowed = {"__name__", "policy", "model_name", "reason", "mix", "phase", "path", "le", "job", "instance"}
    assert series and all(set(s) <= allowed for s in series), {k for s in series for k in s} - allowed
    names = {s["__name__"] for s in series}
    for want in ("sglang_sparse_time_per_output_token_seconds_bucket", "sglang_sparse_decode_step_duration_seconds_bucket",
                 "sglang_sparse_selector_refresh_duration_seconds_bucket", "sglang_sparse_compact_buffer_in_use_bytes",
                 "sglang_sparse_compact_buffer_capacity_bytes", "sglang_sparse_query_store_capacity_bytes",
                 "sglang_sparse_decode_prepare_duration_seconds_bucket", "sglang_sparse_kernel_compiles_total"):
        assert want in names
    # No Triton compile on the CPU (the interpreter runs the kernels); both phases'
    # series exist from start-up, at 0, so the alert on them evaluates.
    phases = {s["phase"] for s in series if s["__name__"] == "sglang_sparse_kernel_compiles_total"}
    assert phases == {"startup", "serving"}
    # the default config reserves a store for each query-aware policy
    stores = {s["policy"] for s in series if s["__name__"] == "sglang_sparse_query_store_capacity_bytes"}
    assert stores == {"quest", "asyncspade", "lfps"}, stores
    mixes = {s["mix"] for s in series if "mix" in s}
    assert mixes <= {"full", "sparse", "mixed"} and "mixed" in mixes
    # Decode forwards by attention path: every path's series from start-up; on the CPU
    # every decode forward is the reference path. No refresh graph on the CPU.
    from sgl_sparse.metrics import DECODE_PATHS

    paths = {s["path"] for s in series if s["__name__"] == "sglang_sparse_decode_forwards_total"}
    assert paths == set(DECODE_PATHS)
    by_path = {r["metric"]["path"]: float(r["value"][1]) for r in requests.get(
        prom_url + "/api/v1/query", params={"query": "sum by (path) (sglang_sparse_decode_forwards_total)"},
        timeout=30).json()["data"]["result"]}
    assert by_path["reference"] > 0 and sum(by_path.values()) == by_path["reference"], by_path
    captures = requests.get(prom_url + "/api/v1/query", params={
        "query": "sum(sglang_sparse_refresh_graph_captures_total)"}, timeout=30).json()["data"]["result"]
    assert [float(r["value"][1]) for r in captures] == [0.0]
