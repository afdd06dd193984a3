#!/usr/bin/env python3
"""
Micro-benchmark: which Triton primitive makes the radix select slow
===================================================================

The radix select of ``topk_range`` (``_radix.py``) spent ~10 us per launch at the
query-aware serving shapes, far more than its loads. Each kernel here walks its
row the same way (grid ``(R,)``, one program per row of ``[R, N]`` fp32,
``for n0 in range(0, N, BLOCK_N)``) but does ONE kind of work per block, so the
per-iteration times say where the cost is (H100, session 9,
bench/results/micro_radix_h100_run1.json: the 256-bin histogram and the prefix-sum
compaction each ~2.2-2.5 us per 4096-block over the load, a count nothing):

* ``load_sum``: load + ``tl.sum`` (the streaming baseline);
* ``hist_top`` / ``hist_mid``: ``_radix.load_key(KEY=2)`` + ``tl.histogram`` of the
  top byte (few distinct digits) / the bits 16-23 (spread digits), 256 bins,
  masked the way ``digit_histogram`` does;
* ``hist_onehot16``: 16-bin histogram of the top nibble by a one-hot ``tl.sum``;
* ``count_gt``: ``tl.sum(v > t)`` (a threshold count, no histogram);
* ``cumsum_gather``: ``v > t`` stored at a running offset + ``tl.cumsum`` (as
  ``gather_prefix16`` / ``place_kept``);
* ``hist_top_noload``: ``hist_top`` on values made in registers from the offsets
  (histogram compute without load latency).

Every result is checked against torch (sums, ``torch.bincount`` of the same key
digits, counts, gathered values as a multiset). Run on a GPU (written for an H100)::

    python bench/kernels/micro_radix_ops.py --out results/micro_radix_ops.json

``--smoke`` runs tiny shapes through the Triton CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from _bench_env import Timer, import_kernels, use_cuda_or_exit

# The kernels below are plain functions, jitted in main() once use_cuda_or_exit has
# (or has not) switched the interpreter on: triton.jit picks the interpreter when it
# decorates, and triton.language jits some of its own helpers at import. So tl and
# load_key (kernels/_radix.py) are bound in main() too (the annotations stay strings).
tl = load_key = None


def load_sum(X, OUT, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        acc += tl.sum(tl.load(X + row * N + offs, mask=offs < N, other=0.0), 0)
    tl.store(OUT + row, acc)


def hist8(X, OUT, N, SHIFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """hist_top (SHIFT 24) / hist_mid (SHIFT 16): digit_histogram's work, FILTER off."""
    row = tl.program_id(0)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], dtype=tl.int32)
    outside = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        _, bits, ok = load_key(X + row * N, offs, offs < N, 0.0, 2)
        hist += tl.histogram(tl.where(ok, (bits >> SHIFT) & 255, 0), 256)
        outside += (~ok).to(tl.int32)
    tl.store(OUT + row * 256 + bins, tl.where(bins == 0, hist - tl.sum(outside, 0), hist))


def hist_top_noload(OUT, N, BLOCK_N: tl.constexpr):
    """hist8(SHIFT=24) on v = ((n * 7919 + row * 104729) % 1000003 - 500001) / 1024 (exact in fp32)."""
    row = tl.program_id(0)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], dtype=tl.int32)
    outside = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < N
        v = ((offs * 7919 + row * 104729) % 1000003 - 500001).to(tl.float32) * 0.0009765625
        bits = v.to(tl.int32, bitcast=True)  # load_key's KEY 2 bits, as-is
        ok = ok & (tl.abs(v) < float("inf"))
        bits = tl.where(v == 0.0, 0x7FFFFFFF, tl.where(bits >= 0, bits ^ 0x7FFFFFFF, bits))
        hist += tl.histogram(tl.where(ok, (bits >> 24) & 255, 0), 256)
        outside += (~ok).to(tl.int32)
    tl.store(OUT + row * 256 + bins, tl.where(bins == 0, hist - tl.sum(outside, 0), hist))


