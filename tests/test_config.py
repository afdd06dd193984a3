"""Server config and request metadata validation: every error names its field."""

import json
from pathlib import Path

import pytest

from sgl_sparse.config import (
    SparseConfigError,
    SparseServerConfig,
    load_server_config,
    parse_request_policy,
)

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

CFG = SparseServerConfig(think_start_id=5, think_end_id=6)
ROOT = Path(__file__).resolve().parent.parent


def test_defaults_fill_in_and_request_overrides():
    p = parse_request_policy({"policy": "streaming", "window": 16}, CFG)
    assert (p.policy, p.window, p.sink) == ("streaming", 16, 4)
    assert parse_request_policy(None, CFG).policy == "full"
    assert parse_request_policy("sadas", CFG).window == 2048
    server = SparseServerConfig(default_policy="streaming", think_start_id=5, think_end_id=6)
    assert parse_request_policy({}, server).policy == "streaming"
    assert parse_request_policy({"window": 8}, server).window == 8


@pytest.mark.parametrize(
    "raw, field, words",
    [
        ({"policy": "nope"}, "custom_params.sparse.policy", "full, streaming, sadas"),
        ({"policy": 3}, "custom_params.sparse.policy", "must be one of"),
        ({"policy": "streaming", "window": 0}, "custom_params.sparse.window", "greater than or equal to 1"),
        ({"policy": "streaming", "window": "12"}, "custom_params.sparse.window", "valid integer"),
        ({"policy": "streaming", "window": True}, "custom_params.sparse.window", "valid integer"),
        ({"policy": "sadas", "sink": -1}, "custom_params.sparse.sink", "greater than or equal to 0"),
        ({"policy": "full", "window": 4}, "custom_params.sparse.window", "unknown field"),
        ({"policy": "sfi", "min_saving": 1}, "custom_params.sparse.min_saving", "less than 1"),
        ({"policy": "sfi", "min_saving": -0.1}, "custom_params.sparse.min_saving", "greater than or equal to 0"),
        ([1, 2], "custom_params.sparse", "must be an object"),
    ],
)
def test_bad_request_metadata_names_field(raw, field, words):
    with pytest.raises(SparseConfigError) as e:
        parse_request_policy(raw, CFG)
    assert str(e.value).startswith(field + ":")
    assert words in str(e.value)


def test_sadas_unavailable_without_think_tokens():
    with pytest.raises(SparseConfigError, match="'sadas' is not available"):
        parse_request_policy({"policy": "sadas"}, SparseServerConfig())


def test_config_file_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("default_policy: sadas\npolicies:\n  sadas:\n    window: 64\n")
    cfg = load_server_config(str(y))
    assert cfg.default_policy == "sadas" and cfg.policies.sadas.window == 64
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"policies": {"streaming": {"window": 32, "sink": 0}}}))
    cfg = load_server_config(str(j), default_policy="streaming")
    assert cfg.default_policy == "streaming" and cfg.policies.streaming.sink == 0


@pytest.mark.parametrize(
    "text, words",
    [
        ("default_policy: fast\n", "default_policy"),
        ("policies:\n  streaming:\n    window: -3\n", "policies.streaming.window"),
        ("polices: {}\n", "polices: unknown field"),
        ("- a\n- b\n", "top level"),
        ("a: [\n", "not valid YAML"),
        # asyncspade's alone: quest / lfps score no keys with a predicted query
        ("query_aware:\n  quest: {index_keys: int8}\n", "query_aware.quest.index_keys: unknown field"),
        ("query_aware:\n  asyncspade: {index_keys: fp8}\n", "query_aware.asyncspade.index_keys"),
        ("query_aware:\n  asyncspade: {topk_layers: 0}\n", "query_aware.asyncspade.topk_layers"),
        ("query_aware:\n  lfps: {topk_layers: 4}\n", "query_aware.lfps.topk_layers: unknown field"),
        ("query_aware:\n  asyncspade: {score_programs_per_sm: 0}\n", "query_aware.asyncspade.score_programs_per_sm"),
        ("query_aware:\n  asyncspade: {score_blocks_per_program: -1}\n",
         "query_aware.asyncspade.score_blocks_per_program"),
        ("query_aware:\n  asyncspade: {cache_device: gpu1}\n", "query_aware.asyncspade.cache_device"),
        ("query_aware:\n  asyncspade: {cache_device: 1}\n", "query_aware.asyncspade.cache_device"),
        ("query_aware:\n  quest: {cache_device: 'cuda:1'}\n", "query_aware.quest.cache_device: unknown field"),
    ],
)
def test_bad_config_file_names_field(tmp_path, text, words):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SparseConfigError) as e:
        load_server_config(str(p))
    assert "--sparse-config" in str(e.value) and words in str(e.value)


def test_missing_config_file():
    with pytest.raises(SparseConfigError, match="file not found"):
        load_server_config("/nonexistent/sparse.yaml")


# The bench scripts pass these to --sparse-config: a field typo, or a trigger file that
# does not read, would only show on the lent GPU, after the wheelhouse and a server start.
BENCH_CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("bench/**/sparse_config*.yaml"))


@pytest.mark.parametrize("path", BENCH_CONFIGS)
def test_committed_sparse_configs_load(path, monkeypatch):
    from sgl_sparse.tokens import sentence_trigger_ids

    monkeypatch.chdir(ROOT)  # their trigger_ids_path is relative to the repo, as run_all.sh runs them
    cfg = load_server_config(path)
    assert isinstance(cfg, SparseServerConfig)
    if cfg.trigger_ids_path:
        table = sentence_trigger_ids(cfg, 151936)  # Qwen3's vocabulary, the benchmarks' model shape
        assert 0 < table.sum() < len(table)


def test_bench_configs_found():
    assert "bench/gpu/sparse_config_sfi_130k4.yaml" in BENCH_CONFIGS and len(BENCH_CONFIGS) >= 8
