#!/usr/bin/env python3
"""
Benchmark: two-segment sparse decode vs FlashInfer dense decode
================================================================

Run on a GPU (written for an H100)::

    python bench/kernels/bench_decode.py --out results/bench_decode.json

What it measures (Qwen3-1.7B attention shape by default: Hq=16, Hkv=8, D=128, bf16):

1. **HBM copy bandwidth**: a large device-to-device copy, counting read+write
   bytes. This is the practical roofline every decode kernel is judged against.
2. **FlashInfer dense decode** (``BatchDecodeWithPagedKVCacheWrapper``,
   page_size 1, NHD layout) at every (context, batch).
3. **Our kernel, dense path** (segment B = [0, n), A empty): same work as (2).
4. **Our kernel, sparse** at retained fractions of the context (default
   1/64, 1/16, 1/8, 1/4, 1/2, 1 = 1.6 .. 100 %): segment A = 4 sink +
   selected tokens in the compact buffer, segment B = the most recent
   ``min(256, budget/2)`` positions read in place from the pool.
5. **Indexed segment A** (``ours_sparse_indexed``): the same selection read in
   place through a per-head position list (``a_slot == -2``, ``a_pos``), as
   Quest / AsyncSpade / LFPS do, instead of from the compact buffer.
6. **One-launch merge** (``*_fused``): wherever ``num_splits > 1``, the same
   call with ``fused_merge=True`` (the last split merges; no merge launch),
   for an A/B against the two-launch path at the same shape.

Every configuration is first checked against the plain-PyTorch reference on
fresh random data (relative error), then timed with ``triton.testing.do_bench``
(median; L2 flushed before each call, which also hides host launch overhead
for these sub-100 us kernels). CUDA-graph replay time is recorded as well.
The table reports time, speedup vs FlashInfer dense at the same shape, the
minimal bytes the kernel must move (K/V + page indices + q/o), achieved GB/s
and the % of the measured copy bandwidth.

``--smoke`` runs tiny shapes through the Triton CPU interpreter (no FlashInfer,
wall-clock timing) to check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from _bench_env import Timer, decode_stage1_variants, import_kernels, module_constant, use_cuda_or_exit
from typing import Dict, List, Optional



def _int_list(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _float_list(s: str) -> List[float]:
    out = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        if "/" in x:
            a, b = x.split("/")
            out.append(float(a) / float(b))
        else:
            out.append(float(x))
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write all results as JSON to this path")
    p.add_argument("--contexts", type=_int_list, default=[4096, 16384, 32768, 131072], help="comma list of context lengths")
    p.add_argument("--batches", type=_int_list, default=[1, 8, 32], help="comma list of batch sizes")
    p.add_argument(
        "--fractions", type=_float_list, default=[1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0],
        help="comma list of retained fractions (e.g. '1/64,0.0625,1')",
    )
    p.add_argument("--sparse-contexts", type=_int_list, default=None,
                   help="contexts at which to run the sparse fractions (default: all --contexts)")
    p.add_argument("--num-q-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--kv-dtype", choices=["model", "fp8_e4m3", "fp8_e5m2"], default="model",
                   help="the KV cache's dtype (SGLang's --kv-cache-dtype): the model's (--dtype) or fp8, "
                        "for our kernel and FlashInfer alike")
    p.add_argument("--sink", type=int, default=4, help="sink tokens in segment A")
    p.add_argument("--recent", type=int, default=256, help="max recent-window length in segment B")
    p.add_argument("--pool-layout", choices=["random", "contiguous"], default="random",
                   help="pool slots of each request: random permutation (worst case, default) or contiguous")
    p.add_argument("--max-kv-len", type=int, default=None,
                   help="static upper bound passed to the kernel (default: the context length, "
                        "as if a CUDA graph were captured for it)")
    p.add_argument("--num-splits", type=int, default=None, help="force num_splits (default: heuristic)")
    p.add_argument("--min-split-len", type=int, default=None, help="override the kernel's min_split_len")
    p.add_argument("--block-n", type=int, default=None)
    # the kernel's own defaults, i.e. what serving launches (session 17: the old
    # num_stages=2 here timed 99.0 us at 8192 x 32 where serving's 3 stages take 92.5)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--sweep", action="store_true",
                   help="also sweep block_n x num_warps x num_stages x num_splits scale for our kernel "
                        "and report the best config per shape")
    p.add_argument("--sweep-block-n", type=_int_list, default=[64, 128], help="--sweep's block_n values")
    p.add_argument("--sweep-stages", type=_int_list, default=[1, 2, 3], help="--sweep's num_stages values")
    p.add_argument("--sweep-indexed", action="store_true",
                   help="sweep block_n x num_stages x num_splits for the indexed segment A, as position lists "
                        "and as pool-slot lists (a_pos_slots)")
    p.add_argument("--split-counts", type=_int_list, default=None,
                   help="also time our kernel at each of these split counts (serving's merge choice: one launch "
                        "up to the fused merge's limit), dense and each sparse fraction, CUDA-graph replay")
    p.add_argument("--slow-step", action="store_true",
                   help="also time the dense launch of SFI's slow step (key norms, saved query, logits kept)")
    p.add_argument("--slow-step-rounds", type=int, default=3,
                   help="the balanced slow step's variants timed round-robin this many times (median kept), "
                        "the plain launch among them, so that their order cannot make a difference")
    p.add_argument("--with-pack", action="store_true", help="also time pack_compact for the sparse fractions")
    p.add_argument("--no-indexed", action="store_true", help="skip the indexed segment-A (a_pos) rows")
    p.add_argument("--no-fused", action="store_true", help="skip the fused_merge=True rows")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer (e.g. not installed)")
    p.add_argument("--fi-tensor-cores", choices=["auto", "on", "off"], default="auto",
                   help="FlashInfer use_tensor_cores (auto: on when Hq/Hkv >= 4, like SGLang)")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth-probe copy")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    p.add_argument("--check-tol", type=float, default=2e-2, help="max relative error vs reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU Triton interpreter; checks this script without a GPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts = [96, 160]
        args.batches = [1, 2]
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.sink, args.recent = 4, 16
        args.no_flashinfer = True
        args.block_n = args.block_n or 16
        args.min_split_len = args.min_split_len or 16
        args.sparse_contexts = None
        args.sweep = False
        args.sweep_indexed = False
    return args


# -----------------------------------------------------------------------------
# Timing helpers
# -----------------------------------------------------------------------------


def measure_copy_bandwidth(torch, timer: Timer, gib: float, device) -> Optional[float]:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes."""
    if not timer.use_cuda:
        return None
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_us = timer.eager_us(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (t_us * 1e-6) / 1e9


# -----------------------------------------------------------------------------
# Problem construction
# -----------------------------------------------------------------------------


def segments_for_fraction(n: int, frac: float, sink: int, recent: int):
    """(a_len, b_start, b_end) for a request of length n keeping round(frac * n) keys."""
    budget = max(1, min(n, int(round(frac * n))))
    r = min(recent, budget // 2)  # recent window read in place (segment B)
    a = budget - r  # sink + selected tokens packed in segment A
    assert a >= min(sink, budget - r)
    return a, n - r, n


class FlashInferDense:
    """FlashInfer paged decode over positions [0, n) of each request (page_size 1, NHD)."""

    def __init__(self, torch, flashinfer, case, args, dtype, kv_dtype):
        bs, hq, d = case.q.shape
        hkv = case.k_pool.shape[1]
        dev = case.q.device
        self.torch = torch
        rows = case.req_to_token[case.req_pool_idx.long()]  # [bs, max_ctx]
        lens = case.seq_lens.long()
        self.indices = torch.cat([rows[b, : int(lens[b])] for b in range(bs)]).to(torch.int32)
        self.indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        self.indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
        self.last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
        if args.fi_tensor_cores == "auto":
            tc = hq // hkv >= 4
        else:
            tc = args.fi_tensor_cores == "on"
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
        self.use_tensor_cores = tc
        plan = getattr(self.wrapper, "plan", None) or self.wrapper.begin_forward
        common = (self.indptr, self.indices, self.last_page_len, hq, hkv, d, 1)
        try:
            plan(*common, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=kv_dtype, sm_scale=case.sm_scale)
            self._run_kwargs = {}
        except TypeError:  # older FlashInfer: sm_scale goes to run/forward
            plan(*common, pos_encoding_mode="NONE", data_type=dtype)
            self._run_kwargs = {"sm_scale": case.sm_scale}
        # page_size 1: [num_tokens, 1, Hkv, D] views of SGLang's pool, no copy.
        self.kv = (case.k_pool.unsqueeze(1), case.v_pool.unsqueeze(1))
        self.q = case.q
        self.out = torch.empty_like(case.q)
        self._run = getattr(self.wrapper, "run", None) or self.wrapper.forward

    def __call__(self):
        try:
            return self._run(self.q, self.kv, out=self.out, **self._run_kwargs)
        except TypeError:
            return self._run(self.q, self.kv, **self._run_kwargs)


def bytes_two_segment(case, a_len_total: int, b_len_total: int, elem: int, a_indexed: bool = False) -> int:
    """Minimal HBM traffic of one decode call: K and V rows (in the cache's dtype, ``elem``
    for q and o), page indices, q and o.

    With ``a_indexed`` segment A also reads, per listed (head, position), one
    int32 of ``a_pos`` and one int32 of ``req_to_token`` (positions differ by head).
    """
    hkv, d = case.k_pool.shape[1], case.k_pool.shape[2]
    kv = (a_len_total + b_len_total * hkv) * d * case.k_pool.element_size() * 2  # a_len_total already sums heads
    idx = b_len_total * 4  # req_to_token entries of segment B (re-reads across heads hit L2)
    if a_indexed:
        idx += a_len_total * 8
    qo = 2 * case.q.numel() * elem
    return kv + idx + qo


# -----------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2

    K = import_kernels()
    T = import_kernels("testing")

    flashinfer = None
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F811
        except ImportError as e:
            print(f"FlashInfer not importable ({e}); continuing without it.", file=sys.stderr)

    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    kv_dtype = {"model": dtype, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    assert hq % hkv == 0
    timer = Timer(use_cuda, args.warmup, args.rep, graphs=not args.no_graph)
    tuning = dict(block_n=args.block_n, num_warps=args.num_warps, num_stages=args.num_stages)

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "flashinfer": getattr(flashinfer, "__version__", None) if flashinfer else None,
        "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)",
        "num_sms": torch.cuda.get_device_properties(device).multi_processor_count if use_cuda else None,
    }
    print("# two-segment decode benchmark")
    print(json.dumps(env))
    print(f"shape: Hq={hq} Hkv={hkv} D={d} {args.dtype}, KV cache {kv_dtype}; sink={args.sink} recent<={args.recent}")

    copy_gbps = measure_copy_bandwidth(torch, timer, args.copy_gib, device)
    if copy_gbps:
        print(f"HBM copy bandwidth (read+write): {copy_gbps:.0f} GB/s")

    results: List[Dict] = []
    failures: List[str] = []

    cur_fi: Dict[str, Optional[float]] = {}  # FlashInfer dense times at the current (ctx, bs)

    printed_variants: set = set()

    def record(**row):
        t = row["time_us"]
        g = row.get("graph_us")
        row["speedup_vs_fi"] = cur_fi["us"] / t if cur_fi.get("us") else None
        row["speedup_vs_fi_graph"] = cur_fi["graph"] / g if (cur_fi.get("graph") and g) else None
        row["gbps"] = row["bytes"] / (t * 1e-6) / 1e9 if t else None
        row["pct_copy_bw"] = 100.0 * row["gbps"] / copy_gbps if (copy_gbps and row["gbps"]) else None
        row["gbps_graph"] = row["bytes"] / (g * 1e-6) / 1e9 if g else None
        results.append(row)
        ok = row["rel_err"] is None or row["rel_err"] < args.check_tol
        if not ok:
            failures.append(f"{row['kernel']} ctx={row['ctx']} bs={row['bs']} frac={row['frac']}: rel_err={row['rel_err']:.3g}")
        return row

    def dump():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump({"env": env, "args": vars(args), "copy_gbps": copy_gbps, "results": results,
                           "failures": failures, "stage1_variants": decode_stage1_variants(K)}, fh, indent=1)

    sparse_ctxs = set(args.sparse_contexts or args.contexts)
    for n in args.contexts:
        for bs in args.batches:
            torch.cuda.empty_cache() if use_cuda else None
            base = T.make_decode_case(
                [n] * bs, [0] * bs, [(0, n)] * bs, num_kv_heads=hkv, group=hq // hkv, head_dim=d, cap=1,
                dtype=dtype, device=device, seed=args.seed + n + bs, pool_layout=args.pool_layout,
            )
            if kv_dtype != dtype:  # the pool as an fp8 cache holds it (unit scales)
                base = base.stored_as(kv_dtype)
            max_kv_len = args.max_kv_len or n
            dense_bytes = bytes_two_segment(base, 0, bs * n, elem)
            cur_fi.clear()

            # ---- FlashInfer dense ------------------------------------------------
            if flashinfer is not None:
                fi = FlashInferDense(torch, flashinfer, base, args, dtype, kv_dtype)
                fi_out = fi()
                ref = K.dense_decode_ref(
                    base.q, base.k_pool, base.v_pool, base.req_to_token, base.req_pool_idx, base.seq_lens, base.sm_scale
                )
                err = T.rel_error(fi_out.float(), ref)
                cur_fi["us"] = timer.eager_us(fi)
                cur_fi["graph"] = timer.graph_us(fi)
                record(ctx=n, bs=bs, kernel="flashinfer_dense", frac=1.0, keys=n, num_splits=None,
                       time_us=cur_fi["us"], graph_us=cur_fi["graph"], bytes=dense_bytes, rel_err=err,
                       note=f"tensor_cores={fi.use_tensor_cores}")
                del fi
            else:
                ref = None

            # ---- Our kernel, dense path (B = [0, n)) -----------------------------
            out = torch.empty_like(base.q)
            msl = {"min_split_len": args.min_split_len} if args.min_split_len else {}
            # the served heuristic: over an fp8 cache twice the programs (programs_per_sm)
            ns = args.num_splits or K.choose_num_splits(bs, hkv, max_kv_len, env["num_sms"] or 4,
                                                        kv_fp8=kv_dtype != dtype, **msl)
            kw = dict(max_kv_len=max_kv_len, num_splits=ns, out=out, **tuning, **msl)
            run = lambda: K.two_segment_decode(*base.args(), **kw)  # noqa: E731
            run()
            if ref is None:
                ref = K.two_segment_decode_ref(*base.args())
            err = T.rel_error(out.float(), ref)
            t = timer.eager_us(run)
            record(ctx=n, bs=bs, kernel="ours_dense", frac=1.0, keys=n, num_splits=ns, time_us=t,
                   graph_us=timer.graph_us(run), bytes=dense_bytes, rel_err=err, note="A empty, B=[0,n)")
            counters = K.make_split_counters(bs, hkv, device)
            if ns > 1 and not args.no_fused:
                kw_f = dict(kw, fused_merge=True, split_counters=counters)
                run = lambda: K.two_segment_decode(*base.args(), **kw_f)  # noqa: E731
                out.fill_(float("nan"))
                run()
                err = T.rel_error(out.float(), ref)
                t = timer.eager_us(run)
                record(ctx=n, bs=bs, kernel="ours_dense_fused", frac=1.0, keys=n, num_splits=ns, time_us=t,
                       graph_us=timer.graph_us(run), bytes=dense_bytes, rel_err=err,
                       note="A empty, B=[0,n); one launch")
            if args.split_counts:
                time_split_counts(args, K, T, timer, base, ref, max_kv_len, results, n, bs, "ours_dense", 1.0,
                                  dense_bytes, counters)
            if args.slow_step:
                time_slow_step(args, K, T, torch, timer, base, ref, max_kv_len, results, n, bs, dense_bytes,
                               counters, kv_dtype != dtype)
                for v in decode_stage1_variants(K):  # each once: the cache keeps the earlier cases' too
                    line = "  stage-1 variant: " + ", ".join(f"{k} {x}" for k, x in v.items())
                    if line not in printed_variants:
                        printed_variants.add(line)
                        print(line, flush=True)
            if args.sweep:
                sweep(args, K, T, torch, timer, base, ref, max_kv_len, results, n, bs, "ours_dense", 1.0, dense_bytes)
            del ref

            dump()  # keep partial results if a long run is cut off

            # ---- Our kernel, sparse fractions ------------------------------------
            if n not in sparse_ctxs:
                continue
            for frac in args.fractions:
                a, bst, ben = segments_for_fraction(n, frac, args.sink, args.recent)
                cap = max(a, 1)
                gen = torch.Generator(device=device)
                gen.manual_seed(args.seed + 7 * n + bs + int(frac * 1e6))
                a_k = torch.randn(bs, hkv, cap, d, generator=gen, device=device, dtype=dtype).to(kv_dtype)
                a_v = torch.randn(bs, hkv, cap, d, generator=gen, device=device, dtype=dtype).to(kv_dtype)
                case = T.DecodeCase(
                    q=base.q, a_k=a_k, a_v=a_v, a_slot=torch.arange(bs, dtype=torch.int32, device=device),
                    a_len=torch.full((bs, hkv), a, dtype=torch.int32, device=device),
                    k_pool=base.k_pool, v_pool=base.v_pool, req_to_token=base.req_to_token,
                    req_pool_idx=base.req_pool_idx,
                    b_start=torch.full((bs,), bst, dtype=torch.int32, device=device),
                    b_end=torch.full((bs,), ben, dtype=torch.int32, device=device),
                    sm_scale=base.sm_scale, seq_lens=base.seq_lens,
                )
                nbytes = bytes_two_segment(case, bs * hkv * a, bs * (ben - bst), elem)
                run = lambda: K.two_segment_decode(*case.args(), **kw)  # noqa: E731
                run()
                ref = K.two_segment_decode_ref(*case.args())
                err = T.rel_error(out.float(), ref)
                t = timer.eager_us(run)
                record(ctx=n, bs=bs, kernel="ours_sparse", frac=frac, keys=a + ben - bst, num_splits=ns, time_us=t,
                       graph_us=timer.graph_us(run), bytes=nbytes, rel_err=err, note=f"A={a} B={ben - bst}")
                if ns > 1 and not args.no_fused:
                    kw_f = dict(kw, fused_merge=True, split_counters=counters)
                    run = lambda: K.two_segment_decode(*case.args(), **kw_f)  # noqa: E731
                    out.fill_(float("nan"))
                    run()
                    err = T.rel_error(out.float(), ref)
                    t = timer.eager_us(run)
                    record(ctx=n, bs=bs, kernel="ours_sparse_fused", frac=frac, keys=a + ben - bst, num_splits=ns,
                           time_us=t, graph_us=timer.graph_us(run), bytes=nbytes, rel_err=err,
                           note=f"A={a} B={ben - bst}; one launch")
                if not args.no_indexed and 0 < a <= bst:
                    # The same budget, segment A as a per-head list of distinct
                    # positions below b_start, read in place (Quest/AsyncSpade/LFPS).
                    a_pos = torch.stack([
                        torch.randperm(bst, generator=gen, device=device)[:a] for _ in range(bs * hkv)
                    ]).view(bs, hkv, a).to(torch.int32)
                    icase = T.DecodeCase(**{**case.__dict__, "a_slot": torch.full_like(case.a_slot, -2), "a_pos": a_pos})
                    iref = K.two_segment_decode_ref(*icase.args(), **icase.kwargs())
                    ibytes = bytes_two_segment(icase, bs * hkv * a, bs * (ben - bst), elem, a_indexed=True)
                    for fused in ((False, True) if ns > 1 and not args.no_fused else (False,)):
                        kw_i = dict(kw, a_pos=a_pos, fused_merge=fused, split_counters=counters)
                        run = lambda: K.two_segment_decode(*icase.args(), **kw_i)  # noqa: E731
                        out.fill_(float("nan"))
                        run()
                        err = T.rel_error(out.float(), iref)
                        t = timer.eager_us(run)
                        record(ctx=n, bs=bs, kernel="ours_sparse_indexed" + ("_fused" if fused else ""), frac=frac,
                               keys=a + ben - bst, num_splits=ns, time_us=t, graph_us=timer.graph_us(run),
                               bytes=ibytes, rel_err=err, note=f"A={a} listed B={ben - bst}")
                    # The same lists as pool slots (a_pos_slots): one dependent load
                    # before the K/V tiles instead of two.
                    slots = T.pool_slots_of(icase)
                    for fused in ((False, True) if ns > 1 and not args.no_fused else (False,)):
                        kw_i = dict(kw, a_pos=slots, a_pos_slots=True, fused_merge=fused, split_counters=counters)
                        run = lambda: K.two_segment_decode(*icase.args(), **kw_i)  # noqa: E731
                        out.fill_(float("nan"))
                        run()
                        err = T.rel_error(out.float(), iref)
                        t = timer.eager_us(run)
                        record(ctx=n, bs=bs, kernel="ours_sparse_indexed_slots" + ("_fused" if fused else ""),
                               frac=frac, keys=a + ben - bst, num_splits=ns, time_us=t, graph_us=timer.graph_us(run),
                               bytes=ibytes, rel_err=err, note=f"A={a} listed as pool slots B={ben - bst}")
                    if args.sweep_indexed:
                        for mode, lists in (("positions", dict(a_pos=icase.a_pos)),
                                            ("slots", dict(a_pos=slots, a_pos_slots=True))):
                            sweep_indexed(args, K, T, torch, timer, icase, iref, max_kv_len, results, n, bs, frac,
                                          ibytes, mode, lists, counters)
                    del icase, a_pos, iref, slots
                if args.split_counts:
                    time_split_counts(args, K, T, timer, case, ref, max_kv_len, results, n, bs, "ours_sparse", frac,
                                      nbytes, counters)
                if args.sweep:
                    sweep(args, K, T, torch, timer, case, ref, max_kv_len, results, n, bs, "ours_sparse", frac, nbytes)
                if args.with_pack and a > 0:
                    time_pack(args, K, torch, timer, case, a, n, bs, frac, results, gen, device)
                del case, a_k, a_v, ref
                dump()
            del base

    print_table(results, copy_gbps)
    if failures:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
    if args.out:
        dump()
        print(f"\nwrote {args.out}")
    return 1 if failures else 0


def _time_at_splits(args, K, T, timer, case, ref, counts, **kw):
    """(split count, µs, relative error) of our kernel at each of ``counts``, checked
    against ``ref`` first, CUDA-graph replay (eager where capture fails); ``kw``: the
    launch's other arguments (everything else as served: the merge in one launch up to
    FUSED_MERGE_MAX_SPLITS, else the merge kernel)."""
    out = case.q.new_empty(case.q.shape)
    timed = []
    for ns in counts:
        kw_ns = dict(kw, num_splits=ns, out=out)
        run = lambda: K.two_segment_decode(*case.args(), **kw_ns)  # noqa: E731
        out.fill_(float("nan"))
        run()
        err = T.rel_error(out.float(), ref)
        timed.append((ns, timer.graph_us(run) or timer.eager_us(run), err))
    return timed


def _split_line(args, timed, mark=None) -> str:
    return ", ".join(f"{ns}{'*' if ns == mark else ''}: {t:.1f}"
                     + ("" if err < args.check_tol else f" (rel_err {err:.2g}: WRONG)") for ns, t, err in timed)


def time_split_counts(args, K, T, timer, case, ref, max_kv_len, results, n, bs, kernel, frac, nbytes, counters):
    """Our kernel at each of ``--split-counts``, CUDA-graph replay: what a split
    heuristic for this GPU should pick."""
    timed = _time_at_splits(args, K, T, timer, case, ref, args.split_counts, max_kv_len=max_kv_len,
                            split_counters=counters, block_n=args.block_n, num_warps=args.num_warps,
                            num_stages=args.num_stages)
    for ns, t, err in timed:
        results.append(dict(ctx=n, bs=bs, kernel=kernel + "_splits", frac=frac, num_splits=ns, time_us=t,
                            bytes=nbytes, gbps=nbytes / (t * 1e-6) / 1e9, rel_err=err))
    print(f"  splits ctx={n} bs={bs} {kernel} frac={frac:.4f} ({nbytes / 1e6:.1f} MB), us by split count: "
          + _split_line(args, timed), flush=True)


def time_slow_step(args, K, T, torch, timer, case, ref, max_kv_len, results, n, bs, nbytes, counters, kv_fp8):
    """SFI's slow step as the backend launches it: every row dense, storing its key
    norm, saving its query and keeping its logits for the Selector (``logits_out``
    ``[rows, Hkv, G, L]`` fp32, L = the context), at the heuristic's splits and at each
    of ``--split-counts``, CUDA-graph replay. The logits' writes are added to the bytes."""
    hkv = case.k_pool.shape[1]
    dev = case.q.device
    sfi = case.slow_step_outputs(n)
    total = nbytes + sfi["logits_out"].numel() * 4
    heuristic = K.choose_num_splits(bs, hkv, max_kv_len, torch.cuda.get_device_properties(0).multi_processor_count
                                    if dev.type == "cuda" else 4, kv_fp8=kv_fp8)
    counts = [heuristic] + [c for c in (args.split_counts or []) if c != heuristic]
    timed = _time_at_splits(args, K, T, timer, case, ref, counts, max_kv_len=max_kv_len, split_counters=counters,
                            **sfi)
    for ns, t, err in timed:
        results.append(dict(ctx=n, bs=bs, kernel="ours_dense_slow_step", frac=1.0, num_splits=ns, time_us=t,
                            bytes=total, gbps=total / (t * 1e-6) / 1e9, rel_err=err, heuristic=ns == heuristic))
    print(f"  slow step ctx={n} bs={bs} (KV + logits {total / 1e6:.1f} MB), us by split count: "
          + _split_line(args, timed, heuristic), flush=True)
    fused = _time_at_splits(args, K, T, timer, case, ref, [c for c in counts if c > 1], max_kv_len=max_kv_len,
                            split_counters=counters, fused_merge=True, **sfi)
    for ns, t, err in fused:
        results.append(dict(ctx=n, bs=bs, kernel="ours_dense_slow_step_fused", frac=1.0, num_splits=ns, time_us=t,
                            bytes=total, gbps=total / (t * 1e-6) / 1e9, rel_err=err))
    print(f"  slow step ctx={n} bs={bs}, the merge in one launch, us by split count: "
          + _split_line(args, fused, heuristic), flush=True)
    for name, grid, row_splits, t, err, rounds in time_balanced_slow_step(args, K, T, timer, case, ref, max_kv_len,
                                                                          counters, kv_fp8, **sfi):
        results.append(dict(ctx=n, bs=bs, kernel="ours_dense_slow_step_balanced", variant=name, frac=1.0,
                            num_splits=grid, row_splits=row_splits, time_us=t, rounds_us=rounds, bytes=total,
                            gbps=total / (t * 1e-6) / 1e9, rel_err=err))
        print(f"  slow step ctx={n} bs={bs} {name} (grid {grid} splits, rows {row_splits}): {t:.1f} us "
              f"(rounds {', '.join(f'{x:.1f}' for x in rounds)})"
              + ("" if err < args.check_tol else f" (rel_err {err:.2g}: WRONG)"), flush=True)


def time_balanced_slow_step(args, K, T, timer, case, ref, max_kv_len, counters, kv_fp8, **sfi):
    """The slow step's launch as the backend makes it where the batch balances its
    splits (``kernels.step_row_splits``, once a step): the grid at BALANCE_FACTOR x the
    heuristic's splits, each request's share from ``balanced_splits`` (over fp8, doubled
    for long dense rows: FP8_DENSE_SPLIT_KEYS), the merge in one launch. The rows
    beside it take one difference away each: the plain launches (timed among the
    balanced ones: session 37 timed them first and blamed order), the merge kernel
    instead of the one-launch merge, no side effects, the logits alone, the query and
    key norms alone, the plain launch's grid, and the registers as Triton chooses them
    (BALANCE_MAX_REGISTERS 0: session 38 found the balanced variant at 142 registers, 3
    programs an SM, 628 us against the plain launch's 400 with the same partition).
    Every variant is timed in ``--slow-step-rounds`` round-robin rounds (their median
    and spread kept). [] where the shape does not balance (batch 1, too many programs)."""
    import importlib

    td = importlib.import_module(K.two_segment_decode.__module__)
    hkv = case.k_pool.shape[1]
    sms = td.device_num_sms(case.q.device)
    row_splits = K.step_row_splits(case.a_len, case.b_start, case.b_end, None, hkv, max_kv_len, sms, kv_fp8=kv_fp8)
    if row_splits is None:
        return []
    base, grid = K.balanced_grid_splits(case.q.shape[0], hkv, max_kv_len, sms, kv_fp8=kv_fp8)
    logits_only = {k: sfi[k] for k in ("q_save", "q_save_slot", "logits_out")}
    norms_query = {k: sfi[k] for k in ("key_norms", "q_save", "q_save_slot")}
    plain = base * (2 if int(row_splits.max()) > base else 1)  # the fp8 doubling's plain launch
    capped = td.BALANCE_MAX_REGISTERS
    variants = [  # (name, launch arguments, row splits, BALANCE_MAX_REGISTERS)
        (f"plain {plain} splits, merge in one launch", dict(num_splits=plain, fused_merge=True, balance=False, **sfi),
         row_splits, capped),
        (f"plain {plain} splits, merge kernel", dict(num_splits=plain, fused_merge=False, balance=False, **sfi),
         row_splits, capped),
        ("balanced as served", dict(**sfi), row_splits, capped),  # the heuristic sizes the grid
        ("balanced, merge kernel", dict(num_splits=grid, fused_merge=False, **sfi), row_splits, capped),
        ("balanced, no side effects", dict(), row_splits, capped),
        ("balanced, logits only", logits_only, row_splits, capped),
        ("balanced, key norms + query only", norms_query, row_splits, capped),
        (f"balanced in a grid of {plain}", dict(num_splits=plain, fused_merge=True, **sfi),
         row_splits.clamp(max=plain), capped),
        ("balanced as served, registers as Triton chooses", dict(**sfi), row_splits, 0),
    ]
    out = case.q.new_empty(case.q.shape)
    runs, errs = [], []
    for name, extra, splits, regs in variants:
        kw = dict(max_kv_len=max_kv_len, out=out, split_counters=counters, balance=True, row_splits=splits)
        kw.update(extra)
        def run(kw=kw, regs=regs):
            with module_constant(td, "BALANCE_MAX_REGISTERS", regs):
                K.two_segment_decode(*case.args(), **kw)

        runs.append(run)
        out.fill_(float("nan"))
        runs[-1]()
        errs.append(T.rel_error(out.float(), ref))
    times = [[] for _ in variants]
    for _ in range(max(1, args.slow_step_rounds)):
        for i, run in enumerate(runs):
            times[i].append(timer.graph_us(run) or timer.eager_us(run))
    rows = []
    for (name, extra, splits, _), ts, err in zip(variants, times, errs):
        ts = sorted(ts)
        rows.append((name, extra.get("num_splits", grid), splits.tolist() if extra.get("balance", True) else None,
                     ts[len(ts) // 2], err, ts))
    return rows


def sweep(args, K, T, torch, timer, case, ref, max_kv_len, results, n, bs, kernel, frac, nbytes):
    """Try tuning knobs for one shape; records every config, prints the best.

    Timed under CUDA-graph replay when possible (what a serving engine sees,
    and free of the host-launch noise that dominates small shapes).
    """
    hkv = case.k_pool.shape[1]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    base_ns = K.choose_num_splits(bs, hkv, max_kv_len, num_sms)
    out = torch.empty_like(case.q)
    best = None
    for block_n in args.sweep_block_n:
        for num_warps in (4, 8):
            for num_stages in args.sweep_stages:
                for ns in sorted({max(1, base_ns // 2), base_ns, min(128, base_ns * 2)}):
                    for msl in (64, 128, 256):
                        kw = dict(num_splits=ns, out=out, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages, min_split_len=msl)
                        run = lambda: K.two_segment_decode(*case.args(), **kw)  # noqa: E731
                        try:
                            run()
                        except Exception as e:  # e.g. out of shared memory
                            print(f"  sweep {kw} failed: {type(e).__name__}", file=sys.stderr)
                            continue
                        err = T.rel_error(out.float(), ref)
                        if err >= args.check_tol:
                            print(f"  sweep {kw}: rel_err {err:.3g}", file=sys.stderr)
                            continue
                        t = timer.graph_us(run) or timer.eager_us(run)
                        cfg = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=ns,
                                   min_split_len=msl)
                        results.append(dict(ctx=n, bs=bs, kernel=kernel + "_sweep", frac=frac, time_us=t,
                                            bytes=nbytes, gbps=nbytes / (t * 1e-6) / 1e9, rel_err=err, config=cfg))
                        if best is None or t < best[0]:
                            best = (t, cfg)
    if best:
        print(f"  sweep best ctx={n} bs={bs} {kernel} frac={frac:.4f}: {best[0]:.1f} us "
              f"({nbytes / (best[0] * 1e-6) / 1e9:.0f} GB/s) {best[1]}", flush=True)


def sweep_indexed(args, K, T, torch, timer, case, ref, max_kv_len, results, n, bs, frac, nbytes, mode, lists,
                  counters):
    """Tuning knobs of the indexed segment A (position lists or pool-slot lists),
    CUDA-graph replay; records every config as ``ours_sparse_indexed_<mode>_sweep``
    and prints the best. Splits past FUSED_MERGE_MAX_SPLITS take the two-launch merge."""
    hkv = case.k_pool.shape[1]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    base_ns = K.choose_num_splits(bs, hkv, max_kv_len, num_sms)
    out = torch.empty_like(case.q)
    best = None
    for block_n in (32, 64, 128):
        for num_stages in (2, 3, 4):
            for ns in sorted({base_ns, 2 * base_ns, 4 * base_ns}):
                fused = 1 < ns <= 8
                kw = dict(num_splits=ns, out=out, block_n=block_n, num_warps=4, num_stages=num_stages,
                          min_split_len=block_n, fused_merge=fused, split_counters=counters, **lists)
                run = lambda: K.two_segment_decode(*case.args(), **kw)  # noqa: E731
                try:
                    out.fill_(float("nan"))
                    run()
                except Exception as e:  # e.g. out of shared memory
                    print(f"  sweep_indexed {mode} {block_n}/{num_stages}/{ns} failed: {type(e).__name__}",
                          file=sys.stderr)
                    continue
                err = T.rel_error(out.float(), ref)
                if not err < args.check_tol:
                    print(f"  sweep_indexed {mode} {block_n}/{num_stages}/{ns}: rel_err {err:.3g}", file=sys.stderr)
                    continue
                t = timer.graph_us(run) or timer.eager_us(run)
                cfg = dict(block_n=block_n, num_warps=4, num_stages=num_stages, num_splits=ns, fused=fused)
                results.append(dict(ctx=n, bs=bs, kernel=f"ours_sparse_indexed_{mode}_sweep", frac=frac, time_us=t,
                                    bytes=nbytes, gbps=nbytes / (t * 1e-6) / 1e9, rel_err=err, config=cfg))
                print(f"  sweep_indexed {mode} ctx={n} bs={bs} {cfg}: {t:.1f} us "
                      f"({nbytes / (t * 1e-6) / 1e9:.0f} GB/s)", flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg)
    if best:
        print(f"  sweep_indexed best {mode} ctx={n} bs={bs} frac={frac:.4f}: {best[0]:.1f} us "
              f"({nbytes / (best[0] * 1e-6) / 1e9:.0f} GB/s) {best[1]}", flush=True)


def time_pack(args, K, torch, timer, case, a, n, bs, frac, results, gen, device):
    """Time packing a fresh selection of `a` positions per (request, head) into segment A."""
    hkv = case.k_pool.shape[1]
    sel_pos = torch.stack([
        torch.randperm(n, generator=gen, device=device)[:a].sort().values for _ in range(bs * hkv)
    ]).view(bs, hkv, a).to(torch.int32)
    sel_len = torch.full((bs, hkv), a, dtype=torch.int32, device=device)
    do_pack = torch.ones(bs, dtype=torch.bool, device=device)
    a_len = case.a_len.clone()
    fn = lambda: K.pack_compact(case.k_pool, case.v_pool, case.req_to_token, case.req_pool_idx, sel_pos,  # noqa: E731
                                sel_len, do_pack, case.a_k, case.a_v, case.a_slot, a_len)
    fn()
    elem = case.a_k.element_size()
    nbytes = 2 * bs * hkv * a * case.a_k.shape[3] * elem * 2 + bs * hkv * a * 8  # K,V read+write; pos+slot idx
    t = timer.eager_us(fn)
    results.append(dict(ctx=n, bs=bs, kernel="pack_compact", frac=frac, keys=a, num_splits=None, time_us=t,
                        graph_us=None, bytes=nbytes, gbps=nbytes / (t * 1e-6) / 1e9, pct_copy_bw=None,
                        rel_err=None, note=f"pack {a} rows/head"))


def print_table(results: List[Dict], copy_gbps: Optional[float]):
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print()
    print("| ctx | bs | kernel | kept % | keys/req | splits | time (us) | graph (us) | speedup vs FI dense "
          "| speedup (graph) | MB moved | GB/s | % copy BW | GB/s (graph) | rel err | note |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        if r["kernel"].endswith(("_sweep", "_splits")):
            continue
        print(
            f"| {r['ctx']} | {r['bs']} | {r['kernel']} | {100 * r['frac']:.2f} | {r.get('keys', '-')} "
            f"| {f(r.get('num_splits'), 'd')} | {r['time_us']:.1f} | {f(r.get('graph_us'), '.1f')} "
            f"| {f(r.get('speedup_vs_fi'), '.2f')} | {f(r.get('speedup_vs_fi_graph'), '.2f')} "
            f"| {r['bytes'] / 1e6:.2f} | {f(r.get('gbps'), '.0f')} | {f(r.get('pct_copy_bw'), '.0f')} "
            f"| {f(r.get('gbps_graph'), '.0f')} | {f(r.get('rel_err'), '.1e')} | {r.get('note', '')} |"
        )


if __name__ == "__main__":
    sys.exit(main())
