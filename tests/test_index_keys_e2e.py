"""`query_aware.asyncspade.index_keys: int8 | int4` end to end on CPU: a real SGLang server
whose asyncspade store keeps int8 or 4-bit key copies (the CPU path quantizes the keys on
the fly, the same codes; tests/test_query_device.py compares it with the device path's
copies). int4 runs on a tiny Qwen3 with head_dim 64 (its scoring dots take D/2 channels,
and an int8 dot's K is >= 32 on the GPU), beside a stock server on that model.

Checked: the store is built with the copies and set aside in the KV pool's budget
(start-up log), asyncspade requests whose
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
from tests.tiny_model import make_tiny_qwen3

# first_version_only: the store's key copies are ours; the server entry points they go
# through are test_server_e2e's, run under every version (tests/ci_legs.py)
pytestmark = [pytest.mark.server, pytest.mark.timeout(900), pytest.mark.first_version_only]

NEW_TOKENS = 16


def _config(index_keys: str) -> dict:
    return {"query_aware": {"asyncspade": {"slots": 8, "max_context": 1024, "capacity": 260,
                                           "index_keys": index_keys}}}


def _sparse_server(model, index_keys, tmp_path_factory):
    path = tmp_path_factory.mktemp("index-keys") / "sparse.json"
    path.write_text(json.dumps(_config(index_keys)))
    return running_server(model, "sgl_sparse", extra_args=[*SHARED_ARGS, "--sparse-config", str(path)])


@pytest.fixture(scope="module")
def int8_server(tiny_qwen3, tmp_path_factory):
    with _sparse_server(tiny_qwen3, "int8", tmp_path_factory) as h:
        yield h


@pytest.fixture(scope="module")
def model_d64(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-d64"), seed=0, head_dim=64)


@pytest.fixture(scope="module")
def int4_servers(model_d64, tmp_path_factory):
    with _sparse_server(model_d64, "int4", tmp_path_factory) as sparse, \
            running_server(model_d64, "torch_native", extra_args=SHARED_ARGS) as stock:
        yield sparse, stock


def test_asyncspade_with_int8_index_keys(int8_server, stock_server):
    _check_served(int8_server, stock_server)


def test_asyncspade_with_int4_index_keys(int4_servers):
    _check_served(*int4_servers)


def _check_served(server, stock_server):
    rng = random.Random(1901)
    prompts = [[rng.randrange(20, 300) for _ in range(n)] for n in (150, 97, 61)]
    log = server.log_path.read_text()
    assert "asyncspade store: 8 slots x 1024 tokens" in log, "no asyncspade store"
    # the stores came out of the KV pool's budget (store_budget), not the activations' share
    assert "go to the sparse stores (" in log and "asyncspade " in log.split("go to the sparse stores (")[1]
    assert "more than the" not in log
    # budget + sink + recent covers every position (<= 150 + 16): dense, stock's tokens
    covering = {"policy": "asyncspade", "budget": 256}
    small = {"policy": "asyncspade", "budget": 16, "recent": 8}
    jobs = [(ids, covering) for ids in prompts] + [(ids, small) for ids in prompts] + [(prompts[0], {"policy": "full"})]
    with cf.ThreadPoolExecutor(len(jobs)) as ex:  # one batch: sparse rows beside dense ones
        outs = list(ex.map(lambda j: greedy_generate(server.url, j[0], j[1], NEW_TOKENS), jobs))
    want = [greedy_generate(stock_server.url, ids, None, NEW_TOKENS)["output_ids"] for ids in prompts]
    for (ids, meta), out in zip(jobs, outs):
        (summary,) = out["meta_info"]["sgl_sparse"]
        assert summary["policy"] == meta["policy"] and len(out["output_ids"]) == NEW_TOKENS
        if meta is small:
            assert 0 < summary["mean_retention"] < 1, summary
        else:
            assert out["output_ids"] == want[prompts.index(ids)], meta
            assert summary["mean_retention"] == 1.0, summary
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    (state,) = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert state["active_requests"] == 0 and not any(state["query_slots_in_use"].values()), state
