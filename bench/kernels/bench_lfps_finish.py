#!/usr/bin/env python3
"""
Benchmark: LFPS's table update after the attention (kernels/lfps_tables.lfps_finish) by chunks a row
====================================================================================================

Run on a GPU (bare machine: torch and triton only)::

    python bench/kernels/bench_lfps_finish.py --out results/lfps_finish.json

One layer of LFPS's store as served: ``[slots, Hkv, max_context]`` fp32 tables,
every slot live with its C2 (``|C2|`` distinct positions, the same count in every
row) over a paged pool read through a scattered ``req_to_token``, GQA 2, D 128, an
e4m3 pool with bf16 queries (``--kv-cache-dtype fp8_e4m3``) and a bf16 one. Each
row's finish gathers its C2 keys once (the logits, kept for the weights) and decays
both of its tables once. Served as one program a (slot, KV head) row, gathering the
keys twice, it took 176 µs a layer at 32768 x 8 with C1 at 2.1% of the positions
(session 35's profile, H200); ``chunks=1`` is that layout (in the two launches it
runs as now), the default
(``finish_chunks``) and every power of two up to 32 cut each row's C2 entries and
table slices into that many programs; each with the tables decayed in place and
with the lazy decay as served (``tscale``: a scale per row instead of the tables'
pass). Each variant is checked against ``chunks=1`` with the decay first (the true
tables within fp32 rounding, the output bit for bit), then timed eagerly and under
CUDA-graph replay (the update is in place: the tables keep changing between
launches, which does not change the work; the lazy scale decays on from launch to
launch and renormalizes the tables about once in 100, as served at r = 0.95).
``--smoke`` runs a tiny shape through the Triton CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_env import add_common_args, import_kernels, start  # noqa: E402


def _cases(smoke: bool):
    # (name, slots, KV heads, max_context, live length, |C2| a row)
    if smoke:
        return [("smoke", 2, 2, 300, 280, 40)]
    return [
        ("32k8-c2-688", 8, 8, 33792, 32768, 688),  # session 35's served C1: 2.1% of 32768
        ("32k8-c2-2048", 8, 8, 33792, 32768, 2048),  # C2 at the default budget
        ("130k4-c2-2048", 4, 8, 132052, 130000, 2048),
    ]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--kv-dtypes", default="fp8_e4m3,bf16", help="pool dtypes: fp8_e4m3, bf16")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    started = start(args, "lfps finish benchmark")
    if started is None:
        return 2
    _, dev, num_sms, env, timer = started
    lt = import_kernels("lfps_tables")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    kv_dtypes = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    results, failures = [], []
    prefixes = [c for c in args.cases.split(",") if c]
    group, d = 2, (16 if args.smoke else 128)
    for name, s, hkv, m, n_live, c2 in _cases(args.smoke):
        if prefixes and not any(name.startswith(c) for c in prefixes):
            continue
        for kv_name in [k for k in args.kv_dtypes.split(",") if k]:
            kv_dtype = kv_dtypes[kv_name]
            bs, hq = s, hkv * group
            pool = s * m + 16
            # scattered pool slots, as a serving allocator leaves them after a while
            req_to_token = torch.randperm(pool, generator=gen, device=dev)[: s * m].view(s, m).to(torch.int32)
            rpi = torch.arange(s, device=dev)
            row = torch.arange(s, device=dev)
            k_pool = torch.randn(pool, hkv, d, generator=gen, device=dev).to(kv_dtype)
            q = torch.randn(bs, hq, d, generator=gen, device=dev).to(torch.bfloat16)
            o = torch.zeros(bs, hq, d, device=dev, dtype=torch.bfloat16)
            n = torch.full((s,), n_live, dtype=torch.int32, device=dev)
            r = torch.full((s,), 0.95, device=dev)
            # C1 = C2 here (lfps's usual case: C1 within C2's budget, idx 0..|C1|-1)
            cand = torch.stack([torch.randperm(n_live - 4, generator=gen, device=dev)[:c2].sort().values + 4
                                for _ in range(s * hkv)]).view(s, hkv, c2).to(torch.int32)
            idx = torch.arange(c2, dtype=torch.int32, device=dev).expand(s, hkv, c2).contiguous()
            count = torch.full((s, hkv), c2, dtype=torch.int32, device=dev)
            bypass = torch.zeros(s, hkv, dtype=torch.int8, device=dev)
            bypass[0, 0] = 1  # one sink-bypassed head: V̄ into its output rows, no C2 (as served)
            count[0, 0] = 0
            vbar = torch.randn(s, hkv, d, generator=gen, device=dev)
            ver0 = torch.randn(s, hkv, m, generator=gen, device=dev).exp()
            sla0 = torch.randn(s, hkv, m, generator=gen, device=dev).exp()
            ver, sla = ver0.clone(), sla0.clone()
            scale = 1 / math.sqrt(d)
            default = lt.finish_chunks(s, hkv, c2, num_sms)

            tscale = torch.ones(s, hkv, device=dev)

            def run(chunks, lazy):
                lt.lfps_finish(q, o, k_pool, req_to_token, rpi, row, n, r, cand, idx, count, bypass, vbar, ver, sla,
                               scale, chunks=chunks, tscale=tscale if lazy else None)

            run(1, False)
            want = ver.clone(), sla.clone(), o.clone()
            for lazy in (False, True):
                # bytes: C2's keys once; with the decay both tables read and written
                nbytes = s * hkv * (c2 * d * k_pool.element_size() + (0 if lazy else 2 * 2 * m * 4))
                for chunks in sorted({1, 2, 4, 8, 16, 32, default} if not args.smoke else {1, 3, default}):
                    if lazy:  # stored over 0.5: true = stored * 0.5, then the step
                        ver.copy_(ver0 * 2)
                        sla.copy_(sla0 * 2)
                        # the timed launches below carry the scale on from here, as serving
                        # does (no fill of their own): the tables renormalized about once in 100
                        tscale.fill_(0.5)
                    else:
                        ver.copy_(ver0)
                        sla.copy_(sla0)
                    o.zero_()
                    run(chunks, lazy)
                    got_v, got_s = (ver * tscale[..., None], sla * tscale[..., None]) if lazy else (ver, sla)
                    ok = bool(torch.equal(o, want[2]) and torch.allclose(got_v, want[0], rtol=1e-5, atol=1e-6)
                              and torch.allclose(got_s, want[1], rtol=1e-5, atol=1e-6)
                              and not (torch.isnan(ver).any() or torch.isnan(sla).any()))
                    if not ok:
                        failures.append((name, kv_name, chunks, "lazy" if lazy else "decay"))
                    t = timer.eager_us(lambda: run(chunks, lazy))
                    g = timer.graph_us(lambda: run(chunks, lazy))
                    best = g if g is not None else t
                    res = dict(case=name, kv=kv_name, slots=s, kv_heads=hkv, max_context=m, c2=c2, chunks=chunks,
                               lazy=lazy, default=chunks == default, eager_us=round(t, 1),
                               graph_us=None if g is None else round(g, 1), bytes=nbytes,
                               gbps=round(nbytes / (best * 1e-6) / 1e9, 1), ok=ok)
                    results.append(res)
                    print(f"  {name:14s} {kv_name:8s} {'lazy ' if lazy else 'decay'} chunks {chunks:2d}"
                          f"{'*' if chunks == default else ' '}: {t:8.1f} us (graph {'-' if g is None else f'{g:7.1f}'})"
                          f"  {res['gbps']:7.1f} GB/s  {'ok' if ok else 'MISMATCH'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "command": " ".join(sys.argv), "results": results}, f, indent=1)
    if failures:
        print(f"FAIL: tables differ from chunks=1 at {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
