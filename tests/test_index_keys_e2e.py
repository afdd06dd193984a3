"""`query_aware.asyncspade.index_keys: int8` end to end on CPU: a real SGLang server whose
asyncspade store keeps int8 key copies (the CPU path quantizes the keys on the fly, the
same codes; tests/test_query_device.py compares it with the device path's copies).

Checked: the store is built with the copies (start-up log), asyncspade requests whose
budget covers the sequence give the stock server's greedy tokens, small budgets are
served sparse beside `full` requests (which keep stock's tokens), and no request state
is left.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random

import pytest
import requests

from tests.server import greedy_generate, running_server
from tests.shared_servers import SHARED_ARGS

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

NEW_TOKENS = 16
CONFIG = {"query_aware": {"asyncspade": {"slots": 8, "max_context": 1024, "capacity": 260, "index_keys": "int8"}}}


@pytest.fixture(scope="module")
def int8_server(tiny_qwen3, tmp_path_factory):
    path = tmp_path_factory.mktemp("index-keys") / "sparse.json"
    path.write_text(json.dumps(CONFIG))
    with running_server(tiny_qwen3, "sgl_sparse", extra_args=[*SHARED_ARGS, "--sparse-config", str(path)]) as h:
        yield h


def test_asyncspade_with_int8_index_keys(int8_server, stock_server):
    rng = random.Random(1901)
    prompts = [[rng.randrange(20, 300) for _ in range(n)] for n in (150, 97, 61)]
    log = int8_server.log_path.read_text()
    assert "asyncspade store: 8 slots x 1024 tokens" in log, "no asyncspade store"
    # budget + sink + recent covers every position (<= 150 + 16): dense, stock's tokens
    covering = {"policy": "asyncspade", "budget": 256}
    small = {"policy": "asyncspade", "budget": 16, "recent": 8}
    jobs = [(ids, covering) for ids in prompts] + [(ids, small) for ids in prompts] + [(prompts[0], {"policy": "full"})]
    with cf.ThreadPoolExecutor(len(jobs)) as ex:  # one batch: sparse rows beside dense ones
        outs = list(ex.map(lambda j: greedy_generate(int8_server.url, j[0], j[1], NEW_TOKENS), jobs))
    want = [greedy_generate(stock_server.url, ids, None, NEW_TOKENS)["output_ids"] for ids in prompts]
    for (ids, meta), out in zip(jobs, outs):
        (summary,) = out["meta_info"]["sgl_sparse"]
        assert summary["policy"] == meta["policy"] and len(out["output_ids"]) == NEW_TOKENS
        if meta is small:
            assert 0 < summary["mean_retention"] < 1, summary
        else:
            assert out["output_ids"] == want[prompts.index(ids)], meta
            assert summary["mean_retention"] == 1.0, summary
    info = requests.get(int8_server.url + "/get_server_info", timeout=30).json()
    (state,) = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert state["active_requests"] == 0 and not any(state["query_slots_in_use"].values()), state
