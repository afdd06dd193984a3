#!/usr/bin/env python3
"""
Benchmark: how much of asyncspade's side stream a decode step's main stream lets run beside it
===============================================================================================

The server profile of asyncspade at 32768 x 8 (H200, bench/README "Session 24")
has a main stream busy 3.04 ms a step and a side stream busy 2.93 ms, yet the two
overlap for only 0.43 ms of a 6.28 ms step. The suspect is residency: a scoring
program walks its share of a row for the whole launch (~70 us), 4 of them fill an
SM's registers, and the main stream's kernels (cuBLAS GEMMs, the decode) cannot
start on an SM until its scoring programs leave. This runs the two streams alone
and together, captured in one CUDA graph as SGLang replays a decode step, so each
scoring launch shape and stream priority can be judged by the overlap it allows:

* main stream, per layer: the Qwen3-1.7B shape's QKV projection at batch 8, then
  (after the fork) the two-segment decode over ``--decode-keys`` keys a request
  and KV head read in place from a paged pool, the output projection and the MLP's
  two projections (``torch.mm`` in bf16, ~100 MB of weights a layer);
* side stream, per layer: ``index_token_scores`` over 8 rows x 8 KV heads x 32768
  positions from int8 or 4-bit copies (steady state: the copies filled), counting
  the Top-K's histogram (``h_top``) as serving does, forked after the layer's QKV
  projection as ``query_device`` forks it after the prediction, and the Top-K of
  ``--topk-layers`` layers a launch (``topk_range``) after a group's last scoring;
* one join at the end of the last layer, as serving joins.

``--cache-device cuda:1`` also runs the side stream's work on a second GPU, the
paper's *cache rank* (ALGORITHMS.md §4 (b)): per layer, a copy stream on the main
GPU sends the layer's ``q_hat`` and the step's new keys over (peer copies), the
scoring and the group's Top-K run there on the copies' own replica, and a finished
group's selections come back; the main stream joins once at the end, all in the one
graph captured on the main GPU (the other GPU's work joined to it by events, its
buffers allocated before the capture). Rows ``cache`` (that work alone) and
``main_cache`` (beside the main stream), ``cache_hidden`` as ``hidden``; the
selections sent back are compared with the main GPU's own, bit for bit. Rows
``peer`` and ``main_peer``: the same without copies, the second GPU's kernels
reading the queries, the pool and the rows' ranges in the main GPU's memory and
writing the selections there (peer loads and stores), only the copies, scores and
Top-K scratch on the second GPU: the form that serves with the least code. The
question it answers: whether a selection that costs ~1.4x the main stream's step
on the same GPU (session 25) hides wholly on another.

Scoring launch shapes: ``PxS`` = P programs a SM in all (persistent: each walks
its share of a row), S pipeline stages (0: the kernel's default); ``tT`` = one
program per T blocks of 128 positions (short programs the block scheduler can
interleave with the main stream's). Priorities: ``default`` captures everything on
a default-priority stream (as SGLang's graph runner does); ``high`` captures the
main stream on the highest-priority stream, the side stream staying at the
default (PyTorch instantiates graphs with ``cudaGraphInstantiateFlagUseNodePriority``,
so the captured kernels keep their stream's priority). Per (shape, priority): the
graph's replay time with the main stream alone, the side stream alone and both,
and ``hidden`` = (main + side - both) / min(main, side): 1 when the shorter one is
wholly hidden, 0 when the streams run one after the other. Run on a GPU::

    python bench/kernels/bench_stream_overlap.py --out results/stream_overlap.json

``--smoke`` runs tiny shapes eagerly through the Triton interpreter (no streams).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
from typing import TYPE_CHECKING

from _bench_env import graph_replay_ms, import_kernels, use_cuda_or_exit

if TYPE_CHECKING:
    import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--topk-layers", type=int, default=14)
    p.add_argument("--index-bits", type=int, choices=(8, 4), default=4)
    p.add_argument("--no-hist", action="store_true", help="do not count h_top in the scoring")
    p.add_argument("--decode-keys", type=int, default=2304,
                   help="keys a request and KV head the main stream's decode reads (0: no decode)")
    p.add_argument("--shapes", default="4x0,2x0,1x0,1x6,t1,t4,t16",
                   help="scoring launch shapes: PxS (P programs a SM, S stages, 0 the default) or tT")
    p.add_argument("--priorities", default="default,high")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cache-device", default=None,
                   help="also run the selection on this device (e.g. cuda:1; cpu with --smoke), the "
                        "paper's cache rank: rows cache and main_cache, and the selections compared")
    p.add_argument("--smoke", action="store_true")
    return p.parse_args(argv)


def scoring_launch(shape: str) -> dict:
    """index_token_scores' launch arguments for a --shapes entry."""
    if shape.startswith("t"):
        return dict(blocks_per_program=int(shape[1:]), num_stages=None)
    per_sm, stages = (int(v) for v in shape.split("x"))
    return dict(programs_per_sm=per_sm, num_stages=stages or None)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return 2
    IK = import_kernels("index_keys")
    TR = import_kernels("topk_range")
    TS = import_kernels("two_segment_decode")
    TSC = import_kernels("token_scores")
    utils = import_kernels("_utils")
    import triton

    dev = torch.device("cuda:0" if use_cuda else "cpu")
    cache_dev = None if args.cache_device is None else torch.device(args.cache_device)
    if cache_dev is not None and (cache_dev.type != dev.type or (use_cuda and cache_dev == dev)):
        print(f"--cache-device {args.cache_device}: a second {dev.type} device is needed, beside {dev}",
              file=sys.stderr)
        return 2
    if use_cuda and cache_dev is not None and not torch.cuda.can_device_access_peer(dev.index, cache_dev.index):
        print(f"--cache-device {args.cache_device}: no peer access from {dev}", file=sys.stderr)
        return 2
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)"}
    print("# stream overlap benchmark\n" + json.dumps(env))
    if args.smoke:
        args.layers, args.ctx, args.batch, args.topk_layers, args.reps = 2, 200, 2, 2, 1
        args.decode_keys = min(args.decode_keys, 40)
    L, n, bs, G = args.layers, args.ctx, args.batch, args.topk_layers
    hq, hkv, d, hidden, inter = 16, 8, 128, 2048, 6144
    if args.smoke:  # small heads too: the interpreter's time goes by the scoring's tiles
        hq, hkv, d, hidden, inter = 4, 2, 64, 64, 96
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    # main stream: one set of projection weights a layer (each read once a step, as decode does)
    x = randn(bs, hidden)
    attn = randn(bs, hq * d)
    h = randn(bs, inter)
    weights = [(randn(hidden, (hq + 2 * hkv) * d), randn(hq * d, hidden), randn(hidden, 2 * inter),
                randn(inter, hidden)) for _ in range(L)]

    # a paged pool, each row's positions contiguous in it: the scoring's new keys and the decode's KV
    k_pool = randn(bs * n + 1, hkv, d)
    v_pool = randn(bs * n + 1, hkv, d)
    req_to_token = (1 + torch.arange(bs * n, device=dev, dtype=torch.int32)).view(bs, n)
    rpi = torch.arange(bs, device=dev)
    lo = torch.full((bs,), 4, dtype=torch.int32, device=dev)
    hi = torch.full((bs,), n - 256 if n > 512 else n - 8, dtype=torch.int32, device=dev)
    budget = torch.full((bs,), 2048 if n > 4096 else 16, dtype=torch.int32, device=dev)
    k_max = int(budget[0])
    q_hat = torch.randn(L, bs, hq, d, generator=gen, device=dev)
    width = d // 2 if args.index_bits == 4 else d
    kq = torch.empty(L, bs, hkv, n, width, dtype=torch.int8, device=dev)
    kscale = torch.empty(L, bs, hkv, n, dtype=torch.float32, device=dev)
    filled = torch.zeros(L, bs, 2, dtype=torch.int32, device=dev)
    ksm = None
    if args.index_bits == 4:  # each row's smoothing from its keys (serving: from the prompt's)
        ksm = torch.stack([IK.channel_smoothing(k_pool[req_to_token[b].long()]) for b in range(bs)])
    scores = torch.empty(G, bs, hkv, n, dtype=torch.float32, device=dev)
    sm_scale = d ** -0.5
    for li in range(L):  # fill the copies, then leave the counters one below hi: the steady state
        IK.index_token_scores(q_hat[li], k_pool, req_to_token, rpi, lo, hi, sm_scale, n, kq[li], kscale[li],
                              filled[li], out=scores[0], ksmooth=ksm)
    par = (hi % 2).long()
    filled[:, rpi, 1 - par] = hi - 1
    sms = utils.device_num_sms(dev)
    use_hist = not args.no_hist and TR.takes_htop(n, G * bs * hkv, dev)
    here = Selection.build(q_hat, k_pool, req_to_token, rpi, lo, hi, budget, kq, kscale, filled, ksm, scores,
                           G, use_hist)
    # the cache device's own copy of everything the selection reads and writes, taken in
    # the same steady state (the same selections), and the main device's landing buffers
    cache = None
    if cache_dev is not None:
        cache = here.to(cache_dev)
        sel_back = torch.zeros_like(here.sel)
        sel_n_back = torch.zeros_like(here.sel_n)
        # the step's new key of every row (position hi - 1), sent each layer as serving
        # would send the step's keys: the copies' refresh reads it from the cache's pool
        new_slots = req_to_token[rpi, (hi - 1).long()].long()
        new_slots_cache = new_slots.to(cache_dev)
        k_new = torch.empty(bs, hkv, d, dtype=bf16, device=dev)
        k_new_cache = torch.empty(bs, hkv, d, dtype=bf16, device=cache_dev)
        # PyTorch enables a device's access to another's memory at its first copy from it
        # (at::cuda::get_p2p_access(src, dst)): the cache device's, for its peer loads below
        torch.zeros(1, device=cache_dev).to(dev)
        # peer: the cache device's kernels read the queries, the pool and the rows' ranges
        # where they are and write the selections where the decode reads them (peer
        # loads and stores over NVLink: nothing copied, nothing sent back); only the
        # copies, scores, histograms and the Top-K's scratch live there (their own replica)
        peer = dataclasses.replace(here.to(cache_dev), q_hat=q_hat, k_pool=k_pool, req_to_token=req_to_token,
                                   rpi=rpi, lo=lo, hi=hi, sel=torch.zeros_like(here.sel),
                                   sel_n=torch.zeros_like(here.sel_n))

    # the decode: segment B only, a different window a layer (no L2 reuse between layers)
    dk = min(args.decode_keys, n)
    q_dec = randn(bs, hq, d)
    a_k = torch.zeros(1, hkv, 1, d, dtype=bf16, device=dev)
    a_slot = torch.zeros(bs, dtype=torch.int32, device=dev)
    a_len = torch.zeros(bs, hkv, dtype=torch.int32, device=dev)
    windows = max(1, n // max(1, dk))
    b_start = [torch.full((bs,), (li % windows) * dk, dtype=torch.int32, device=dev) for li in range(L)]
    b_end = [b + dk for b in b_start]
    dec_out = torch.empty(bs, hq, d, dtype=bf16, device=dev)

    def select(st: "Selection", li: int, launch: dict) -> None:
        """Layer li's scoring into its group's row, and the group's Top-K after its last layer."""
        g = li % G
        IK.index_token_scores(st.q_hat[li], st.k_pool, st.req_to_token, st.rpi, st.lo, st.hi, sm_scale, n,
                              st.kq[li], st.kscale[li], st.filled[li], out=st.scores[g], ksmooth=st.ksm,
                              h_top=None if st.h_top is None else st.h_top[g], **launch)
        if g == G - 1 or li == L - 1:
            rows = (g + 1) * bs
            TR.topk_range(st.scores[: g + 1].flatten(0, 1), st.g_lo[:rows], st.g_hi[:rows], st.g_budget[:rows],
                          k_max, out=st.sel[:rows], out_len=st.sel_n[:rows],
                          h_top=None if st.h_top is None else st.h_top[: g + 1].flatten(0, 1),
                          scratch=st.scratch[: g + 1].flatten(0, 1),
                          # on the cache device unsplit, as served: the split kernel allocates
                          splits=None if st is here else 1)

    def to_cache(li: int, launch: dict, streams) -> None:
        """Layer li's selection on the cache device: its q_hat and the step's new keys
        sent over, the selection there, a finished group's Top-K sent back. Copies
        between devices run on the source device's current stream after the
        destination's (PyTorch's copy_), so the main device's current stream is a
        copy stream of its own here: the main stream never waits on the cache's."""
        copy_main, side = streams
        if copy_main is not None:
            copy_main.wait_stream(torch.cuda.current_stream())
            # joins the capture before copy_ records on it (a capturing stream may not
            # wait for an event recorded outside the capture)
            side.wait_stream(copy_main)
        with _stream(copy_main), _stream(side):
            cache.q_hat[li].copy_(q_hat[li], non_blocking=True)
            torch.index_select(k_pool, 0, new_slots, out=k_new)
            k_new_cache.copy_(k_new, non_blocking=True)
            cache.k_pool.index_copy_(0, new_slots_cache, k_new_cache)
            select(cache, li, launch)
            g = li % G
            if g == G - 1 or li == L - 1:
                rows = (g + 1) * bs
                sel_back[:rows].copy_(cache.sel[:rows], non_blocking=True)
                sel_n_back[:rows].copy_(cache.sel_n[:rows], non_blocking=True)

    def step(launch: dict, with_main: bool, where: str | None, streams) -> None:
        """One decode step of L layers: the main stream's work (with_main) and the
        selection (where: None, "here" on a side stream of the main device, "cache" on
        the cache device); streams: (side,) here, (copy stream, cache stream) there;
        None entries on the CPU, where everything runs in order."""
        main = torch.cuda.current_stream() if use_cuda else None
        for li in range(L):
            if with_main:
                wqkv, wo, wgu, wd = weights[li]
                torch.mm(x, wqkv)
            if where in ("here", "peer"):  # a stream of either device, forked from the main one
                side = streams[0]
                if side is not None:
                    side.wait_stream(main)
                with _stream(side):
                    select(here if where == "here" else peer, li, launch)
            elif where == "cache":
                to_cache(li, launch, streams)
            if with_main:
                if dk:
                    TS.two_segment_decode(q_dec, a_k, a_k, a_slot, a_len, k_pool, v_pool, req_to_token, rpi,
                                          b_start[li], b_end[li], sm_scale, max_kv_len=dk, out=dec_out)
                torch.mm(attn, wo)
                torch.mm(x, wgu)
                torch.mm(h, wd)
        for s_ in streams if where is not None else ():
            if s_ is not None:
                main.wait_stream(s_)

    modes = [("main", True, None), ("side", False, "here"), ("both", True, "here")]
    if cache is not None:
        modes += [("cache", False, "cache"), ("main_cache", True, "cache"),
                  ("peer", False, "peer"), ("main_peer", True, "peer")]
    results = []
    prios = [p for p in args.priorities.split(",") if p]
    for shape in filter(None, args.shapes.split(",")):
        launch = scoring_launch(shape)
        # the launch's own programs per (row, KV head): its arguments as given, the kernel's defaults otherwise
        programs = TSC.scoring_programs(n, 128, bs, hkv, dev, **{k: v for k, v in launch.items() if k != "num_stages"})
        for prio in prios:
            row = dict(shape=shape, priority=prio, programs=programs, stages=launch["num_stages"])
            cap = None
            if use_cuda and prio == "high":
                cap = torch.cuda.Stream(priority=-64)  # mapped to the highest
            for name, with_main, where in modes:
                if not use_cuda:
                    step(launch, with_main, where, (None, None))
                    row[f"{name}_ms"] = None
                    continue
                if where == "cache":  # a copy stream on the main device, the selection's on the cache device
                    streams = (torch.cuda.Stream(device=dev), torch.cuda.Stream(device=cache_dev))
                elif where == "peer":
                    streams = (torch.cuda.Stream(device=cache_dev),)
                else:
                    streams = (torch.cuda.Stream(),)  # default priority, as query_device's
                row[f"{name}_ms"] = graph_replay_ms(
                    lambda: step(launch, with_main, where, streams), args.reps, warm_replays=3, capture_stream=cap)
            if use_cuda:
                m, sd, both = row["main_ms"], row["side_ms"], row["both_ms"]
                row["hidden"] = round((m + sd - both) / min(m, sd), 3)
                line = (f"  scoring {shape} ({row['programs']} programs a row and head), {prio} priority: "
                        f"main {m:.3f} ms, side {sd:.3f} ms, both {both:.3f} ms, hidden {row['hidden']:.0%}")
                if cache is not None:
                    c, mc = row["cache_ms"], row["main_cache_ms"]
                    row["cache_hidden"] = round((m + c - mc) / min(m, c), 3)
                    p_, mp = row["peer_ms"], row["main_peer_ms"]
                    row["peer_hidden"] = round((m + p_ - mp) / min(m, p_), 3)
                    line += (f"; on {cache_dev}: cache {c:.3f} ms, main + cache {mc:.3f} ms "
                             f"({mc / m:.3f}x main alone), hidden {row['cache_hidden']:.0%}; "
                             f"peer {p_:.3f} ms, main + peer {mp:.3f} ms ({mp / m:.3f}x), "
                             f"hidden {row['peer_hidden']:.0%}")
                print(line, flush=True)
            results.append(row)
            if not use_cuda:
                break  # no streams on the interpreter: one pass per shape checks the launches
    # the selections are real: every row keeps its budget (the scores are finite on [lo, hi))
    ok = bool((here.sel_n == min(k_max, int(hi[0] - lo[0]))).all())
    print(f"  selections: {'ok' if ok else 'WRONG COUNTS'}")
    cache_equal = None
    if cache is not None:
        # the cache device's selections, sent back, are the main device's own bit for bit
        cache_equal = all(torch.equal(a.cpu(), b.cpu()) for a, b in (
            (sel_back, here.sel), (sel_n_back, here.sel_n), (peer.sel, here.sel), (peer.sel_n, here.sel_n)))
        print(f"  selections from {cache_dev}: {'the same' if cache_equal else 'DIFFERENT'}")
        ok = ok and cache_equal
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, args=vars(args), sms=sms, use_hist=use_hist, results=results, check_ok=ok,
                           cache_device=None if cache_dev is None else str(cache_dev), cache_equal=cache_equal),
                      f, indent=1)
    return 0 if ok else 1


