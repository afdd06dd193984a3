"""Where a decode step's GPU time goes: SGLang's own torch profiler on a live server.

For each backend and policy, a batch of `ctx`-token prompts decodes `out_len`
tokens; once decoding has begun, `/start_profile` records `--steps` forward passes.
The trace's GPU kernels are summed by name: time per decode step, kernel count,
and the GPU-idle share of the profiled span (host overhead the GPU waits on).
Where a step runs on several streams (asyncspade's side stream), the main chain's
idle time is split by the length of its gaps: many short gaps spread over the
layers are its kernels waiting for SMs the side stream's programs hold, one long
gap a step is a join (or the host between graph replays); the long gaps are listed
with the kernels either side. The main chain is every kernel but the side stream's
(by name, SIDE_KERNELS): inside a CUDA-graph replay CUPTI reports the executor's
stream ids, not the capture's, and one captured stream's kernels land on several
(session 27). `--timeline N` also writes every kernel of N steps from the middle of
the trace (stream, start, length, name) to timeline-<backend>-<policy>.csv beside
--out.

    python bench/gpu/profile_decode.py --model /root/model --case 32768x8 \
        --runs flashinfer:stock,sgl_sparse:streaming:16,sgl_sparse:sfi-pinned --out $OUT/profile.json

A run's policy may be a mixed row, as in server_compare.py ('sgl_sparse:full+sfi-pinned':
the batch's requests dealt round-robin over both, the graph variant `mixed`); --extra
gives every server the same flags (an fp8 KV cache for stock too).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import gzip
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict

import requests

sys.path.insert(0, os.path.dirname(__file__))
from server_compare import (batch_wall, check_port_free, gen_stream, graph_flags, parse_row,  # noqa: E402
                            request_meta, wait_ready)


def busy_union(kernels: list[dict]) -> float:
    """Time (us) during which at least one of the kernels ran."""
    total, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if b > end:
            total += b - max(a, end)
            end = b
    return total


#: main-chain gap classes (us): a kernel's launch latency, a wait inside a step, a join or the host
GAP_CLASSES = ((0.0, 5.0), (5.0, 50.0), (50.0, float("inf")))
#: the kernels asyncspade's side stream runs (query_device._aspd_next): the rest is the main chain
SIDE_KERNELS = re.compile(r"_(index_)?token_scores|_topk_range|_topk_split|_expand_selection")


def main_chain_gaps(kernels: list[dict], steps: int, longest: int = 12) -> dict:
    """The idle time between consecutive kernels of the main chain (every kernel whose
    name SIDE_KERNELS does not match), per step, by gap length; and the `longest`
    gaps of GAP_CLASSES' last class in time order, with the kernels either side."""
    mine = sorted((e for e in kernels if not SIDE_KERNELS.match(e["name"])), key=lambda e: e["ts"])
    pairs = [(b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(mine, mine[1:])]
    out = {}
    for lo, hi in GAP_CLASSES:
        sel = [g for g, _, _ in pairs if lo <= g < hi]
        name = f"{lo:g}-{hi:g}us" if hi != float("inf") else f">={lo:g}us"
        out[name] = {"ms_per_step": round(sum(sel) / 1e3 / steps, 3), "per_step": round(len(sel) / steps, 1)}
    long_lo = GAP_CLASSES[-1][0]
    out["long"] = [{"us": round(g, 1), "after": a["name"][:60], "before": b["name"][:60]}
                   for g, a, b in pairs if g >= long_lo][:longest]
    return out


def _stream(e: dict) -> str:
    return str(e.get("args", {}).get("stream", e.get("tid")))


def write_timeline(kernels: list[dict], a: float, b: float, path: str) -> None:
    """Every kernel that starts in [a, b) us, its start relative to a."""
    with open(path, "w") as f:
        f.write("stream,start_us,dur_us,name\n")
        for e in sorted(kernels, key=lambda e: e["ts"]):
            if a <= e["ts"] < b:
                f.write(f"{_stream(e)},{e['ts'] - a:.1f},{e['dur']:.1f},{e['name'][:70].replace(',', ';')}\n")


def summarize(trace_path: str, steps: int, top: int = 25, timeline: tuple[int, str] | None = None) -> dict:
    """timeline: (steps, path) to write write_timeline's CSV to."""
    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "no kernel events"}
    by_name = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)  # kernels of one stream do not overlap
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    by_stream = defaultdict(float)
    for e in kernels:
        by_stream[_stream(e)] += e["dur"]
    union = busy_union(kernels)
    if timeline is not None:  # `timeline[0]` steps' span from the middle of the trace
        mid = (t0 + t1) / 2
        write_timeline(kernels, mid, mid + timeline[0] * (t1 - t0) / steps, timeline[1])
    return {
        "steps": steps, "span_ms_per_step": per_step(t1 - t0),
        "gpu_busy_ms_per_step": per_step(busy),
        "gpu_idle_share": round(1 - busy / max(t1 - t0, 1e-9), 3),
        # several streams (asyncspade's side stream): each one's kernel time, the time
        # any kernel ran, and how much of the streams' time ran concurrently
        "stream_busy_ms_per_step": {k: per_step(v) for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])},
        "any_busy_ms_per_step": per_step(union),
        "concurrent_ms_per_step": per_step(busy - union),
        "main_chain_gaps": main_chain_gaps(kernels, steps),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "top": [{"name": n[:90], "ms_per_step": round(t / 1e3 / steps, 4), "calls_per_step": round(c / steps, 2)}
                for n, (t, c) in rows],
    }


