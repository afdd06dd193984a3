"""`python -m sgl_sparse.memory_plan`: the stores' bytes per GPU before a launch.

Checked against a real server: on an H200, session 28's server with
`bench/gpu/sparse_config_qa_32slots_int4_b4.yaml` on the Qwen3-1.7B shape logged its
stores' sizes at start-up (bench/results/e2e_h200_32768x8_qa32_oom_s28_server_tail.log);
the plan prints the same. Then the ranks' shares at --tp-size (KV heads replicated once
there are more ranks than heads, as SGLang does), which stores exist with decode CUDA
graphs on or off, and the errors that name the flag.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from sgl_sparse.config import SparseServerConfig, load_server_config

ROOT = Path(__file__).resolve().parents[1]
SERVER_LOG = ROOT / "bench/results/e2e_h200_32768x8_qa32_oom_s28_server_tail.log"
# Qwen3-1.7B's config.json fields the plan reads (bench/gpu/shapes.py's qwen3-1.7b)
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "vocab_size": 151936}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-1.7b-config")
    (d / "config.json").write_text(json.dumps(QWEN3_1_7B))
    return d


def _run(*args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgl_sparse.memory_plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=None if env is None else {**os.environ, **env})


def _plan(*args: str, env: Optional[dict] = None) -> dict:
    proc = _run(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_prints_what_the_h200_server_allocated(model):
    found = re.findall(r"sgl_sparse: (\w+) store: .*, ([\d.]+) GiB", SERVER_LOG.read_text())
    logged = {name: float(gib) for name, gib in found}
    assert set(logged) == {"quest", "asyncspade", "lfps"}
    args = ("--model-path", str(model), "--sparse-config", "bench/gpu/sparse_config_qa_32slots_int4_b4.yaml")
    # that server (session 28) copied asyncspade's lists each layer: no pool slots in its store
    copied = {"SGLANG_SPARSE_ASPD_LISTS_IN_PLACE": "0"}
    p = _plan(*args, env=copied)
    assert {k: round(v / 2**30, 3) for k, v in p["stores_bytes"].items()} == logged
    assert p["kv_bytes_per_token"] == 28 * 8 * 2 * 128 * 2 and p["kv_tokens"] == p["total_bytes"] // (28 * 8 * 512)
    text = _run(*args, env=copied).stdout
    assert "quest          7.219 GiB" in text and "total         24.900 GiB" in text, text
    # the default reads them in place: + the selections' pool slots, int32, a row each
    # of the 32 slots and the scratch row (L x (slots + 1) x Hkv x capacity x 4 bytes)
    in_place = _plan(*args)["stores_bytes"]
    capacity = load_server_config(args[-1]).query_aware.asyncspade.capacity
    assert in_place["asyncspade"] - p["stores_bytes"]["asyncspade"] == 28 * 33 * 8 * capacity * 4
    assert {k: v for k, v in in_place.items() if k != "asyncspade"} == {
        k: v for k, v in p["stores_bytes"].items() if k != "asyncspade"}


def test_tensor_parallel_shares(model):
    one = _plan("--model-path", str(model), "--sparse-config", "bench/gpu/sparse_config_32k8.yaml")
    two = _plan("--model-path", str(model), "--sparse-config", "bench/gpu/sparse_config_32k8.yaml", "--tp-size", "2")
    sixteen = _plan("--model-path", str(model), "--tp-size", "16")
    assert (one["shape"]["kv_heads"], two["shape"]["kv_heads"], sixteen["shape"]["kv_heads"]) == (8, 4, 1)
    assert (one["shape"]["q_heads"], two["shape"]["q_heads"]) == (16, 8)
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    assert 0 < two["total_bytes"] < one["total_bytes"]


def test_cuda_graphs_decide_which_query_aware_stores_exist(model):
    on = _plan("--model-path", str(model))  # the defaults: query-aware policies off in decode graphs
    off = _plan("--model-path", str(model), "--disable-cuda-graph")
    assert set(on["stores_bytes"]) == {"sfi"} and on["not_offered"] == ["asyncspade", "lfps", "quest"]
    assert set(off["stores_bytes"]) == {"sfi", "quest", "asyncspade", "lfps"} and off["not_offered"] == []
    assert off["stores_bytes"]["sfi"] == on["stores_bytes"]["sfi"] and on["key_norm_bytes_per_token"] == 28 * 8 * 4


def test_fp8_kv_cache_offers_every_policy(model):
    """With an fp8 KV cache the server offers every policy (the decode kernel reads fp8;
    quest's bounds, asyncspade's query ring and lfps's tables are kept in the model's
    dtype or fp32, the same bytes as over bf16; SFI's compact K/V copy fp8 pool rows,
    half their bf16 bytes, beside queries in the model's dtype). A token of KV is half
    the bf16 one, so the same store is twice as many KV tokens."""
    bf16 = _plan("--model-path", str(model), "--disable-cuda-graph")
    cfg = SparseServerConfig()
    shape = dict(layers=28, hkv=8, hq=16, d=128)  # the plan's model (Qwen3-1.7B's config)
    kv_elems = shape["layers"] * cfg.compact.slots * shape["hkv"] * cfg.compact.capacity * shape["d"] * 2
    for name in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = _plan("--model-path", str(model), "--disable-cuda-graph", "--kv-cache-dtype", name)
        assert set(fp8["stores_bytes"]) == {"quest", "asyncspade", "lfps", "sfi"}
        for store in ("quest", "asyncspade", "lfps"):
            assert fp8["stores_bytes"][store] == bf16["stores_bytes"][store], store
        # the compact K/V at 1 byte a value instead of 2; the queries, logits and norms unchanged
        assert bf16["stores_bytes"]["sfi"] - fp8["stores_bytes"]["sfi"] == kv_elems
        assert fp8["not_offered"] == []
        assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
        assert fp8["kv_tokens"] == fp8["total_bytes"] // fp8["kv_bytes_per_token"]
        assert fp8["shape"]["dtype"] == {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[name]


@pytest.mark.parametrize("args,message", [
    (("--model-path", "/nonexistent"), "--model-path: no config.json"),
    (("--tp-size", "3"), "--tp-size 3: must divide the model's 16 attention heads"),
    (("--kv-cache-dtype", "mxfp8"), "--kv-cache-dtype mxfp8"),
    (("--sparse-config", "/nonexistent.yaml"), "--sparse-config: file not found"),
])
def test_bad_flags_name_the_flag(model, args, message):
    base = [] if "--model-path" in args else ["--model-path", str(model)]
    proc = _run(*base, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_cache_device_plans_the_selection_on_its_gpu(model, tmp_path):
    """query_aware.asyncspade.cache_device: asyncspade's copies, scores and Top-K buffers
    are planned on the cache GPU (printed apart, not out of this GPU's budget); one
    cache GPU serves one serving GPU, so --tp-size 2 is refused naming the field.
    (In process: the CLI's flags are the tests above.)"""
    from sgl_sparse import memory_plan

    aspd = "  asyncspade: {slots: 8, max_context: 32768, index_keys: int4, topk_layers: 14"
    here, there = tmp_path / "here.yaml", tmp_path / "there.yaml"
    here.write_text(f"query_aware:\n{aspd}}}\n")
    there.write_text(f"query_aware:\n{aspd}, cache_device: 'cuda:1'}}\n")
    a = memory_plan.plan(str(model), str(here), cuda_graphs=False)
    b = memory_plan.plan(str(model), str(there), cuda_graphs=False)
    assert a["cache_device_bytes"] == {} and set(b["cache_device_bytes"]) == {"cuda:1"}
    moved = b["cache_device_bytes"]["cuda:1"]
    # int4 copies of 8 slots x 28 layers x 8 KV heads x 32768 positions: 64 B codes + a 4 B scale each
    assert moved > 8 * 28 * 8 * 32768 * 68
    assert b["stores_bytes"]["asyncspade"] < a["stores_bytes"]["asyncspade"] < moved + b["stores_bytes"]["asyncspade"]
    assert {k: v for k, v in a["stores_bytes"].items() if k != "asyncspade"} == \
        {k: v for k, v in b["stores_bytes"].items() if k != "asyncspade"}
    assert "asyncspade's selection on its cache GPU cuda:1 (not from this GPU's budget)" in memory_plan._report(b)
    with pytest.raises(ValueError, match="query_aware.asyncspade.cache_device 'cuda:1': one cache GPU"):
        memory_plan.plan(str(model), str(there), tp_size=2, cuda_graphs=False)