def hist_onehot16(X, OUT, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    bins = tl.arange(0, 16)
    hist = tl.zeros([16], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        _, bits, ok = load_key(X + row * N, offs, offs < N, 0.0, 2)
        d = (bits >> 28) & 15
        hist += tl.sum(((d[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32), 0)
    tl.store(OUT + row * 16 + bins, hist)


def count_gt(X, OUT, N, t, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cnt = tl.zeros([], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        m = offs < N
        v = tl.load(X + row * N + offs, mask=m, other=0.0)
        cnt += tl.sum(((v > t) & m).to(tl.int32), 0)
    tl.store(OUT + row, cnt)


def cumsum_gather(X, SCR, CNT, N, t, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cnt = tl.zeros([], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        m = offs < N
        v = tl.load(X + row * N + offs, mask=m, other=0.0)
        keep = ((v > t) & m).to(tl.int32)
        tl.store(SCR + row * N + cnt + tl.cumsum(keep, 0) - keep, v, mask=keep != 0)
        cnt += tl.sum(keep, 0)
    tl.store(CNT + row, cnt)


def key_digits(torch, v, shift: int, width: int = 8):
    """load_key(KEY=2)'s key bits in int64, digit (key >> shift) & (2**width - 1), and finite."""
    b = v.view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(v == 0, 0x7FFFFFFF, torch.where(b < 2**31, b ^ 0x7FFFFFFF, b))
    return (key >> shift) & ((1 << width) - 1), torch.isfinite(v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=1.55, help="t: ~6%% of randn values are above")
    p.add_argument("--smoke", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global load_key, tl
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    load_key = import_kernels("_radix").load_key
    import triton
    import triton.language as tl

    K = {f.__name__: triton.jit(f) for f in (load_sum, hist8, hist_top_noload, hist_onehot16, count_gt,
                                             cumsum_gather)}
    dev = torch.device("cuda" if use_cuda else "cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)"}
    print("# radix-select primitives, one kind of work per block\n" + json.dumps(env))
    timer = Timer(use_cuda, args.warmup, args.rep, graphs=True)
    shapes = [(2, 3000)] if args.smoke else [(8, 32768), (64, 32768)]
    launches = ((256, 2), (1024, 4)) if args.smoke else ((1024, 4), (2048, 8), (4096, 16))
    t = args.threshold

    results, failures = [], []
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    print(f"{'kernel':16s} {'R':>3s} {'N':>6s} {'launch':>9s} {'iters':>5s} {'us':>9s} {'graph us':>9s} "
          f"{'us/iter':>8s} {'g us/iter':>9s} {'g - load_sum':>12s}  check")
    for r, n in shapes:
        x = torch.randn(r, n, generator=gen, device=dev)
        pos = torch.arange(n, device=dev)
        gen_v = ((pos[None, :] * 7919 + torch.arange(r, device=dev)[:, None] * 104729) % 1000003
                 - 500001).float() * 0.0009765625
        ref = {"load_sum": x.double().sum(1)}
        for name, src, shift, width in (("hist_top", x, 24, 8), ("hist_mid", x, 16, 8),
                                        ("hist_top_noload", gen_v, 24, 8), ("hist_onehot16", x, 28, 4)):
            d, fin = key_digits(torch, src, shift, width)
            ref[name] = torch.stack([torch.bincount(d[i][fin[i]], minlength=1 << width) for i in range(r)])
        ref["count_gt"] = (x > t).sum(1)
        out_f = torch.empty(r, device=dev)
        out_i = torch.empty(r, dtype=torch.int32, device=dev)
        h256 = torch.empty(r, 256, dtype=torch.int32, device=dev)
        h16 = torch.empty(r, 16, dtype=torch.int32, device=dev)
        scr = torch.empty(r, n, device=dev)
        for bn, nw in launches:
            kw = dict(BLOCK_N=bn, num_warps=nw)
            fns = {
                "load_sum": (lambda: K["load_sum"][(r,)](x, out_f, n, **kw), out_f),
                "hist_top": (lambda: K["hist8"][(r,)](x, h256, n, 24, **kw), h256),
                "hist_mid": (lambda: K["hist8"][(r,)](x, h256, n, 16, **kw), h256),
                "hist_onehot16": (lambda: K["hist_onehot16"][(r,)](x, h16, n, **kw), h16),
                "count_gt": (lambda: K["count_gt"][(r,)](x, out_i, n, t, **kw), out_i),
                "cumsum_gather": (lambda: K["cumsum_gather"][(r,)](x, scr, out_i, n, t, **kw), None),
                "hist_top_noload": (lambda: K["hist_top_noload"][(r,)](h256, n, **kw), h256),
            }
            iters = triton.cdiv(n, bn)
            base = None
            for kname, (fn, out) in fns.items():
                fn()
                if kname == "load_sum":
                    ok = bool(torch.allclose(out.double(), ref[kname], rtol=1e-5, atol=1e-2))
                elif kname == "cumsum_gather":
                    ok = bool(torch.equal(out_i.long(), ref["count_gt"].long())) and all(
                        torch.equal(scr[i, : int(out_i[i])].sort().values, x[i][x[i] > t].sort().values)
                        for i in range(r))
                else:
                    ok = bool(torch.equal(out.long(), ref[kname].long()))
                if not ok:
                    failures.append(f"{kname} R={r} N={n} {bn}/{nw}w")
                us, g = timer.eager_us(fn), timer.graph_us(fn)
                per = (g if g is not None else us) / iters
                base = per if kname == "load_sum" else base
                row = dict(kernel=kname, R=r, N=n, block_n=bn, num_warps=nw, iters=iters, time_us=us, graph_us=g,
                           us_per_iter=us / iters, graph_us_per_iter=None if g is None else g / iters,
                           over_load_sum_us_per_iter=per - base, check_ok=ok)
                results.append(row)
                gs = f"{g:9.1f}" if g is not None else f"{'-':>9s}"
                gi = f"{g / iters:9.3f}" if g is not None else f"{'-':>9s}"
                print(f"{kname:16s} {r:3d} {n:6d} {f'{bn}/{nw}w':>9s} {iters:5d} {us:9.1f} {gs} "
                      f"{us / iters:8.3f} {gi} {per - base:12.3f}  {'ok' if ok else 'MISMATCH'}", flush=True)
    print("(g - load_sum: per-iteration time over load_sum's, graph times where there are some)")

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, threshold=t, results=results, failures=failures), f, indent=1)
    if failures:
        print("MISMATCH: " + ", ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
