"""bench/gpu/make_random_model.py's --qk-norm-gain: every layer's q_norm and k_norm
weights set to the gain, nothing else changed, and the attention logits of a layer
scaled by its square (a tiny Qwen3 config on CPU; the benchmark writes the real shapes).
Not marked sglang_independent: it needs transformers, which the SGLang venvs pin."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "gpu"))
from make_random_model import set_qk_norm_gain  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402


def _tiny() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=64)
    return Qwen3ForCausalLM(cfg)


def _logits(model: Qwen3ForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's q.k over the normed q/k projections of the hidden states x [n, hidden] (no RoPE)."""
    attn = model.model.layers[0].self_attn
    q = attn.q_norm(attn.q_proj(x).view(len(x), -1, 16))
    k = attn.k_norm(attn.k_proj(x).view(len(x), -1, 16))
    return torch.einsum("qhd,khd->hqk", q[:, ::2], k)  # query heads 0 and 2 against KV heads 0 and 1


def test_qk_norm_gain_sets_the_norms_and_scales_the_logits_by_its_square():
    plain, gained = _tiny(), _tiny()
    set_qk_norm_gain(gained, 2.5)
    before, after = plain.state_dict(), gained.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")}
    assert all(bool((after[k] == 2.5).all()) for k in changed)
    x = torch.randn(8, 32)
    with torch.no_grad():
        ratio = _logits(gained, x) / _logits(plain, x)
    assert torch.allclose(ratio, torch.full_like(ratio, 6.25), rtol=1e-4)


def test_a_checkpoint_from_the_same_arguments_is_kept(tmp_path, monkeypatch, capsys):
    """Every e2e call of a lease runs make_random_model.py: the same arguments keep the
    checkpoint already written (its files untouched), other ones, or a write cut short
    (no marker), write it again."""
    import json

    import make_random_model as M
    from shapes import SHAPES, Shape

    monkeypatch.setitem(SHAPES, "tiny", Shape(32, 2, 4, 2, 64, True, head_dim=16, vocab=64))
    out = tmp_path / "model"
    argv = ["--shape", "tiny", "--out", str(out), "--vocab", "64", "--max-pos", "64"]
    M.main(argv)
    shard = next(out.glob("*.safetensors"))
    stamp = shard.stat().st_mtime_ns
    assert "wrote tiny" in capsys.readouterr().out
    M.main(argv)
    assert "kept tiny" in capsys.readouterr().out and shard.stat().st_mtime_ns == stamp
    M.main([*argv, "--qk-norm-gain", "2.5"])  # another model: written again
    assert "wrote tiny" in capsys.readouterr().out
    (out / M.MARKER).unlink()  # as after a write cut short
    M.main([*argv, "--qk-norm-gain", "2.5"])
    assert "wrote tiny" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 64
