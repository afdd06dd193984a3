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
