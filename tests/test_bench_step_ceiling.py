"""bench/gpu/step_ceiling.py: the ceiling of a sparse decode step from a measured
profile (SGLang's non-attention work and per-step gap as measured, the attended KV at
copy bandwidth, slow steps at a stock step), against hand arithmetic and the committed
H100 profiles."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench_scripts import BENCH, load_bench_script

pytestmark = pytest.mark.sglang_independent

_RESULTS = BENCH / "results"
step_ceiling = load_bench_script("gpu/step_ceiling.py")
from shapes import SHAPES, Shape  # noqa: E402  (bench/gpu, on the path load_bench_script puts it)


def _run(backend, policy, span, busy, top, sparse=None, ctx=1000, batch=2):
    return dict(backend=backend, policy=policy, sparse=sparse, ctx=ctx, batch=batch, steps=64,
                span_ms_per_step=span, gpu_busy_ms_per_step=busy, top=top)


_STOCK = _run("flashinfer", "stock", 10.0, 9.0, [
    dict(name="void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", ms_per_step=6.5, calls_per_step=28),
    dict(name="void flashinfer::PersistentVariableLengthMergeStatesKernel<...>", ms_per_step=0.5, calls_per_step=28),
    dict(name="nvjet_sm90_tst_64x8", ms_per_step=1.5, calls_per_step=84)])
_SFI = _run("sgl_sparse", "sfi-pinned", 4.0, 3.5, [
    dict(name="_two_segment_decode_stage1", ms_per_step=1.0, calls_per_step=28),
    dict(name="_selector_stats", ms_per_step=0.2, calls_per_step=0.06),
    dict(name="nvjet_sm90_tst_64x8", ms_per_step=1.5, calls_per_step=84)],
    sparse=dict(policy="sfi", budget=64, recent=32, sink=4, sentence_triggers=False, t_max=3))


def test_ceiling_matches_hand_arithmetic(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(dict(command="x", results=[_STOCK, _SFI])))
    runs = step_ceiling.load_runs(str(path))
    stock, sfi = runs
    assert stock.attention_ms == pytest.approx(7.0) and sfi.attention_ms == pytest.approx(1.0)
    assert sfi.ours_other_ms == pytest.approx(0.2)
    # budget 64 + recent 32 + sink 4 = 100 keys; t_max 3 without triggers: r = 1/4
    assert step_ceiling.attended_keys(sfi.sparse, sfi.ctx) == 100
    assert step_ceiling.slow_ratio(sfi.sparse) == 0.25
    c = step_ceiling.ceiling(stock, SHAPES["qwen3-1.7b"], 100, 0.25, bandwidth=1e12)
    kv_token = 28 * 8 * 128 * 2 * 2
    fast_attn_ms = 2 * 100 * kv_token / 1e12 * 1e3
    assert c.non_attention_ms == pytest.approx(2.0) and c.gap_ms == pytest.approx(1.0)
    assert c.fast_attention_ms == pytest.approx(fast_attn_ms)
    step = 0.75 * (2.0 + 1.0 + fast_attn_ms) + 0.25 * 10.0
    assert c.step_ms == pytest.approx(step) and c.speedup == pytest.approx(10.0 / step)
    w = 2 * (28 * (2048 * 16 * 128 * 2 + 2048 * 8 * 128 * 2 + 3 * 2048 * 6144) + 151936 * 2048)
    stock_bytes = w + 2 * 1000 * kv_token
    ours = 0.75 * (w + 2 * 100 * kv_token) + 0.25 * stock_bytes
    assert c.roofline_speedup == pytest.approx(stock_bytes / ours)
    (row,) = step_ceiling.rows(runs, SHAPES["qwen3-1.7b"], [], 1e12)
    assert row["measured"] == pytest.approx(10.0 / 4.0)
    assert row["idle_ms"] == pytest.approx(0.5) and row["rest_ms"] == pytest.approx(3.5 - 1.0 - 0.2)


def test_log_with_printed_summaries_and_noise(tmp_path):
    path = tmp_path / "profile.log"
    path.write_text("server up {not json}\n" + json.dumps(_STOCK, indent=1) + "\nnoise\n"
                    + json.dumps(_SFI, indent=1) + "\n")
    runs = step_ceiling.load_runs(str(path))
    assert [(r.backend, r.policy) for r in runs] == [("flashinfer", "stock"), ("sgl_sparse", "sfi-pinned")]
    one = tmp_path / "stock_only.log"
    one.write_text(json.dumps(_STOCK, indent=1))
    assert [r.policy for r in step_ceiling.load_runs(str(one))] == ["stock"]


def test_policy_spec_and_attended_keys():
    assert step_ceiling.parse_policy("sfi-pinned=2308:0.03125:5.74") == ("sfi-pinned", 2308, 0.03125, 5.74)
    assert step_ceiling.parse_policy("streaming=2052:0") == ("streaming", 2052, 0.0, None)
    with pytest.raises(Exception, match="--policy 'sfi'"):
        step_ceiling.parse_policy("sfi")
    assert step_ceiling.attended_keys(dict(policy="streaming", window=2048), 32768) == 2052
    assert step_ceiling.attended_keys(dict(policy="sfi", budget=2048, recent=256, sink=4), 1024) == 1024
    assert step_ceiling.attended_keys(None, 1024) is None
    # natural triggers: the ratio is not known from the policy
    assert step_ceiling.slow_ratio(dict(policy="sfi", budget=2048)) == 0.0


@pytest.mark.parametrize("name", ["profile_decode_h100_8192x32_sfi_pinned_s17.json",
                                  "profile_decode_h100_32768x8_sfi_pinned_s17.json"])
def test_committed_h100_profiles_stay_under_their_ceiling(name):
    """The measured step can not beat a ceiling built from its own stock run: a
    check of the model (and of the kernel classification) on real profiles."""
    runs = step_ceiling.load_runs(str(_RESULTS / name))
    (row,) = step_ceiling.rows(runs, SHAPES["qwen3-1.7b"], [], step_ceiling.COPY_BANDWIDTH)
    c = row["ceiling"]
    assert all(math.isfinite(v) for v in (c.speedup, c.roofline_speedup, row["measured"]))
    assert 1.0 < row["measured"] <= c.speedup < c.roofline_speedup
    assert c.ratio == pytest.approx(1 / 32)
    # the same non-attention work in both servers, within 10%
    assert row["rest_ms"] == pytest.approx(c.non_attention_ms, rel=0.1)


def test_shape_from_hf_config(tmp_path):
    """The public Qwen3-1.7B config gives the table's shape; a Llama-style config
    without head_dim or num_key_value_heads derives them (hidden / heads, MHA)."""
    qwen = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                intermediate_size=6144, tie_word_embeddings=True, head_dim=128, vocab_size=151936)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen))
    assert Shape.from_hf_config(str(path)) == SHAPES["qwen3-1.7b"]
    llama = Shape.from_hf_config(dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      intermediate_size=11008, vocab_size=32000))
    assert (llama.head_dim, llama.kv_heads, llama.tie_embeddings) == (128, 32, False)
    assert llama.kv_bytes_per_token() == 32 * 32 * 128 * 2 * 2
    # Llama-2-7B: 6.74B parameters, of which the input embedding (not read by a step) 131M
    assert llama.weight_bytes_per_step() == pytest.approx(2 * (6.738e9 - 32000 * 4096), rel=2e-3)


def test_cli_with_an_hf_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, intermediate_size=6144, tie_word_embeddings=True,
                                   head_dim=128, vocab_size=151936)))
    prof = str(_RESULTS / "profile_decode_h100_32768x8_sfi_pinned_s17.json")
    assert step_ceiling.main([prof, "--hf-config", str(cfg), "--policy", "streaming=2052:0:4.17"]) == 0
    out = capsys.readouterr().out
    assert "| 32768 x 8 | sfi-pinned |" in out and "| 32768 x 8 | streaming |" in out
    assert step_ceiling.main([prof, "--policy", "streaming=2052:0:4.17"]) == 0
    assert capsys.readouterr().out == out  # --shape qwen3-1.7b, the default: the same numbers
