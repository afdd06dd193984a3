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
    from sgl_sparse.decision import plan_decode
    from tests.kernels.test_query_device_graph import HKV, LENS, MAXCTX, SCALE, G, D, KV, Twin

    graph_gate.ENABLED = False
    dev = torch.device("cuda")
    bs = 8
    lens = {r: n + 7 * r for r, n in LENS.items()} if args.max_context > MAXCTX else LENS
    for name, rows in {"full-only": [5, 0, 0, 0, 0, 0, 0, 0], "live q+a+l": [1, 3, 7, 5, 0, 0, 0, 0]}.items():
        twin = Twin(use_kernels=True, lens=lens, max_ctx=args.max_context)
        twin.admit(torch.randn(sum(lens.values()), HKV * G, D, device=dev).to(KV))
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        lens_t = torch.tensor([lens[r] + 1 if r else 1 for r in rows], dtype=torch.int32, device=dev)
        tok_t = torch.ones(bs, dtype=torch.int64, device=dev)
        q = torch.randn(bs, HKV * G, D, device=dev).to(KV)
        o = torch.zeros(bs, HKV * G, D, dtype=KV, device=dev)
        twin.rt.plan_step([0] * bs, [1] * bs, dev, graphed=True)

        def step():
            plan = plan_decode(twin.st, rows_t, tok_t, lens_t, (None, None), num_kv_heads=HKV)
            for _ in range(args.layers):
                lp = twin.rt.select(0, plan, q, twin.k, twin.r2t, rows_t, lens_t, SCALE)
                twin.rt.finish(0, lp, q, o, twin.k, twin.r2t, rows_t, lens_t, SCALE)

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
