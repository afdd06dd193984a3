#!/usr/bin/env python3
"""Markdown table from server_compare.py JSON files, with the memory roofline.

roofline tok/s = batch / ((KV bytes read per step + weight bytes) / copy bandwidth),
KV bytes per token = layers * kv_heads * head_dim * 2 (K and V) * 2 bytes (bf16);
a request attends min(n, window + sink) tokens, n = context + out_len / 2 (mean).
    python bench/gpu/summarize.py bench/results/e2e_h100_run*.json
"""
import json
import sys

from shapes import SHAPES  # bench/gpu, next to this script

# The tables' documented constants (../shared/gpu/README.md: rounded weights, measured
# copy bandwidth); the KV bytes per token from the shape, as step_ceiling.py takes them.
WEIGHT_BYTES, BANDWIDTH = 3.4e9, 3.0e12
KV_PER_TOKEN = SHAPES["qwen3-1.7b"].kv_bytes_per_token()


def roofline(batch, n, attended):
    return batch / ((batch * attended * KV_PER_TOKEN + WEIGHT_BYTES) / BANDWIDTH)


def main(paths):
    print("| context x batch | policy | flashinfer tok/s | sgl_sparse tok/s | ratio | roofline speedup | % of roofline speedup |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        d = json.load(open(path))
        for cmp in d["compare"]:
            for r in cmp["rows"]:
                case = next(c for run in d["runs"] if run["backend"] == cmp["backend"] for c in run["cases"]
                            if c["ctx"] == r["ctx"] and c["batch"] == r["batch"] and c["policy"] == r["policy"])
                n = r["ctx"] + case["out_len"] / 2
                sp = case["sparse"] or {}
                attended = n if r["policy"] == "full" else min(n, sp.get("window", 0) + 4)
                roof = roofline(r["batch"], n, attended) / roofline(r["batch"], n, n)
                pct = f"{100 * (r['ratio'] - 1) / (roof - 1):.0f}%" if roof > 1.05 else "-"
                print(f"| {r['ctx']} x {r['batch']} | {r['policy']} | {r['stock_tok_s']} | {r['tok_s']} | {r['ratio']:.3f} | {roof:.2f}x | {pct} |")


if __name__ == "__main__":
    main(sys.argv[1:])
