#!/usr/bin/env python3
"""
Benchmark: SFI's refresh after a slow step (Selector + repack), per layer
=========================================================================

    python bench/kernels/bench_selector.py --out results/selector.json

For each (context, batch) -- every request of the batch refreshing at once, the
worst case -- the Qwen3-1.7B attention shape (28 layers, Hq 16, Hkv 8, D 128,
bf16, K = 2048, recent 256, sink 4) is timed with CUDA events (median of
repeats, after warm-up; every layer reads the same key pool, which changes no
work):

* `refresh`: sgl_sparse.selector.refresh.refresh for all layers -- the
  window_evidence kernel per layer, the Selector's tensor ops batched over
  layers, Top-K, the pack kernel per layer -- with the evidence window of a
  later slow step (w = 1) and of the first one (w = 32), reported per layer;
* `dense`: the same batch's dense decode attention for one layer (our kernel,
  B = [0, n)), the work a slow step does anyway;
* w = 1 only (a slow step after the first): `dense_logits`, the same attention
  also storing the slow query's logits (compact.slow_logits_context > 0), and
  `refresh_stored`, the refresh whose evidence reads those logits instead of the
  keys (kernels.stored_evidence: no window_evidence pass 1).

The ratio refresh/dense is the slow step's extra attention-side cost per layer;
`stored_over_dense` = (refresh_stored + dense_logits - dense) / dense is the same
with the logits kept. `--profile CTXxBATCH` prints the per-kernel breakdown of
both refreshes (w = 1): `_evidence_pass1` disappears from the stored one,
`_stored_partials` / `_stored_pass2` read G fp32 logits per key instead.
`--selections slot_lists`: the store keeps the selections as pool-slot lists
(`compact.selections`): the refresh's packing writes 4 bytes a row instead of copying
its K and V.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from sgl_sparse.compact import CompactStore
from sgl_sparse.config import SfiPolicy, SparseServerConfig
from sgl_sparse.kernels import two_segment_decode
from sgl_sparse.policies import sfi
from sgl_sparse.selector.refresh import refresh
from sgl_sparse.state import SparseState


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


LAYERS = 28
SELECTIONS = "packed"  # --selections: CompactStore's segment A


def _segment_a(store) -> list[torch.Tensor]:
    """What the refresh writes for segment A: the lists, or the packed K and V."""
    return [store.lists] if store.slot_lists else [store.k, store.v]


def case(ctx: int, bs: int, w: int, reps: int, fns: dict | None = None, room: int = 0, norms: str = "pool"):
    """`room` > ctx: req_to_token rows and stored logits sized for `room` positions
    (a refresh's bound may then exceed the requests' length, as a padded one does)."""
    dev = torch.device("cuda")
    room = max(room, ctx)
    hkv, hq, d, cap = 8, 16, 128, 2052
    spec = SfiPolicy(w_prefill=max(w, 1))
    cfg = SparseServerConfig.model_validate({"compact": {"slots": bs, "capacity": cap},
                                             "policies": {"sfi": {"w_prefill": max(w, 1)}}})
    st = SparseState(bs + 1, dev, cfg)
    rows = list(range(1, bs + 1))
    st.admit(rows, [sfi.init_row(spec, [], [], (None, None))] * bs)
    pool = bs * ctx + 16
    k = torch.randn(pool, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.zeros(bs + 1, room + 8, dtype=torch.int32, device=dev)
    r2t[1:, :ctx] = torch.randperm(bs * ctx, device=dev).view(bs, ctx).int()
    stored = w == 1
    st.compact = CompactStore(slots=bs, capacity=cap, num_layers=LAYERS, num_kv_heads=hkv, num_q_heads=hq,
                              head_dim=d, dtype=torch.bfloat16, pool_size=pool, prompt_queries=max(w - 1, 0),
                              device=dev, logit_len=room if stored else 0, selections=SELECTIONS)
    # "pool": the random keys' own norms (a chi spread: few survivors in the medians);
    # "qknorm": norms as a Qwen3 pool holds them (stats_ab's qk_normed_key_norms)
    shape = tuple(st.compact.knorm.shape)
    st.compact.knorm[:] = k.float().norm(dim=-1) if norms == "pool" else qk_normed_key_norms(shape, dev)
    st.compact.q.normal_()
    st.compact.q_prompt.normal_()
    idx = torch.tensor(rows, device=dev)
    st.saved_n[idx] = ctx
    st.prompt_q[idx] = w - 1
    scale = 1 / math.sqrt(d)
    # w = 1: a later slow step (its window is its own query); the first slow step's
    # window is w_prefill queries. The key-reading path, whatever the store keeps:
    later = set(rows) if stored else set()

    def run_refresh():
        logits, st.compact.logits = st.compact.logits, None  # the keys read again, whatever the store keeps
        try:
            refresh(st, rows, ctx, lambda i: k, lambda i: v, r2t, scale, use_kernels=True, later=later)
        finally:
            st.compact.logits = logits

    t_refresh = time_ms(run_refresh, reps) / LAYERS
    q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
    zero = torch.zeros(bs, dtype=torch.int32, device=dev)
    n = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    a_len = torch.zeros(bs, hkv, dtype=torch.int32, device=dev)
    slots = st.slot[idx].int()

    no_compact = k.new_zeros(1, hkv, 1, d)  # a_len 0: segment A unread

    def dense(layer: int = 0, **kw):
        return two_segment_decode(q, no_compact, no_compact, zero - 1, a_len, k, v, r2t, idx,
                                  zero, n, scale, max_kv_len=ctx, **kw)

    t_dense = time_ms(dense, reps)
    kv_bytes = bs * ctx * hkv * d * 2 * 2
    out = {"ctx": ctx, "batch": bs, "w": w, "refresh_ms": round(t_refresh, 3), "dense_attn_ms": round(t_dense, 3),
           "refresh_all_layers_ms": round(t_refresh * LAYERS, 2),
           "refresh_over_dense": round(t_refresh / t_dense, 2), "kv_bytes_per_layer": kv_bytes}
    if fns is not None:
        fns["refresh"] = run_refresh
        fns["_state"] = st
        fns.update(_k=k, _v=v, _r2t=r2t, _scale=scale)
    if not stored:
        return out
    # The slow step storing its logits (every layer, as serving does), then the
    # refresh reading them.
    save = dict(q_save=st.compact.q[0], q_save_slot=slots)
    for layer in range(LAYERS):
        dense(layer, q_save=st.compact.q[layer], q_save_slot=slots, logits_out=st.compact.logits[layer])
    t_dense_lg = time_ms(lambda: dense(0, logits_out=st.compact.logits[0], **save), reps)

    def run_stored():
        refresh(st, rows, ctx, lambda i: k, lambda i: v, r2t, scale, use_kernels=True, later=later)

    t_stored = time_ms(run_stored, reps) / LAYERS
    if fns is not None:
        fns["refresh_stored"] = run_stored
    out.update({"dense_logits_ms": round(t_dense_lg, 3), "refresh_stored_ms": round(t_stored, 3),
                "refresh_stored_all_layers_ms": round(t_stored * LAYERS, 2),
                "stored_over_dense": round((t_stored + t_dense_lg - t_dense) / t_dense, 2),
                "logits_bytes": st.compact.logits.numel() * 4})
    return out


def _runs(fns: dict) -> list:
    """The refresh runs `case` put in `fns` (name, fn), without the state and tensors
    it shares under "_" names ("_state", "_k", ...)."""
    return [(n, f) for n, f in fns.items() if not n.startswith("_")]


def profile(ctx: int, bs: int, w: int, norms: str = "pool") -> None:
    """Where a refresh's time goes: CUDA time per op (torch.profiler), all layers;
    for w = 1 both the key-reading refresh and the one from stored logits."""
    from torch.profiler import ProfilerActivity, profile as prof

    fns: dict = {}
    case(ctx, bs, w, 2, fns, norms=norms)
    for name, fn in _runs(fns):
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        print(f"--- {name} ({ctx} x {bs}, w = {w}, {LAYERS} layers)")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def host_profile(ctx: int, bs: int, calls: int = 20) -> dict:
    """The host's share of a refresh (w = 1, both paths): host time per call (the
    launches returning, no synchronization) against the call's device time, then
    cProfile's functions by own time over `calls` calls. A refresh whose host time
    exceeds its device time keeps the GPU waiting on the serving path, where it is
    launched right before the next decode step.

    Then the same refreshes replayed from CUDA graphs (selector/graphs.py: the
    first call eager and captured, the others replays): `*_graphed_host_ms` /
    `*_graphed_device_ms`, and `*_graphed_same` whether the compact buffers,
    counts and ready flags equal the eager refresh's, bit for bit."""
    import cProfile
    import io
    import pstats
    import time

    from sgl_sparse.selector.graphs import RefreshGraphs

    fns: dict = {}
    case(ctx, bs, 1, 2, fns)
    st = fns.pop("_state")
    out = {"ctx": ctx, "batch": bs}

    def host_ms(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        host = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        return round(statistics.median(host), 3)

    def snapshot() -> list[torch.Tensor]:
        torch.cuda.synchronize()
        return [t.clone() for t in (*_segment_a(st.compact), st.sel_count, st.sel_ready)]

    for name, fn in _runs(fns):
        st.compact.refresh_graphs = None
        out[f"{name}_host_ms"] = host_ms(fn)
        out[f"{name}_device_ms"] = round(time_ms(fn, calls), 3)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        print(f"--- host profile: {name} ({ctx} x {bs}, w = 1, {calls} calls)\n{buf.getvalue()}", flush=True)
        eager = snapshot()
        for t in (*_segment_a(st.compact), st.sel_count):
            t.zero_()
        st.sel_ready.zero_()
        graphs = st.compact.refresh_graphs = RefreshGraphs(torch.device("cuda"))
        out[f"{name}_graphed_host_ms"] = host_ms(fn)
        out[f"{name}_graphed_device_ms"] = round(time_ms(fn, calls), 3)
        out[f"{name}_graphed_same"] = all(torch.equal(a, b) for a, b in zip(eager, snapshot()))
        out[f"{name}_graphs"] = {"captures": graphs.captures, "replays": graphs.replays}
        st.compact.refresh_graphs = None
    print(json.dumps(out), flush=True)
    return out


def length_pad(ctx: int, bs: int, factors: tuple[int, ...] = (1, 2, 4), calls: int = 20) -> dict:
    """Whether a refresh graph's work follows its length bucket or the requests'
    lengths: the graphed refresh from stored logits (w = 1) of requests of `ctx`
    positions, with its bound on positions `f` x ctx (what a coarser length bucket
    would pad it to), device ms per refresh of all layers, and whether the compact
    buffers, counts and ready flags equal those of the bound `ctx`, bit for bit."""
    from sgl_sparse.selector.graphs import RefreshGraphs

    fns: dict = {}
    case(ctx, bs, 1, 2, fns, room=ctx * max(factors))
    st = fns.pop("_state")
    rows = list(range(1, bs + 1))
    ref = None
    out = {"ctx": ctx, "batch": bs, "device_ms": {}, "same": {}}
    for f in factors:
        st.compact.refresh_graphs = RefreshGraphs(torch.device("cuda"))
        for t in (*_segment_a(st.compact), st.sel_count):
            t.zero_()
        st.sel_ready.zero_()

        def fn(bound=ctx * f):
            refresh(st, rows, bound, lambda i: fns["_k"], lambda i: fns["_v"], fns["_r2t"], fns["_scale"],
                    use_kernels=True, later=set(rows))

        out["device_ms"][f] = round(time_ms(fn, calls), 3)
        torch.cuda.synchronize()
        got = [t.clone() for t in (*_segment_a(st.compact), st.sel_count, st.sel_ready)]
        ref = ref if ref is not None else got
        out["same"][f] = all(torch.equal(a, b) for a, b in zip(ref, got))
        out.setdefault("graphs", {})[f] = {"captures": st.compact.refresh_graphs.captures,
                                           "replays": st.compact.refresh_graphs.replays}
    st.compact.refresh_graphs = None
    print(json.dumps(out), flush=True)
    return out


def qk_normed_key_norms(shape: tuple, dev: torch.device, d: int = 128, vectors: int = 1 << 16,
                        weight_spread: float = 0.0) -> torch.Tensor:
    """Key norms as a Qwen3 KV pool holds them: every key RMS-normalized per head
    (the model's k_norm; RoPE keeps the norm) times a per-channel weight, stored as
    fp8 e4m3, so the norms lie within a few % of each other -- unlike the log-normal
    norms below, much of a row shares the median's top 16 bits (session 33's 130000
    x 4 profile). ``weight_spread`` 0: the weights of the random-weights checkpoints
    served here (ones); a trained model's vary. ``vectors`` such keys, drawn at
    random into ``shape``."""
    g = torch.Generator(device=dev).manual_seed(33)
    w = 1 + weight_spread * torch.randn(d, device=dev, generator=g)
    x = torch.randn(vectors, d, device=dev, generator=g)
    k = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.float8_e4m3fn).float()
    return k.norm(dim=-1)[torch.randint(0, vectors, shape, device=dev, generator=g)]


