#!/usr/bin/env python3
"""
Profile: LFPS's prompt state at a prefill's last chunk (query_serving's lfps extend), by op
==========================================================================================

Run on a GPU (bare machine: torch and triton only)::

    PYTHONPATH=$PWD python bench/kernels/profile_lfps_extend.py --out results/lfps_extend.json

The served call, one layer: ``QueryAwareRuntime.plan_extend`` then ``on_extend`` for
lfps rows whose last prefill chunk (``--chunk`` queries, SGLang's 8192 on an H200)
ends their prompt of n tokens: each row's keys and values of [0, n) gathered from a
paged pool through a scattered ``req_to_token``, ``init_tables`` over its last s = 32
queries (logits, the causal softmax, the vertical and slash tables, K̄, V̄, σ̂²),
written into the store's slots. Qwen3-1.7B's attention shape (8 KV heads, GQA 2, D
128), pools of bf16 and e4m3 (a value scale as served).

At 32768 x 8 (bf16, session 58) lfps's prefill-only batch took 7.2% longer than
stock's, all of it here: ~1.3 ms a row and layer. Per case: the median time of the
call (eager: the extend is not graphed), the bytes it must move at least (the keys
and values read once, the two tables written) over that time, and the CUDA time of
each op under torch.profiler, largest first, per call. Checked first: the batched
call's tables equal ``init_tables`` on each row alone.
``--smoke`` runs a tiny shape on the CPU (no profile there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_env import add_common_args, start  # noqa: E402


def _cases(smoke: bool):
    # (name, rows ending their prompt in the forward, n, the last chunk's queries)
    if smoke:
        return [("smoke", 2, 300, 64)]
    return [
        ("32k-1row", 1, 32768, 8192),  # 32768 x 8/32 served: one row a forward
        ("32k-4rows", 4, 32768, 2048),  # prompts ending together (short last chunks)
        ("8k-1row", 1, 8192, 8192),
        ("130k-1row", 1, 131072, 8192),
    ]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--kv-dtypes", default="bf16,fp8_e4m3", help="pool dtypes: bf16, fp8_e4m3")
    ap.add_argument("--top", type=int, default=12, help="ops listed per case")
    return ap.parse_args(argv)


def _runtime(rows: int, n: int, hkv: int, hq: int, d: int, dev):
    """A QueryAwareRuntime over an lfps store of `rows` slots, as the backend builds it."""
    from sgl_sparse.config import SparseServerConfig
    from sgl_sparse.policies.base import PolicyId
    from sgl_sparse.query_serving import QueryAwareRuntime
    from sgl_sparse.query_store import LfpsStore
    from sgl_sparse.state import SparseState

    cfg = SparseServerConfig.model_validate({"query_aware": {"lfps": {"slots": rows, "max_context": n + 512}}})
    st = SparseState(rows + 1, dev, cfg)
    st.query_stores[PolicyId.LFPS] = LfpsStore(cfg.query_aware.lfps, num_layers=1, num_kv_heads=hkv,
                                               num_q_heads=hq, head_dim=d, device=dev)
    return st, QueryAwareRuntime(st)


def _profile(fn, top: int) -> list[dict]:
    """CUDA time per op of one call of ``fn`` (torch.profiler over 3 calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    calls = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ops = [(e.key, e.device_time_total / calls, e.count // calls) for e in prof.key_averages()
           if e.device_time_total > 0]
    ops.sort(key=lambda x: -x[1])
    return [dict(op=k[:90], us=round(t, 1), launches=c) for k, t, c in ops[:top]]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    started = start(args, "lfps extend profile")
    if started is None:
        return 2
    use_cuda, dev, _, env, timer = started
    from sgl_sparse.config import LfpsPolicy
    from sgl_sparse.policies import MODULES
    from sgl_sparse.policies.base import PolicyId
    from sgl_sparse.query_serving import lfps_knobs
    from sgl_sparse.queryaware import lfps as lfps_math

    kv_dtypes = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    hkv, group = 8, 2
    hq, d = hkv * group, (16 if args.smoke else 128)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    prefixes = [c for c in args.cases.split(",") if c]
    results, failures = [], []
    for name, rows, n, chunk in _cases(args.smoke):
        if prefixes and not any(name.startswith(c) for c in prefixes):
            continue
        for kv_name in [k for k in args.kv_dtypes.split(",") if k]:
            kv = kv_dtypes[kv_name]
            st, rt = _runtime(rows, n, hkv, hq, d, dev)
            store = st.query_stores[PolicyId.LFPS]
            pool = rows * n + 1
            req_to_token = torch.zeros(rows + 1, n + 512, dtype=torch.int32, device=dev)
            req_to_token[1:, :n] = (torch.randperm(pool - 1, generator=gen, device=dev) + 1).view(rows, n).int()
            k_pool = torch.randn(pool, hkv, d, generator=gen, device=dev).to(kv)
            v_pool = torch.randn(pool, hkv, d, generator=gen, device=dev).to(kv)
            v_scale = 0.5 if kv_name == "fp8_e4m3" else None
            scale = 1 / math.sqrt(d)
            q3 = torch.randn(rows * chunk, hq, d, generator=gen, device=dev).to(torch.bfloat16)
            spec = LfpsPolicy()
            init = dataclasses.replace(MODULES["lfps"].init_row(spec, [], [], (None, None)), prefill_end=n)
            req_rows = list(range(1, rows + 1))
            admitted = st.admit(req_rows, [init] * rows)
            rt.plan_extend(req_rows, [n] * rows, [chunk] * rows, admitted)

            def run():
                rt.on_extend(0, q3, k_pool, v_pool, req_to_token, scale, v_scale)

            checked_us = timer.checked_run(run)
            # each row alone, as the row loop initialized it before the batched calls
            ok = True
            kn = dataclasses.replace(lfps_knobs(spec), s=min(spec.s, chunk))
            for i, r in enumerate(req_rows):
                slot = st.row_init(r).slot
                locs = req_to_token[r, :n].long()
                values = v_pool[locs][None]
                values = values.float() * v_scale if v_scale is not None else values
                one = lfps_math.init_tables(q3[(i + 1) * chunk - kn.s: (i + 1) * chunk][None], k_pool[locs][None],
                                            values, torch.tensor([n], device=dev), scale, store.cfg.max_context, kn)
                for f in ("ver", "sla", "kbar", "vbar", "sigma_hat2"):
                    got, want = getattr(store, f)[0, slot], getattr(one, f)[0].to(torch.float32)
                    ok &= bool(torch.allclose(got, want, rtol=1e-4, atol=1e-6)) and not bool(got.isnan().any())
            if not ok:
                failures.append((name, kv_name))
            eager_us, _ = timer.again(run, checked_us)
            nbytes = rows * n * hkv * d * kv.itemsize * 2 + rows * hkv * store.cfg.max_context * 4 * 2
            res = dict(case=name, kv=kv_name, rows=rows, n=n, chunk=chunk, s=kn.s, eager_us=round(eager_us, 1),
                       us_per_row=round(eager_us / rows, 1), bytes=nbytes,
                       gbps=round(nbytes / (eager_us * 1e-6) / 1e9, 1), ok=ok,
                       ops=_profile(run, args.top) if use_cuda else [])
            results.append(res)
            print(f"  {name:10s} {kv_name:8s} rows {rows} n {n:6d}: {eager_us:9.1f} us ({res['us_per_row']:.1f} a row)"
                  f"  {res['gbps']:7.1f} GB/s over the least bytes  {'ok' if ok else 'MISMATCH'}", flush=True)
            for op in res["ops"]:
                print(f"      {op['us']:9.1f} us  x{op['launches']:<3d} {op['op']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "command": " ".join(sys.argv), "results": results}, f, indent=1)
    if failures:
        print(f"FAIL: the batched tables differ from init_tables row by row at {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