def profile_run(url: str, prompts, policy, out_len: int, steps: int, outdir: str,
                timeline: tuple[int, str] | None = None) -> dict:
    batch_wall(url, prompts[:1], 2, policy)  # JIT / graph warm-up
    t_prefill = batch_wall(url, prompts, 1, policy)
    # Enough tokens that the profiled steps fall inside the decode even when a
    # step takes ~2 ms (a 512x8 run once finished before the profiler started).
    out_len = max(out_len, 8 * steps)
    # The profile starts once every request has its second token, i.e. the whole batch
    # decodes. (A sleep of 1.1x a prefill-only batch's time overshot the 512-token
    # decode of sfi-pinned at 130000 x 4 in sessions 18 and 21: it started after the
    # batch had finished, and no step was profiled.)
    decoding = threading.Event()
    lock, seen = threading.Lock(), set()

    def on_tokens(i: int, count: int) -> None:
        if count >= 2:
            with lock:
                seen.add(i)
                if len(seen) == len(prompts):
                    decoding.set()

    def batch() -> None:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            list(ex.map(lambda i: gen_stream(url, prompts[i], out_len, request_meta(policy, i), lambda c: on_tokens(i, c)),
                        range(len(prompts))))
        decoding.set()  # finished (or failed) without decoding together: the profile then says so

    th = threading.Thread(target=batch)
    th.start()
    decoding.wait(timeout=max(600.0, 3 * t_prefill))
    os.makedirs(outdir, exist_ok=True)
    r = requests.post(url + "/start_profile", json={"output_dir": outdir, "num_steps": steps,
                                                     "activities": ["GPU"]}, timeout=600)
    th.join()
    for _ in range(180):  # the scheduler exports the trace after the profiled steps (130000 x 4: > 60 s, s18)
        traces = sorted(glob.glob(os.path.join(outdir, "*.trace.json*")), key=os.path.getmtime)
        if traces:
            break
        time.sleep(1)
    if not r.ok or not traces:
        return {"error": f"profile failed: {r.status_code} {r.text[:200]}", "traces": traces}
    res = summarize(traces[-1], steps, timeline=timeline)
    for t in traces:
        os.remove(t)  # hundreds of MB each; the summary is what comes back
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", default="32768x8")
    ap.add_argument("--runs", default="flashinfer:stock,sgl_sparse:streaming:16,sgl_sparse:sfi-pinned")
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sparse-extra", default="--sparse-config bench/gpu/sparse_config.yaml")
    ap.add_argument("--extra", default="", help="SGLang flags of every server (e.g. --kv-cache-dtype fp8_e4m3)")
    ap.add_argument("--graph-max-bs", default="auto",
                    help="every server's decode-graph sizes: auto (up to the case's batch), sglang or N "
                         "(server_compare.graph_flags)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--mem-fraction-static", default="0.8",
                    help="lower it where the stores of many query-aware slots must fit beside the pool")
    ap.add_argument("--timeline", type=int, default=0,
                    help="write every kernel of this many steps to timeline-<backend>-<policy>.csv beside --out")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ctx, bs = map(int, a.case.split("x"))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(ctx)] for _ in range(bs)]
    by_backend: dict[str, list[str]] = defaultdict(list)
    for run in a.runs.split(","):
        backend, _, pol = run.partition(":")
        by_backend[backend].append(pol)
    url = f"http://127.0.0.1:{a.port}"
    results = []
    outdir = os.path.join(os.path.dirname(os.path.abspath(a.out)), "traces")
    for backend, pols in by_backend.items():
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--attention-backend", backend,
               "--skip-tokenizer-init", "--port", str(a.port), "--mem-fraction-static", a.mem_fraction_static,
               "--disable-radix-cache", "--disable-prefill-cuda-graph", *graph_flags(a.extra, a.case, a.graph_max_bs)
               ] + a.extra.split() + \
            (a.sparse_extra.split() if backend == "sgl_sparse" else [])
        env = {**os.environ, "SGLANG_TORCH_PROFILER_DIR": outdir}
        log = open(os.path.join(os.path.dirname(os.path.abspath(a.out)), f"profile-server-{backend}.log"), "w")
        check_port_free(a.port)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            wait_ready(url, proc, 480)
            for pol in pols:
                # a mixed row ('full+sfi-pinned'): its policies dealt round-robin over the batch
                label, meta = ("stock", None) if pol == "stock" else parse_row(pol)
                tl = None
                if a.timeline:
                    tl = (a.timeline, os.path.join(os.path.dirname(os.path.abspath(a.out)),
                                                   "timeline-{}-{}.csv".format(backend, re.sub(r"[^\w.=-]", "_", label))))
                res = {"backend": backend, "policy": label, "sparse": meta, "ctx": ctx, "batch": bs,
                       **profile_run(url, prompts, meta, a.out_len, a.steps, outdir, tl)}
                results.append(res)
                print(json.dumps(res, indent=1), flush=True)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
