"""Model shapes and the bytes a decode step reads.

Shared by make_random_model.py (which writes checkpoints of the Qwen3 shapes below)
and the roofline / ceiling arithmetic (step_ceiling.py), so both use one set of
numbers. Any other dense-attention model: `Shape.from_hf_config(config.json)`.
"""
from __future__ import annotations

import json
from typing import Dict, NamedTuple, Union


class Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie_embeddings: bool
    head_dim: int = 128  # every Qwen3 size
    vocab: int = 151936

    @classmethod
    def from_hf_config(cls, config: Union[str, dict]) -> "Shape":
        """A Hugging Face `config.json` (path or dict) of a decoder with GQA/MHA
        attention and a gated MLP (Llama, Qwen2/3, Mistral, ...)."""
        c = json.load(open(config)) if isinstance(config, str) else config
        heads = int(c["num_attention_heads"])
        return cls(hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads), intermediate=int(c["intermediate_size"]),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads), vocab=int(c["vocab_size"]))

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        """K and V of one token over every layer (bf16: elem = 2)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * elem

    def weight_bytes_per_step(self, elem: int = 2) -> int:
        """Weights a decode step reads: every layer's projections and gated MLP, and
        the LM head (the input embedding is only gathered by row, so an untied one
        adds nothing). Norm weights are negligible."""
        h, d = self.hidden, self.head_dim
        per_layer = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * self.intermediate
        return elem * (self.layers * per_layer + self.vocab * h)


SHAPES: Dict[str, Shape] = {
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": Shape(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, False),
}
