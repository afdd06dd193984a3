"""What a CUDA server offers with decode CUDA graphs on: quest and asyncspade
(their decode selection is captured, sgl_sparse/query_device.py), not lfps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_sparse import plugin
from sgl_sparse.config import ENV_CONFIG, config_from_env


@pytest.mark.parametrize("graphs, off", [(True, {"lfps"}), (False, set())])
def test_query_aware_offered_with_decode_graphs(monkeypatch, graphs, off):
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    monkeypatch.setattr("sgl_sparse.tokens.resolve_think_ids", lambda cfg, *a, **k: cfg)
    args = SimpleNamespace(attention_backend="sgl_sparse", device="cuda", model_path="m", tokenizer_path="m",
                           disable_cuda_graph=not graphs, cuda_graph_config=None, speculative_algorithm=None)
    plugin.server_args_resolved(None, args)
    cfg = config_from_env()
    assert {p for p in ("quest", "asyncspade", "lfps") if cfg.unavailable_reason(p)} == off
