#!/usr/bin/env python3
"""
Benchmark: how much of asyncspade's side stream a decode step's main stream lets run beside it
===============================================================================================

The server profile of asyncspade at 32768 x 8 (H200, bench/README "Session 21")
holds 8.3-8.9 ms of kernels in a 7.2 ms step: the side stream's scoring and Top-K
(~5 ms) overlap the main stream's layers (~3.9 ms) by only ~1.7 ms. One suspect
is residency: a scoring program walks its share of a row for the whole launch
(~130 us), and the main stream's GEMMs (cuBLAS, large shared-memory pipelines)
cannot start on an SM until its scoring programs leave. This runs the two
streams alone and together, captured in one CUDA graph as SGLang replays a
decode step, so each scoring launch shape can be judged by the overlap it allows:

* main stream, per layer: the Qwen3-1.7B shape's four projections at batch 8
  (``torch.mm`` in bf16 over 2048 x 4096, 2048 x 2048, 2048 x 12288 and
  6144 x 2048 weights, ~100 MB a layer), as SGLang's linear layers;
* side stream, per layer: ``index_token_scores`` over 8 rows x 8 KV heads x 32768
  positions from int8 copies (steady state: the copies filled), forked after the
  layer's GEMMs as ``query_device`` forks it, and the Top-K of ``--topk-layers``
  layers a launch (``topk_range``) after a group's last scoring;
* one join at the end.

Per scoring shape (programs per SM x pipeline stages): the graph's replay time
with the main stream alone, the side stream alone and both, and ``hidden`` =
(main + side - both) / min(main, side): 1 when the shorter one is wholly hidden,
0 when the streams run one after the other. Run on a GPU::

    python bench/kernels/bench_stream_overlap.py --out results/stream_overlap.json

``--smoke`` runs tiny shapes eagerly through the Triton interpreter (no streams).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from _bench_env import graph_replay_ms, import_kernels, use_cuda_or_exit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--topk-layers", type=int, default=14)
    p.add_argument("--shapes", default="4x0,2x0,1x0,2x1,2x2,4x1",
                   help="scoring launch shapes PROGRAMS_PER_SMxSTAGES (stages 0: the kernel's default)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    IK = import_kernels("index_keys")
    TR = import_kernels("topk_range")
    utils = import_kernels("_utils")
    import triton

    dev = torch.device("cuda" if use_cuda else "cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)"}
    print("# stream overlap benchmark\n" + json.dumps(env))
    if args.smoke:
        args.layers, args.ctx, args.batch, args.topk_layers, args.reps = 2, 300, 2, 2, 1
    L, n, bs, G = args.layers, args.ctx, args.batch, args.topk_layers
    hq, hkv, d, hidden, inter = 16, 8, 128, 2048, 6144
    if args.smoke:
        hidden, inter = 64, 96
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    # main stream: one set of projection weights a layer (each read once a step, as decode does)
    x = randn(bs, hidden)
    attn = randn(bs, hq * d)
    h = randn(bs, inter)
    weights = [(randn(hidden, (hq + 2 * hkv) * d), randn(hq * d, hidden), randn(hidden, 2 * inter),
                randn(inter, hidden)) for _ in range(L)]

    # side stream: a pool of keys, each row's positions contiguous in it, and the int8 copies
    k_pool = randn(bs * n + 1, hkv, d)
    req_to_token = (1 + torch.arange(bs * n, device=dev, dtype=torch.int32)).view(bs, n)
    rpi = torch.arange(bs, device=dev)
    lo = torch.full((bs,), 4, dtype=torch.int32, device=dev)
    hi = torch.full((bs,), n - 256 if n > 512 else n - 8, dtype=torch.int32, device=dev)
    budget = torch.full((bs,), 2048 if n > 4096 else 16, dtype=torch.int32, device=dev)
    k_max = int(budget[0])
    q_hat = torch.randn(L, bs, hq, d, generator=gen, device=dev)
    kq = torch.empty(L, bs, hkv, n, d, dtype=torch.int8, device=dev)
    kscale = torch.empty(L, bs, hkv, n, dtype=torch.float32, device=dev)
    filled = torch.zeros(L, bs, 2, dtype=torch.int32, device=dev)
    scores = torch.empty(G, bs, hkv, n, dtype=torch.float32, device=dev)
    sm_scale = d ** -0.5
    for li in range(L):  # fill the copies, then leave the counters one below hi: the steady state
        IK.index_token_scores(q_hat[li], k_pool, req_to_token, rpi, lo, hi, sm_scale, n, kq[li], kscale[li],
                              filled[li], out=scores[0])
    par = (hi % 2).long()
    filled[:, rpi, 1 - par] = hi - 1
    g_lo, g_hi, g_budget = lo.repeat(G), hi.repeat(G), budget.repeat(G)
    sel = torch.empty(G * bs, hkv, k_max, dtype=torch.int32, device=dev)
    sel_n = torch.empty(G * bs, hkv, dtype=torch.int32, device=dev)
    sms = utils.device_num_sms(dev)

    def step(per_sm: int, stages: int, with_main: bool, with_side: bool, side) -> None:
        programs = max(1, utils.cdiv(per_sm * sms, bs * hkv))
        main = torch.cuda.current_stream() if use_cuda else None
        for li in range(L):
            if with_main:
                wqkv, wo, wgu, wd = weights[li]
                torch.mm(x, wqkv)
                torch.mm(attn, wo)
                torch.mm(x, wgu)
                torch.mm(h, wd)
            if not with_side:
                continue
            if side is not None:
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else _null():
                g = li % G
                IK.index_token_scores(q_hat[li], k_pool, req_to_token, rpi, lo, hi, sm_scale, n, kq[li],
                                      kscale[li], filled[li], out=scores[g], num_programs=programs,
                                      num_stages=stages or None)
                if g == G - 1 or li == L - 1:
                    rows = (g + 1) * bs
                    TR.topk_range(scores[: g + 1].flatten(0, 1), g_lo[:rows], g_hi[:rows], g_budget[:rows], k_max,
                                  out=sel[:rows], out_len=sel_n[:rows])
        if side is not None and with_side:
            main.wait_stream(side)

    results = []
    for shape in filter(None, args.shapes.split(",")):
        per_sm, stages = (int(v) for v in shape.split("x"))
        row = dict(programs_per_sm=per_sm, stages=stages, programs=max(1, utils.cdiv(per_sm * sms, bs * hkv)))
        for name, with_main, with_side in (("main", True, False), ("side", False, True), ("both", True, True)):
            if not use_cuda:
                step(per_sm, stages, with_main, with_side, None)
                row[f"{name}_ms"] = None
                continue
            side = torch.cuda.Stream()
            row[f"{name}_ms"] = graph_replay_ms(
                lambda: step(per_sm, stages, with_main, with_side, side), args.reps, warm_replays=3)
        if use_cuda:
            m, sd, both = row["main_ms"], row["side_ms"], row["both_ms"]
            row["hidden"] = round((m + sd - both) / min(m, sd), 3)
            print(f"  scoring {per_sm} programs/SM ({row['programs']} per row), stages {stages or 'default'}: "
                  f"main {m:.3f} ms, side {sd:.3f} ms, both {both:.3f} ms, hidden {row['hidden']:.0%}", flush=True)
        results.append(row)
    # the selections are real: every row keeps its budget (the scores are finite on [lo, hi))
    ok = bool((sel_n == min(k_max, int(hi[0] - lo[0]))).all())
    print(f"  selections: {'ok' if ok else 'WRONG COUNTS'}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, args=vars(args), sms=sms, results=results, check_ok=ok), f, indent=1)
    return 0 if ok else 1


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