@dataclasses.dataclass
class Selection:
    """What asyncspade's next-step selection reads and writes, on the device that runs
    it: the queries it scores with, the pool its copies refresh from, the rows'
    ranges, the copies, the group's scores and histograms, the Top-K's output and
    scratch (preallocated: a graph captured on another device allocates from that
    device's pool only)."""

    q_hat: "torch.Tensor"
    k_pool: "torch.Tensor"
    req_to_token: "torch.Tensor"
    rpi: "torch.Tensor"
    lo: "torch.Tensor"
    hi: "torch.Tensor"
    kq: "torch.Tensor"
    kscale: "torch.Tensor"
    filled: "torch.Tensor"
    ksm: "torch.Tensor | None"
    scores: "torch.Tensor"
    g_lo: "torch.Tensor"
    g_hi: "torch.Tensor"
    g_budget: "torch.Tensor"
    sel: "torch.Tensor"
    sel_n: "torch.Tensor"
    h_top: "torch.Tensor | None"
    scratch: "torch.Tensor"

    @classmethod
    def build(cls, q_hat, k_pool, req_to_token, rpi, lo, hi, budget, kq, kscale, filled, ksm, scores, groups: int,
              use_hist: bool) -> "Selection":
        import torch

        g, (bs, hkv, _), dev = groups, scores.shape[1:], scores.device
        k_max = int(budget.max())
        return cls(q_hat, k_pool, req_to_token, rpi, lo, hi, kq, kscale, filled, ksm, scores,
                   lo.repeat(g), hi.repeat(g), budget.repeat(g),
                   torch.zeros(g * bs, hkv, k_max, dtype=torch.int32, device=dev),
                   torch.zeros(g * bs, hkv, dtype=torch.int32, device=dev),
                   torch.zeros(g, bs, hkv, 64, dtype=torch.int32, device=dev) if use_hist else None,
                   torch.empty_like(scores))

    def to(self, device) -> "Selection":
        """A copy of every tensor on ``device`` (a copy on the same device too: --smoke's cpu)."""
        return Selection(**{f.name: None if getattr(self, f.name) is None
                            else getattr(self, f.name).to(device, copy=True) for f in dataclasses.fields(self)})


def _stream(s):
    """The stream's context, or nothing (the CPU: no streams)."""
    import torch

    return contextlib.nullcontext() if s is None else torch.cuda.stream(s)


if __name__ == "__main__":
    sys.exit(main())
