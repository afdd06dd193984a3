"""What a CUDA server offers with decode CUDA graphs on: quest, asyncspade and lfps
where the config opts in (their decode selection is captured,
sgl_sparse/query_device.py, and then runs at every decode step); everything with
graphs off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sgl_sparse import plugin
from sgl_sparse.config import ENV_CONFIG, SparseServerConfig, config_from_env


@pytest.mark.parametrize("graphs, opt_in, off", [
    (True, (), {"quest", "asyncspade", "lfps"}),
    (True, ("quest", "asyncspade", "lfps"), set()),
    (True, ("asyncspade",), {"quest", "lfps"}),
    (True, ("lfps",), {"quest", "asyncspade"}),
    (False, (), set()),
])
def test_query_aware_offered_with_decode_graphs(monkeypatch, graphs, opt_in, off):
    cfg = SparseServerConfig.model_validate({"query_aware": {p: {"cuda_graphs": True} for p in opt_in}})
    monkeypatch.setenv(ENV_CONFIG, json.dumps(json.loads(cfg.model_dump_json())))
    monkeypatch.setattr("sgl_sparse.tokens.resolve_think_ids", lambda cfg, *a, **k: cfg)
    args = SimpleNamespace(attention_backend="sgl_sparse", device="cuda", model_path="m", tokenizer_path="m",
                           disable_cuda_graph=not graphs, cuda_graph_config=None, speculative_algorithm=None)
    plugin.server_args_resolved(None, args)
    cfg = config_from_env()
    assert {p for p in ("quest", "asyncspade", "lfps") if cfg.unavailable_reason(p)} == off
    for p in off & {"quest", "lfps"} if graphs else ():
        assert f"query_aware.{p}.cuda_graphs" in cfg.unavailable_reason(p)


def _cuda_args(**kw):
    return SimpleNamespace(attention_backend="sgl_sparse", device="cuda", model_path="m", tokenizer_path="m",
                           disable_cuda_graph=True, cuda_graph_config=None, speculative_algorithm=None, **kw)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_offers_every_policy(monkeypatch, kv_dtype):
    """An fp8 cache: every policy (the decode kernel and FlashInfer read fp8, the
    selections read the stored keys with the layers' key scales; quest's bounds are kept
    in the model's dtype). (The CUDA server's arguments: on CPU the plugin's path is the
    same.)"""
    monkeypatch.setenv(ENV_CONFIG, SparseServerConfig().model_dump_json())
    monkeypatch.setattr("sgl_sparse.tokens.resolve_think_ids", lambda cfg, *a, **k: cfg)
    plugin.server_args_resolved(None, _cuda_args(kv_cache_dtype=kv_dtype))
    cfg = config_from_env()
    assert not any(cfg.unavailable_reason(p) for p in ("full", "streaming", "sfi", "quest", "asyncspade", "lfps"))
    assert "kv-cache-dtype" not in (cfg.unavailable_reason("sadas") or "")  # (here: no think tokens)


E4M3_SNIPPET = r"""
import json, torch
from sgl_sparse.backend import _check_kv_dtype

def err(*a):
    try:
        _check_kv_dtype(*a)
        return None
    except ValueError as e:
        return str(e)

e4, e5, bf = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
print("RESULT " + json.dumps({
    "e4m3_sm80": err(e4, bf, (8, 0)), "e5m2_sm80": err(e5, bf, (8, 0)), "e4m3_sm89": err(e4, bf, (8, 9)),
    "e4m3_sm90": err(e4, bf, (9, 0)), "bf16_sm75": err(bf, bf, (7, 5)), "fp16_sm90": err(torch.float16, bf, (9, 0)),
}))
"""


def test_e4m3_cache_needs_compute_capability_8_9_by_name():
    """The backend's start-up check: e4m3 on an A100 (sm_80) stops with the flag and the
    way out (Triton compiles e4m3 for sm_89+ only); e5m2 there, and e4m3 on an H100,
    pass; the model's dtype passes anywhere, another dtype is refused. (A fresh
    interpreter: the backend imports SGLang, with its CPU stand-ins.)"""
    from tests.server import run_snippet

    out = run_snippet(E4M3_SNIPPET)
    assert "--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9" in out["e4m3_sm80"]
    assert "this one is 8.0: use --kv-cache-dtype fp8_e5m2" in out["e4m3_sm80"]
    assert out["e5m2_sm80"] is None and out["e4m3_sm89"] is None and out["e4m3_sm90"] is None
    assert out["bf16_sm75"] is None and "must be the model's" in out["fp16_sm90"]


def test_block_quantized_kv_cache_stops_startup_naming_the_flag(monkeypatch, capsys):
    """fp4 / mxfp8 caches (packed values with block scales) are refused, not misread.
    (On CPU SGLang refuses them first: the CUDA server's arguments here.)"""
    monkeypatch.setenv(ENV_CONFIG, SparseServerConfig().model_dump_json())
    with pytest.raises(SystemExit) as e:
        plugin.server_args_resolved(None, _cuda_args(kv_cache_dtype="fp4_mx_block16"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-cache-dtype fp4_mx_block16" in err
    assert "other quantized KV caches are not supported yet" in err and "fp8_e4m3, fp8_e5m2" in err
