#!/usr/bin/env python3
"""
Benchmark: SFI's refresh after a slow step (Selector + repack), per layer
=========================================================================

    python bench/kernels/bench_selector.py --out results/selector.json

For each (context, batch) -- every request of the batch refreshing at once, the
worst case -- the Qwen3-1.7B attention shape (28 layers, Hq 16, Hkv 8, D 128,
bf16, K = 2048, recent 256, sink 4) is timed with CUDA events (median of
repeats, after warm-up; every layer reads the same key pool, which changes no
work):

* `refresh`: sgl_sparse.selector.refresh.refresh for all layers -- the
  window_evidence kernel per layer, the Selector's tensor ops batched over
  layers, Top-K, the pack kernel per layer -- with the evidence window of a
  later slow step (w = 1) and of the first one (w = 32), reported per layer;
* `dense`: the same batch's dense decode attention for one layer (our kernel,
  B = [0, n)), the work a slow step does anyway.

The ratio refresh/dense is the slow step's extra attention-side cost per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from sgl_sparse.compact import CompactStore
from sgl_sparse.config import SfiPolicy, SparseServerConfig
from sgl_sparse.kernels import two_segment_decode
from sgl_sparse.policies import sfi
from sgl_sparse.selector.refresh import refresh
from sgl_sparse.state import SparseState


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


LAYERS = 28


def case(ctx: int, bs: int, w: int, reps: int):
    dev = torch.device("cuda")
    hkv, hq, d, cap = 8, 16, 128, 2052
    spec = SfiPolicy(w_prefill=max(w, 1))
    cfg = SparseServerConfig.model_validate({"compact": {"slots": bs, "capacity": cap},
                                             "policies": {"sfi": {"w_prefill": max(w, 1)}}})
    st = SparseState(bs + 1, dev, cfg)
    rows = list(range(1, bs + 1))
    st.admit(rows, [sfi.init_row(spec, [], [], (None, None))] * bs)
    pool = bs * ctx + 16
    k = torch.randn(pool, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.zeros(bs + 1, ctx + 8, dtype=torch.int32, device=dev)
    r2t[1:, :ctx] = torch.randperm(bs * ctx, device=dev).view(bs, ctx).int()
    st.compact = CompactStore(slots=bs, capacity=cap, num_layers=LAYERS, num_kv_heads=hkv, num_q_heads=hq,
                              head_dim=d, dtype=torch.bfloat16, pool_size=pool, prompt_queries=max(w - 1, 0),
                              device=dev)
    st.compact.knorm[:] = k.float().norm(dim=-1)
    st.compact.q.normal_()
    st.compact.q_prompt.normal_()
    idx = torch.tensor(rows, device=dev)
    st.saved_n[idx] = ctx
    st.prompt_q[idx] = w - 1
    scale = 1 / math.sqrt(d)
    t_refresh = time_ms(lambda: refresh(st, rows, ctx, lambda i: k, lambda i: v, r2t, scale, use_kernels=True),
                        reps) / LAYERS
    q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
    zero = torch.zeros(bs, dtype=torch.int32, device=dev)
    n = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    a_len = torch.zeros(bs, hkv, dtype=torch.int32, device=dev)
    t_dense = time_ms(lambda: two_segment_decode(q, st.compact.k[0], st.compact.v[0], zero - 1, a_len, k, v, r2t,
                                                 idx, zero, n, scale, max_kv_len=ctx), reps)
    kv_bytes = bs * ctx * hkv * d * 2 * 2
    return {"ctx": ctx, "batch": bs, "w": w, "refresh_ms": round(t_refresh, 3), "dense_attn_ms": round(t_dense, 3),
            "refresh_all_layers_ms": round(t_refresh * LAYERS, 2),
            "refresh_over_dense": round(t_refresh / t_dense, 2), "kv_bytes_per_layer": kv_bytes}


def profile(ctx: int, bs: int, w: int) -> None:
    """Where a refresh's time goes: CUDA time per op (torch.profiler), one layer."""
    from torch.profiler import ProfilerActivity, profile as prof

    global time_ms
    timed = time_ms
    calls = []
    time_ms = lambda fn, reps: (calls.append(fn), timed(fn, 2))[1]  # noqa: E731
    case(ctx, bs, w, 2)
    time_ms = timed
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        calls[0]()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="131072x4,32768x8,8192x32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default="", help="CTXxBATCH: print a per-op profile of one refresh")
    a = ap.parse_args()
    for c in filter(None, a.profile.split(",")):
        ctx, bs = map(int, c.split("x"))
        profile(ctx, bs, 1)
    res = []
    for c in filter(None, a.cases.split(",")):
        ctx, bs = map(int, c.split("x"))
        for w in (1, 32):
            r = case(ctx, bs, w, a.reps)
            print(json.dumps(r), flush=True)
            res.append(r)
            torch.cuda.empty_cache()
    print("\n| context x batch | window w | refresh ms/layer | dense attention ms/layer | ratio |\n|---|---|---|---|---|")
    for r in res:
        print(f"| {r['ctx']} x {r['batch']} | {r['w']} | {r['refresh_ms']} | {r['dense_attn_ms']} | {r['refresh_over_dense']} |")
    json.dump({"device": torch.cuda.get_device_name(), "command": "python bench/kernels/bench_selector.py "
               + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()), "rows": res},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
