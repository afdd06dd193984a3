#!/usr/bin/env python3
"""On the GPU: SGLang's stock `flashinfer` backend vs `sgl_sparse` in one run.

For each backend: start the server on the same random-weights model, send the same
greedy token-id prompts (output ids recorded), then time decode for CTXxBATCH cases.
Decode throughput = batch*(L-1) / (T(L) - T(1)): the wall time of the batch with L
new tokens minus the same batch with 1 (its prefill), so prefill is excluded.

    python bench/gpu/server_compare.py --model /root/m17 --cases 8192x8,2048x64 --out $OUT/e2e.json

--interleave: both servers run at once and their timed batches alternate, stock
then each policy, `repeats` rounds; each row also gets the median of the per-round
ratios. Run one after the other, the two servers' batches drift apart by several %
at small, host-bound rows (2048x64: stock alone measured 7690-8046 tok/s across
runs); alternating puts the same drift in numerator and denominator. The servers
start one after the other, each with its KV pool capped (--max-total-tokens) at what
the cases need: SGLang sizes the pool as a fraction of the memory free when the
server starts, so two servers started at once each see the other's allocations
half-made (H100 run: the second one refused to start), and an uncapped first server
leaves the second nothing. Only where two capped pools fit: 2048x64 (~140K tokens,
~16 GB at the Qwen3-1.7B shape) and 32768x1, not 32768x8.
"""
import argparse, json, os, random, re, socket, statistics, subprocess, sys, time, concurrent.futures as cf
import requests


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Refuse a port something already answers on: wait_ready would take that server's
    /health for the new one's. Session 55: a server of the call before, left running,
    answered on 30000, the new servers failed to start, and every row of the call
    measured the stale server (batches of 32 without decode graphs, captured up to 8)."""
    with socket.socket() as sock:
        sock.settimeout(1)
        if sock.connect_ex((host, port)) == 0:
            raise SystemExit(f"port {port} already answers: another server is up (an earlier call's? "
                             "bench/gpu/stop_stale_servers.sh stops it)")


def wait_ready(url, proc, limit):
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200 and proc.poll() is None:
                return time.time() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit("server not ready in time")


def sampling(n, sparse=None):
    """Greedy, exactly n new tokens, with the request's sparse metadata."""
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if sparse:
        sp["custom_params"] = {"sparse": sparse}
    return sp


def flag_value(extra: str, flag: str, default: str) -> str:
    """A flag's value among the servers' extra flags (`--flag V` or `--flag=V`)."""
    words = extra.replace("=", " ").split()
    return words[words.index(flag) + 1] if flag in words[:-1] else default


def kv_cache_dtype(extra: str) -> str:
    """The --kv-cache-dtype among the servers' extra flags ("auto" if none)."""
    return flag_value(extra, "--kv-cache-dtype", "auto")


def gen(url, ids, n, sparse=None):
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling(n, sparse)}, timeout=900)
    r.raise_for_status()
    return r.json()


def gen_stream(url, ids, n, sparse=None, on_tokens=None):
    """Greedy generation streamed: (arrival time, tokens generated so far) per chunk;
    `on_tokens(count)` is called as each chunk arrives."""
    out, buf = [], b""
    req = {"input_ids": ids, "sampling_params": sampling(n, sparse), "stream": True}
    with requests.post(url + "/generate", json=req, stream=True, timeout=900) as r:
        r.raise_for_status()
        for piece in r.iter_content(chunk_size=None):  # as it arrives: no 512-byte buffering
            t = time.perf_counter()
            buf += piece
            *lines, buf = buf.split(b"\n")
            for line in lines:
                body = line[5:].strip() if line.startswith(b"data:") else b""
                if body and body != b"[DONE]":
                    out.append((t, json.loads(body)["meta_info"]["completion_tokens"]))
                    if on_tokens is not None:
                        on_tokens(out[-1][1])
    return out


def step_times(arrivals, since=float("-inf")):
    """One request's decode-step times (s) from its chunks, from the second token on
    and from time `since`; a chunk that brought k > 1 tokens (the client read late)
    counts as k equal steps. Returns (times, chunks with k > 1)."""
    times, late = [], 0
    for (t0, c0), (t1, c1) in zip(arrivals, arrivals[1:]):
        k = c1 - c0
        if k > 0 and t0 >= since:
            times += [(t1 - t0) / k] * k
            late += k > 1
    return times, late


