#!/usr/bin/env python3
"""
Probe: the SFI slow step's decode launch with and without BALANCE, for Nsight Compute
=====================================================================================

    PYTHONPATH=$PWD ncu --set full -k regex:_two_segment_decode_stage1 --launch-skip 4 --launch-count 2 \\
        -o $OUT/balance python3 bench/kernels/probe_balanced_launch.py --out $OUT/probe.json

Session 37 timed the slow step's launch at 131072 x 4 over e4m3 (every row dense,
key norms stored, the query saved, the logits kept) at 399 us a layer with 16 splits,
and the same partition launched with ``balance=True`` (a grid of 16, 16 a request:
the same chunks, the same relative error to the last digit, its PTX one load and a
branch apart) at 625 us, in ``bench_decode.py --slow-step``. This script launches the
two once each after two warm launches apiece (so ``--launch-skip 4 --launch-count 2``
profiles exactly the pair: the plain launch first), then times them alternately with
CUDA events (``--rounds`` each, medians), to hold the numbers against a profile's
achieved occupancy, DRAM throughput and warp stalls. ``--no-side-effects``: the same
without the slow step's stores.

``--rows sparse``: a fast step's rows instead (2052 compact keys + the last 256 read in
place, every row alike), each launch as served: the heuristic's splits unbalanced
against the balanced grid (BALANCE_FACTOR x them, each request's share from
``step_row_splits``). Session 38's bench_mixed_rows timed that balanced launch 24-31%
slower than the unbalanced one at 32768 x 8 and 8192 x 32 (6 and 19 us a layer) with
the same per-request partition, where the slow step's cause (registers) was ruled
out; the pair under Nsight Compute says where it goes.

``--variants``: two more, the balanced launch with its grid split-major
(``BALANCE_SPLIT_MAJOR``) and the gated pair (``BALANCE_GATE``: the plain twin and the
balanced launch, one running by the step's gate; two kernels); then ``--launch-skip 10
--launch-count 5``. (Session 40 removed a third, split-major with each request's working
splits strided over its grid positions: never faster than split-major alone.) Session 39's pair
under Nsight Compute ran the same instructions with the same average SM-active cycles
but 1.55-1.75x the elapsed ones balanced: the SMs idle ~45% of it, as if the 256
working programs, first of the grid's 1024, were not spread over the SMs.

``--record`` (compiled GPUs only): one more launch of each, recording every program's
SM and start / end times (``two_segment_decode(record=...)``, ``%smid`` and
``%globaltimer``): how the block scheduler dealt each grid to the SMs (the working
programs an SM, at most and on average; the SMs that got one; the launch's span), into
``record`` of the output.

``--smoke``: a small shape on the CPU interpreter (the outputs checked equal).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics

from _bench_env import import_kernels, module_constant, use_cuda_or_exit


def record_launch(run, hkv: int, bs: int) -> dict:
    """One more launch of ``run`` recording its programs (``record=``): where the
    working ones (those that ran to the end) went. Its ``programs``: [SM, start ns from
    the launch's first start, end ns or -1] per program, in launch order."""
    import torch

    tsd = importlib.import_module(import_kernels().two_segment_decode.__module__)
    rec = torch.zeros(bs * hkv * tsd.MAX_SPLITS, 3, dtype=torch.int64, device="cuda")
    run(record=rec)
    torch.cuda.synchronize()
    r = rec[rec[:, 1] > 0].cpu()
    t0 = int(r[:, 1].min())
    working = r[r[:, 2] > 0]
    per_sm = torch.bincount(working[:, 0], minlength=int(r[:, 0].max()) + 1)
    busy = [int(working[working[:, 0] == sm][:, 2].max() - working[working[:, 0] == sm][:, 1].min())
            for sm in per_sm.nonzero().flatten().tolist()]
    return {"programs": [[int(x[0]), int(x[1]) - t0, int(x[2]) - t0 if x[2] > 0 else -1] for x in r.tolist()],
            "launched": len(r), "working": len(working), "sms_with_work": int((per_sm > 0).sum()),
            "sms_seen": int(r[:, 0].unique().numel()), "max_working_an_sm": int(per_sm.max()),
            "mean_working_an_sm_with_work": round(len(working) / max(1, int((per_sm > 0).sum())), 2),
            "span_us": round((int(working[:, 2].max()) - t0) / 1e3, 2),
            "mean_sm_busy_us": round(sum(busy) / max(1, len(busy)) / 1e3, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU interpreter")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--splits", type=int, default=16, help="the grid's splits, and every request's")
    ap.add_argument("--kv-dtype", choices=("fp8_e4m3", "bf16"), default="fp8_e4m3")
    ap.add_argument("--no-side-effects", action="store_true")
    ap.add_argument("--rows", choices=("dense", "sparse"), default="dense",
                    help="dense: the slow step's rows; sparse: a fast step's (2052 compact + 256 recent)")
    ap.add_argument("--variants", action="store_true",
                    help="two more: balanced split-major, the gated pair")
    ap.add_argument("--record", action="store_true", help="each launch's programs: SM and times (GPU only)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cuda = use_cuda_or_exit(a.smoke)
    if cuda is None:
        return 2
    import torch

    K = import_kernels()
    T = import_kernels("testing")
    dev = "cuda" if cuda else "cpu"
    n, bs, hkv, group, d = (a.ctx, a.batch, 8, 2, 128) if cuda else (160, 2, 2, 2, 128)
    sparse = a.rows == "sparse"
    cap, recent = (2052, 256) if cuda else (24, 16)
    case = T.make_decode_case([n] * bs, [cap if sparse else 0] * bs, [(n - recent if sparse else 0, n)] * bs,
                              num_kv_heads=hkv, group=group, head_dim=d, cap=cap if sparse else 16,
                              dtype=torch.bfloat16, device=dev, seed=37, empty_slot_value=None)
    if a.kv_dtype == "fp8_e4m3":  # the pool as an fp8 cache holds it (unit scales)
        case = case.stored_as(torch.float8_e4m3fn)
    sfi = {} if a.no_side_effects or sparse else case.slow_step_outputs(n)
    counters = K.make_split_counters(bs, hkv, dev)
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    names = ("plain", "balanced") + (("split_major", "gated") if a.variants else ())
    outs = {name: torch.empty_like(case.q) for name in names}
    if sparse:  # as served: the heuristic's splits over serving's req_to_token width
        max_kv_len, sms = (140000, None) if cuda else (n, 4)
        row_splits = K.step_row_splits(case.a_len, case.b_start, case.b_end, None, hkv, max_kv_len,
                                       sms or device_sms, kv_fp8=a.kv_dtype != "bf16")
        if row_splits is None:
            print("this shape does not balance (kernels.balances)")
            return 2
        common = dict(split_counters=counters, max_kv_len=max_kv_len, num_sms=sms)
        splits = None
    else:
        splits = a.splits if cuda else 3
        common = dict(num_splits=splits, fused_merge=True, split_counters=counters, max_kv_len=n, **sfi)
        row_splits = torch.full((bs,), splits, dtype=torch.int32, device=dev)
    launches = {  # each takes two_segment_decode's extra keywords (record_launch's)
        "plain": lambda **x: K.two_segment_decode(*case.args(), out=outs["plain"], balance=False, **common, **x),
        "balanced": lambda **x: K.two_segment_decode(*case.args(), out=outs["balanced"], balance=True,
                                                     row_splits=row_splits, **common, **x),
    }
    if a.variants:
        tsd = importlib.import_module(K.two_segment_decode.__module__)

        def split_major(**x):
            with module_constant(tsd, "BALANCE_SPLIT_MAJOR", True):
                K.two_segment_decode(*case.args(), out=outs["split_major"], balance=True, row_splits=row_splits,
                                     **common, **x)
        launches["split_major"] = split_major
        with module_constant(tsd, "BALANCE_GATE", True):
            gate = K.balance_gate(row_splits, None, hkv, common["max_kv_len"], common.get("num_sms") or device_sms,
                                  kv_fp8=a.kv_dtype != "bf16", segments=(case.a_len, case.b_start, case.b_end))

        def gated(**x):  # one of the two runs (the gate: the shares against the heuristic's splits)
            K.two_segment_decode(*case.args(), out=outs["gated"], balance=False, gate=(gate, False), **common, **x)
            K.two_segment_decode(*case.args(), out=outs["gated"], balance=True, row_splits=row_splits,
                                 gate=(gate, True), **common, **x)
        launches["gated"] = gated
    for name in launches:  # two warm launches each: compiled, caches filled (ncu's --launch-skip 4, or 12)
        launches[name]()
        launches[name]()
    for name in launches:  # the profiled pair, plain first
        launches[name]()
    # a balanced partition other than the plain one (fp8's shares at P 4 an SM) rounds
    # differently: equal within bench_mixed_rows' tolerance, bit for bit only where the
    # partitions agree (session 42's H200 probes: False where P 4 split rows alike anew)
    ref = outs["plain"].float()
    rel = {name: ((o.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item() for name, o in outs.items()}
    finite = not any(o.isnan().any().item() for o in outs.values())
    same = finite and max(rel.values()) < 2e-2
    bitwise = finite and all(torch.equal(outs["plain"], o) for o in outs.values())
    times = {name: [] for name in launches}
    if cuda:
        for _ in range(a.rounds):
            for name, run in launches.items():
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                stop.record()
                stop.synchronize()
                times[name].append(start.elapsed_time(stop) * 1e3)
    doc = {"ctx": n, "batch": bs, "rows": a.rows, "splits": splits, "kv_dtype": a.kv_dtype, "side_effects": bool(sfi),
           "outputs_equal": same, "outputs_bitwise_equal": bitwise, "max_rel_diff": rel, "us": times,
           "median_us": {k: statistics.median(v) if v else None for k, v in times.items()}}
    if a.record and cuda:
        doc["record"] = {name: record_launch(run, hkv, bs) for name, run in launches.items()}
        for name, r in doc["record"].items():
            print(name, json.dumps({k: v for k, v in r.items() if k != "programs"}))
    print(json.dumps(doc["median_us"]), "outputs equal:", same, "bit for bit:", bitwise)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
