"""Qwen3 model shapes (from the public configs) and the bytes a decode step reads.

Shared by make_random_model.py (which writes checkpoints of these shapes) and the
roofline / ceiling arithmetic (step_ceiling.py), so both use one set of numbers.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

HEAD_DIM = 128  # every Qwen3 size
VOCAB = 151936


class Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie_embeddings: bool

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        """K and V of one token over every layer (bf16: elem = 2)."""
        return self.layers * self.kv_heads * HEAD_DIM * 2 * elem

    def weight_bytes_per_step(self, elem: int = 2, vocab: int = VOCAB) -> int:
        """Weights a decode step reads: every layer's projections and MLP, and the
        LM head (the input embedding is only gathered by row, so an untied one adds
        nothing). Norm weights are negligible."""
        h, d = self.hidden, HEAD_DIM
        per_layer = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * self.intermediate
        return elem * (self.layers * per_layer + vocab * h)


SHAPES: Dict[str, Shape] = {
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": Shape(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, False),
}
