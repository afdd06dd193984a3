"""`--page-size 16` end to end on CPU: the KV pool allocated in pages of 16 slots.

Every policy reads the KV pool through `req_to_token` position by position, and quest's
pages are positions too, so SGLang's page size must be invisible to what a request
attends. Checked against the shared page-size-1 servers, with prompts whose lengths are
not multiples of 16 and a distinct prompt per request (no prefix hits but the one the
test makes on purpose):
- the default, `full`, a covering window and covering `sfi` / `quest` budgets give the
  stock `torch_native` server's greedy tokens;
- small windows and budgets of every sparse policy give the same tokens as the same
  request on the page-size-1 `sgl_sparse` server (same selections);
- a radix-cache hit is page-aligned (the cached prefix is a whole number of pages) and
  decodes the same tokens; no request state is left.

The page-16 server also keeps SFI's selections as KV-pool slot lists (`compact.selections:
slot_lists`) where the shared server packs their K/V: the same rows in the same order, so
that must be invisible too (its own server would cost another ~1 min of CI start-up; the
kernels' equality is tests/kernels/test_slot_lists.py).

SGLang allocates pages with a Triton kernel (`alloc_extend_kernel`) that needs a GPU
driver: on CPU the page-16 server runs it in Triton's interpreter (`TRITON_INTERPRET=1`,
the stock server's requirement too, not the plugin's: its CPU path is plain PyTorch).
"""

from __future__ import annotations

import random

import pytest
import requests

from tests.server import greedy_generate, running_server
from tests.shared_servers import SHARED_ARGS

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PAGE = 16
NEW_TOKENS = 16
LENGTHS = (37, 150)
# budget/window covering prompt + NEW_TOKENS: served dense, stock's tokens
COVERING = [
    None,
    {"policy": "full"},
    {"policy": "streaming", "window": 4096},
    {"policy": "sfi", "budget": 1024, "recent": 8},
    {"policy": "quest", "budget": 1024},
]
# small: each policy's own selections, compared with the page-size-1 sgl_sparse server
SMALL = [
    {"policy": "streaming", "window": 16},
    {"policy": "sadas", "window": 24},
    {"policy": "sfi", "budget": 16, "recent": 8, "t_max": 4, "min_saving": 0},
    {"policy": "quest", "budget": 32, "recent": 8},
    {"policy": "asyncspade", "budget": 16, "recent": 8},
    {"policy": "lfps", "budget": 16},
]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 300) for _ in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


@pytest.fixture(scope="module")
def page16(tiny_qwen3, tmp_path_factory):
    config = tmp_path_factory.mktemp("page16") / "sparse.yaml"
    config.write_text("compact:\n  selections: slot_lists\n")
    with running_server(tiny_qwen3, "sgl_sparse",
                        extra_args=[*SHARED_ARGS, "--page-size", str(PAGE), "--sparse-config", str(config)],
                        env_extra={"TRITON_INTERPRET": "1"}) as h:
        yield h


def _requests(metas: list, seed: int) -> list[tuple[list[int], dict]]:
    prompts = _prompts(len(metas) * len(LENGTHS), seed)
    return [(ids, meta) for ids, meta in zip(prompts, [m for m in metas for _ in LENGTHS])]


def test_covering_policies_match_stock(page16, stock_server):
    for ids, meta in _requests(COVERING, seed=1601):
        want = greedy_generate(stock_server.url, ids, None, NEW_TOKENS)["output_ids"]
        got = greedy_generate(page16.url, ids, meta, NEW_TOKENS)
        assert got["output_ids"] == want, (len(ids), meta)
        (summary,) = got["meta_info"]["sgl_sparse"]
        assert summary["mean_retention"] == 1.0, (len(ids), meta, summary)


def test_small_budgets_select_as_at_page_size_1(page16, sparse_server):
    for ids, meta in _requests(SMALL, seed=1602):
        want = greedy_generate(sparse_server.url, ids, meta, NEW_TOKENS)
        got = greedy_generate(page16.url, ids, meta, NEW_TOKENS)
        assert got["output_ids"] == want["output_ids"], (len(ids), meta)
        (w,), (g,) = want["meta_info"]["sgl_sparse"], got["meta_info"]["sgl_sparse"]
        assert g == {**w, "time_per_output_token_s": g["time_per_output_token_s"]}, (len(ids), meta)
        assert 0 < g["mean_retention"] < 1, (len(ids), meta, g)


def test_prefix_hit_is_page_aligned(page16, stock_server):
    ids = _prompts(2, seed=1603)[1]  # 150 tokens: 9 whole pages and 6 positions
    want = greedy_generate(stock_server.url, ids, None, NEW_TOKENS)["output_ids"]
    first = greedy_generate(page16.url, ids, {"policy": "full"}, NEW_TOKENS)
    again = greedy_generate(page16.url, ids, {"policy": "full"}, NEW_TOKENS)
    assert first["output_ids"] == again["output_ids"] == want
    cached = again["meta_info"]["cached_tokens"]
    assert cached == (len(ids) - 1) // PAGE * PAGE > 0, cached
    info = requests.get(page16.url + "/get_server_info", timeout=30).json()
    (state,) = [s["sgl_sparse"] for s in info["internal_states"] if "sgl_sparse" in s]
    assert state["active_requests"] == 0 and state["compact_slots_in_use"] == 0
    assert not any(state["query_slots_in_use"].values()), state
