#!/usr/bin/env python3
"""Where the ragged top-k's time goes at the query-aware serving shapes (CUDA only).

``profile_query_aware_layer.py`` showed the split top-k's launches as most of a
query-aware layer with live rows (~10 us each, 12 per layer). This times
``topk_range`` per launch (torch.profiler, the launches of one call in order: for
a split call, phases 0-3) and per call under CUDA-graph replay, at:

* ``asyncspade-32768x8``: 8 slots x 8 KV heads of 32768 tokens, k 2048 (batch 8 at 32K);
* ``asyncspade-32768x1``: one live slot of 8 (batch 1 at 32K);
* ``quest-2048x8``: the quest pages of those rows (32768 / 16), k 128;
* ``lfps-c1-32768x8``: lfps's candidate pass, k 8192 (its default ``candidates``);

for every splits / launch shape ("auto": ``topk_range``'s own pick). Every
variant's output is checked against the default launch's (positions, counts).
Run it with the checkout first on PYTHONPATH (``PYTHONPATH=$PWD:...``): the kernels
are imported as ``sgl_sparse.kernels``, an installed wheel's otherwise. Runs 1-2
(bench/results/topk_profile_h100_run{1,2}.log) also timed the radix passes' loads
software-pipelined (``tl.range(num_stages=2..4)``, run 1 by mistake on the installed
wheel's kernels): no gain, up to 15% slower, so not kept. Session 10's run 3
(bench/results/topk_profile_h100_run3.json) also timed ``topk_band.py``'s two-launch
sampled-band select: slower than the radix select in every case (graph replay, auto
launch: asyncspade-32768x8 88.4 vs 73.0 us, asyncspade-32768x1 87.0 vs 53.0,
quest-2048x8 23.5 vs 14.7, lfps-c1-32768x8 108.2 vs 74.3), so it was removed.
Run: PYTHONPATH=$PWD python bench/kernels/profile_topk.py [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CASES = (
    # name, slots, heads, N, live lengths, k
    ("asyncspade-32768x8", 8, 8, 33024, [32768] * 8, 2048),
    ("asyncspade-32768x1", 8, 8, 33024, [32768] + [0] * 7, 2048),
    ("quest-2048x8", 8, 8, 2064, [2048] * 8, 128),
    ("lfps-c1-32768x8", 8, 8, 33024, [32768] * 8, 8192),
)
VARIANTS = (  # (splits, block_n, num_warps); None: topk_range's own pick
    (None, None, None), (1, 4096, 16), (1, 2048, 8), (2, None, None),
    (4, None, None), (8, None, None), (8, 1024, 4),
)


def run_one(reps: int) -> list:
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    from _bench_env import import_kernels

    topk_range = import_kernels("topk_range").topk_range
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, r, h, n, lens, k in CASES:
        lo = torch.full((r,), 4, dtype=torch.int32, device=dev)
        hi = torch.tensor(lens, dtype=torch.int32, device=dev)
        budget = torch.full((r,), k, dtype=torch.int32, device=dev)
        s = torch.randn(r, h, n, generator=gen, device=dev)
        out = torch.zeros(r, h, k, dtype=torch.int32, device=dev)
        ref_pos, ref_cnt = topk_range(s, lo, hi, budget, k)
        for splits, bn, nw in VARIANTS:
            def call():
                return topk_range(s, lo, hi, budget, k, out=out, splits=splits, block_n=bn, num_warps=nw)
            p, c = call()
            same = bool(torch.equal(p, ref_pos) and torch.equal(c, ref_cnt))
            graph_us = 1e3 * triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    call()
                torch.cuda.synchronize()
            evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "topk" in e.name),
                         key=lambda e: e.time_range.start)
            per_call = len(evs) // reps
            phase_us = [sorted(e.device_time for e in evs[i::per_call])[reps // 2] for i in range(per_call)]
            label = f"split{splits or 'auto'} {bn or 'auto'}/{nw or 'auto'}w"
            rows.append(dict(case=name, variant=label, splits=splits, block_n=bn, num_warps=nw,
                             graph_us=graph_us, launch_us=phase_us, same_as_default=same))
            print(f"  {name:20s} {label:32s} graph {graph_us:7.1f} us  launches "
                  + " ".join(f"{t:6.1f}" for t in phase_us) + ("" if same else "  MISMATCH"), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = run_one(args.reps)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(results, open(args.out, "w"), indent=1)
    return 0 if all(r["same_as_default"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
