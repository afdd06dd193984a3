#!/usr/bin/env python3
"""How fast a sparse decode step can be at most, from a measured step profile.

The issues' targets are "x% of the roofline speedup": every byte a step reads
(weights + the KV it attends) at the measured copy bandwidth, for stock and for the
sparse policy. That roofline assumes the model's non-attention work (GEMMs, norms,
RoPE, KV stores, sampling) also runs at copy bandwidth. An attention backend cannot
change that work, so this script also reports the ceiling with that part as measured:

  non-attention = stock's GPU busy time per step minus its attention kernels
  gap           = stock's step span minus its GPU busy time (SGLang's own per-step
                  idle between graph replays)
  fast step     = non-attention + gap + the attended KV at copy bandwidth
  slow step     = a stock step (a dense step plus the refresh: never less)
  ceiling step  = (1 - r) * fast step + r * stock step,  r = slow-step ratio

and where the sparse run's measured step went (its attention kernels, our other
kernels -- the SFI refresh --, the same non-attention work, idle). Input: the JSON
of profile_decode.py (or its log), i.e. SGLang's profiler on a live server:

    python3 bench/gpu/step_ceiling.py bench/results/profile_decode_h100_8192x32_sfi_pinned_s17.json
    python3 bench/gpu/step_ceiling.py bench/results/profile_decode_h100_130000x4_stock_only_s17.log \\
        --policy sfi-pinned=2308:0.03125:5.74

For your own model: profile it (`profile_decode.py --model PATH --case CTXxBATCH
--runs flashinfer:stock`) and pass `--hf-config PATH/config.json`; `--bandwidth`
is your GPU's measured copy bandwidth (`bench/kernels/bench_decode.py` prints it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, Shape  # noqa: E402

COPY_BANDWIDTH = 3.018e12  # H100 80GB HBM3, bench_decode.py's copy (read + write) in session 17
# Kernels that are attention: FlashInfer's decode and merge (stock, and rows it
# serves for us), our two-segment decode and its merge.
ATTENTION = ("BatchDecodeWithPagedKVCache", "MergeStates", "_two_segment_decode", "_merge_splits")


def is_attention(name: str) -> bool:
    return any(a in name for a in ATTENTION)


def is_ours(name: str) -> bool:
    """Our Triton kernels are named `_snake_case` (SGLang's and PyTorch's are not);
    after attention, what is left of them is the SFI refresh and the step plan."""
    return name.startswith("_") and not is_attention(name)


@dataclass
class Run:
    backend: str
    policy: str
    ctx: int
    batch: int
    span_ms: float
    busy_ms: float
    kernels: List[dict]
    sparse: Optional[dict] = None

    @property
    def attention_ms(self) -> float:
        return sum(k["ms_per_step"] for k in self.kernels if is_attention(k["name"]))

    @property
    def ours_other_ms(self) -> float:
        return sum(k["ms_per_step"] for k in self.kernels if is_ours(k["name"]))


def load_runs(path: str) -> List[Run]:
    """profile_decode.py's --out JSON ({"results": [...]}) or its log (each run's
    summary printed as one JSON object)."""
    text = open(path).read()
    try:
        data = json.loads(text)
        raw = data.get("results", [data]) if isinstance(data, dict) else data
    except json.JSONDecodeError:
        raw, dec, i = [], json.JSONDecoder(), 0
        while (i := text.find("{", i)) >= 0:
            try:
                obj, end = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                i += 1
                continue
            if isinstance(obj, dict) and "span_ms_per_step" in obj:
                raw.append(obj)
            i = end
    return [Run(r["backend"], r["policy"], int(r["ctx"]), int(r["batch"]), float(r["span_ms_per_step"]),
                float(r["gpu_busy_ms_per_step"]), list(r.get("top", [])), r.get("sparse"))
            for r in raw if "span_ms_per_step" in r]


def attended_keys(sparse: Optional[dict], ctx: int) -> Optional[int]:
    """Keys a fast step reads per request and KV head, from the run's policy."""
    if not sparse:
        return None
    sink = int(sparse.get("sink", 4))
    if sparse.get("policy") == "sfi":
        return min(ctx, int(sparse.get("budget", 2048)) + int(sparse.get("recent", 256)) + sink)
    if "window" in sparse:
        return min(ctx, int(sparse["window"]) + sink)
    return None


def slow_ratio(sparse: Optional[dict]) -> float:
    """The pinned ratio, 1 / (t_max + 1) without sentence triggers; else unknown (0)."""
    if sparse and sparse.get("policy") == "sfi" and sparse.get("sentence_triggers") is False:
        return 1.0 / (int(sparse.get("t_max", 31)) + 1)
    return 0.0


@dataclass
class Ceiling:
    stock_step_ms: float
    non_attention_ms: float
    gap_ms: float
    fast_attention_ms: float
    ratio: float
    roofline_speedup: float

    @property
    def fast_step_ms(self) -> float:
        return self.non_attention_ms + self.gap_ms + self.fast_attention_ms

    @property
    def step_ms(self) -> float:
        return (1 - self.ratio) * self.fast_step_ms + self.ratio * self.stock_step_ms

    @property
    def speedup(self) -> float:
        return self.stock_step_ms / self.step_ms


