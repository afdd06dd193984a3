#!/usr/bin/env python3
"""
Benchmark: LFPS's priorities (kernels/lfps_tables.lfps_priority) by chunks a row
================================================================================

Run on a GPU (bare machine: torch and triton only)::

    python bench/kernels/bench_lfps_priority.py --out results/lfps_priority.json

One layer of LFPS's store as served (``[slots, Hkv, max_context]`` fp32 tables
``Φ_ver`` / ``Φ_sla``, peaked as the learned ones: a few % non-zero, GQA 2),
every slot live with ragged lengths. ``chunks=1`` is one program a (slot, KV
head) row walking its row three times (session 32's profile: 110 µs a layer at
32768 x 8 on an H200, 38% of lfps's step); the default (``priority_chunks``) and
every power of two up to 32 cut each row's passes into that many programs. Each
variant is checked against ``chunks=1`` first (the same priorities: finite
entries equal, -inf alike), then timed eagerly and under CUDA-graph replay, with the
chunks' moments merged in chunk order and by one tree reduction
(``PRIORITY_TREE_MERGE``).
Bytes: both tables read twice and once more with neighbours (~3 x 2 x 4 B a
position), the priorities written once (4 B) over the live range.
Then the table statistics by power sums about the rows' last means
(``STATS_POWER_SUMS``) against Pébay's merges, at the default chunks (the same
priorities up to entries at a threshold, which fp32 rounding may move: counted).
Then the whole C1 stage, before (one program a row, ``topk_range`` over every row)
and now (chunks; C1 listed by a fourth launch where it fits the 8192 candidates,
``topk_range`` skipping those rows): the same C1, and both times.
``--smoke`` runs a tiny shape through the Triton CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_env import add_common_args, import_kernels, module_constant, start  # noqa: E402


def _cases(smoke: bool):
    # (name, slots, KV heads, max_context, live lengths as fractions of the table)
    if smoke:
        return [("smoke", 2, 2, 2048, [0.9, 0.5])]  # the default chunks 2 (the interpreter pays by the program)
    return [
        ("32k8", 8, 8, 33792, [32768 / 33792] * 8),
        ("32k8-ragged", 8, 8, 33792, [0.97, 0.5, 0.25, 0.9, 0.1, 0.97, 0.6, 0.3]),
        ("130k4", 4, 8, 132052, [130000 / 132052] * 4),
        ("8k32", 32, 8, 10240, [8192 / 10240] * 32),
    ]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    started = start(args, "lfps priority benchmark")
    if started is None:
        return 2
    _, dev, num_sms, env, timer = started
    lt = import_kernels("lfps_tables")
    kernels_topk = import_kernels("topk_range")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    results, failures = [], []
    prefixes = [c for c in args.cases.split(",") if c]
    for name, s, hkv, m, fracs in _cases(args.smoke):
        if prefixes and not any(name.startswith(c) for c in prefixes):
            continue
        group = 2

        def table():
            t = torch.randn(s, hkv, m, generator=gen, device=dev).exp()
            return t * (torch.rand(s, hkv, m, generator=gen, device=dev) < 0.05)

        ver, sla = table(), table()
        n = torch.tensor([int(f * m) for f in fracs], dtype=torch.int32, device=dev)
        sink = torch.full((s,), 4, dtype=torch.int32, device=dev)
        rho = torch.rand(s, hkv * group, generator=gen, device=dev) * 0.1
        eps = torch.full((s,), 0.2, device=dev)
        a = torch.full((s,), 0.05, device=dev)
        prio = torch.empty(s, hkv, m, device=dev)
        bypass = torch.empty(s, hkv, dtype=torch.int8, device=dev)
        live_pos = int((n - sink).clamp(min=0).sum()) * hkv
        nbytes = live_pos * (3 * 2 * 4 + 4)
        default = lt.priority_chunks(s, hkv, m, num_sms)
        want, _ = lt.lfps_priority(rho, eps, a, ver, sla, n, sink, chunks=1)
        want = want.clone()
        pos = torch.arange(m, device=dev)
        live = ((pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None]))[:, None, :].expand(s, hkv, m)
        for chunks in sorted({1, 2, 4, 8, 16, 32, default} if not args.smoke else {1, 3, default}):
            # the chunk moments merged in chunk order, and by one tree reduction
            # (PRIORITY_TREE_MERGE; the smoke checks it at 3 chunks only)
            for tree in (False, True) if not args.smoke or chunks == 3 else (False,):
                def run(chunks=chunks, tree=tree):
                    with module_constant(lt, "PRIORITY_TREE_MERGE", tree):
                        lt.lfps_priority(rho, eps, a, ver, sla, n, sink, prio=prio, bypass=bypass, chunks=chunks)

                prio.fill_(float("nan"))
                first = timer.checked_run(run)
                ok = torch.equal(prio[live], want[live])
                if not ok:
                    failures.append((name, chunks, "tree" if tree else "in order"))
                t, g = timer.again(run, first)
                best = g if g is not None else t
                row = dict(case=name, slots=s, kv_heads=hkv, max_context=m, chunks=chunks, tree_merge=tree,
                           default=chunks == default and not tree,
                           eager_us=round(t, 1), graph_us=None if g is None else round(g, 1), bytes=nbytes,
                           gbps=round(nbytes / (best * 1e-6) / 1e9, 1), ok=ok,
                           finite_share=round(float(torch.isfinite(want[live]).float().mean()), 4))
                results.append(row)
                print(f"  {name:12s} chunks {chunks:2d}{'*' if chunks == default else ' '}"
                      f"{' tree' if tree else '     '}: {t:8.1f} us (graph {'-' if g is None else f'{g:7.1f}'})  "
                      f"{row['gbps']:7.1f} GB/s  {'ok' if ok else 'MISMATCH'}", flush=True)
        # C0 at a position from the entries just read (8 table reads a position, since
        # session 38) against reading them again (10), at the default chunks, one run
        for reread in (True, False):
            def run_c0(reread=reread):
                with module_constant(lt, "PRIORITY_C0_FROM_READ", not reread):
                    lt.lfps_priority(rho, eps, a, ver, sla, n, sink, prio=prio, bypass=bypass, chunks=default)

            prio.fill_(float("nan"))
            first = timer.checked_run(run_c0)
            ok = torch.equal(prio[live], want[live])
            if not ok:
                failures.append((name, "c0 reread" if reread else "c0 from read"))
            t, g = timer.again(run_c0, first)
            label = "C0 read again (10 reads)" if reread else "C0 from the read (8)"
            results.append(dict(case=name, slots=s, kv_heads=hkv, max_context=m, c0=label, c0_chunks=default,
                                eager_us=round(t, 1), graph_us=None if g is None else round(g, 1), ok=ok))
            print(f"  {name:12s} {label:24s}: {t:8.1f} us (graph {'-' if g is None else f'{g:7.1f}'})  "
                  f"{'ok' if ok else 'MISMATCH'}", flush=True)
        # the table statistics by power sums about the rows' last means
        # (STATS_POWER_SUMS, the store's shift) against Pébay's merges, at the default
        # chunks with the tree merge, as served; the shift after the first run is the
        # rows' means, as a step leaves it for the next
        shift = torch.zeros(s, hkv, 2, device=dev)
        for power_sums in (False, True):
            def run_ps(power_sums=power_sums):
                with module_constant(lt, "STATS_POWER_SUMS", power_sums), \
                        module_constant(lt, "PRIORITY_TREE_MERGE", True):
                    lt.lfps_priority(rho, eps, a, ver, sla, n, sink, prio=prio, bypass=bypass, chunks=default,
                                     shift=shift)

            prio.fill_(float("nan"))
            first = timer.checked_run(run_ps)
            # the thresholds move by fp32 rounding: an entry at one may change sides
            differ = int((prio[live] != want[live]).sum())
            ok = differ <= max(1, live_pos // 10000)
            if not ok:
                failures.append((name, "power sums" if power_sums else "moments"))
            t, g = timer.again(run_ps, first)
            label = "statistics by power sums" if power_sums else "statistics by Pébay merges"
            results.append(dict(case=name, slots=s, kv_heads=hkv, max_context=m, statistics=label, stats_chunks=default,
                                eager_us=round(t, 1), graph_us=None if g is None else round(g, 1),
                                differing_entries=differ, ok=ok))
            print(f"  {name:12s} {label:26s}: {t:8.1f} us (graph {'-' if g is None else f'{g:7.1f}'})  "
                  f"{differ} entries differ", flush=True)
        # the whole C1 stage as lfps_device ran it before (one program a row, then
        # topk_range over every row) and as it runs now (chunks, C1 listed where it fits
        # the candidates budget, topk_range skipping those rows)
        k = min(8192, m)
        budget = torch.full((s,), k, dtype=torch.int32, device=dev)
        cand = torch.empty(s, hkv, k, dtype=torch.int32, device=dev)
        n_c1 = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        listed = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        topk = kernels_topk.topk_range

        def before():
            p, _ = lt.lfps_priority(rho, eps, a, ver, sla, n, sink, prio=prio, bypass=bypass, chunks=1)
            topk(p, sink, n, budget, k, out=cand, out_len=n_c1)

        def now():
            p, _ = lt.lfps_priority(rho, eps, a, ver, sla, n, sink, prio=prio, bypass=bypass,
                                    c1_list=(budget, cand, n_c1, listed))
            topk(p, sink, n, budget, k, out=cand, out_len=n_c1, skip=listed)

        outs = []
        for stage, fn in (("c1-stage before", before), ("c1-stage now", now)):
            cand.fill_(-1)
            first = timer.checked_run(fn)
            outs.append((cand.clone(), n_c1.clone()))
            t, g = timer.again(fn, first)
            results.append(dict(case=name, slots=s, kv_heads=hkv, max_context=m, stage=stage, k=k, eager_us=round(t, 1),
                                graph_us=None if g is None else round(g, 1), listed_share=None))
            print(f"  {name:12s} {stage:16s}: {t:8.1f} us (graph {'-' if g is None else f'{g:7.1f}'})", flush=True)
        results[-1]["listed_share"] = round(float(listed.float().mean()), 4)
        (c_a, l_a), (c_b, l_b) = outs
        same = torch.equal(l_a, l_b) and all(
            torch.equal(c_a[i, j, : int(l_a[i, j])], c_b[i, j, : int(l_a[i, j])]) for i in range(s) for j in range(hkv))
        if not same:
            failures.append((name, "c1-stage"))
        print(f"  {name:12s} C1 listed by the priorities on {results[-1]['listed_share']:.0%} of rows; "
              f"{'same C1' if same else 'C1 DIFFERS'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "command": " ".join(sys.argv), "results": results}, f, indent=1)
    if failures:
        print(f"FAIL: priorities differ from chunks=1 at {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
