#!/usr/bin/env python3
"""
Benchmark: the query-aware policies' kernels (Quest, AsyncSpade, LFPS)
======================================================================

Run on a GPU (written for an H100)::

    python bench/kernels/bench_query_aware.py --out results/bench_query_aware.json

Per (context, batch), Qwen3-1.7B attention shape by default (Hq=16, Hkv=8,
D=128, bf16), one layer:

* ``quest_bounds_update``: page bounds of the whole context (extend / radix hit).
* ``quest_bounds_decode``: one decode step's key folded into its page.
* ``quest_page_scores``: bounds of every page scored against the query.
* ``quest_select``: ``torch.topk`` + expansion into ``a_pos`` (budget pages).
* ``token_scores``: every key of the context scored with a predicted query
  (AsyncSpade), for a bf16 and an fp32 ``q_hat``.
* ``index_scores_{cold,steady}``: the same scores from int8 key copies
  (``kernels/index_keys.py``, ``index_keys: int8``): ``cold`` quantizes and
  copies every key (a request's first step), ``steady`` reads the copies and
  copies one new position (every later step). ``index4_scores_*``: from the 4-bit
  copies (``index_keys: int4``). ``steady`` rows give their Top-``--budget``'s mean
  and smallest overlap with the exact scores' over the (row, KV head)s.
* ``token_select``: ``torch.topk`` of the token scores + the expansion into
  ``a_pos`` (``--budget`` tokens per KV head).
* ``token_scores_at``: ``--candidates`` listed positions per KV head (LFPS).

Every kernel is first checked against its reference on the same data (the
references loop in Python: checked on the first rows/pages only where they
would take minutes), then timed with ``triton.testing.do_bench`` (median, L2
flushed) and under CUDA-graph replay. Each row reports the minimal HBM bytes
the kernel must move and the achieved GB/s, so a row far below the copy
bandwidth is visibly not memory bound.

``--smoke`` runs tiny shapes through the Triton CPU interpreter (wall-clock
timing) to check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from _bench_env import Timer, import_kernels, use_cuda_or_exit
from typing import Dict, List



def _int_list(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--contexts", type=_int_list, default=[4096, 32768, 131072])
    p.add_argument("--batches", type=_int_list, default=[1, 8, 32])
    p.add_argument("--num-q-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--budget", type=int, default=2048, help="tokens kept per KV head (Quest: budget/16 pages)")
    p.add_argument("--candidates", type=int, default=4096, help="LFPS candidates per KV head")
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1 << 21,
                   help="skip (ctx, batch) pairs whose total context exceeds this (GPU memory)")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--index-tiles", default="",
                   help="also time index_scores_steady at these BLOCK_NxWARPS[xSTAGES[xPROGRAMS]][w|s], e.g. "
                        "64x8,128x4x3x18w (the launch's tile, pipeline depth, programs per row and KV head; w: the "
                        "keys as the dot's M side, s: the queries, index_token_scores' keys_as_m)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts, args.batches = [200], [1, 2]
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.budget, args.candidates, args.recent = 48, 40, 32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    K = import_kernels()
    T = import_kernels("testing")
    import triton

    dev = torch.device("cuda" if use_cuda else "cpu")
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    page = K.QUEST_PAGE_SIZE
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)",
    }
    print("# query-aware kernels benchmark\n" + json.dumps(env))

    timer = Timer(use_cuda, args.warmup, args.rep, graphs=not args.no_graph)
    eager_us, graph_us = timer.eager_us, timer.graph_us

    results: List[Dict] = []
    failures: List[str] = []

    def record(ctx, bs, kernel, fn, nbytes, ok, note=""):
        t = eager_us(fn)
        g = graph_us(fn)
        row = dict(ctx=ctx, bs=bs, kernel=kernel, time_us=t, graph_us=g, bytes=nbytes,
                   gbps=nbytes / (t * 1e-6) / 1e9, gbps_graph=nbytes / (g * 1e-6) / 1e9 if g else None,
                   check_ok=ok, note=note)
        results.append(row)
        if not ok:
            failures.append(f"{kernel} ctx={ctx} bs={bs}")
        print(f"  {kernel:22s} ctx={ctx:>6} bs={bs:>3}: {t:9.1f} us (graph {g or float('nan'):8.1f})"
              f"  {row['gbps']:7.0f} GB/s  {'ok' if ok else 'MISMATCH'}  {note}", flush=True)

    for n in args.contexts:
        for bs in args.batches:
            if n * bs > args.max_tokens:
                continue
            if use_cuda:
                torch.cuda.empty_cache()
            case = T.make_decode_case([n] * bs, [0] * bs, [(0, n)] * bs, num_kv_heads=hkv, group=hq // hkv,
                                      head_dim=d, cap=1, dtype=torch.bfloat16, device=dev, seed=args.seed + n + bs)
            elem = case.k_pool.element_size()
            pool = (case.k_pool, case.req_to_token, case.req_pool_idx)
            max_pages = triton.cdiv(n, page)
            slot = torch.arange(bs, dtype=torch.int32, device=dev)
            kmin = torch.empty(bs, hkv, max_pages, d, dtype=case.k_pool.dtype, device=dev)
            kmax = torch.empty_like(kmin)
            zero = torch.zeros(bs, dtype=torch.int32, device=dev)
            seq = case.seq_lens

            # ---- Quest: bounds of the whole context ----------------------------
            fn = lambda: K.quest_bounds_update(*pool, slot, zero, seq, kmin, kmax)  # noqa: E731
            fn()
            rmin, rmax = torch.zeros_like(kmin[:1]), torch.zeros_like(kmax[:1])
            K.quest_bounds_ref(*pool, slot[:1], zero[:1], torch.clamp(seq[:1], max=64 * page), rmin, rmax)
            ok = torch.equal(kmin[0, :, :64], rmin[0, :, :64]) and torch.equal(kmax[0, :, :64], rmax[0, :, :64])
            nbytes = bs * n * hkv * d * elem + bs * n * 4 + 2 * bs * hkv * max_pages * d * elem
            record(n, bs, "quest_bounds_update", fn, nbytes, ok, "keys + r2t read, bounds written")

            # ---- Quest: one decode step ----------------------------------------
            # Folding in key n - 1, already covered by the full bounds, must
            # leave them unchanged (also when n - 1 opens its page).
            before = (kmin.clone(), kmax.clone())
            fn = lambda: K.quest_bounds_decode(*pool, slot, seq, kmin, kmax)  # noqa: E731
            fn()
            ok = torch.equal(kmin, before[0]) and torch.equal(kmax, before[1])
            nbytes = bs * hkv * d * elem * 5  # key + 2 bounds read + 2 bounds written
            record(n, bs, "quest_bounds_decode", fn, nbytes, ok, "tiny: launch-bound")
            del before

            # ---- Quest: page scores + selection -------------------------------
            first = torch.ones(bs, dtype=torch.int32, device=dev)
            last = (seq - args.recent) // page
            out = torch.empty(bs, hkv, max_pages, dtype=torch.float32, device=dev)
            fn = lambda: K.quest_page_scores(case.q, kmin, kmax, slot, first, last, out=out)  # noqa: E731
            fn()
            ref = K.quest_page_scores_ref(case.q[:1], kmin, kmax, slot[:1], first[:1], last[:1])
            fin = torch.isfinite(ref)
            ok = bool(torch.equal(torch.isneginf(out[:1]), ~fin)) and bool(
                torch.allclose(out[:1][fin], ref[fin], rtol=1e-4, atol=1e-2))
            nbytes = 2 * bs * hkv * max_pages * d * elem + bs * hkv * max_pages * 4
            record(n, bs, "quest_page_scores", fn, nbytes, ok, f"{max_pages} pages/head")
            k_pages = max(1, args.budget // page)
            b_start = last * page
            fn = lambda: K.quest_select_positions(out, k_pages, b_start, max_select_pages=k_pages, n_sink=4)  # noqa: E731
            a_pos, a_len = fn()
            # Every page in [first, last) has a finite score and lies below
            # b_start, so each (row, head) lists 4 sinks + k_pages whole pages.
            want = 4 + min(k_pages, int((last - first).min())) * page
            p0 = a_pos[0, 0, : int(a_len[0, 0])]
            ok = bool((a_len == want).all()) and p0.unique().numel() == want and int(p0.max()) < int(b_start[0])
            record(n, bs, "quest_select", fn, bs * hkv * max_pages * 4, ok, f"top {k_pages} pages (topk + expand)")
            del kmin, kmax, rmin, rmax, out

            # ---- AsyncSpade: every key scored ---------------------------------
            lo = torch.full((bs,), 4, dtype=torch.int32, device=dev)
            hi = seq - args.recent
            ts_out = torch.empty(bs, hkv, n, dtype=torch.float32, device=dev)
            for q_hat, tag in ((case.q, "bf16"), (case.q.float(), "fp32")):
                fn = lambda: K.token_scores(q_hat, *pool, lo, hi, case.sm_scale, n, out=ts_out)  # noqa: E731
                fn()
                ref = K.token_scores_ref(q_hat[:1], *pool, lo[:1], hi[:1], case.sm_scale, n)
                fin = torch.isfinite(ref)
                ok = bool(torch.equal(torch.isneginf(ts_out[:1]), ~fin)) and bool(
                    torch.allclose(ts_out[:1][fin], ref[fin], rtol=1e-4, atol=1e-3))
                nbytes = bs * n * (hkv * d * elem + 4) + bs * hkv * n * 4
                record(n, bs, f"token_scores_{tag}", fn, nbytes, ok, "keys + r2t read, scores written")
            # ---- AsyncSpade over int8 / 4-bit key copies (index_keys: int8 | int4) -----
            IK = import_kernels("index_keys")
            q_hat = case.q.float()
            # the exact scores' Top-k, for the copies' overlap with it (random keys here:
            # no outlier channels, unlike LLM keys; tests/kernels/test_index_keys.py has those)
            K.token_scores(q_hat, *pool, lo, hi, case.sm_scale, n, out=ts_out)
            keep_ov = max(1, min(args.budget, int((hi - lo).min())))
            exact_top = ts_out.topk(keep_ov, dim=-1).indices.sort(-1).values
            par = (hi % 2).long()
            rows = torch.arange(bs, device=dev)
            for bits in (8, 4):
                width = d // 2 if bits == 4 else d
                kq = torch.empty(bs, hkv, n, width, dtype=torch.int8, device=dev)
                kscale = torch.empty(bs, hkv, n, dtype=torch.float32, device=dev)
                filled = torch.zeros(bs, 2, dtype=torch.int32, device=dev)
                ksm = None
                if bits == 4:  # each row's smoothing from its keys (serving: from the prompt's)
                    ksm = torch.stack([IK.channel_smoothing(case.k_pool[case.req_to_token[int(case.req_pool_idx[b]),
                                                                                          :n].long()])
                                       for b in range(bs)])
                name = "index_scores" if bits == 8 else "index4_scores"
                for tag, valid_to in (("cold", torch.zeros_like(hi)), ("steady", hi - 1)):
                    # the counter every launch reads (it writes the other one): 0, nothing
                    # copied yet, or hi - 1, the previous step's (the copies are filled by
                    # the cold runs before it)
                    filled[rows, 1 - par] = valid_to
                    fn = lambda: IK.index_token_scores(q_hat, *pool, lo, hi, case.sm_scale, n, kq,  # noqa: E731
                                                       kscale, filled, out=ts_out, ksmooth=ksm)
                    fn()
                    ref = IK.index_token_scores_ref(q_hat[:1], *pool, lo[:1], hi[:1], case.sm_scale, n,
                                                    ksmooth=None if ksm is None else ksm[:1])
                    m = torch.zeros_like(ref, dtype=torch.bool)
                    m[:, :, int(lo[0]):int(hi[0])] = True
                    fin = torch.isfinite(ref) & m
                    ok = bool(torch.allclose(ts_out[:1][fin], ref[fin], rtol=1e-4, atol=1e-3))
                    span = (hi - lo).float().sum().item()
                    new = span if tag == "cold" else bs
                    # copies read (width + 4 bytes a position and head), new keys read and
                    # copied, scores written
                    nbytes = int((span - new) * hkv * (width + 4) + new * (hkv * (d * elem + width) + hkv * 4 + 4)
                                 + span * hkv * 4)
                    note = f"{bits}-bit copies read, new keys copied"
                    if tag == "steady":
                        top = ts_out.topk(keep_ov, dim=-1).indices.sort(-1).values
                        # |top ∩ exact_top| / k, per (row, head), by sorted membership
                        idx = torch.searchsorted(exact_top, top).clamp(max=keep_ov - 1)
                        overlap = (exact_top.gather(-1, idx) == top).float().mean(-1)
                        note += f"; top-{keep_ov} overlap with exact mean {overlap.mean().item():.4f} " \
                                f"min {overlap.min().item():.4f}"
                    record(n, bs, f"{name}_{tag}", fn, nbytes, ok, note)
                    if tag == "steady":
                        # as serving launches it: the Top-K's top-digit histogram counted too
                        # (query_device.TOPK_HIST_FROM_SCORES; added up over the replays here)
                        h_top = torch.zeros(bs, hkv, 64, dtype=torch.int32, device=dev)
                        fn = lambda: IK.index_token_scores(q_hat, *pool, lo, hi, case.sm_scale, n, kq,  # noqa: E731
                                                           kscale, filled, out=ts_out, ksmooth=ksm, h_top=h_top)
                        fn()
                        ok = bool(torch.allclose(ts_out[:1][fin], ref[fin], rtol=1e-4, atol=1e-3))
                        record(n, bs, f"{name}_{tag}_hist", fn, nbytes, ok, "+ h_top counted")
                for tile in filter(None, args.index_tiles.split(",")):
                    orient = {"w": dict(keys_as_m=True), "s": dict(keys_as_m=False)}.get(tile[-1], {})
                    bn, nw, ns, npg = ([int(x) for x in tile.rstrip("ws").split("x")] + [0, 0])[:4]
                    fn = lambda: IK.index_token_scores(q_hat, *pool, lo, hi, case.sm_scale, n, kq,  # noqa: E731
                                                       kscale, filled, out=ts_out, block_n=bn, num_warps=nw,
                                                       num_stages=ns or None, num_programs=npg or None,
                                                       ksmooth=ksm, **orient)
                    fn()
                    ok = bool(torch.allclose(ts_out[:1][fin], ref[fin], rtol=1e-4, atol=1e-3))
                    record(n, bs, f"{name}_steady_{tile}", fn, nbytes, ok,
                           f"BLOCK_N x warps [x stages x programs] {tile}")
                del kq, kscale, filled

            keep = min(args.budget, n)
            b_start = seq - args.recent
            fn = lambda: K.token_select_positions(ts_out, keep, b_start, max_select=keep, n_sink=4)  # noqa: E731
            a_pos, a_len = fn()
            want = 4 + min(keep, int((hi - lo).min()))
            p0 = a_pos[0, 0, : int(a_len[0, 0])]
            ok = bool((a_len == want).all()) and p0.unique().numel() == want and int(p0.max()) < int(b_start[0])
            record(n, bs, "token_select", fn, bs * hkv * n * 4, ok, f"top {keep} tokens (topk + expand)")
            del ts_out, a_pos, a_len

            # ---- LFPS: listed candidates --------------------------------------
            c = min(args.candidates, n)
            gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
            cand = torch.randint(0, n, (bs, hkv, c), generator=gen, device=dev, dtype=torch.int32)
            fn = lambda: K.token_scores_at(case.q, *pool, cand, case.sm_scale, lo=lo, hi=hi)  # noqa: E731
            s = fn()
            m = min(c, 64)
            ref = K.token_scores_at_ref(case.q[:1], *pool, cand[:1, :, :m].contiguous(), case.sm_scale,
                                        lo=lo[:1], hi=hi[:1])
            fin = torch.isfinite(ref)
            ok = bool(torch.equal(torch.isneginf(s[:1, :, :m]), ~fin)) and bool(
                torch.allclose(s[:1, :, :m][fin], ref[fin], rtol=1e-4, atol=1e-3))
            nbytes = bs * hkv * c * (d * elem + 4 + 4 + 4)
            record(n, bs, "token_scores_at", fn, nbytes, ok, f"{c} candidates/head")
            del case, cand, s

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"env": env, "args": vars(args), "results": results, "failures": failures}, fh, indent=1)
        print(f"wrote {args.out}")
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