def slow_bursts(trace: list[list[float]], factor: float = 2.0) -> dict:
    """SFI's slow tail from the requests' step-time traces (ms): a burst is a run of
    consecutive steps above `factor` x the median step (a slow step, then the step
    that carries its refresh, under a pinned ratio), per request. Returns the fast
    steps' median, bursts per 100 steps, their mean length, and the mean time of a
    burst's first, second, ... step (where the slow step and the refresh go)."""
    steps = sorted(t for ts in trace for t in ts)
    if not steps:
        return {}
    cut = factor * steps[len(steps) // 2]
    bursts = []
    for ts in trace:
        run = []
        for t in ts + [0.0]:  # a sentinel closes the last run
            if t > cut:
                run.append(t)
            elif run:
                bursts.append(run)
                run = []
    fast = [t for ts in trace for t in ts if t <= cut]
    longest = max((len(b) for b in bursts), default=0)
    by_pos = [[b[i] for b in bursts if len(b) > i] for i in range(longest)]
    return {"fast_ms_p50": round(statistics.median(fast), 3) if fast else None,
            "bursts_per_100_steps": round(100 * len(bursts) / len(steps), 2),
            "burst_steps_mean": round(statistics.fmean(len(b) for b in bursts), 2) if bursts else 0,
            "burst_ms_by_position": [round(statistics.fmean(x), 2) for x in by_pos]}


def fast_steps(trace: list[list[float]], factor: float = 1.2) -> dict:
    """The fast steps' own time (ms) from the requests' step-time traces: each step's
    median over the requests that decode together (one client's arrival jitter out),
    then the median of the steps within ``factor`` x their 10th percentile (steps under
    half the median left out first: a client's flush of several tokens at once, seen at
    8192 x 32 as steps of ~0.1 ms). Where fast steps mix with steps just above them
    (natural sfi: a slow row among fast ones, or a one-row refresh, ~1.3-1.8x a fast
    step, under slow_bursts' 2x cut), slow_bursts' ``fast_ms_p50`` is the mixture's
    median: session 43's natural sfi at 32768 x 8 gave 2.91 ms there, 2.63 here
    (pinned 2.49 / 2.47)."""
    n = min((len(ts) for ts in trace), default=0)
    if n == 0:
        return {}
    step = [statistics.median(ts[i] for ts in trace) for i in range(n)]
    floor = statistics.median(step) / 2
    real = sorted(t for t in step if t >= floor)
    cut = factor * real[len(real) // 10]
    fast = [t for t in real if t <= cut]
    return {"fast_step_ms_p50": round(statistics.median(fast), 3), "fast_step_share": round(len(fast) / n, 3)}


def itl_stats(url, prompts, n, sparse=None):
    """Per-step latency of a batch, client side (each request streamed): mean, median
    and p99 over every request's steps once all of them decode. Before that, a
    request's inter-token times include the other requests' prefill chunks (32768 x 8,
    H100: stock's mean 26.3 ms over all steps against a median of 12.3). In a batch
    that decodes together a request's inter-token time is the step's time, so p99 is
    the slow tail (SFI's slow steps and refreshes) and the mean gives decode tok/s
    without subtracting a prefill."""
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        arrivals = list(ex.map(lambda jp: gen_stream(url, jp[1], n, request_meta(sparse, jp[0])),
                               enumerate(prompts)))
    since = max(a[0][0] for a in arrivals if a)  # the last request's first token
    per_req = [step_times(a, since) for a in arrivals]
    times = sorted(t for ts, _ in per_req for t in ts)
    if not times:
        return {}
    mean = statistics.fmean(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    trace_ms = [[1e3 * t for t in ts] for ts, _ in per_req]
    return {"itl_ms_mean": round(1e3 * mean, 3), "itl_ms_p50": round(1e3 * q(0.5), 3),
            "itl_ms_p90": round(1e3 * q(0.9), 3), "itl_ms_p95": round(1e3 * q(0.95), 3),
            "itl_ms_p99": round(1e3 * q(0.99), 3), "itl_ms_max": round(1e3 * times[-1], 3),
            "itl_steps": len(times), "itl_late_chunks": sum(late for _, late in per_req),
            "decode_tok_s_itl": round(len(prompts) / mean, 1),
            # Each request's step times in order: where the slow tail falls (SFI's
            # refresh steps recur every T_max + 1 steps per request).
            "itl_ms_trace": [[round(t, 2) for t in ts] for ts in trace_ms],
            "itl_bursts": slow_bursts(trace_ms), "itl_fast_steps": fast_steps(trace_ms)}


def batch_wall(url, prompts, n, sparse=None):
    t0 = time.time()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        list(ex.map(lambda jp: gen(url, jp[1], n, request_meta(sparse, jp[0])), enumerate(prompts)))
    return time.time() - t0


# SFI runs (issue 4): the paper's budget with natural sentence triggers, and the
# slow-step ratio pinned to 1/32 by the refresh budget (31 fast steps, then slow).
SFI = {"policy": "sfi", "budget": 2048, "recent": 256, "sink": 4}
# sfi-pinned: the slow ratio pinned to 1/32 by the refresh budget (issue 4's rows):
# a batch's requests all refresh on the same step (one refresh group, the default
# until session 58). sfi-pinned-gN: the same dealt into N refresh groups
# (refresh_groups; session 14's first "sfi-pinned" run was N = 31, its
# "sfi-pinned-aligned" is sfi-pinned).
NAMED = {"sfi": SFI, "sfi-pinned": {**SFI, "sentence_triggers": False, "t_max": 31, "refresh_groups": 1},
         **{f"sfi-pinned-g{g}": {**SFI, "sentence_triggers": False, "t_max": 31, "refresh_groups": g}
            for g in (2, 4, 8, 31)}}


def parse_policy(text):
    """'name[:window]' or a NAMED run, then ':knob=value' overrides of its request
    metadata (the load test's spelling; values as JSON) -> (label, metadata):
    'lfps:a=0.001' (labelled so), 'streaming:2048' (labelled 'streaming')."""
    base, *parts = text.split(":")
    meta = dict(NAMED[base]) if base in NAMED else {"policy": base}
    knobs = False
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            meta["window"] = int(part)
            continue
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
        knobs = True
    return (text if knobs or base in NAMED else base), meta


def parse_row(text):
    """A row's policies: one (parse_policy), or several joined by '+' dealt round-robin
    over the batch's requests ('full+sfi-pinned': even requests full, odd ones
    sfi-pinned) -> (label, metadata or a list of them). A mixed row is what a served
    batch holds when requests choose their own policies: both decode paths in one
    step (graph variant `mixed`)."""
    if "+" not in text:
        return parse_policy(text)
    return text, [parse_policy(part)[1] for part in text.split("+")]


def members(pol) -> list:
    """The metadata of a row's requests, once each (stock: none)."""
    return [] if pol is None else list(pol) if isinstance(pol, list) else [pol]


def request_meta(pol, j: int):
    """Request j's metadata in a row (a mixed row deals its list round-robin)."""
    return pol[j % len(pol)] if isinstance(pol, list) else pol


def counted_policy(pol) -> tuple[str, float]:
    """The policy label whose counters describe a row, and every how many requests one
    carries it: a mixed row's first sparse member (its `full` requests count nothing
    sparse)."""
    ms = members(pol)
    if not ms:
        return "", 1
    name = next((m["policy"] for m in ms if m["policy"] != "full"), ms[0]["policy"])
    return name, len(ms) / sum(m["policy"] == name for m in ms)


def scrape(url):
    """sglang_sparse_* counters by (name, policy) from the server's /metrics."""
    try:
        return parse_metrics(requests.get(url + "/metrics", timeout=10).text)
    except requests.RequestException:
        return {}


STEP = "sglang_sparse_decode_step_duration_seconds"
FALLBACK = "sglang_sparse_dense_fallback_steps_total"
# Dense steps a sparse row should not have where it measures its policy: the server ran
# short of slots or the store's context. The others are the policies' own (asyncspade's
# first step, a budget that covers the sequence, an SFI selection not yet made).
UNPLANNED_FALLBACK = ("no_compact_slot", "no_store_slot", "context_exceeds_store")


def parse_metrics(text):
    """sglang_sparse_* counters by (name, policy), summed over the other labels; the
    kernel-compile counter by (name, "phase=<phase>"), the decode-forward one by
    (name, "path=<path>"); the prepare, Selector-run and lfps scored-fraction
    histograms' sum and count by (name, "")."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("sglang_sparse_decode_prepare_duration_seconds_",
                            "sglang_sparse_selector_refresh_duration_seconds_",
                            "sglang_sparse_lfps_scored_fraction_")) and ("_sum{" in line or "_count{" in line):
            key = (line.split("{", 1)[0], "")  # host time per decode forward; Selector runs; lfps's scored
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(STEP + "_bucket{"):
            # the decode-step period's histogram, summed over its mix labels
            _, kv, value = _sample(line)
            key = (STEP + "_bucket", kv["le"])
            out[key] = out.get(key, 0.0) + value
        elif line.startswith("sglang_sparse_") and "_total{" in line:
            name, kv, value = _sample(line)
            pol, phase, path = kv.get("policy", ""), kv.get("phase", ""), kv.get("path", "")
            key = (name, pol or (f"phase={phase}" if phase else f"path={path}" if path else ""))
            out[key] = out.get(key, 0.0) + value
            if name == FALLBACK and kv.get("reason", "") in UNPLANNED_FALLBACK:
                key = (FALLBACK + ":unplanned", pol)
                out[key] = out.get(key, 0.0) + value
    return out


def _sample(line: str) -> tuple[str, dict, float]:
    """`name{k="v",...} value` -> (name, {k: v}, value)."""
    name, rest = line.split("{", 1)
    labels, value = rest.rsplit("} ", 1)
    return name, {k: v.strip('"') for k, v in (x.split("=", 1) for x in labels.split(",") if "=" in x)}, float(value)


def step_quantiles(before, after, qs=(0.5, 0.99)):
    """The server's decode-step periods over a window (the histogram's difference),
    their quantiles in ms as Prometheus' histogram_quantile interpolates them, and
    the steps counted. Server side: at batch 32 and ~3 ms steps the client's streamed
    chunks come in bunches (session 49's per-request p99 was 24 ms where the median
    of the 32 requests' gaps, step by step, had a p99 of 6), so the per-request
    inter-token times overstate the slow tail there."""
    les = sorted((float(k[1]), after[k] - before.get(k, 0.0)) for k in after if k[0] == STEP + "_bucket")
    if not les or les[-1][1] <= 0:
        return {}
    total, out = les[-1][1], {"server_steps": int(les[-1][1])}
    for q in qs:
        rank, lo, below = q * total, 0.0, 0.0
        for le, cum in les:
            if cum >= rank:
                if le == float("inf"):  # past the last bound: that bound, as Prometheus does
                    value = lo
                else:
                    value = lo + (le - lo) * ((rank - below) / (cum - below) if cum > below else 1.0)
                out[f"server_step_ms_p{round(q * 100):d}"] = round(1e3 * value, 3)
                break
            lo, below = le, cum
    return out


def sparse_stats(before, after, policy):
    d = lambda n: after.get((n, policy), 0.0) - before.get((n, policy), 0.0)  # noqa: E731
    d0 = lambda n: after.get((n, ""), 0.0) - before.get((n, ""), 0.0)  # noqa: E731  (no policy label)
    steps = d("sglang_sparse_decode_steps_total")
    if not steps:
        return {}
    cached = d("sglang_sparse_cached_tokens_total")
    prep = "sglang_sparse_decode_prepare_duration_seconds_"
    forwards, prep_s = d0(prep + "count"), d0(prep + "sum")
    compiles = ("sglang_sparse_kernel_compiles_total", "phase=serving")
    scored = "sglang_sparse_lfps_scored_fraction_"
    # Selector runs (each one refresh before a decode step, with a fixed cost whatever
    # its rows) per decode forward, and the rows each refreshed.
    runs = d0("sglang_sparse_selector_refresh_duration_seconds_count")
    rows = d0("sglang_sparse_selector_refreshed_rows_total")
    fw = "sglang_sparse_decode_forwards_total"
    paths = {k[1]: after[k] - before.get(k, 0.0) for k in after if k[0] == fw}
    # kernel_balanced and the query-aware balanced twins (qa_<policy>_kernel_balanced)
    balanced = sum(v for k, v in paths.items() if k.endswith("kernel_balanced"))
    all_paths = sum(paths.values())
    return {"decode_steps": int(steps),  # request-steps: counted once per step whatever the TP size
            "slow_step_ratio": round(d("sglang_sparse_slow_steps_total") / steps, 4),
            "retention": round(d("sglang_sparse_attended_tokens_total") / cached, 4) if cached else None,
            # steps of the policy served dense (no store slot, a sequence past the store's
            # max_context, ...): a row measuring a sparse policy should have none (session
            # 21's first 512-token A/B left its 33024-position store after ~256 steps)
            "dense_fallback_share": round(d(FALLBACK) / steps, 4),
            "dense_fallback_unplanned_share": round(d(FALLBACK + ":unplanned") / steps, 4),
            "prepare_ms_per_step": round(1e3 * prep_s / forwards, 3) if forwards else None,
            "selector_runs_per_step": round(runs / forwards, 4) if forwards else None,
            "selector_rows_per_run": round(rows / runs, 2) if runs else None,
            # decode forwards on the balanced-splits graph (compact.balance_splits), and those
            # whose gate ran the balanced launch (the others: the plain one beside it)
            "balanced_forward_share": round(balanced / all_paths, 4) if all_paths else None,
            "balanced_launch_share": (round(d0("sglang_sparse_balanced_launches_total") / all_paths, 4)
                                      if all_paths else None),
            # SFI refresh shapes captured (each held its step): level off after the first batch
            "refresh_graph_captures": int(d0("sglang_sparse_refresh_graph_captures_total")),
            # Triton compiles during the row's timed batches (each stalled one): should be 0
            "compiles_while_serving": int(after.get(compiles, 0.0) - before.get(compiles, 0.0)),
            # lfps: positions scored exactly over those past the sinks, per finished request
            # (read a forward after each release: the previous batch's requests, mostly)
            "lfps_scored_fraction": round(d0(scored + "sum") / d0(scored + "count"), 4) if d0(scored + "count") else None,
            # the scheduler's decode-step periods over the timed batches (server side)
            **step_quantiles(before, after)}


#: quest/asyncspade/lfps requests that attend every key of check_greedy's prompts
#: (sink + budget + recent, or lfps's local window, >= length): the greedy ids of full.
QUERY_AWARE_COVERING = {
    "quest": {"policy": "quest", "recent": 1 << 20},
    "asyncspade": {"policy": "asyncspade", "recent": 1 << 20},
    "lfps": {"policy": "lfps", "local": 1 << 16},
}


def kv_pool_tokens(log_text: str) -> int | None:
    """The KV pool SGLang sized at start-up, read from its log (`max_total_num_tokens=N`,
    0.5.17 and 0.5.23 alike)."""
    found = re.findall(r"max_total_num_tokens=(\d+)", log_text)
    return int(found[-1]) if found else None


def pool_shortfall(pool: int | None, ctx: int, bs: int, out_len: int) -> int | None:
    """KV tokens a case's batch needs beyond the server's pool, else None. Such a batch
    runs in waves and its row is not the shape it names (a low --mem-fraction-static,
    or memory another process holds: session 55's stock server found 76552 tokens' room
    beside a stale server, where 8192 x 32 needs 278528)."""
    need = bs * (ctx + out_len)
    return need - pool if pool is not None and need > pool else None


class Server:
    """One SGLang server process (`--attention-backend backend`) and what it ran."""

    def __init__(self, a, spec: str, port: int, log: str, mem_fraction: float, max_tokens: int | None = None):
        base, env = split_env(spec)
        backend, config = split_backend(base)
        self.backend, self.url, self.log = backend, f"http://127.0.0.1:{port}", log
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--attention-backend", backend,
               "--skip-tokenizer-init", "--port", str(port), "--mem-fraction-static", str(mem_fraction),
               *(["--max-total-tokens", str(max_tokens)] if max_tokens else []), "--enable-metrics",
               "--disable-radix-cache", *graph_flags(a.extra, a.cases, a.graph_max_bs), *a.extra.split(),
               *(sparse_flags(a.sparse_extra, config) if backend == "sgl_sparse" else [])]
        self.res = {"backend": spec, "cmd": " ".join(cmd), "env": env, "cases": []}
        check_port_free(port)
        with open(log, "w") as lf:
            self.proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **env})
        self.policies = ([("stock", None)] if backend != "sgl_sparse"
                         else [parse_row(p) for p in a.policies.split(",")])

    def ready(self, a) -> None:
        self.res["ready_s"] = round(wait_ready(self.url, self.proc, a.ready_limit), 1)
        with open(self.log, errors="replace") as f:
            self.res["kv_pool_tokens"] = kv_pool_tokens(f.read())
        for ctx, bs in shapes(a.cases):
            if short := pool_shortfall(self.res["kv_pool_tokens"], ctx, bs, a.out_len):
                print(f"WARNING {self.res['backend']}: {ctx} x {bs} needs {short} KV tokens more than the pool's "
                      f"{self.res['kv_pool_tokens']}: its batches run in waves (another process on the GPU?)",
                      flush=True)

    def check_greedy(self, a) -> None:
        """Greedy outputs on fixed prompts (the same on every server: the rng is reseeded)."""
        url, rng, (lo, hi) = self.url, random.Random(0), token_range(a)
        gen(url, [rng.randrange(lo, hi) for _ in range(256)], 8)  # warm-up
        prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in (300, 1500, 4000, 777)]
        self.res["greedy"] = [gen(url, p, a.check_len)["output_ids"] for p in prompts]
        if self.backend == "sgl_sparse":  # a window covering every prompt must reproduce full
            self.res["greedy_window_covering"] = [
                gen(url, p, a.check_len, {"policy": "streaming", "window": 1 << 20})["output_ids"] for p in prompts]
            self.res["greedy_sfi_covering"] = [
                gen(url, p, a.check_len, {"policy": "sfi", "recent": 1 << 20})["output_ids"] for p in prompts]
            # a window shorter than every prompt: our kernel serves these rows, alone in
            # their batches (graph variant `kernel`, or `mixed` with
            # SGLANG_SPARSE_ROUTE_VARIANTS=0); compare across runs, not with full's ids
            self.res["greedy_window_256"] = [
                gen(url, p, a.check_len, {"policy": "streaming", "window": 256})["output_ids"] for p in prompts]
            # quest/asyncspade/lfps served with decode graphs replay the query-aware
            # graph variant; a request whose sink + budget + recent (lfps: local) covers
            # it must still reproduce full (FlashInfer planned into that variant's wrappers).
            for name, meta in QUERY_AWARE_COVERING.items():
                if not a.no_qa_covering and name in {m["policy"] for _, pol in self.policies for m in members(pol)}:
                    self.res[f"greedy_{name}_covering"] = [
                        gen(url, p, a.check_len, meta)["output_ids"] for p in prompts]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def base_case(base_cases: list[dict], c: dict) -> dict:
    """The first server's row that a later server's row `c` is compared with: the same
    context, batch and policy where the first server ran that policy (an A/B of two
    sgl_sparse servers over several policies), else its row at that context and batch
    (stock, which runs one row a case)."""
    same_shape = [b for b in base_cases if (b["ctx"], b["batch"]) == (c["ctx"], c["batch"])]
    return next((b for b in same_shape if b["policy"] == c["policy"]), same_shape[0])


def split_env(spec: str) -> tuple[str, dict[str, str]]:
    """'sgl_sparse@c.yaml+SGLANG_SPARSE_X=0' -> ('sgl_sparse@c.yaml', {'SGLANG_SPARSE_X': '0'}):
    the server's process gets those environment variables on top of this one's (an
    A/B of an operator switch in one run, each server labelled by its whole spec)."""
    base, *pairs = spec.split("+")
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"backend {spec!r}: '+{pair}' is not NAME=VALUE")
        env[name] = value
    return base, env


def split_backend(spec: str) -> tuple[str, str | None]:
    """'sgl_sparse@path.yaml' -> ('sgl_sparse', 'path.yaml'): a second sgl_sparse server
    of the same run with another --sparse-config (an A/B of a server-wide setting)."""
    backend, _, config = spec.partition("@")
    return backend, config or None


def shapes(cases: str) -> list[tuple[int, int]]:
    """--cases "CTXxBATCH,..." as (context, batch) pairs."""
    return [tuple(map(int, c.split("x"))) for c in cases.split(",")]


def sparse_flags(extra: str, config: str | None) -> list[str]:
    """--sparse-extra's flags, its --sparse-config replaced by `config` when given."""
    flags = extra.split()
    if config is None:
        return flags
    if "--sparse-config" in flags:
        i = flags.index("--sparse-config")
        return flags[:i] + ["--sparse-config", config] + flags[i + 2:]
    return flags + ["--sparse-config", config]


def store_shortfalls(config: dict | None, policies: str, cases: str, out_len: int) -> list[str]:
    """The query-aware stores of a --sparse-config too short for a run: a request whose
    prompt plus generated tokens pass ``query_aware.<policy>.max_context`` is served by
    the dense kernel from there on (reason context_exceeds_store), so its row would time
    stock attention under the policy's name (session 37: lfps at 130000 x 4 with a store
    of 130304 and 512 tokens out, 41% of its steps dense)."""
    longest = max(ctx for ctx, _ in shapes(cases)) + out_len
    stores = (config or {}).get("query_aware") or {}
    short = []
    for name in sorted({m["policy"] for p in policies.split(",") for m in members(parse_row(p)[1])}):
        limit = (stores.get(name) or {}).get("max_context")
        if limit is not None and int(limit) < longest:
            short.append(f"query_aware.{name}.max_context {limit} < {longest} (the longest case's prompt + --out-len)")
    return short


def check_stores(a) -> None:
    """Refuse a run whose sgl_sparse servers' --sparse-config stores are too short
    (store_shortfalls), before any server starts."""
    import yaml

    for spec in a.backends.split(","):
        backend, config = split_backend(split_env(spec)[0])
        if backend != "sgl_sparse":
            continue
        flags = sparse_flags(a.sparse_extra, config)
        if "--sparse-config" not in flags:
            continue
        path = flags[flags.index("--sparse-config") + 1]
        with open(path) as f:
            short = store_shortfalls(yaml.safe_load(f), a.policies, a.cases, a.out_len)
        if short:
            sys.exit(f"server_compare: {path}: " + "; ".join(short))


def log_name(spec: str) -> str:
    return "server-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in spec) + ".log"


def token_range(a) -> tuple[int, int]:
    lo, hi = map(int, a.token_range.split(","))
    return lo, hi


def case_prompts(a, case: str):
    """'CTXxBS' -> (ctx, bs, prompts): the same random token ids for every server."""
    ctx, bs = map(int, case.split("x"))
    rng, (lo, hi) = random.Random(f"case-{case}"), token_range(a)
    return ctx, bs, [[rng.randrange(lo, hi) for _ in range(ctx)] for _ in range(bs)]


def graph_flags(extra: str, cases: str, graph_max_bs: str) -> list[str]:
    """Both servers' decode-graph sizes: up to the largest batch the cases run
    (`--graph-max-bs auto`), unless the extra flags set them or it is `sglang` (its
    default list). A batch replays the graph of the smallest captured size that holds
    it whatever sizes follow, so the timed steps are the same; each server starts
    faster: SGLang's default 36 sizes took 78-91 s a server to capture at 32768 x 8
    (H200, session 54, ten variants a size on sgl_sparse), and three servers overran
    a 560 s call. Greedy checks send one request at a time (size 1, always captured)."""
    own = {"--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", "--cuda-graph-bs", "--cuda-graph-bs-decode",
           "--disable-cuda-graph", "--cuda-graph-backend-decode"}
    if graph_max_bs == "sglang" or own & set(extra.replace("=", " ").split()):
        return []
    if graph_max_bs == "auto":
        graph_max_bs = str(max(bs for _, bs in shapes(cases)))
    if not graph_max_bs.isdigit() or int(graph_max_bs) < 1:
        raise SystemExit(f"--graph-max-bs: 'auto', 'sglang' or a batch size >= 1, not {graph_max_bs!r}")
    # the flag's name since SGLang 0.5.17 (--cuda-graph-max-bs: its deprecated alias)
    return ["--cuda-graph-max-bs-decode", graph_max_bs]


def warm_requests(ctx: int, bs: int, extra: str) -> int:
    """Requests of a row's warm-up batch: enough that a prompt crosses a prefill chunk
    (--chunked-prefill-size, SGLang's default 8192), so the chunked prefill's kernels
    are built before the prefill-only timing. One request of 3072 tokens fits a chunk:
    the first full batch then built them, inside stock's prefill-only time (sessions
    50 and 51: `t_prefill_s` 9-11 s, the row's wall-clock figure lost)."""
    chunk = int(flag_value(extra, "--chunked-prefill-size", "8192"))
    return max(1, min(bs, chunk // ctx + 2)) if chunk > 0 else 1


def pool_tokens(a) -> int:
    """KV tokens an interleaved server needs: the largest case's prompts and outputs,
    10% and one 8K chunk of headroom (the greedy checks are smaller)."""
    need = max(bs * (ctx + a.out_len) for ctx, bs in shapes(a.cases))
    return int(need * 1.1) + 8192


def _timed_row(a, s, label, pol, ctx: int, bs: int, t1: float, walls: list, before: str, after: str) -> dict:
    """One (server, policy)'s row from its timed batches and the counters around them."""
    name, every = counted_policy(pol)
    stats = sparse_stats(before, after, name)
    if a.interleave:  # the host-time counter is per server: mixed over its policies here
        stats.pop("prepare_ms_per_step", None)
    if "decode_steps" in stats:  # 1.0: every decoded token of the timed batches counted once
        steps = a.repeats * bs * (a.out_len - 1) / every  # a mixed row: its requests of that policy
        stats["steps_per_decoded_token"] = round(stats["decode_steps"] / steps, 3)
    tl = statistics.median(walls)
    # None where a batch was not slower than its prefill alone: no decode time to divide by
    tok = lambda w: bs * (a.out_len - 1) / (w - t1) if w > t1 else None  # noqa: E731
    return {"ctx": ctx, "batch": bs, "policy": label, "sparse": pol, "out_len": a.out_len,
            "pool_shortfall": pool_shortfall(s.res.get("kv_pool_tokens"), ctx, bs, a.out_len),
            "t_prefill_s": round(t1, 3), "t_total_s": round(tl, 3), "t_total_runs_s": [round(w, 3) for w in walls],
            "decode_tok_s": tok(tl) and round(tok(tl), 1),
            "decode_tok_s_runs": [x and round(x, 1) for x in map(tok, walls)],
            **stats}


def _show(s, row: dict) -> None:
    shown = {k: v for k, v in row.items() if k != "itl_ms_trace"}  # the trace: JSON only
    print(json.dumps({"backend": s.backend, **shown}), flush=True)


def time_cases(a, servers: list) -> None:
    """Per case and (server, policy): the prefill-only wall time, then `repeats` timed
    batches; decode time = batch wall time - prefill-only wall time (median of the
    batches; each re-prefills: the radix cache is off). With several servers the
    timed batches alternate round by round (--interleave). Each row is printed (and
    kept) as soon as its timed batches are done, then again with its per-step
    latencies (--itl): a run its watchdog stops keeps the rows it finished (session
    33 lost a server's every row to the last one's ITL batch)."""
    for case in a.cases.split(","):
        ctx, bs, ps = case_prompts(a, case)
        runs = [(s, label, pol) for s in servers for label, pol in s.policies]
        t1, before, walls, rows = {}, {}, {}, {}
        for i, (s, label, pol) in enumerate(runs):
            batch_wall(s.url, ps[:warm_requests(ctx, bs, a.extra)], 2, pol)  # JIT / graph warm-up at this size
            t1[i] = min(batch_wall(s.url, ps, 1, pol) for _ in range(a.prefill_runs))
            walls[i] = []
        # Interleaved: round by round over every (server, policy); otherwise each one's
        # batches back to back, so the server's unlabelled host-time counter is its own.
        order = ([(k, i) for k in range(a.repeats) for i in range(len(runs))] if a.interleave
                 else [(k, i) for i in range(len(runs)) for k in range(a.repeats)])
        for k, i in order:
            s, label, pol = runs[i]
            if k == 0:  # the counters before this run's first timed batch (one scrape, not one per batch)
                before[i] = scrape(s.url)
            walls[i].append(batch_wall(s.url, ps, a.out_len, pol))
            if k == a.repeats - 1:
                # lfps's scored fractions are observed by a server thread once their copies
                # complete, just after the last responses (sgl_sparse/device_reads.py)
                time.sleep(0.2)
                rows[i] = _timed_row(a, s, label, pol, ctx, bs, t1[i], walls[i], before[i], scrape(s.url))
                s.res["cases"].append(rows[i])
                _show(s, rows[i])
        if a.itl:
            for i, (s, label, pol) in enumerate(runs):
                rows[i].update(itl_stats(s.url, ps, a.out_len, pol))
                _show(s, rows[i])


def run_servers(a) -> list:
    """One server at a time (the default), or all at once with alternating batches."""
    backends = a.backends.split(",")
    if not a.interleave:
        out = []
        for b in backends:
            s = Server(a, b, a.port, os.path.join(a.logdir, log_name(b)), 0.8)
            try:
                s.ready(a)
                s.check_greedy(a)
                time_cases(a, [s])
            finally:
                s.stop()
            out.append(s.res)
        return out
    servers = []
    try:
        for i, b in enumerate(backends):  # one after the other: each sizes its pool on what the others left
            servers.append(Server(a, b, a.port + i, os.path.join(a.logdir, log_name(b)), a.interleave_mem,
                                  pool_tokens(a)))
            servers[-1].ready(a)
        for s in servers:
            s.check_greedy(a)
        time_cases(a, servers)
    finally:
        for s in servers:
            s.stop()
    return [s.res for s in servers]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backends", default="flashinfer,sgl_sparse",
                    help="servers in order, the first the baseline; sgl_sparse@CONFIG: --sparse-config CONFIG")
    ap.add_argument("--cases", default="8192x8")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per row (median)")
    ap.add_argument("--policies", default="full,streaming:2048,sadas:2048",
                    help="sgl_sparse runs, name[:window][:knob=value]; A+B: a batch of both, dealt round-robin")
    ap.add_argument("--check-len", type=int, default=32)
    ap.add_argument("--prefill-runs", type=int, default=2,
                    help="prefill-only batches per row (their minimum is subtracted; 1 at 130000 x 4 saves ~26 s a row)")
    ap.add_argument("--no-qa-covering", action="store_true",
                    help="skip the covering quest/asyncspade/lfps greedy checks (they run before the timed batches)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--extra", default="--disable-prefill-cuda-graph")
    ap.add_argument("--sparse-extra", default="", help="extra flags for the sgl_sparse server only")
    ap.add_argument("--graph-max-bs", default="auto",
                    help="both servers' --cuda-graph-max-bs-decode: auto (the cases' largest batch), sglang (its "
                         "default sizes) or N; --extra's own graph flags win (graph_flags)")
    ap.add_argument("--ready-limit", type=float, default=480)
    ap.add_argument("--interleave", action="store_true",
                    help="both servers at once, timed batches alternating (see the module doc)")
    ap.add_argument("--interleave-mem", type=float, default=0.85,
                    help="--mem-fraction-static of each interleaved server, of the memory free when it starts "
                         "(its pool is capped by --max-total-tokens: pool_tokens)")
    ap.add_argument("--itl", action="store_true",
                    help="per row, one more batch with every request streamed: per-step latency mean/p50/p99 "
                         "client side (after the timed batches and the counters' scrape)")
    ap.add_argument("--token-range", default="1000,100000", help="random prompt ids in [LO, HI) (a small model: its vocab)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logdir", default="/tmp")
    a = ap.parse_args()
    check_stores(a)
    runs = run_servers(a)
    base = runs[0]
    summary = {"device": os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip(),
               "command": " ".join(sys.argv), "kv_cache_dtype": kv_cache_dtype(a.extra), "runs": runs, "compare": []}
    for r in runs[1:]:
        same = [x == y for x, y in zip(base["greedy"], r["greedy"])]
        covering = [x == y for x, y in zip(base["greedy"], r.get("greedy_window_covering", []))]
        sfi_covering = [x == y for x, y in zip(base["greedy"], r.get("greedy_sfi_covering", []))]
        qa_covering = {n: [x == y for x, y in zip(base["greedy"], r[f"greedy_{n}_covering"])]
                       for n in QUERY_AWARE_COVERING if f"greedy_{n}_covering" in r}
        rows = []
        for c in r["cases"]:
            st = base_case(base["cases"], c)
            ratio = lambda x, y: round(x / y, 3) if x and y else None  # noqa: E731
            row = {"ctx": c["ctx"], "batch": c["batch"], "policy": c["policy"], "stock_tok_s": st["decode_tok_s"],
                   "tok_s": c["decode_tok_s"], "ratio": ratio(c["decode_tok_s"], st["decode_tok_s"]),
                   "slow_step_ratio": c.get("slow_step_ratio"), "retention": c.get("retention"),
                   "dense_fallback_share": c.get("dense_fallback_share"),
                   "dense_fallback_unplanned_share": c.get("dense_fallback_unplanned_share"),
                   "pool_short": bool(c.get("pool_shortfall") or st.get("pool_shortfall"))}
            if c.get("server_step_ms_p99") and st.get("decode_tok_s"):
                # the slow tail server side against the first server's mean step (stock: batch / its tok/s)
                stock_step = 1e3 * c["batch"] / st["decode_tok_s"]
                row["server_step_ms"] = [c.get("server_step_ms_p50"), c["server_step_ms_p99"]]
                row["server_p99_over_stock_step"] = round(c["server_step_ms_p99"] / stock_step, 3)
            if c.get("itl_ms_mean") and st.get("itl_ms_mean"):  # --itl: per-step latency, client side
                row["itl_ratio"] = round(st["itl_ms_mean"] / c["itl_ms_mean"], 3)
                # the slow tail against a dense step at the same length (issue 4: <= 1.3)
                row["itl_p99_over_stock_p50"] = round(c["itl_ms_p99"] / st["itl_ms_p50"], 3)
                row["itl_bursts"] = c.get("itl_bursts")
                row["itl_fast_steps"] = c.get("itl_fast_steps")
            if a.interleave:  # round i of this policy ran right after round i of stock
                per = [ratio(x, y) for x, y in zip(c["decode_tok_s_runs"], st["decode_tok_s_runs"])]
                row["paired_ratios"] = per
                ok = [x for x in per if x is not None]
                row["paired_ratio"] = round(statistics.median(ok), 3) if ok else None
            rows.append(row)
        summary["compare"].append({"backend": r["backend"], "greedy_identical_full": same,
                                   "greedy_identical_window_covering": covering,
                                   "greedy_identical_sfi_covering": sfi_covering,
                                   **{f"greedy_identical_{n}_covering": v for n, v in qa_covering.items()},
                                   "rows": rows})
        print(f"\n{r['backend']} vs {base['backend']}: greedy identical (full) {same}; (window >= length) {covering}; "
              f"(sfi, budget + recent >= length) {sfi_covering}"
              + "".join(f"; ({n}, covering) {v}" for n, v in qa_covering.items()))
        print(f"| ctx x batch | policy | {base['backend']} tok/s | {r['backend']} tok/s | ratio | slow ratio | retention |"
              "\n|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['ctx']} x {row['batch']} | {row['policy']} | {row['stock_tok_s']} | {row['tok_s']} | "
                  f"{row['ratio']} | {row['slow_step_ratio']} | {row['retention']} |"
                  + (f" paired {row['paired_ratio']} {row['paired_ratios']}" if "paired_ratio" in row else "")
                  + (f" server step p50 / p99 {row['server_step_ms'][0]} / {row['server_step_ms'][1]} ms, "
                     f"p99 / base mean step {row['server_p99_over_stock_step']};" if "server_step_ms" in row else "")
                  + (f" itl ratio {row['itl_ratio']}, p99 / stock p50 {row['itl_p99_over_stock_p50']}"
                     if "itl_ratio" in row else "")
                  + (f"; slow bursts {b['bursts_per_100_steps']} / 100 steps, {b['burst_steps_mean']} steps each, "
                     f"ms by step {b['burst_ms_by_position']} (fast {b['fast_ms_p50']})"
                     if (b := row.get("itl_bursts")) and b.get("burst_steps_mean") else "")
                  + (f"; fast steps {f['fast_step_ms_p50']} ms ({f['fast_step_share']:.0%} of the steps)"
                     if (f := row.get("itl_fast_steps")) else "")
                  + (f" DENSE FALLBACK (no slot, or past the store) on {row['dense_fallback_unplanned_share']:.1%}"
                     " of its steps" if row.get("dense_fallback_unplanned_share") else "")
                  + (" POOL SHORT: a batch ran in waves, not this shape (pool_shortfall in the JSON)"
                     if row["pool_short"] else ""))
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
