"""Tensor parallelism end to end on CPU: real SGLang servers with `--tp-size 2`.

Each rank holds half of the tiny model's heads (1 of its 2 KV heads, 2 of its 4 query
heads) and runs the same batch; SGLang all-reduces over gloo on CPU. Checked:
- `full` through `sgl_sparse` gives the stock `torch_native` server's greedy tokens at
  the same TP size, and so do `sfi` with a covering budget and a covering window;
  small budgets and windows are served (each rank selecting over its own KV heads);
- the SFI compact buffers are sized per rank (this rank's query heads, not the
  model's: under 0.5.17 the model runner has no `tp_size`, so the heads were once
  taken from a TP size of 1);
- each rank sets its own stores' bytes aside in its KV pool's budget, and they are the
  bytes it then allocates (store_budget.py; the backend warns where they differ);
- every rank runs the same batch, so the metrics are counted once (attention-TP rank
  0, as SGLang's own scheduler metrics): a request's decode steps once, not per rank,
  and the compact-buffer gauges report the whole group's bytes, equal to the TP-1
  server's for the same config.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.server import greedy_generate, running_server
from tests.test_server_e2e import _scrape, _value

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

NEW_TOKENS = 16
TP_ARGS = ["--tp-size", "2", "--chunked-prefill-size", "64"]
# SGLang's CPU engine binds each rank's OpenMP threads to a NUMA node unless told which
# cores to use: one core per rank (CI has two).
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
CONFIG = {"compact": {"slots": 4, "capacity": 64}}


def _generate(url: str, ids: list[int], sparse=None) -> dict:
    return greedy_generate(url, ids, sparse, NEW_TOKENS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(20, 300) for _ in range(n)] for n in (150, 97)]


@pytest.fixture(scope="module")
def sparse_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-config") / "sparse.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def stock_tp2(tiny_qwen3, prompts):
    with running_server(tiny_qwen3, "torch_native", extra_args=TP_ARGS, env_extra=TP_ENV) as h:
        yield [_generate(h.url, ids)["output_ids"] for ids in prompts]


@pytest.fixture(scope="module")
def sparse_tp2(tiny_qwen3, sparse_config, stock_tp2):
    with running_server(tiny_qwen3, "sgl_sparse",
                        extra_args=[*TP_ARGS, "--enable-metrics", "--sparse-config", str(sparse_config)],
                        env_extra=TP_ENV) as h:
        yield h


def test_greedy_tokens_match_stock_at_tp2(sparse_tp2, stock_tp2, prompts):
    for ids, want in zip(prompts, stock_tp2):
        assert _generate(sparse_tp2.url, ids)["output_ids"] == want
        assert _generate(sparse_tp2.url, ids, {"policy": "full"})["output_ids"] == want
        assert _generate(sparse_tp2.url, ids, {"policy": "streaming", "window": 4096})["output_ids"] == want
        # budget + recent covers every position (<= 150 + 16): served dense
        got = _generate(sparse_tp2.url, ids, {"policy": "sfi", "budget": 48, "recent": 160})
        assert got["output_ids"] == want
    # small budgets and windows: served, each rank selecting over its own KV head
    out = _generate(sparse_tp2.url, prompts[0], {"policy": "sfi", "budget": 16, "recent": 8, "t_max": 4, "min_saving": 0})
    (info,) = out["meta_info"]["sgl_sparse"]
    assert len(out["output_ids"]) == NEW_TOKENS and info["policy"] == "sfi"
    assert 0 < info["slow_step_ratio"] < 1 and 0 < info["mean_retention"] < 1
    out = _generate(sparse_tp2.url, prompts[1], {"policy": "streaming", "window": 16, "sink": 4})
    assert len(out["output_ids"]) == NEW_TOKENS and out["meta_info"]["sgl_sparse"][0]["mean_retention"] < 1


def test_metrics_count_each_step_once(sparse_tp2, prompts, tiny_qwen3, sparse_config):
    before = _scrape(sparse_tp2.url)
    (summary,) = _generate(sparse_tp2.url, prompts[1], {"policy": "sadas", "window": 16})["meta_info"]["sgl_sparse"]
    after = _scrape(sparse_tp2.url)
    steps = (_value(after, "sglang_sparse_decode_steps_total", policy="sadas")
             - _value(before, "sglang_sparse_decode_steps_total", policy="sadas"))
    # the request's own count (its meta_info), not one per rank
    assert summary["decode_steps"] > 0 and steps == summary["decode_steps"]
    assert _value(after, "sglang_sparse_active_requests") == 0
    # the whole group's compact buffers: what one rank holds x 2 = the TP-1 server's
    tp2_bytes = _value(after, "sglang_sparse_compact_buffer_capacity_bytes")
    with running_server(tiny_qwen3, "sgl_sparse", extra_args=[
            "--chunked-prefill-size", "64", "--enable-metrics", "--sparse-config", str(sparse_config)]) as h:
        tp1_bytes = _value(_scrape(h.url), "sglang_sparse_compact_buffer_capacity_bytes")
    assert tp1_bytes > 0 and tp2_bytes == tp1_bytes


def test_each_rank_sets_its_stores_aside(sparse_tp2):
    log = sparse_tp2.log_path.read_text()
    lines = [ln for ln in log.splitlines() if "go to the sparse stores (" in ln]
    assert len(lines) == 2 and all("sfi " in ln for ln in lines), lines
    assert "where the KV pool's budget set aside" not in log
