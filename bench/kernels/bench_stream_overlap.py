#!/usr/bin/env python3
"""
Benchmark: how much of asyncspade's side stream a decode step's main stream lets run beside it
===============================================================================================

The server profile of asyncspade at 32768 x 8 (H200, bench/README "Session 24")
has a main stream busy 3.04 ms a step and a side stream busy 2.93 ms, yet the two
overlap for only 0.43 ms of a 6.28 ms step. The suspect is residency: a scoring
program walks its share of a row for the whole launch (~70 us), 4 of them fill an
SM's registers, and the main stream's kernels (cuBLAS GEMMs, the decode) cannot
start on an SM until its scoring programs leave. This runs the two streams alone
and together, captured in one CUDA graph as SGLang replays a decode step, so each
scoring launch shape and stream priority can be judged by the overlap it allows:

* main stream, per layer: the Qwen3-1.7B shape's QKV projection at batch 8, then
  (after the fork) the two-segment decode over ``--decode-keys`` keys a request
  and KV head read in place from a paged pool, the output projection and the MLP's
  two projections (``torch.mm`` in bf16, ~100 MB of weights a layer);
* side stream, per layer: ``index_token_scores`` over 8 rows x 8 KV heads x 32768
  positions from int8 or 4-bit copies (steady state: the copies filled), counting
  the Top-K's histogram (``h_top``) as serving does, forked after the layer's QKV
  projection as ``query_device`` forks it after the prediction, and the Top-K of
  ``--topk-layers`` layers a launch (``topk_range``) after a group's last scoring;
* one join at the end of the last layer, as serving joins.

Scoring launch shapes: ``PxS`` = P programs a SM in all (persistent: each walks
its share of a row), S pipeline stages (0: the kernel's default); ``tT`` = one
program per T blocks of 128 positions (short programs the block scheduler can
interleave with the main stream's). Priorities: ``default`` captures everything on
a default-priority stream (as SGLang's graph runner does); ``high`` captures the
main stream on the highest-priority stream, the side stream staying at the
default (PyTorch instantiates graphs with ``cudaGraphInstantiateFlagUseNodePriority``,
so the captured kernels keep their stream's priority). Per (shape, priority): the
graph's replay time with the main stream alone, the side stream alone and both,
and ``hidden`` = (main + side - both) / min(main, side): 1 when the shorter one is
wholly hidden, 0 when the streams run one after the other. Run on a GPU::

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
    p.add_argument("--index-bits", type=int, choices=(8, 4), default=4)
    p.add_argument("--no-hist", action="store_true", help="do not count h_top in the scoring")
    p.add_argument("--decode-keys", type=int, default=2304,
                   help="keys a request and KV head the main stream's decode reads (0: no decode)")
    p.add_argument("--shapes", default="4x0,2x0,1x0,1x6,t1,t4,t16",
                   help="scoring launch shapes: PxS (P programs a SM, S stages, 0 the default) or tT")
    p.add_argument("--priorities", default="default,high")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    return p.parse_args(argv)


def scoring_launch(shape: str) -> dict:
    """index_token_scores' launch arguments for a --shapes entry."""
    if shape.startswith("t"):
        return dict(blocks_per_program=int(shape[1:]), num_stages=None)
    per_sm, stages = (int(v) for v in shape.split("x"))
    return dict(programs_per_sm=per_sm, num_stages=stages or None)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    IK = import_kernels("index_keys")
    TR = import_kernels("topk_range")
    TS = import_kernels("two_segment_decode")
    TSC = import_kernels("token_scores")
    utils = import_kernels("_utils")
    import triton

    dev = torch.device("cuda" if use_cuda else "cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)"}
    print("# stream overlap benchmark\n" + json.dumps(env))
    if args.smoke:
        args.layers, args.ctx, args.batch, args.topk_layers, args.reps = 2, 300, 2, 2, 1
        args.decode_keys = min(args.decode_keys, 40)
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

    # a paged pool, each row's positions contiguous in it: the scoring's new keys and the decode's KV
    k_pool = randn(bs * n + 1, hkv, d)
    v_pool = randn(bs * n + 1, hkv, d)
    req_to_token = (1 + torch.arange(bs * n, device=dev, dtype=torch.int32)).view(bs, n)
    rpi = torch.arange(bs, device=dev)
    lo = torch.full((bs,), 4, dtype=torch.int32, device=dev)
    hi = torch.full((bs,), n - 256 if n > 512 else n - 8, dtype=torch.int32, device=dev)
    budget = torch.full((bs,), 2048 if n > 4096 else 16, dtype=torch.int32, device=dev)
    k_max = int(budget[0])
    q_hat = torch.randn(L, bs, hq, d, generator=gen, device=dev)
    width = d // 2 if args.index_bits == 4 else d
    kq = torch.empty(L, bs, hkv, n, width, dtype=torch.int8, device=dev)
    kscale = torch.empty(L, bs, hkv, n, dtype=torch.float32, device=dev)
    filled = torch.zeros(L, bs, 2, dtype=torch.int32, device=dev)
    ksm = None
    if args.index_bits == 4:  # each row's smoothing from its keys (serving: from the prompt's)
        ksm = torch.stack([IK.channel_smoothing(k_pool[req_to_token[b].long()]) for b in range(bs)])
    scores = torch.empty(G, bs, hkv, n, dtype=torch.float32, device=dev)
    sm_scale = d ** -0.5
    for li in range(L):  # fill the copies, then leave the counters one below hi: the steady state
        IK.index_token_scores(q_hat[li], k_pool, req_to_token, rpi, lo, hi, sm_scale, n, kq[li], kscale[li],
                              filled[li], out=scores[0], ksmooth=ksm)
    par = (hi % 2).long()
    filled[:, rpi, 1 - par] = hi - 1
    g_lo, g_hi, g_budget = lo.repeat(G), hi.repeat(G), budget.repeat(G)
    sel = torch.empty(G * bs, hkv, k_max, dtype=torch.int32, device=dev)
    sel_n = torch.empty(G * bs, hkv, dtype=torch.int32, device=dev)
    sms = utils.device_num_sms(dev)
    use_hist = not args.no_hist and TR.takes_htop(n, G * bs * hkv, dev)
    h_top = torch.zeros(G, bs, hkv, 64, dtype=torch.int32, device=dev) if use_hist else None

    # the decode: segment B only, a different window a layer (no L2 reuse between layers)
    dk = min(args.decode_keys, n)
    q_dec = randn(bs, hq, d)
    a_k = torch.zeros(1, hkv, 1, d, dtype=bf16, device=dev)
    a_slot = torch.zeros(bs, dtype=torch.int32, device=dev)
    a_len = torch.zeros(bs, hkv, dtype=torch.int32, device=dev)
    windows = max(1, n // max(1, dk))
    b_start = [torch.full((bs,), (li % windows) * dk, dtype=torch.int32, device=dev) for li in range(L)]
    b_end = [b + dk for b in b_start]
    dec_out = torch.empty(bs, hq, d, dtype=bf16, device=dev)

    def step(launch: dict, with_main: bool, with_side: bool, side) -> None:
        main = torch.cuda.current_stream() if use_cuda else None
        for li in range(L):
            if with_main:
                wqkv, wo, wgu, wd = weights[li]
                torch.mm(x, wqkv)
            if with_side:
                if side is not None:
                    side.wait_stream(main)
                with torch.cuda.stream(side) if side is not None else _null():
                    g = li % G
                    IK.index_token_scores(q_hat[li], k_pool, req_to_token, rpi, lo, hi, sm_scale, n, kq[li],
                                          kscale[li], filled[li], out=scores[g], ksmooth=ksm,
                                          h_top=None if h_top is None else h_top[g], **launch)
                    if g == G - 1 or li == L - 1:
                        rows = (g + 1) * bs
                        TR.topk_range(scores[: g + 1].flatten(0, 1), g_lo[:rows], g_hi[:rows], g_budget[:rows],
                                      k_max, out=sel[:rows], out_len=sel_n[:rows],
                                      h_top=None if h_top is None else h_top[: g + 1].flatten(0, 1))
            if with_main:
                if dk:
                    TS.two_segment_decode(q_dec, a_k, a_k, a_slot, a_len, k_pool, v_pool, req_to_token, rpi,
                                          b_start[li], b_end[li], sm_scale, max_kv_len=dk, out=dec_out)
                torch.mm(attn, wo)
                torch.mm(x, wgu)
                torch.mm(h, wd)
        if side is not None and with_side:
            main.wait_stream(side)

    results = []
    prios = [p for p in args.priorities.split(",") if p]
    for shape in filter(None, args.shapes.split(",")):
        launch = scoring_launch(shape)
        # the launch's own programs per (row, KV head): its arguments as given, the kernel's defaults otherwise
        programs = TSC.scoring_programs(n, 128, bs, hkv, dev, **{k: v for k, v in launch.items() if k != "num_stages"})
        for prio in prios:
            row = dict(shape=shape, priority=prio, programs=programs, stages=launch["num_stages"])
            cap = None
            if use_cuda and prio == "high":
                cap = torch.cuda.Stream(priority=-64)  # mapped to the highest
            for name, with_main, with_side in (("main", True, False), ("side", False, True), ("both", True, True)):
                if not use_cuda:
                    step(launch, with_main, with_side, None)
                    row[f"{name}_ms"] = None
                    continue
                side = torch.cuda.Stream()  # default priority, as query_device's
                row[f"{name}_ms"] = graph_replay_ms(
                    lambda: step(launch, with_main, with_side, side), args.reps, warm_replays=3, capture_stream=cap)
            if use_cuda:
                m, sd, both = row["main_ms"], row["side_ms"], row["both_ms"]
                row["hidden"] = round((m + sd - both) / min(m, sd), 3)
                print(f"  scoring {shape} ({row['programs']} programs a row and head), {prio} priority: "
                      f"main {m:.3f} ms, side {sd:.3f} ms, both {both:.3f} ms, hidden {row['hidden']:.0%}",
                      flush=True)
            results.append(row)
            if not use_cuda:
                break  # no streams on the interpreter: one pass per shape checks the launches
    # the selections are real: every row keeps its budget (the scores are finite on [lo, hi))
    ok = bool((sel_n == min(k_max, int(hi[0] - lo[0]))).all())
    print(f"  selections: {'ok' if ok else 'WRONG COUNTS'}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, args=vars(args), sms=sms, use_hist=use_hist, results=results, check_ok=ok),
                      f, indent=1)
    return 0 if ok else 1


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
