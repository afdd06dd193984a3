#!/usr/bin/env python3
"""On the GPU: SGLang's stock `flashinfer` backend vs `sgl_sparse` in one run.

For each backend: start the server on the same random-weights model, send the same
greedy token-id prompts (output ids recorded), then time decode for CTXxBATCH cases.
Decode throughput = batch*(L-1) / (T(L) - T(1)): the wall time of the batch with L
new tokens minus the same batch with 1 (its prefill), so prefill is excluded.

    python bench/gpu/server_compare.py --model /root/m17 --cases 8192x8,2048x64 --out $OUT/e2e.json
"""
import argparse, json, os, random, statistics, subprocess, sys, time, concurrent.futures as cf
import requests


def wait_ready(url, proc, limit):
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return time.time() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit("server not ready in time")


def gen(url, ids, n, sparse=None):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if sparse:
        sp["custom_params"] = {"sparse": sparse}
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=900)
    r.raise_for_status()
    return r.json()


def batch_wall(url, prompts, n, sparse=None):
    t0 = time.time()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        list(ex.map(lambda p: gen(url, p, n, sparse), prompts))
    return time.time() - t0


# SFI runs (issue 4): the paper's budget with natural sentence triggers, and the
# slow-step ratio pinned to 1/32 by the refresh budget (31 fast steps, then slow).
SFI = {"policy": "sfi", "budget": 2048, "recent": 256, "sink": 4}
NAMED = {"sfi": SFI, "sfi-pinned": {**SFI, "sentence_triggers": False, "t_max": 31}}


def parse_policy(text):
    """'name[:window]' or a NAMED run -> (label, request metadata)."""
    if text in NAMED:
        return text, NAMED[text]
    name, _, window = text.partition(":")
    return name, {"policy": name, **({"window": int(window)} if window else {})}


def scrape(url):
    """sglang_sparse_* counters by (name, policy) from the server's /metrics."""
    out = {}
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return out
    for line in text.splitlines():
        if line.startswith("sglang_sparse_decode_prepare_duration_seconds_") and ("_sum{" in line or "_count{" in line):
            key = (line.split("{", 1)[0], "")  # the backend's host time per decode forward
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("sglang_sparse_") and "_total{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            pol = next((kv.split("=")[1].strip('"') for kv in labels.split(",") if kv.startswith("policy=")), "")
            key = (name, pol)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def sparse_stats(before, after, policy):
    d = lambda n: after.get((n, policy), 0.0) - before.get((n, policy), 0.0)  # noqa: E731
    steps = d("sglang_sparse_decode_steps_total")
    if not steps:
        return {}
    cached = d("sglang_sparse_cached_tokens_total")
    prep = "sglang_sparse_decode_prepare_duration_seconds_"
    forwards = after.get((prep + "count", ""), 0.0) - before.get((prep + "count", ""), 0.0)
    prep_s = after.get((prep + "sum", ""), 0.0) - before.get((prep + "sum", ""), 0.0)
    return {"slow_step_ratio": round(d("sglang_sparse_slow_steps_total") / steps, 4),
            "retention": round(d("sglang_sparse_attended_tokens_total") / cached, 4) if cached else None,
            "prepare_ms_per_step": round(1e3 * prep_s / forwards, 3) if forwards else None}