def stats_ab(ctx: int, bs: int, reps: int, norms_kind: str = "lognormal") -> dict:
    """The Selector's stats kernel (medians of the key norms, then the sums) on one
    layer chunk as the refresh batches it ([layers x bs, Hkv, ctx]), with the
    medians' last two radix passes over the gathered survivors (the default) and
    over all of A (the previous kernel); single program, the MAD bracketed by the
    median's histograms (``stats_split1_ms``, the default) or not (``stats_mad_radix_ms``).
    ``norms_kind``: ``lognormal`` (spread: few survivors) or ``qknorm``
    (:func:`qk_normed_key_norms`, as served); ``survivors`` is the share of a row
    sharing its median's top 16 bits."""
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.kernels import selector_stats
    from sgl_sparse.selector.core import SelectorKnobs

    dev = torch.device("cuda")
    hkv = 8
    rows = max(1, min(LAYERS * bs, (1 << 25) // (hkv * ctx)))  # refresh._MAX_SELECT_ELEMS_KERNELS
    if norms_kind == "qknorm":
        norms = qk_normed_key_norms((rows, hkv, ctx), dev)
    else:
        norms = torch.exp(torch.randn(rows, hkv, ctx, device=dev) * 0.3) * 20
    u = torch.rand(rows, hkv, ctx, device=dev)
    lo = torch.full((rows,), 4, device=dev)
    hi = torch.full((rows,), ctx - 256, device=dev)
    knobs = SelectorKnobs.from_specs([SfiPolicy()] * rows, dev, torch.float32)
    from sgl_sparse.kernels._split import STATS_RULE, split_count

    on = norms[..., 4: ctx - 256]
    med = on.sort(dim=-1).values[..., (on.shape[-1] - 1) // 2]
    top16 = lambda t: t.view(torch.int32) >> 16  # noqa: E731
    out = {"ctx": ctx, "batch": bs, "rows": rows, "norms": norms_kind,
           "survivors": round(float((top16(on) == top16(med)[..., None]).float().mean()), 4),
           "auto_splits": split_count(ctx, rows * hkv, dev, STATS_RULE)}
    for name, gather in (("stats_gather_ms", True), ("stats_all_passes_ms", False)):
        out[name] = round(time_ms(lambda: selector_stats(u, norms, lo, hi, knobs, gather=gather), reps), 3)
    # The MAD's select bracketed by the median's histograms (one pass over the row;
    # the default) or as the median's (three passes): kernels/_mad_bracket.py.
    out["stats_mad_radix_ms"] = round(time_ms(lambda: selector_stats(u, norms, lo, hi, knobs, splits=1,
                                                                     mad_bracket=False), reps), 3)
    a = selector_stats(u, norms, lo, hi, knobs, gather=True)
    b = selector_stats(u, norms, lo, hi, knobs, gather=False)
    c = selector_stats(u, norms, lo, hi, knobs, splits=1, mad_bracket=False)
    out["same_medians"] = bool(torch.equal(a[..., 3:], b[..., 3:]) and torch.equal(b[..., 3:], c[..., 3:]))
    # Each (row, head) over S programs (kernels/selector_stats_split.py; the
    # default picks auto_splits): the same medians, the sums to fp32 rounding.
    one = selector_stats(u, norms, lo, hi, knobs, splits=1)
    for sp in (1, 2, 4, 8, 16):
        out[f"stats_split{sp}_ms"] = round(time_ms(lambda: selector_stats(u, norms, lo, hi, knobs, splits=sp), reps), 3)
        got = selector_stats(u, norms, lo, hi, knobs, splits=sp)
        out[f"stats_split{sp}_ok"] = bool(torch.equal(got[..., 3:], one[..., 3:])
                                          and torch.allclose(got[..., :3], one[..., :3], rtol=1e-5, atol=0))
    return out


def pack_ab(ctx: int, bs: int, reps: int) -> dict:
    """pack_compact alone at the refresh's shape (one layer: bs rows x 8 KV heads x
    2052 slots of 128 bf16, K and V gathered from a shuffled pool), at several
    tilings: (rows per tile, programs per (row, head) at most, warps). The bytes
    moved (read + write) over the time, vs the HBM roofline, say whether the grid
    or the gathers' latency is what costs (run 7: 52 us per layer at 32768 x 8)."""
    from sgl_sparse.kernels import pack_compact

    dev = torch.device("cuda")
    hkv, d, cap = 8, 128, 2052
    k = torch.randn(bs * ctx + 16, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.randperm(bs * ctx, device=dev).view(bs, ctx).int()
    i32 = torch.arange(bs, dtype=torch.int32, device=dev)
    sel = torch.rand(bs, hkv, ctx, device=dev).topk(cap, dim=-1).indices.sort(dim=-1).values.int()
    n_sel = torch.full((bs, hkv), cap, dtype=torch.int32, device=dev)
    a_k = torch.empty(bs, hkv, cap, d, device=dev, dtype=torch.bfloat16)
    a_v, a_len = torch.empty_like(a_k), torch.empty(bs, hkv, dtype=torch.int32, device=dev)
    ones = torch.ones(bs, dtype=torch.bool, device=dev)
    moved = 2 * 2 * bs * hkv * cap * d * 2  # K and V, read and written
    out = {"ctx": ctx, "batch": bs, "bytes": moved}
    for bn, mc, nw in ((64, 16, 4), (64, None, 4), (32, None, 4), (32, 16, 2), (128, None, 8), (16, None, 1)):
        def run():
            pack_compact(k, v, r2t, i32, sel, n_sel, ones, a_k, a_v, i32, a_len, block_n=bn, max_chunks=mc,
                         num_warps=nw)
        t = time_ms(run, max(reps, 20))
        out[f"pack_{bn}_{mc}_{nw}w_us"] = round(t * 1000, 1)
        out[f"pack_{bn}_{mc}_{nw}w_GBps"] = round(moved / (t * 1e-3) / 1e9)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="131072x4,32768x8,8192x32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default="", help="CTXxBATCH: print a per-op profile of one refresh")
    ap.add_argument("--host-profile", default="", help="CTXxBATCH,...: host vs device time of a refresh, cProfile")
    ap.add_argument("--length-pad", default="", help="CTXxBATCH,...: graphed refresh device time with its "
                    "bound on positions 1x, 2x, 4x the requests' length (coarser length buckets)")
    ap.add_argument("--norms", choices=("pool", "qknorm"), default="pool",
                    help="the refresh's key norms: the random keys' own, or Qwen3-like (qk-norm, fp8)")
    ap.add_argument("--windows", default="1,32", help="the refresh's evidence windows w timed per case")
    ap.add_argument("--stats-ab", action="store_true", help="time the stats kernel's two histograms per case")
    ap.add_argument("--pack-ab", action="store_true", help="time pack_compact's tilings per case")
    ap.add_argument("--selections", choices=("packed", "slot_lists"), default="packed",
                    help="the compact store's segment A (compact.selections)")
    a = ap.parse_args()
    global SELECTIONS
    SELECTIONS = a.selections
    for c in filter(None, a.profile.split(",")):
        ctx, bs = map(int, c.split("x"))
        profile(ctx, bs, 1, a.norms)
    hp = []
    for c in filter(None, a.host_profile.split(",")):
        ctx, bs = map(int, c.split("x"))
        hp.append(host_profile(ctx, bs))
    lp = []
    for c in filter(None, a.length_pad.split(",")):
        ctx, bs = map(int, c.split("x"))
        lp.append(length_pad(ctx, bs))
        torch.cuda.empty_cache()
    res, ab = [], []
    for c in filter(None, a.cases.split(",")):
        ctx, bs = map(int, c.split("x"))
        if a.stats_ab:
            for kind in ("lognormal", "qknorm"):
                ab.append(stats_ab(ctx, bs, a.reps, kind))
                print(json.dumps(ab[-1]), flush=True)
        if a.pack_ab:
            ab.append(pack_ab(ctx, bs, a.reps))
            print(json.dumps(ab[-1]), flush=True)
        for w in map(int, a.windows.split(",")):
            r = case(ctx, bs, w, a.reps, norms=a.norms)
            print(json.dumps(r), flush=True)
            res.append(r)
            torch.cuda.empty_cache()
    print("\n| context x batch | window w | refresh ms/layer | dense attention ms/layer | ratio "
          "| dense + logits ms | refresh from logits ms | ratio (logits kept) |\n|---|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['ctx']} x {r['batch']} | {r['w']} | {r['refresh_ms']} | {r['dense_attn_ms']} "
              f"| {r['refresh_over_dense']} | {r.get('dense_logits_ms', '-')} | {r.get('refresh_stored_ms', '-')} "
              f"| {r.get('stored_over_dense', '-')} |")
    doc = {"device": torch.cuda.get_device_name(), "command": "python bench/kernels/bench_selector.py "
           + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()), "rows": res}
    if ab:
        doc["stats_ab"] = ab
    if hp:
        doc["host_profile"] = hp
    if lp:
        doc["length_pad"] = lp
    json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
