"""`--enable-mixed-chunk` end to end on CPU: SGLang runs decoding requests inside the
batches that prefill new prompts (ForwardMode.MIXED), through the backend's extend path.

Such a step attends densely for every policy, and the decode-step counters skip it
(README, "Server flags"). Checked, with short prompts decoding while long ones are
admitted in 64-token chunks beside them: `full`, the default and a covering window give
the stock `torch_native` server's greedy tokens (mixed chunk on both); small windows
and SFI budgets are served; mixed batches did happen; no request state is left.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import re
import time

import pytest
import requests

from tests.server import greedy_generate, running_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

ARGS = ["--enable-mixed-chunk", "--chunked-prefill-size", "64"]
NEW_TOKENS = 48
# (prompt length, sparse metadata, delay s): the long prompts arrive while the short
# ones decode, so their chunks share batches with those decodes
TRAFFIC = [
    (40, None, 0.0),
    (60, {"policy": "full"}, 0.0),
    (300, {"policy": "sfi", "budget": 16, "recent": 8, "t_max": 4, "min_saving": 0}, 0.05),
    (500, {"policy": "sadas", "window": 16}, 0.05),
    (80, {"policy": "streaming", "window": 4096}, 0.1),
]
SAME_AS_STOCK = {0, 1, 4}


def _generate(url: str, ids: list[int], sparse, delay: float) -> dict:
    time.sleep(delay)
    return greedy_generate(url, ids, sparse, NEW_TOKENS)


def _traffic(url: str, prompts, sparse: bool) -> list[dict]:
    with cf.ThreadPoolExecutor(len(TRAFFIC)) as ex:
        futs = [ex.submit(_generate, url, ids, meta if sparse else None, delay)
                for ids, (_, meta, delay) in zip(prompts, TRAFFIC)]
        return [f.result() for f in futs]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(20, 300) for _ in range(n)] for n, _, _ in TRAFFIC]


def test_mixed_chunk_serves_every_policy(tiny_qwen3, prompts):
    with running_server(tiny_qwen3, "torch_native", extra_args=ARGS) as h:
        stock = _traffic(h.url, prompts, sparse=False)
    with running_server(tiny_qwen3, "sgl_sparse", extra_args=ARGS) as h:
        out = _traffic(h.url, prompts, sparse=True)
        info = requests.get(h.url + "/get_server_info", timeout=30).json()
        log = h.log_path.read_text()
    # SGLang did put decodes into prefill batches
    assert re.search(r"Prefill batch.*#running-req: [1-9]", log), "no mixed batch: the test lost its point"
    for i, (want, got) in enumerate(zip(stock, out)):
        assert len(got["output_ids"]) == NEW_TOKENS
        (summary,) = got["meta_info"]["sgl_sparse"]
        if i in SAME_AS_STOCK:
            assert got["output_ids"] == want["output_ids"], TRAFFIC[i]
            assert summary["mean_retention"] == 1.0
        else:
            assert 0 < summary["mean_retention"] < 1, (TRAFFIC[i], summary)
        # steps run inside a prefill batch are dense and not counted
        assert 0 < summary["decode_steps"] <= NEW_TOKENS
    (state,) = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert state["active_requests"] == 0 and state["compact_slots_in_use"] == 0
