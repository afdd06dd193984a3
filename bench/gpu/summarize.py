#!/usr/bin/env python3
"""Markdown table from server_compare.py JSON files, with the memory roofline.

roofline tok/s = batch / ((KV bytes read per step + weight bytes) / copy bandwidth),
KV bytes per token = layers * kv_heads * head_dim * 2 (K and V) * 2 bytes (bf16);
n = context + out_len / 2 (the mean length). A request attends per step:
  full                     n
  streaming / sadas        min(n, window + sink)
  sfi                      (1 - r) * min(n, budget + recent + sink) + r * n, with r the
                           pinned slow ratio 1 / (t_max + 1), else the run's measured one
  quest / asyncspade / lfps  "-": what they read besides the selected keys (page bounds,
                           every key's score) is not a fixed count of keys; their
                           ceiling is step_ceiling.py's.
    python bench/gpu/summarize.py [--shape qwen3-4b] bench/results/e2e_h100_run*.json
"""
import argparse
import json
from typing import Optional

from shapes import SHAPES  # bench/gpu, next to this script
from step_ceiling import attended_keys, slow_ratio

# The tables' documented copy bandwidth (../shared/gpu/README.md: measured); for the
# Qwen3-1.7B shape the tables' rounded weight bytes, else the shape's own.
BANDWIDTH = 3.0e12
WEIGHT_BYTES = {"qwen3-1.7b": 3.4e9}


def roofline(batch, attended, kv_per_token, weight_bytes):
    return batch / ((batch * attended * kv_per_token + weight_bytes) / BANDWIDTH)


def attended(policy: str, sparse, n: float, measured_slow: float) -> Optional[float]:
    """Keys a request reads per step and KV head on average; None where not a fixed count.
    A mixed row (server_compare's 'A+B': a list, dealt round-robin): its members' mean."""
    if isinstance(sparse, list):
        each = [attended(m.get("policy", ""), m, n, measured_slow) for m in sparse]
        return None if None in each else sum(each) / len(each)
    if policy in ("full", "stock") or not sparse or sparse.get("policy") == "full":
        return n
    keys = attended_keys(sparse, int(n))
    if keys is None:
        return None
    if sparse.get("policy") == "sfi":
        r = slow_ratio(sparse) or measured_slow
        return (1 - r) * keys + r * n
    return keys


def rows(paths, shape: str = "qwen3-1.7b"):
    """(row of the compare table, roofline speedup or None) for every compared row."""
    kv = SHAPES[shape].kv_bytes_per_token()
    weights = WEIGHT_BYTES.get(shape, SHAPES[shape].weight_bytes_per_step())
    for path in paths:
        d = json.load(open(path))
        for cmp in d["compare"]:
            for r in cmp["rows"]:
                case = next(c for run in d["runs"] if run["backend"] == cmp["backend"] for c in run["cases"]
                            if c["ctx"] == r["ctx"] and c["batch"] == r["batch"] and c["policy"] == r["policy"])
                n = r["ctx"] + case["out_len"] / 2
                a = attended(r["policy"], case.get("sparse"), n, float(r.get("slow_step_ratio") or 0.0))
                roof = None if a is None else (roofline(r["batch"], a, kv, weights) /
                                               roofline(r["batch"], n, kv, weights))
                yield r, roof


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("paths", nargs="+")
    a = ap.parse_args(argv)
    print("| context x batch | policy | flashinfer tok/s | sgl_sparse tok/s | ratio | roofline speedup | % of roofline speedup |")
    print("|---|---|---|---|---|---|---|")
    for r, roof in rows(a.paths, a.shape):
        pct = f"{100 * (r['ratio'] - 1) / (roof - 1):.0f}%" if roof is not None and roof > 1.05 else "-"
        shown = f"{roof:.2f}x" if roof is not None else "-"
        print(f"| {r['ctx']} x {r['batch']} | {r['policy']} | {r['stock_tok_s']} | {r['tok_s']} | {r['ratio']:.3f} | {shown} | {pct} |")


if __name__ == "__main__":
    main()
