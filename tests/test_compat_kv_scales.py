"""compat.kv_key_scales: each attention layer's fp8 key scale, read from the model's
real SGLang `RadixAttention` modules (what SFI's refresh reads several layers' keys
with, outside their forward), by layer id, for a rank's or a pipeline stage's layers.

In a subprocess with the installed SGLang (its imports need the CPU stand-ins,
tests/cpu_stand_ins), as tests/test_memory_headroom.py does.
"""

from __future__ import annotations

import pytest

from tests.server import run_snippet

pytestmark = pytest.mark.timeout(300)

SNIPPET = r"""
import json
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sgl_sparse import compat


def decoder(layer_ids):
    # attention layers nested as a model nests them (model.layers[i].self_attn.attn)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in layer_ids:
        block = torch.nn.Module()
        block.self_attn = torch.nn.Module()
        block.self_attn.attn = RadixAttention(num_heads=4, head_dim=8, scaling=8 ** -0.5, num_kv_heads=2, layer_id=i)
        model.layers.append(block)
    return model


out = {}
model = decoder(range(4))
out["default"] = compat.kv_key_scales(model, 0, 4)
# as BaseKVCacheMethod.process_weights_after_loading sets them from a checkpoint's scales
model.layers[1].self_attn.attn.k_scale_float = 0.5
model.layers[3].self_attn.attn.k_scale_float = 2.0
out["scaled"] = compat.kv_key_scales(model, 0, 4)
stage = decoder(range(4, 8))  # a pipeline stage holding layers 4..7
stage.layers[0].self_attn.attn.k_scale_float = 0.25
out["stage"] = compat.kv_key_scales(stage, 4, 4)
out["stage_first_two"] = compat.kv_key_scales(stage, 4, 2)
print("RESULT " + json.dumps(out))
"""


def test_key_scales_by_layer_id():
    out = run_snippet(SNIPPET)
    assert out["default"] == [None] * 4  # SGLang's default: no calibrated scales
    assert out["scaled"] == [None, 0.5, None, 2.0]
    assert out["stage"] == [0.25, None, None, None]
    assert out["stage_first_two"] == [0.25, None]  # layers past the pool's: not counted
