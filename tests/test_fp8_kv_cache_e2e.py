"""`--kv-cache-dtype fp8_e4m3` end to end on CPU: real SGLang servers, stock and ours.

With an fp8 KV cache `sgl_sparse` serves every policy (the decode kernel widens fp8 as
it reads, FlashInfer reads it itself, SFI's Selector reads the fp8 keys and its compact
buffers copy fp8 rows, asyncspade's scoring and lfps's tables widen them, quest's page
bounds are kept in the model's dtype; on CPU the reference path casts, as the stock
`torch_native` backend does). Checked against a stock `torch_native` server with the
same fp8 cache:
- the default, `full`, covering `streaming` / `sadas` windows and covering `sfi`,
  `quest`, `asyncspade` and `lfps` budgets give its greedy tokens, in one concurrent
  batch;
- small windows and small sfi (its slow steps, Selector and compact fast steps over
  fp8), quest, asyncspade and lfps budgets are served (retention below 1), beside those;
- no request state is left.

SGLang 0.5.23's CPU engine refuses fp8 KV caches on a CPU without Intel AMX (CI's has
none), for the stock backend as for ours: there the module is skipped, saying so.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import random

import pytest
import requests

from tests.server import ServerLaunchError, greedy_generate, launch_server
from tests.shared_servers import SHARED_ARGS

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

FP8_ARGS = [*SHARED_ARGS, "--kv-cache-dtype", "fp8_e4m3"]
NEW_TOKENS = 16
COVERING = [None, {"policy": "full"}, {"policy": "streaming", "window": 4096},
            {"policy": "sadas", "window": 4096}, {"policy": "sfi", "budget": 1024, "recent": 64},
            {"policy": "quest", "budget": 1024}, {"policy": "asyncspade", "budget": 1024},
            {"policy": "lfps", "budget": 2000}]
SMALL = [{"policy": "streaming", "window": 16}, {"policy": "sadas", "window": 24},
         {"policy": "sfi", "budget": 24, "recent": 8, "sink": 4, "t_max": 3, "min_saving": 0},
         {"policy": "quest", "budget": 32, "recent": 8}, {"policy": "asyncspade", "budget": 32, "recent": 8},
         {"policy": "lfps", "budget": 24, "local": 6, "s": 16}]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(8)
    return [[rng.randrange(20, 300) for _ in range(n)] for n in (150, 97)]


@contextlib.contextmanager
def _fp8_server(model, backend):
    try:
        handle = launch_server(model, backend, extra_args=FP8_ARGS)
    except ServerLaunchError as e:
        if "CPU FP8 KV cache requires Intel AMX support" in str(e):
            pytest.skip("this SGLang's CPU engine serves fp8 KV caches only on CPUs with Intel AMX")
        raise
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def stock_fp8(tiny_qwen3, prompts):
    with _fp8_server(tiny_qwen3, "torch_native") as h:
        yield [greedy_generate(h.url, ids, None, NEW_TOKENS)["output_ids"] for ids in prompts]


@pytest.fixture(scope="module")
def sparse_fp8(tiny_qwen3):
    with _fp8_server(tiny_qwen3, "sgl_sparse") as h:
        yield h


def test_covering_policies_match_stock_and_small_windows_are_served(sparse_fp8, stock_fp8, prompts):
    jobs = [(i, meta) for meta in COVERING + SMALL for i in range(len(prompts))]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: greedy_generate(sparse_fp8.url, prompts[j[0]], j[1], NEW_TOKENS), jobs))
    for (i, meta), out in zip(jobs, outs):
        (summary,) = out["meta_info"]["sgl_sparse"]
        if meta in SMALL:
            assert summary["mean_retention"] < 1.0, (i, meta, summary)
        else:
            assert out["output_ids"] == stock_fp8[i], (i, meta)
            assert summary["mean_retention"] == 1.0, (i, meta, summary)


def test_no_state_left(sparse_fp8):
    info = requests.get(sparse_fp8.url + "/get_server_info", timeout=30).json()
    (state,) = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert state["active_requests"] == 0 and state["active_by_policy"] == {}
    assert state["compact_slots_in_use"] == 0 and not any(state["query_slots_in_use"].values())