def ceiling(stock: Run, shape: Shape, attended: int, ratio: float, bandwidth: float = COPY_BANDWIDTH) -> Ceiling:
    s = shape
    kv_fast = stock.batch * attended * s.kv_bytes_per_token()
    kv_dense = stock.batch * stock.ctx * s.kv_bytes_per_token()
    w = s.weight_bytes_per_step()
    stock_bytes = w + kv_dense
    ours_bytes = (1 - ratio) * (w + kv_fast) + ratio * stock_bytes
    return Ceiling(stock_step_ms=stock.span_ms, non_attention_ms=stock.busy_ms - stock.attention_ms,
                   gap_ms=stock.span_ms - stock.busy_ms, fast_attention_ms=kv_fast / bandwidth * 1e3,
                   ratio=ratio, roofline_speedup=stock_bytes / ours_bytes)


def parse_policy(spec: str) -> Tuple[str, int, float, Optional[float]]:
    """NAME=ATTENDED:RATIO[:MEASURED_SPEEDUP] for a row without a sparse profile."""
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    if not name or len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--policy {spec!r}: expected NAME=ATTENDED:RATIO[:MEASURED]")
    return name, int(parts[0]), float(parts[1]), float(parts[2]) if len(parts) == 3 else None


def rows(runs: Iterable[Run], shape: Shape, policies: List[Tuple[str, int, float, Optional[float]]],
         bandwidth: float) -> List[Dict]:
    runs = list(runs)
    out = []
    for stock in (r for r in runs if r.backend == "flashinfer"):
        for run in (r for r in runs if r.backend != "flashinfer" and (r.ctx, r.batch) == (stock.ctx, stock.batch)):
            attended = attended_keys(run.sparse, run.ctx)
            if attended is None:
                continue
            c = ceiling(stock, shape, attended, slow_ratio(run.sparse), bandwidth)
            measured = stock.span_ms / run.span_ms
            out.append(dict(row=f"{stock.ctx} x {stock.batch}", policy=run.policy, ceiling=c, measured=measured,
                            attention_ms=run.attention_ms, ours_other_ms=run.ours_other_ms,
                            rest_ms=run.busy_ms - run.attention_ms - run.ours_other_ms,
                            idle_ms=run.span_ms - run.busy_ms, span_ms=run.span_ms))
        for name, attended, ratio, measured in policies:
            c = ceiling(stock, shape, min(attended, stock.ctx), ratio, bandwidth)
            out.append(dict(row=f"{stock.ctx} x {stock.batch}", policy=name, ceiling=c, measured=measured))
    return out


def print_table(out: List[Dict]) -> None:
    print("| row | policy | stock step ms | non-attention ms | gap ms | fast attention at copy BW ms | slow ratio "
          "| ceiling step ms | ceiling speedup | roofline speedup (80%) | measured (share of ceiling) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        c, m = r["ceiling"], r["measured"]
        meas = f"{m:.2f}x ({100 * m / c.speedup:.0f}%)" if m else "-"
        print(f"| {r['row']} | {r['policy']} | {c.stock_step_ms:.2f} | {c.non_attention_ms:.2f} | {c.gap_ms:.2f} "
              f"| {c.fast_attention_ms:.2f} | {c.ratio:.4f} | {c.step_ms:.2f} | {c.speedup:.2f}x "
              f"| {c.roofline_speedup:.2f}x ({0.8 * c.roofline_speedup:.2f}x) | {meas} |")
    measured_rows = [r for r in out if "span_ms" in r]
    if measured_rows:
        print()
        print("| row | policy | step span ms | attention ms | our other kernels ms | rest ms | idle ms |")
        print("|---|---|---|---|---|---|---|")
        for r in measured_rows:
            print(f"| {r['row']} | {r['policy']} | {r['span_ms']:.2f} | {r['attention_ms']:.2f} "
                  f"| {r['ours_other_ms']:.2f} | {r['rest_ms']:.2f} | {r['idle_ms']:.2f} |")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", help="profile_decode.py JSON or log files")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b",
                    help="the profiled model's shape (weights and KV bytes per token)")
    ap.add_argument("--hf-config", default=None,
                    help="the profiled model's config.json instead of --shape (any Llama/Qwen-style decoder)")
    ap.add_argument("--bandwidth", type=float, default=COPY_BANDWIDTH, help="copy bandwidth, bytes/s")
    ap.add_argument("--policy", type=parse_policy, action="append", default=[],
                    help="NAME=ATTENDED:RATIO[:MEASURED]: a row to compute against each stock run")
    a = ap.parse_args(argv)
    runs = [r for p in a.profiles for r in load_runs(p)]
    if not any(r.backend == "flashinfer" for r in runs):
        ap.error("no stock (flashinfer) run in the profiles")
    shape = Shape.from_hf_config(a.hf_config) if a.hf_config else SHAPES[a.shape]
    print_table(rows(runs, shape, a.policy, a.bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
