#!/usr/bin/env python3
"""
One launch of asyncspade's int8 scoring pass, for Nsight Compute
================================================================

``index_token_scores`` reads 268 MB a layer at 32768 x 8 (8 rows x 8 KV heads of
int8 copies) in ~107 us on an H200, 2.5 TB/s, where the gathered bf16 tiles of
the KV-key path reach 3.6-4.0 TB/s (bench/README, "Session 21"). This sets up the
steady state (copies filled, one new position a launch), warms the kernel, and
brackets ONE launch with the CUDA profiler API, so that::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        --section LaunchStats python bench/kernels/profile_index_scores.py

reports that launch alone: DRAM throughput against peak, achieved occupancy,
and where its warps stall (memory, barriers, or the epilogue). Without ncu it
prints the launch's time from CUDA events.
"""

from __future__ import annotations

import argparse
import sys

from _bench_env import import_kernels, use_cuda_or_exit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--programs", type=int, default=0, help="programs per (row, KV head); 0: the kernel's default")
    p.add_argument("--stages", type=int, default=0, help="pipeline stages; 0: the kernel's default")
    p.add_argument("--keys-as-m", type=int, choices=(-1, 0, 1), default=-1,
                   help="the scoring dot's orientation (index_token_scores' keys_as_m); -1: its default")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    IK = import_kernels("index_keys")
    dev = torch.device("cuda" if use_cuda else "cpu")
    n, bs, hq, hkv, d = (300, 2, 4, 2, 16) if args.smoke else (args.ctx, args.batch, 16, 8, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_pool = torch.randn(bs * n + 1, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
    req_to_token = (1 + torch.arange(bs * n, device=dev, dtype=torch.int32)).view(bs, n)
    rpi = torch.arange(bs, device=dev)
    lo = torch.full((bs,), 4, dtype=torch.int32, device=dev)
    hi = torch.full((bs,), n - 256 if n > 512 else n - 8, dtype=torch.int32, device=dev)
    q_hat = torch.randn(bs, hq, d, generator=gen, device=dev)
    kq = torch.empty(bs, hkv, n, d, dtype=torch.int8, device=dev)
    kscale = torch.empty(bs, hkv, n, dtype=torch.float32, device=dev)
    filled = torch.zeros(bs, 2, dtype=torch.int32, device=dev)
    out = torch.empty(bs, hkv, n, dtype=torch.float32, device=dev)
    kw = dict(out=out, num_programs=args.programs or None, num_stages=args.stages or None,
              **({} if args.keys_as_m < 0 else dict(keys_as_m=bool(args.keys_as_m))))

    def launch():
        IK.index_token_scores(q_hat, k_pool, req_to_token, rpi, lo, hi, d ** -0.5, n, kq, kscale, filled, **kw)

    launch()  # fills the copies
    par = (hi % 2).long()
    filled[rpi, 1 - par] = hi - 1  # the steady state: one position copied a launch
    for _ in range(3):
        launch()
    if not use_cuda:
        print("smoke: ok")
        return 0
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.profiler.start()
    a.record()
    launch()
    b.record()
    torch.cuda.profiler.stop()
    b.synchronize()
    mb = bs * hkv * (int(hi[0]) - 4) * (d + 4) / 1e6
    print(f"index_token_scores {n} x {bs}: {a.elapsed_time(b) * 1e3:.1f} us for ~{mb:.0f} MB of copies read "
          f"(profiled launch; under ncu the time includes its replays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