def run_backend(a, backend, log):
    url = f"http://127.0.0.1:{a.port}"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--attention-backend", backend,
           "--skip-tokenizer-init", "--port", str(a.port), "--mem-fraction-static", "0.8",
           "--enable-metrics",
           "--disable-radix-cache"] + a.extra.split() + (a.sparse_extra.split() if backend == "sgl_sparse" else [])
    res = {"backend": backend, "cmd": " ".join(cmd)}
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        res["ready_s"] = round(wait_ready(url, proc, a.ready_limit), 1)
        rng = random.Random(0)
        gen(url, [rng.randrange(1000, 100000) for _ in range(256)], 8)  # warm-up
        prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in (300, 1500, 4000, 777)]
        res["greedy"] = [gen(url, p, a.check_len)["output_ids"] for p in prompts]
        policies = [("stock", None)] if backend != "sgl_sparse" else [parse_policy(p) for p in a.policies.split(",")]
        if backend == "sgl_sparse":  # a window covering every prompt must reproduce full
            res["greedy_window_covering"] = [
                gen(url, p, a.check_len, {"policy": "streaming", "window": 1 << 20})["output_ids"] for p in prompts]
            res["greedy_sfi_covering"] = [
                gen(url, p, a.check_len, {"policy": "sfi", "recent": 1 << 20})["output_ids"] for p in prompts]
        res["cases"] = []
        for case in a.cases.split(","):
            ctx, bs = map(int, case.split("x"))
            ps = [[rng.randrange(1000, 100000) for _ in range(ctx)] for _ in range(bs)]
            for label, pol in policies:
                batch_wall(url, ps[:1], 2, pol)  # JIT / graph warm-up at this size
                t1 = min(batch_wall(url, ps, 1, pol) for _ in range(2))
                before = scrape(url)
                # Decode time = batch wall time - the prefill-only wall time; the median
                # of `repeats` batches (each re-prefills: the radix cache is off).
                walls = [batch_wall(url, ps, a.out_len, pol) for _ in range(a.repeats)]
                stats = sparse_stats(before, scrape(url), (pol or {}).get("policy", ""))
                tl = statistics.median(walls)
                tok_s = bs * (a.out_len - 1) / max(tl - t1, 1e-9)
                res["cases"].append({"ctx": ctx, "batch": bs, "policy": label,
                                     "sparse": pol, "out_len": a.out_len, "t_prefill_s": round(t1, 3),
                                     "t_total_s": round(tl, 3), "t_total_runs_s": [round(w, 3) for w in walls],
                                     "decode_tok_s": round(tok_s, 1), **stats})
                print(json.dumps({"backend": backend, **res["cases"][-1]}), flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backends", default="flashinfer,sgl_sparse")
    ap.add_argument("--cases", default="8192x8")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per row (median)")
    ap.add_argument("--policies", default="full,streaming:2048,sadas:2048", help="sgl_sparse runs, name[:window]")
    ap.add_argument("--check-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--extra", default="--disable-prefill-cuda-graph")
    ap.add_argument("--sparse-extra", default="", help="extra flags for the sgl_sparse server only")
    ap.add_argument("--ready-limit", type=float, default=480)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logdir", default="/tmp")
    a = ap.parse_args()
    runs = [run_backend(a, b, os.path.join(a.logdir, f"server-{b}.log")) for b in a.backends.split(",")]
    base = runs[0]
    summary = {"device": os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip(),
               "command": " ".join(sys.argv), "runs": runs, "compare": []}
    for r in runs[1:]:
        same = [x == y for x, y in zip(base["greedy"], r["greedy"])]
        covering = [x == y for x, y in zip(base["greedy"], r.get("greedy_window_covering", []))]
        sfi_covering = [x == y for x, y in zip(base["greedy"], r.get("greedy_sfi_covering", []))]
        stock = {(c["ctx"], c["batch"]): c["decode_tok_s"] for c in base["cases"]}
        rows = [{"ctx": c["ctx"], "batch": c["batch"], "policy": c["policy"], "stock_tok_s": stock[(c["ctx"], c["batch"])],
                 "tok_s": c["decode_tok_s"], "ratio": round(c["decode_tok_s"] / stock[(c["ctx"], c["batch"])], 3),
                 "slow_step_ratio": c.get("slow_step_ratio"), "retention": c.get("retention")}
                for c in r["cases"]]
        summary["compare"].append({"backend": r["backend"], "greedy_identical_full": same,
                                   "greedy_identical_window_covering": covering,
                                   "greedy_identical_sfi_covering": sfi_covering, "rows": rows})
        print(f"\n{r['backend']} vs {base['backend']}: greedy identical (full) {same}; (window >= length) {covering}; "
              f"(sfi, budget + recent >= length) {sfi_covering}")
        print(f"| ctx x batch | policy | {base['backend']} tok/s | {r['backend']} tok/s | ratio | slow ratio | retention |"
              "\n|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['ctx']} x {row['batch']} | {row['policy']} | {row['stock_tok_s']} | {row['tok_s']} | "
                  f"{row['ratio']} | {row['slow_step_ratio']} | {row['retention']} |")
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
