"""How much GPU memory a --sparse-config's stores take, before anything is launched.

    python -m sgl_sparse.memory_plan --model-path DIR --sparse-config FILE [--tp-size N]
        [--context-length N] [--kv-cache-dtype auto|bf16|fp16|fp32] [--disable-cuda-graph] [--json]

For sizing `--mem-fraction-static`, the config's slots and a pod's GPU before the pod is
scheduled: the bytes each GPU (one rank of `--tp-size`) takes out of SGLang's KV pool
budget at start-up for SFI's compact buffers and the query-aware policies' stores, and
how many tokens of KV that is. They are store_budget's bytes, the very stores the
backend allocates built on the meta device; the model's shape comes from its
`config.json` as SGLang reads it (KV heads split over the ranks, at least one each).
With decode CUDA graphs on (SGLang's CUDA default), a query-aware policy whose
`cuda_graphs` is false is not offered and gets no store, as at start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from sgl_sparse.config import SparseConfigError, load_server_config
from sgl_sparse.plugin import KV_CACHE_DTYPES, with_unavailable
from sgl_sparse.store_budget import StoreShape, cache_device_bytes, planned_bytes

# the model's torch_dtype and the --kv-cache-dtype spellings the server accepts (plugin.KV_CACHE_DTYPES)
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def model_shape(model_path: str, tp_size: int = 1, context_length: Optional[int] = None,
                kv_cache_dtype: str = "auto") -> StoreShape:
    """One rank's StoreShape of the Hugging Face checkpoint at `model_path`."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model-path: no config.json in {model_path!r}")
    c = json.loads(path.read_text())
    c = c.get("text_config", c)  # multimodal wrappers keep the decoder's fields there
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    if tp_size < 1 or heads % tp_size:
        raise ValueError(f"--tp-size {tp_size}: must divide the model's {heads} attention heads")
    if kv_cache_dtype not in KV_CACHE_DTYPES:  # what the server refuses at start-up
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: one of {', '.join(KV_CACHE_DTYPES)}")
    model = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    if model not in _DTYPES:
        raise ValueError(f"{path}: torch_dtype {model!r} is not a floating dtype the KV pool can hold")
    name = model if kv_cache_dtype == "auto" else kv_cache_dtype
    return StoreShape(
        num_layers=int(c["num_hidden_layers"]), num_kv_heads=max(1, kv_heads // tp_size),
        num_q_heads=heads // tp_size, head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        dtype=_DTYPES[name], context_len=int(context_length or c.get("max_position_embeddings") or 32768),
        model_dtype=_DTYPES[model])


def plan(model_path: str, sparse_config: Optional[str], *, tp_size: int = 1, context_length: Optional[int] = None,
         kv_cache_dtype: str = "auto", cuda_graphs: bool = True) -> dict:
    """The stores one GPU holds: bytes by store, in all, per pool token, as KV tokens."""
    cfg = with_unavailable(load_server_config(sparse_config), decode_graphs=cuda_graphs)
    shape = model_shape(model_path, tp_size, context_length, kv_cache_dtype)
    fixed, per_slot = planned_bytes(cfg, shape)
    cache = cache_device_bytes(cfg, shape)
    if cache and tp_size > 1:
        raise ValueError(f"query_aware.asyncspade.cache_device {cfg.query_aware.asyncspade.cache_device!r}: one "
                         f"cache GPU serves one serving GPU, not --tp-size {tp_size}")
    total, cell = sum(fixed.values()), shape.kv_cell_bytes()
    return {"tp_size": tp_size, "shape": {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads,
                                          "q_heads": shape.num_q_heads, "head_dim": shape.head_dim,
                                          "dtype": str(shape.dtype).removeprefix("torch."),
                                          "context_len": shape.context_len},
            "stores_bytes": fixed, "total_bytes": total, "key_norm_bytes_per_token": per_slot,
            "kv_bytes_per_token": cell, "kv_tokens": total // cell, "cache_device_bytes": cache,
            "not_offered": sorted(cfg.unavailable)}


def _report(p: dict) -> str:
    s = p["shape"]
    gib = lambda n: f"{n / 2**30:9.3f} GiB"  # noqa: E731
    lines = [f"sgl_sparse stores on each GPU (tp {p['tp_size']}: {s['layers']} layers, {s['kv_heads']} KV heads, "
             f"{s['q_heads']} query heads, head_dim {s['head_dim']}, {s['dtype']}), taken out of the KV pool's budget:"]
    lines += [f"  {name:<11}{gib(n)}" for name, n in p["stores_bytes"].items()] or ["  (none: no store has slots)"]
    lines.append(f"  {'total':<11}{gib(p['total_bytes'])} = {p['kv_tokens']:,} tokens of KV "
                 f"({p['kv_bytes_per_token']:,} B a token)")
    if p["key_norm_bytes_per_token"]:
        lines.append(f"  + SFI's key norms, {p['key_norm_bytes_per_token']} B a KV-pool token")
    for device, n in p["cache_device_bytes"].items():
        lines.append(f"  asyncspade's selection on its cache GPU {device} (not from this GPU's budget): {gib(n)}")
    if p["not_offered"]:
        lines.append(f"  not offered (no store): {', '.join(p['not_offered'])}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgl_sparse.memory_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="a Hugging Face checkpoint directory (its config.json)")
    ap.add_argument("--sparse-config", default=None, help="the server's --sparse-config (default: the defaults)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=None, help="as SGLang's flag (default: the model's)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help=f"as SGLang's flag: {', '.join(KV_CACHE_DTYPES)} (fp8: the pool's tokens are half the bytes; "
                         f"SFI's compact K/V are fp8 too)")
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="decode CUDA graphs off: every query-aware policy with slots gets its store")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    try:
        p = plan(a.model_path, a.sparse_config, tp_size=a.tp_size, context_length=a.context_length,
                 kv_cache_dtype=a.kv_cache_dtype, cuda_graphs=not a.disable_cuda_graph)
    except (SparseConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, indent=1) if a.json else _report(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
