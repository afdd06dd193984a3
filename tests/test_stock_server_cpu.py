"""Stock SGLang on CPU: the harness itself works for the installed sglang.

Uses one real ``sglang.launch_server`` with the stock
``--attention-backend torch_native`` on the tiny random Qwen3 model made by
tests/tiny_model.py (the session's shared stock server, tests/shared_servers.py),
and checks what the sgl-sparse tests rely on:

* ``/generate`` with ``text`` and with ``input_ids`` (greedy, deterministic,
  same tokens either way), batched prompts;
* ``sampling_params.custom_params`` (nested dicts) is accepted and does not
  change stock output;
* the OpenAI routes accept ``extra_body={"custom_params": {...}}``
  (``ChatCompletionRequest.custom_params`` -> ``sampling_params["custom_params"]``);
* greedy output depends on the context (so a policy that drops context is
  visible);
* the spawned scheduler/detokenizer processes import the CPU stand-ins.

One server start costs ~40-90 s on the 2-core CI machine (hence the shared one;
tests/test_server_e2e.py takes its reference tokens from it too).  The first tests
(no server) check the pure-torch ``sgl_kernel`` stand-in ops against reference
loops; they load tests/cpu_stand_ins by file path so that this pytest process
does not get the stand-ins on its own ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import requests

STAND_INS = Path(__file__).resolve().parent / "cpu_stand_ins"


def server_test(fn):
    """Marks a test that uses the (session-scoped) real SGLang server."""
    return pytest.mark.server(pytest.mark.timeout(900)(fn))

SP = {"max_new_tokens": 16, "temperature": 0}
TEXT = "The cat and the dog went to the river city on day 42 and saw a blue bird."
SPARSE_PARAMS = {"sparse": {"policy": "full"}}


def _load_stand_in(name: str):
    """Import tests/cpu_stand_ins/<name> under a private module name."""
    pkg = STAND_INS / name
    spec = importlib.util.spec_from_file_location(
        f"_stand_in_{name}", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------
# sgl_kernel / torchvision stand-ins (no server)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_stand_in_assign_req_to_token_pool(idx_dtype):
    import torch

    sk = _load_stand_in("sgl_kernel")
    dt = getattr(torch, idx_dtype)
    rows, pool_len = 6, 40
    req_to_token = torch.full((rows, pool_len), -7, dtype=torch.int32)
    ref = req_to_token.clone()
    req_pool_indices = torch.tensor([3, 1, 5], dtype=dt)
    start = torch.tensor([0, 4, 10], dtype=dt)
    end = torch.tensor([7, 4, 21], dtype=dt)
    total = int((end - start).sum())
    out_cache_loc = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:total]
    sk.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len)
    pt = 0
    for r, s_, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        ref[r, s_:e] = out_cache_loc[pt : pt + e - s_].to(torch.int32)
        pt += e - s_
    assert torch.equal(req_to_token, ref)


def test_stand_in_copy_all_layer_kv_cache_overlapping():
    import torch

    sk = _load_stand_in("sgl_kernel")
    bufs = [torch.randn(16, 2, 8), torch.randn(16, 2, 8), torch.randn(16, 3, 4).to(torch.bfloat16)]
    refs = [b.clone() for b in bufs]
    # overlapping: slot 2 is both a source and a target
    tgt = torch.tensor([2, 3, 9], dtype=torch.int64)
    src = torch.tensor([1, 2, 15], dtype=torch.int64)
    data_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs], dtype=torch.int64)
    sk.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, r in zip(bufs, refs):
        r[tgt] = r[src].clone()
        assert torch.equal(b, r)


def test_stand_in_speculative_ops_raise():
    sk = _load_stand_in("sgl_kernel")
    with pytest.raises(NotImplementedError, match="speculative"):
        sk.verify_tree_greedy_cpu(*[None] * 8)
    assert not hasattr(sk, "convert_weight_packed")


def test_torchvision_stub_imports():
    tv = _load_stand_in("torchvision")
    assert tv.transforms.InterpolationMode.BICUBIC.value == "bicubic"
    assert tv.transforms.v2.functional.InterpolationMode is tv.transforms.InterpolationMode
    with pytest.raises(NotImplementedError):
        tv.io.decode_jpeg(b"")
    with pytest.raises(NotImplementedError):
        tv.transforms.Normalize(mean=[0.5], std=[0.5])
    with pytest.raises(NotImplementedError):
        tv.transforms.functional.anything_else()


# --------------------------------------------------------------------------
# stock server
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3):
    return tiny_qwen3


@pytest.fixture(scope="module")
def server(stock_server):
    """The shared stock server: it runs with SGL_SPARSE_STAND_IN_TRACE=stand_in_trace."""
    return stock_server


def _generate(server, payload, timeout=120):
    r = requests.post(server.url + "/generate", json=payload, timeout=timeout)
    assert r.status_code == 200, f"{r.status_code}: {r.text}\n{server.log_tail(40)}"
    return r.json()


@server_test
def test_generate_text_is_deterministic(server):
    t0 = time.monotonic()
    a = _generate(server, {"text": TEXT, "sampling_params": SP})
    latency = time.monotonic() - t0
    b = _generate(server, {"text": TEXT, "sampling_params": SP})
    assert len(a["output_ids"]) == SP["max_new_tokens"]
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"]["type"] == "length"
    print(f"[stock server] /generate 16 tokens: {latency:.3f}s")


@server_test
def test_generate_input_ids_matches_text(server, model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT).input_ids
    by_text = _generate(server, {"text": TEXT, "sampling_params": SP})
    by_ids = _generate(server, {"input_ids": ids, "sampling_params": SP})
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


@server_test
def test_batch_matches_single(server):
    single = _generate(server, {"text": TEXT, "sampling_params": SP})
    batch = _generate(server, {"text": [TEXT, TEXT + " Then", "hello world"], "sampling_params": SP})
    assert isinstance(batch, list) and len(batch) == 3
    assert batch[0]["output_ids"] == single["output_ids"]


@server_test
def test_custom_params_accepted_and_ignored_by_stock(server):
    plain = _generate(server, {"text": TEXT, "sampling_params": SP})
    for cp in (
        SPARSE_PARAMS,
        # other (non-sgl-sparse) keys: dict / list / scalar values
        {"other_plugin": {"a": 1, "b": "x"}, "flag": True, "ids": [1, 2]},
    ):
        out = _generate(server, {"text": TEXT, "sampling_params": dict(SP, custom_params=cp)})
        assert out["output_ids"] == plain["output_ids"], cp


@server_test
def test_output_depends_on_context(server):
    a = _generate(server, {"text": TEXT, "sampling_params": SP})
    b = _generate(server, {"text": "A" + TEXT[1:], "sampling_params": SP})
    c = _generate(server, {"text": TEXT.replace("river", "green"), "sampling_params": SP})
    assert a["output_ids"] != b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    # and the model does not just repeat one token
    assert len(set(a["output_ids"])) > 4


@server_test
def test_openai_chat_and_completion_accept_custom_params(server, model_dir):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello world, what is the answer?"}]
    kw = dict(model=str(model_dir), messages=messages, max_tokens=16, temperature=0)
    with_cp = client.chat.completions.create(**kw, extra_body={"custom_params": SPARSE_PARAMS})
    without = client.chat.completions.create(**kw)
    assert with_cp.choices[0].message.content == without.choices[0].message.content
    assert with_cp.usage.completion_tokens == 16

    comp = client.completions.create(
        model=str(model_dir), prompt=TEXT, max_tokens=16, temperature=0,
        extra_body={"custom_params": SPARSE_PARAMS},
    )
    plain = _generate(server, {"text": TEXT, "sampling_params": SP})
    assert comp.choices[0].text == plain["text"]


@server_test
def test_client_disconnect_aborts_and_server_recovers(server):
    plain = _generate(server, {"text": TEXT, "sampling_params": SP})
    long_sp = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/generate", json={"text": TEXT, "sampling_params": long_sp}, timeout=1.0)
    r = requests.post(server.url + "/abort_request", json={"abort_all": True}, timeout=30)
    assert r.status_code == 200
    again = _generate(server, {"text": TEXT, "sampling_params": SP})
    assert again["output_ids"] == plain["output_ids"]


@server_test
def test_stand_ins_loaded_in_server_subprocesses(server, stand_in_trace):
    _generate(server, {"text": TEXT, "sampling_params": SP})
    lines = stand_in_trace.read_text().splitlines()
    pids = {l.split("pid=")[1].split()[0] for l in lines}
    # launch_server + scheduler + detokenizer (spawned; they inherit PYTHONPATH)
    assert len(pids) >= 3, lines
