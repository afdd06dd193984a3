"""Where the captured query-aware path's time goes per layer, by GPU kernel (CUDA only).

tests/kernels/test_query_device_graph.py's replay-cost test times the whole captured
select + finish of quest + asyncspade + lfps per layer; this runs the same step
eagerly (the kernels a graph replays are the same ones) under torch.profiler and
prints the GPU kernels by total time, for a `full`-only batch and a batch with a
live row of each policy, at the given max_context.
Run: python bench/kernels/profile_query_aware_layer.py [--max-context 32768] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    from sgl_sparse import graph_gate
    from tests.kernels.test_query_device_graph import LENS, MAXCTX, layer_step

    graph_gate.ENABLED = False  # as torch 2.11 captures it: every block, whatever the batch holds
    lens = {r: n + 7 * r for r, n in LENS.items()} if args.max_context > MAXCTX else LENS
    for name, rows in {"full-only": [5, 0, 0, 0, 0, 0, 0, 0], "live q+a+l": [1, 3, 7, 5, 0, 0, 0, 0]}.items():
        # the replay-cost test's step, run eagerly after the rows are placed
        twin, step, place, *_ = layer_step(rows, args.layers, lens, args.max_context)
        place()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per = 5 * args.layers
        print(f"== max_context {args.max_context}, {name}: GPU us per layer by kernel (5 steps x {args.layers} layers)")
        evs = [e for e in prof.key_averages() if e.device_time_total > 0]
        evs.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in evs)
        print(f"   total {total / per:8.1f} us per layer")
        for e in evs[: args.rows]:
            print(f"   {e.device_time_total / per:8.1f} us  x{e.count / per:5.2f}  {e.key[:110]}")
        del twin


if __name__ == "__main__":
    main()
