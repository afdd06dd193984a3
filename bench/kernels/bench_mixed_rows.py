#!/usr/bin/env python3
"""
Benchmark: dense rows inside a sparse decode batch (the two-segment kernel)
===========================================================================

    python bench/kernels/bench_mixed_rows.py --out results/mixed_rows.json

An SFI slow step, or any request whose policy attends everything this step, is a
dense row (segment B = [0, n)) in a batch whose other rows read ~2.3K keys (sink +
2048 selected + 256 recent). Without balance the grid has `num_splits` programs per
(row, KV head) for every row and each row cuts its own keys into that many chunks:
at batch 32 (1 split) a dense row of 8192 keys is one program doing 3.5x the work of
the others, at 32768 x 8 (4 splits) 14x, and the step waits for it. With balance
(the default where the heuristic picks the splits: kernels/two_segment_decode.py,
`balance`) the grid allows BALANCE_FACTOR x the splits and each row takes its share
of the launch's programs by its keys.

Per (context x batch, dense rows): the 28-layer time of the launch as serving makes
it (split heuristic, fused merge, CUDA graph of a step's 28 launches, median of
replays) with `balance=False` and balanced (the requests' splits once per step,
`balanced_splits`, passed to every layer; without the plain twin BALANCE_GATE
launches beside it as served, which ``--variants`` adds); the outputs are
checked equal (fp32 tolerance). Rows with no dense row and all-dense rows show what balance costs
where every row is alike.

Qwen3-1.7B attention shape: Hq 16, Hkv 8, D 128, bf16; ``--kv-dtype fp8_e4m3``: the
pool and compact buffers as an fp8 cache holds them (unit scales), the splits as the
backend picks them over fp8 (``kv_fp8``: balanced_splits doubles the programs of a
step whose keys a program pass FP8_DENSE_SPLIT_KEYS; run it again with
SGLANG_SPARSE_FP8_DENSE_SPLIT_KEYS=0 for the A/B).

``--slot-lists``: SFI's segment A as pool-slot lists (``compact.selections:
slot_lists``, ``two_segment_decode``'s ``a_slot_lists``) beside the packed rows: each
sparse row's 2052 listed rows are the pool slots of random ascending positions below
its recent window (``req_to_token`` is a random permutation here: a worst case for the
gather, where serving's prompt slots are mostly in order), the packed buffers hold
those rows, and ``lists_ms`` / ``lists_balanced_ms`` time the same launches reading
the lists (outputs checked equal).

``--variants`` also times the gated pair as one launch (``BALANCE_ONE_GRID``:
``balanced_gated_one_grid_ms``).

``--tilings 64:4:3,32:2:2,...``: the plain launch (no balance) again at each
``block_n:num_warps:num_stages`` (``tilings_ms``; the default is 64:4:3, chosen over
bf16 on an H100 in session 12, never swept over fp8 on sparse rows).
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
from _bench_env import decode_stage1_variants, graph_replay_ms, import_kernels, module_constant

# The installed package's kernels, else this checkout's (a bare GPU machine).
K = import_kernels()
TSD = importlib.import_module(K.two_segment_decode.__module__)

LAYERS, HKV, HQ, D, CAP, RECENT = 28, 8, 16, 128, 2052, 256
MAX_KV_LEN = 140000  # serving's bound: the req_to_token row


def case(ctx: int, bs: int, dense: int, kv_dtype: torch.dtype = torch.bfloat16, variants: bool = False,
         slot_lists: bool = False, tilings: tuple = ()) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(ctx + bs + dense)
    pool = bs * ctx + 16
    k = torch.randn(pool, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(pool, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    r2t = torch.zeros(bs, ctx + 8, dtype=torch.int32, device=dev)
    r2t[:, :ctx] = torch.randperm(bs * ctx, device=dev, generator=gen).view(bs, ctx).int()
    a_k = torch.randn(bs, HKV, CAP, D, device=dev, dtype=torch.bfloat16, generator=gen)
    a_v = torch.randn_like(a_k)
    q = torch.randn(bs, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lists = None
    if slot_lists and ctx - RECENT >= CAP:  # ascending random positions below the recent window, as a Top-K
        below = ctx - RECENT
        pos = torch.rand(bs, HKV, below, device=dev, generator=gen).argsort(-1)[..., :CAP - 4].sort(-1).values
        pos = torch.cat([torch.arange(4, device=dev).expand(bs, HKV, 4), pos.clamp(min=4)], -1)  # the sink
        lists = torch.gather(r2t[:, None, :below].expand(bs, HKV, below), 2, pos).int().contiguous()
        head = torch.arange(HKV, device=dev)[None, :, None]
        a_k, a_v = k[lists.long(), head], v[lists.long(), head]
    fp8 = kv_dtype != torch.bfloat16
    if fp8:
        k, v, a_k, a_v = (t.to(kv_dtype) for t in (k, v, a_k, a_v))
    is_dense = torch.arange(bs, device=dev) < dense  # the first `dense` rows
    a_slot = torch.where(is_dense, -1, torch.arange(bs, device=dev)).int()
    a_len = torch.where(is_dense, 0, CAP)[:, None].expand(bs, HKV).contiguous().int()
    b_start = torch.where(is_dense, 0, ctx - RECENT).int()
    b_end = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    idx = torch.arange(bs, dtype=torch.int32, device=dev)
    counters = K.make_split_counters(bs, HKV, dev)
    scale = D ** -0.5
    sms = TSD.device_num_sms(dev)
    base_splits, grid_splits = K.balanced_grid_splits(bs, HKV, MAX_KV_LEN, sms, kv_fp8=fp8)
    # the unbalanced launch's own splits (over fp8 it may double the heuristic's one)
    plain_splits = K.plain_fp8_splits(base_splits, bs, HKV, MAX_KV_LEN, sms) if fp8 else base_splits
    keys = HKV * (dense * ctx + (bs - dense) * (CAP + RECENT))
    outs = {}

    def launch(name, balance: bool, listed: bool = False, tiling: dict | None = None):
        o = torch.empty(bs, HQ, D, device=dev, dtype=torch.bfloat16)
        outs[name] = o
        seg_a = dict(a_slot_lists=lists) if listed else {}
        seg_a.update(tiling or {})

        def step():
            # As the backend: the splits (and BALANCE_GATE's gate) once per step, for every
            # layer, in one launch (kernels.step_balance; until session 42 the torch pair
            # step_row_splits + balance_gate, ~45 tiny kernels in this timed graph)
            launches = [dict(balance=False)]
            row_splits = gate = None  # the unbalanced step computes no shares (not in its timed graph)
            if balance:
                row_splits, gate = K.step_balance(a_len, b_start, b_end, None, HKV, MAX_KV_LEN, sms, fp8)
            if row_splits is not None:
                launches = [dict(balance=True, row_splits=row_splits)]
                if gate is not None and TSD.BALANCE_ONE_GRID:  # both partitions in one launch
                    launches = [dict(launches[0], gate=(gate, None))]
                elif gate is not None:  # the plain twin beside it, one of the two running
                    launches = [dict(balance=False, gate=(gate, False)), dict(launches[0], gate=(gate, True))]
            for _ in range(LAYERS):
                for kw in launches:
                    K.two_segment_decode(q, a_k, a_v, a_slot, a_len, k, v, r2t, idx, b_start, b_end, scale,
                                         max_kv_len=MAX_KV_LEN, out=o, split_counters=counters, **seg_a, **kw)
        return step

    t_default = graph_replay_ms(launch("default", False))
    with module_constant(TSD, "BALANCE_GATE", False):  # the balanced launch alone
        t_bal = graph_replay_ms(launch("balanced", True))
    t_major = t_gated = t_gated_major = t_one_grid = None
    if variants:  # the balanced launch split-major (BALANCE_SPLIT_MAJOR); gated with its twin (BALANCE_GATE), both
        with module_constant(TSD, "BALANCE_SPLIT_MAJOR", True):
            with module_constant(TSD, "BALANCE_GATE", False):
                t_major = graph_replay_ms(launch("split_major", True))
            with module_constant(TSD, "BALANCE_GATE", True), module_constant(TSD, "BALANCE_ONE_GRID", False):
                t_gated_major = graph_replay_ms(launch("gated_split_major", True))
        with module_constant(TSD, "BALANCE_GATE", True):
            # the pair forced, as the backend runs it: its gate compares the shares with
            # the plain twin's own splits (kernels.plain_partition_splits)
            with module_constant(TSD, "BALANCE_ONE_GRID", False):
                t_gated = graph_replay_ms(launch("gated", True))
            with module_constant(TSD, "BALANCE_ONE_GRID", True):
                t_one_grid = graph_replay_ms(launch("gated_one_grid", True))
    t_lists = t_lists_bal = None
    if lists is not None:
        t_lists = graph_replay_ms(launch("lists", False, True))
        t_lists_bal = graph_replay_ms(launch("lists_balanced", True, True))
    t_tilings = {}
    for bn, nw, ns in tilings:
        name = f"{bn}:{nw}:{ns}"
        try:
            t_tilings[name] = round(graph_replay_ms(launch(name, False, tiling=dict(block_n=bn, num_warps=nw,
                                                                                     num_stages=ns))), 3)
        except Exception as e:  # e.g. out of shared memory: a tiling this GPU cannot run
            outs.pop(name, None)
            t_tilings[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    ref = outs["default"].float()
    err = max(((o.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
              for name, o in outs.items() if name != "default")
    moved = LAYERS * keys * D * 2 * (1 if fp8 else 2)  # K and V bytes read
    return {"ctx": ctx, "batch": bs, "dense_rows": dense, "kv_dtype": str(kv_dtype).replace("torch.", ""),
            "splits": base_splits,
            "plain_splits": plain_splits,
            "balanced_grid_splits": grid_splits,
            "balance_factor": TSD.balance_factor(fp8), "balance_programs_per_sm": TSD.balance_programs_per_sm(fp8),
            "default_ms": round(t_default, 3), "balanced_ms": round(t_bal, 3),
            "balanced_split_major_ms": None if t_major is None else round(t_major, 3),
            "balanced_gated_ms": None if t_gated is None else round(t_gated, 3),
            "balanced_gated_split_major_ms": None if t_gated_major is None else round(t_gated_major, 3),
            "balanced_gated_one_grid_ms": None if t_one_grid is None else round(t_one_grid, 3),
            "tilings_ms": t_tilings or None,
            "lists_ms": None if t_lists is None else round(t_lists, 3),
            "lists_balanced_ms": None if t_lists_bal is None else round(t_lists_bal, 3),
            "speedup": round(t_default / t_bal, 3), "kv_bytes_28_layers": moved,
            "default_TBps": round(moved / t_default / 1e9, 2), "balanced_TBps": round(moved / t_bal / 1e9, 2),
            "max_rel_diff": err, "same": err < 2e-2 and not any(o.isnan().any().item() for o in outs.values())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8192x32,32768x8,131072x4,2048x64")
    ap.add_argument("--dense", default="0,1,2,4,all")
    ap.add_argument("--factor", type=int, default=None,
                    help="override BALANCE_FACTOR (the grid's splits per heuristic split; 0: by the cache dtype, "
                         "16 over fp8, 4 over bf16)")
    ap.add_argument("--programs-per-sm", type=int, default=None,
                    help="override BALANCE_PROGRAMS_PER_SM (the balanced shares' P an SM; 0: by the cache dtype, "
                         "4 over fp8, the heuristic's over bf16)")
    ap.add_argument("--kv-dtype", choices=("model", "fp8_e4m3", "fp8_e5m2"), default="model")
    ap.add_argument("--variants", action="store_true",
                    help="also time the balanced launch split-major (BALANCE_SPLIT_MAJOR), gated with its plain "
                         "twin (BALANCE_GATE, the default), and both, in the same run; 'balanced' is ungated")
    ap.add_argument("--slot-lists", action="store_true",
                    help="also time segment A read from pool-slot lists (a_slot_lists) instead of packed rows")
    ap.add_argument("--tilings", default="",
                    help="block_n:num_warps:num_stages,...: the plain launch timed at each tiling too")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    kv_dtype = {"model": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[a.kv_dtype]
    if a.factor is not None:
        TSD.BALANCE_FACTOR = a.factor
    if a.programs_per_sm is not None:
        TSD.BALANCE_PROGRAMS_PER_SM = a.programs_per_sm
    rows = []
    tilings = tuple(tuple(map(int, t.split(":"))) for t in filter(None, a.tilings.split(",")))
    for c in a.cases.split(","):
        ctx, bs = map(int, c.split("x"))
        for d in a.dense.split(","):
            r = case(ctx, bs, bs if d == "all" else int(d), kv_dtype, a.variants, a.slot_lists, tilings)
            print(json.dumps(r), flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    major = " balanced split-major ms | gated ms | gated split-major ms | gated one grid ms |" if a.variants else ""
    print("\n| context x batch | dense rows | splits (unbalanced; heuristic -> balanced grid) "
          f"| unbalanced ms (28 layers) | balanced ms | speedup |{major}"
          "\n|---|---|---|---|---|---|" + ("---|---|---|---|" if major else ""))
    for r in rows:
        print(f"| {r['ctx']} x {r['batch']} | {r['dense_rows']} | {r['plain_splits']}; {r['splits']} -> "
              f"{r['balanced_grid_splits']} "
              f"| {r['default_ms']} | {r['balanced_ms']} | {r['speedup']} |"
              + (f" {r['balanced_split_major_ms']} | {r['balanced_gated_ms']} | "
                 f"{r['balanced_gated_split_major_ms']} | {r['balanced_gated_one_grid_ms']} |" if major else "")
              + (f" lists {r['lists_ms']} / balanced {r['lists_balanced_ms']}" if a.slot_lists else "")
              + (f" tilings {r['tilings_ms']}" if r["tilings_ms"] else ""))
    variants = decode_stage1_variants(K)  # registers a variant: programs resident an SM
    for v in variants:
        print("  stage-1 variant: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    doc = {"device": torch.cuda.get_device_name(), "command": "python bench/kernels/bench_mixed_rows.py "
           + " ".join(f"--{k} {v}" for k, v in vars(a).items()), "rows": rows, "stage1_variants": variants}
    json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
