#!/usr/bin/env python3
"""
Benchmark: ragged top-k (kernels/topk_range.py) vs torch.topk
=============================================================

Run on a GPU (written for an H100)::

    python bench/kernels/bench_topk.py --out results/bench_topk.json

Per case ``[R rows, H heads, N]`` fp32 scores, ``-inf`` off each row's live range
``[lo, hi)`` (as the callers give them), ``k`` = output width = budget:

* ``torch.topk``: what ``query_device`` paid per layer before (full width ``N``,
  every row, empty or not).
* ``torch.topk+sort``: what ``selector.core.top_k_positions`` paid (sorted top-k,
  then a sort of the kept positions).
* ``topk_range`` (the default: rows up to ``ROW_BLOCK_MAX`` in registers, wider ones
  gather on at the default launch shape; the select on 8-bit digits),
  ``topk_range 6bit`` (the same on 6-bit digits over the row, ``small_digits=True``,
  opt-in until timed here), ``topk_range walk`` (the block-walking kernel for every row: the default
  before session 18) and ``topk_range nogather``;
  then ``topk_range B/Ww`` at each (block_n, num_warps) ``launch_shape`` could pick.
* ``topk_range htop`` (asyncspade's cases and ``--smoke``): the block-walking kernel given
  the top digit's histogram (``h_top=``, as the scores' producer would count it), so
  without its first pass over the row; compare with ``topk_range split1`` (the same
  kernel, launch and output, computing that pass itself). The kernel zeroes ``h_top``
  for the producer's next step, so every timed call first refills it from a copy made
  before timing (``h_top.copy_(saved)``, one small copy kernel in the same graph); the
  copy alone is timed as ``htop copy``: the first pass's cost is about
  ``split1 - (htop - htop copy)``. The producer's atomics are not in these rows (they
  land in the scoring kernel's time).

Cases: the serving shapes of ``query_device`` (8 slots x 8 KV heads, max_context
40960 and 32768, k = 2048) with half the slots empty and ragged live lengths,
the same with every slot full, and a Selector-like batch (64 rows = layers x
requests). Each kernel is checked first (counts equal, kept values equal as
multisets, positions ascending in range), then timed with
``triton.testing.do_bench`` (median) and under CUDA-graph replay.
``--smoke`` runs tiny shapes through the Triton CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from _bench_env import Timer, import_kernels, use_cuda_or_exit



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cases", default="", help="comma-separated name prefixes (default: every case)")
    return p.parse_args(argv)


def _cases(smoke: bool):
    # (name, R, H, N, k, live lengths per row as fractions of N (0 = empty)[, the share of
    # the live range that is finite, the rest -inf (default 1)[, "prefix": that share is
    # the range's first positions, not random ones]])
    if smoke:
        return [("smoke-half-empty", 4, 2, 300, 40, [0.9, 0.0, 0.5, 0.0]), ("smoke-full", 2, 2, 300, 40, [1.0, 0.7]),
                ("smoke-prefix", 2, 2, 300, 40, [1.0, 0.5], 0.3, "prefix")]
    half = [1.0, 0.0, 0.6, 0.0, 0.3, 0.0, 0.1, 0.0]
    full = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    return [
        ("qa-40960-half-empty", 8, 8, 40960, 2048, half),
        ("qa-32768-half-empty", 8, 8, 32768, 2048, half),
        ("qa-40960-all-empty", 8, 8, 40960, 2048, [0.0] * 8),
        ("qa-40960-full", 8, 8, 40960, 2048, full),
        ("qa-32768-full", 8, 8, 32768, 2048, [1.0] * 8),
        ("quest-pages-2560", 8, 8, 2560, 129, half),
        ("selector-64x32768", 64, 8, 32768, 2048, [1.0] * 64),
        # quest at 32768 x 1 and x 8 (8 slots, 2049 live pages + the store's spare),
        # at 130000 x 4 (8126 pages), at 2048 x 64: k = budget / 16
        ("quest-32k-batch1", 8, 8, 2064, 128, [1.0] + [0.0] * 7),
        ("quest-32k-batch8", 8, 8, 2064, 128, [0.993] * 8),
        ("quest-130k-batch4", 4, 8, 8192, 128, [0.992] * 4),
        ("quest-2k-batch64", 64, 8, 136, 128, [0.95] * 64),
        # the Selector's rows at 2048 x 64 (rows x layers: one refresh of 16 requests)
        ("selector-448x2176", 448, 8, 2176, 2048, [1.0] * 448),
        # asyncspade's Top-K at 32768 x 8 (8 slots of 33024, 32768 live) for one layer
        # and for `topk_layers` layers in one launch (their rows stacked): per layer, time / G
        *[(f"aspd-layers-{g}", 8 * g, 8, 33024, 2048, [32768 / 33024] * (8 * g)) for g in (1, 4, 7, 14, 28)],
        # and at 130000 x 4 (4 slots of 130560, sparse_config_130k4_qa_int4_b4.yaml), 14 layers
        # a launch: session 28 served it at 2.30x stock against quest's 3.36x
        ("aspd130k-layers-14", 4 * 14, 8, 130560, 2048, [130000 / 130560] * (4 * 14)),
        # lfps at 32768 x 8 (8 slots of 33792), a layer: its priorities keep C1 (a few %
        # of the context; the rest -inf) and the Top-`candidates` (8192) of them keeps
        # all (k = F: no select, session 31); at half the context finite it selects.
        # Then its Top-`budget` of the exact scores over C1 (rows of 8192, C1 live).
        ("lfps-prio-5pct", 8, 8, 33792, 8192, [32768 / 33792] * 8, 0.05),
        ("lfps-prio-50pct", 8, 8, 33792, 8192, [32768 / 33792] * 8, 0.5),
        ("lfps-rank", 8, 8, 8192, 2048, [0.2] * 8),
        # the rank Top-K as served: rows over the whole candidate buffer [0, 8192), C1's
        # exact scores finite in its first n_c1 (here 4096, and all 8192: C1 above the
        # candidates), -inf after; the budget selects (session 32's profile: 23 us a layer)
        ("lfps-rank-c1-half", 8, 8, 8192, 2048, [1.0] * 8, 0.5, "prefix"),
        ("lfps-rank-c1-full", 8, 8, 8192, 2048, [1.0] * 8),
    ]


def _htop_fns(topk_range, saved, s, lo, hi, budget, k) -> dict:
    """``topk_range htop``: the Top-K given the producer's top-digit histogram (``saved``,
    counted once before timing). The kernel zeroes its ``h_top`` as it reads it, so each
    call refills it first: that copy is in the timed region, and timed alone as
    ``htop copy`` (not a topk_range row: no output to check)."""
    h_top = saved.clone()
    return {
        "topk_range htop": lambda: (h_top.copy_(saved), topk_range(s, lo, hi, budget, k, h_top=h_top))[1],
        "htop copy": lambda: h_top.copy_(saved),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    kernels = import_kernels()
    topk_range, top_digit_hist_ref = kernels.topk_range, kernels.top_digit_hist_ref
    import triton

    dev = torch.device("cuda" if use_cuda else "cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)"}
    print("# ragged top-k benchmark\n" + json.dumps(env))

    timer = Timer(use_cuda, args.warmup, args.rep, graphs=True)
    eager_us, graph_us = timer.eager_us, timer.graph_us

    results, failures = [], []
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    prefixes = [c for c in args.cases.split(",") if c]
    for name, r, h, n, k, fracs, *density in _cases(args.smoke):
        if prefixes and not any(name.startswith(c) for c in prefixes):
            continue
        lo = torch.full((r,), 4, dtype=torch.int32, device=dev)
        hi = torch.tensor([max(int(f * n), 0) for f in fracs], dtype=torch.int32, device=dev)
        hi = torch.where(hi > lo, hi, 0)
        budget = torch.full((r,), k, dtype=torch.int32, device=dev)
        pos_n = torch.arange(n, device=dev)
        live = (pos_n >= lo[:, None]) & (pos_n < hi[:, None])
        s = torch.randn(r, h, n, generator=gen, device=dev).masked_fill(~live[:, None, :], float("-inf"))
        if density and len(density) > 1 and density[1] == "prefix":  # finite: the live range's first share
            cut = lo + ((hi - lo).clamp(min=0).float() * density[0]).to(torch.int32)
            s = s.masked_fill((pos_n >= cut[:, None])[:, None, :], float("-inf"))
        elif density:
            sparse = torch.rand(r, h, n, generator=gen, device=dev) >= density[0]
            s = s.masked_fill(sparse, float("-inf"))

        # check: counts, kept values (multisets), ascending positions in range
        pos, cnt = topk_range(s, lo, hi, budget, k)
        want_cnt = torch.minimum(budget[:, None], torch.isfinite(s).sum(-1)).clamp(max=k)
        kk = min(k, n)
        vals = torch.topk(s, kk, dim=-1).values
        j = torch.arange(k, device=dev)
        kept = j < cnt[..., None]
        got = torch.where(kept, s.gather(-1, pos.long()), float("-inf")).sort(-1, descending=True).values[..., :kk]
        want = torch.where(kept[..., :kk], vals, float("-inf"))
        asc = ((pos[..., 1:] > pos[..., :-1]) | ~kept[..., 1:]).all()
        inr = (~kept | ((pos >= lo[:, None, None]) & (pos < hi[:, None, None]))).all()
        ok = bool(torch.equal(cnt, want_cnt.to(torch.int32)) and torch.equal(got, want) and asc and inr)
        if not ok:
            failures.append(name)

        fns = {
            "torch.topk": lambda: torch.topk(s, kk, dim=-1),
            "torch.topk+sort": lambda: torch.sort(torch.topk(s, kk, dim=-1, sorted=True).indices, dim=-1),
            "topk_range": lambda: topk_range(s, lo, hi, budget, k),
            # the select's passes over the row on 6-bit digits (64-bin histograms) against
            # the default's 8-bit ones (256 bins): same output, fewer instructions a pass
            "topk_range 6bit": lambda: topk_range(s, lo, hi, budget, k, small_digits=True),
            "topk_range nogather": lambda: topk_range(s, lo, hi, budget, k, gather=False),
            # the block-walking kernel at launch_shape's block (the default before the
            # row kernel, for rows up to ROW_BLOCK_MAX)
            "topk_range walk": lambda: topk_range(s, lo, hi, budget, k, one_block=False),
        }
        if not args.smoke:  # the launch shapes launch_shape() picks between, for every case
            for bn, nw in ((1024, 4), (2048, 8), (4096, 16), (8192, 32)):
                fns[f"topk_range {bn}/{nw}w"] = (lambda bn=bn, nw=nw: topk_range(s, lo, hi, budget, k, splits=1,
                                                                                 block_n=bn, num_warps=nw))
        # each (row, head) over S programs (kernels/topk_split.py; the default row
        # "topk_range" picks split_count(N, R x H, TOPK_RULE)), S = 1: the single-program kernel
        for sp in ((1, 2) if args.smoke else (1, 2, 4, 8, 16)):
            fns[f"topk_range split{sp}"] = lambda sp=sp: topk_range(s, lo, hi, budget, k, splits=sp)
        if args.smoke or name.startswith("aspd"):
            fns.update(_htop_fns(topk_range, top_digit_hist_ref(s, lo, hi), s, lo, hi, budget, k))
        live_elems = int(((hi - lo).clamp(min=0)).sum()) * h
        for kname, fn in fns.items():
            if kname.startswith("topk_range"):  # every launch shape: the same output (ties by position)
                p2, c2 = fn()
                if not (torch.equal(p2, pos) and torch.equal(c2, cnt)):
                    failures.append(f"{name} {kname}")
            t, g = eager_us(fn), graph_us(fn)
            row = dict(case=name, R=r, H=h, N=n, k=k, live_elems=live_elems, kernel=kname, time_us=t, graph_us=g,
                       check_ok=ok)
            results.append(row)
            print(f"  {name:22s} {kname:24s}: {t:9.1f} us (graph {g if g is not None else float('nan'):8.1f})"
                  f"  live {live_elems / (r * h * n):4.0%}  {'ok' if ok else 'MISMATCH'}", flush=True)

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, results=results, failures=failures), f, indent=1)
    if failures:
        print("MISMATCH: " + ", ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
