"""Task accuracy per policy and context length through a real SGLang server (sgl_sparse).

    # starts the server itself (GPU):
    python bench/quality/eval.py --model bench/quality/out/tiny-recall --launch \
        --lengths 2048,8192,16384,32768 --n 8 --out-json q.json --out-md q.md
    # or against a running server started with --attention-backend sgl_sparse --enable-metrics:
    python bench/quality/eval.py --model <ckpt> --url http://127.0.0.1:30000 ...

Each request is a tasks.py prompt sent as token ids to /generate (greedy) with the
policy in ``sampling_params.custom_params.sparse``; exact match (``tasks.answer_correct``)
= the output starts with "the code of KEY V" (plain) or does so right after the
generated ``</think>`` (think); the value V comes from a decode step, never the prefill.
Per row (policy x length) the server's sgl_sparse counters on /metrics are read
before and after, so mean retention (attended / cached tokens, token-weighted over
decode steps) and the slow-step ratio (slow / decode steps) are this row's alone:
rows run one after another. A policy the server rejects with HTTP 400 (e.g. not
implemented yet) is reported as not available, with the server's message.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import tasks  # noqa: E402

DEFAULT_POLICIES = ("full,sfi,sfi:budget=256:recent=64,sfi:prompt_evidence=every,"
                    "sfi:budget=256:recent=64:prompt_evidence=every,sfi:beta=1.0,sfi:beta=1.0:prompt_evidence=every,"
                    "sadas:window=64,sadas,streaming:window=64,"
                    "streaming:window=1024,asyncspade,lfps,quest")
DEFAULT_LENGTHS = "2048,8192,16384,32768"
DEFAULT_CONCURRENCY = 16  # requests in flight (sparse_config_eval.yaml sizes its store slots by it)
COUNTERS = ("attended_tokens", "cached_tokens", "decode_steps", "slow_steps")
_SAMPLE = re.compile(r"^(sglang_sparse_[a-z_]+)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class PolicySpec:
    """'sfi:budget=256:recent=64' -> name 'sfi', knobs {'budget': 256, 'recent': 64}."""

    label: str
    name: str
    knobs: tuple[tuple[str, Any], ...]

    @classmethod
    def parse(cls, text: str) -> "PolicySpec":
        name, *kv = text.strip().split(":")
        knobs = []
        for item in kv:
            k, v = item.split("=", 1)
            knobs.append((k, json.loads(v) if re.fullmatch(r"-?[0-9.eE+-]+|true|false", v) else v))
        return cls(text.strip(), name, tuple(knobs))

    def metadata(self) -> dict:
        return {"policy": self.name, **dict(self.knobs)}


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{counter: {policy: value}} for the sgl_sparse counters (summed over model_name)."""
    out: dict[str, dict[str, float]] = {c: {} for c in COUNTERS}
    text = requests.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        short = name[len("sglang_sparse_"):].removesuffix("_total")
        if short not in out:
            continue
        pol = re.search(r'policy="([^"]*)"', labels or "")
        key = pol.group(1) if pol else ""
        out[short][key] = out[short].get(key, 0.0) + float(value)
    return out


def _diff(after: dict, before: dict, counter: str, policy: str) -> float:
    return after[counter].get(policy, 0.0) - before[counter].get(policy, 0.0)


def generate(url: str, ids: list[int], spec: PolicySpec, max_new_tokens: int) -> requests.Response:
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0,
          "custom_params": {"sparse": spec.metadata()}}
    return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=3600)


def examples_for(length: int, depths: Sequence[float], variants: Sequence[str], n: int,
                 seed: int) -> list[tasks.Example]:
    """n examples per (variant, depth) cell at prompt length `length` (deterministic)."""
    return [tasks.make_example(length, d, v, seed + i) for v in variants for d in depths for i in range(n)]


def failure_record(ex: tasks.Example, output_ids: Sequence[int], tail: int = 30) -> dict:
    """What a failing example looked like: enough to tell, without re-running, whether
    the model closed the think block, restated the right key, and which value it gave
    (the fact's, another fact's, or none)."""
    out = list(output_ids)
    end = tasks.ID[tasks.END_THINK]
    key = ex.prompt[ex.fact_pos]
    after = out[out.index(end) + 1:] if end in out else out
    prefix = tasks.answer_prefix(key)
    # the token right after the restated "the code of KEY"-shaped prefix, if any
    given = after[len(prefix)] if len(after) > len(prefix) and after[:len(prefix) - 1] == prefix[:-1] else None
    where = [i for i, t in enumerate(ex.prompt) if given is not None and t == given]
    return {
        "variant": ex.variant, "depth": round(ex.depth, 3), "distance": ex.distance,
        "prompt_tail": tasks.decode(ex.prompt[-tail:]),
        "output": tasks.decode(out),
        "expected": tasks.decode(ex.completion),
        "emitted_end_think": end in out,
        "restated_key": after[:len(prefix)] == prefix,  # "the code of KEY" with the asked key
        "value_given": tasks.decode([given]) if given is not None else None,
        # tokens from the prompt's end back to the given value's last occurrence (None:
        # not in the prompt): another fact's value, and how far back the policy reached
        "value_distance": len(ex.prompt) - where[-1] if where else None,
    }


def pick_failures(failed: list[tuple[tasks.Example, list[int]]], n: int) -> list[dict]:
    """Up to n failure records, taken round-robin over the (variant, depth) cells so a
    row whose plain and think prompts both fail shows both (examples are variant-major)."""
    cells: dict[tuple[str, float], list] = {}
    for ex, out in failed:
        # realized depths scatter by a few hundredths around the requested one
        cells.setdefault((ex.variant, round(ex.depth, 1)), []).append((ex, out))
    picked, queues = [], list(cells.values())
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(failure_record(*q.pop(0)))
    return picked


def run_row(url: str, spec: PolicySpec, length: int, exs: list[tasks.Example],
            concurrency: int, dump_failures: int = 0) -> dict:
    before = scrape(url)
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        resps = list(pool.map(lambda e: generate(url, e.prompt, spec, len(e.completion) + 4), exs))
    wall = time.monotonic() - t0
    bad = [r for r in resps if r.status_code != 200]
    if bad:
        return {"policy": spec.label, "length": length, "status": bad[0].status_code,
                "error": bad[0].text[:500]}
    time.sleep(1.0)  # metrics are flushed by the scheduler process shortly after the step
    after = scrape(url)
    hits, by_cell, failed, summaries = [], {}, [], []
    for ex, r in zip(exs, resps):
        body = r.json()
        out_ids = body["output_ids"]
        summaries.append(request_summary(body))
        ok = tasks.answer_correct(ex, out_ids)
        hits.append(ok)
        if not ok:
            failed.append((ex, out_ids))
        cell = by_cell.setdefault(f"{ex.variant}@{round(ex.depth, 2)}", [])
        cell.append(ok)
    att, cac = (_diff(after, before, c, spec.name) for c in ("attended_tokens", "cached_tokens"))
    steps, slow = (_diff(after, before, c, spec.name) for c in ("decode_steps", "slow_steps"))
    row = {
        "policy": spec.label, "length": length, "status": 200, "n": len(exs),
        "accuracy": sum(hits) / len(hits),
        "by_variant": {v: _mean([h for e, h in zip(exs, hits) if e.variant == v])
                       for v in dict.fromkeys(e.variant for e in exs)},
        "by_cell": {k: _mean(v) for k, v in sorted(by_cell.items())},
        "retention": att / cac if cac else None,
        "slow_ratio": slow / steps if steps else None,
        "decode_steps": steps, "wall_s": wall,
        # per variant, from each response's meta_info["sgl_sparse"] (the /metrics counters
        # above mix the variants of a row; a long answer's retention is not a short one's)
        "by_variant_stats": {v: variant_stats([s for e, s in zip(exs, summaries) if e.variant == v])
                             for v in dict.fromkeys(e.variant for e in exs)},
    }
    if dump_failures:
        row["failures"] = pick_failures(failed, dump_failures)
    return row


def request_summary(body: dict) -> Optional[dict]:
    """The request's sgl_sparse summary (README "Per request"): policy, decode_steps,
    slow_step_ratio, mean_retention; None where the response has none."""
    got = (body.get("meta_info") or {}).get("sgl_sparse") or []
    got = [x for x in got if isinstance(x, dict)]
    return got[-1] if got else None


def variant_stats(summaries: Sequence[Optional[dict]]) -> dict:
    """Decode-step-weighted mean retention and slow-step ratio over requests (within a
    row every prompt has the same length, so this is the token-weighted mean of the
    /metrics counters up to the few completion tokens), and the mean decode steps per
    request; None where no request carried a summary."""
    got = [s for s in summaries if s and s.get("decode_steps")]
    steps = sum(s["decode_steps"] for s in got)

    def weighted(key: str) -> Optional[float]:
        have = [s for s in got if s.get(key) is not None]
        n = sum(s["decode_steps"] for s in have)
        return sum(s[key] * s["decode_steps"] for s in have) / n if n else None

    return {"requests": len(got), "decode_steps_mean": steps / len(got) if got else None,
            "retention": weighted("mean_retention"), "slow_ratio": weighted("slow_step_ratio")}


def _mean(xs: Sequence[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def evaluate(url: str, policies: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
             variants: Sequence[str] = ("plain", "think"), n: int = 4, seed: int = 1000,
             concurrency: int = 8, log=print, dump_failures: int = 0) -> dict:
    rows, errors, not_available = [], [], {}
    specs = [PolicySpec.parse(p) for p in policies]
    for length in lengths:
        exs = examples_for(length, depths, variants, n, seed)
        for spec in specs:
            if spec.label in not_available:
                continue
            row = run_row(url, spec, length, exs, concurrency, dump_failures)
            if row["status"] == 400:
                not_available[spec.label] = row["error"]
                log(f"{spec.label}: not available ({row['error'][:160]})")
                continue
            if row["status"] != 200:  # keep going: one failing row must not lose the others
                errors.append(row)
                log(f"{length:6d} {spec.label}: HTTP {row['status']}: {row['error'][:300]}")
                continue
            rows.append(row)
            per = {v: _fmt(st["retention"]) for v, st in row["by_variant_stats"].items()}
            log(f"{length:6d} {spec.label:28s} acc {row['accuracy']:.3f} {row['by_variant']} "
                f"retention {_fmt(row['retention'])} slow {_fmt(row['slow_ratio'])} ({row['wall_s']:.1f}s)"
                + (f" retention by variant {per}" if len(per) > 1 else ""))
    return {"rows": rows, "errors": errors, "not_available": not_available,
            "settings": {"policies": list(policies), "lengths": list(lengths), "depths": list(depths),
                         "variants": list(variants), "n_per_cell": n, "seed": seed}}


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(result: dict, title: str = "") -> str:
    lengths = result["settings"]["lengths"]
    labels = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    cell = {(r["policy"], r["length"]): r for r in result["rows"]}
    lines = [title, ""] if title else []
    variants = result["settings"].get("variants", ["plain", "think"])
    lines += [f"Exact match ({' / '.join(variants)}) · mean retention · slow-step ratio, per context length.", "",
              "| policy | " + " | ".join(f"{l}" for l in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for p in labels:
        parts = []
        for l in lengths:
            r = cell.get((p, l))
            if r is None:
                parts.append("-")
                continue
            bv = " / ".join(f"{v:.2f}" for v in r["by_variant"].values())
            parts.append(f"**{r['accuracy']:.2f}** ({bv}) · ret {_fmt(r['retention'])} · slow {_fmt(r['slow_ratio'])}")
        lines.append(f"| `{p}` | " + " | ".join(parts) + " |")
    for r in result.get("errors", []):
        lines.append(f"| `{r['policy']}` | error at {r['length']}: HTTP {r['status']} |" + " |" * (len(lengths) - 1))
    for p, why in result["not_available"].items():
        lines.append(f"| `{p}` | not available: {why[:120].strip()} |" + " |" * (len(lengths) - 1))
    per_variant = [r for r in result["rows"] if any(st.get("requests") for st in r.get("by_variant_stats", {}).values())]
    if per_variant:
        lines += ["", "Per variant: exact match · mean retention · slow-step ratio · decode steps per request "
                  "(from each response's `meta_info[\"sgl_sparse\"]`, decode-step weighted).", "",
                  "| policy | length | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
        for r in per_variant:
            parts = []
            for v in variants:
                st, acc = r["by_variant_stats"].get(v), r["by_variant"].get(v)
                if acc is None:
                    parts.append("-")
                    continue
                if not st or not st.get("requests"):  # no response carried a summary
                    parts.append(f"{acc:.2f} · -")
                    continue
                steps = st["decode_steps_mean"]
                parts.append(f"{acc:.2f} · ret {_fmt(st['retention'])} · slow {_fmt(st['slow_ratio'])} · "
                             f"{'-' if steps is None else f'{steps:.1f}'} steps")
            lines.append(f"| `{r['policy']}` | {r['length']} | " + " | ".join(parts) + " |")
    s = result["settings"]
    lines += ["", f"n = {s['n_per_cell']} per (variant, depth) cell; depths {s['depths']}; "
              f"variants {s['variants']}; greedy; prompts sent as token ids."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, context: int, extra: Sequence[str], log_path: Path, timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """Start sglang.launch_server with sgl_sparse in its own process group; wait for /health."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--attention-backend", "sgl_sparse", "--enable-metrics", "--host", "127.0.0.1",
           "--port", str(port), "--context-length", str(context), *extra]
    log = open(log_path, "w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)
    stop(proc)
    raise RuntimeError(f"server not healthy after {timeout}s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL to the server's own process group (pgid == its pid)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint (for --launch and the record)")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running sgl_sparse server started with --enable-metrics")
    where.add_argument("--launch", action="store_true", help="start the server here")
    ap.add_argument("--server-args", default="--dtype bfloat16 --disable-prefill-cuda-graph",
                    help="extra launch_server flags (with --launch)")
    ap.add_argument("--server-log", default="eval_server.log")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--variants", default="plain,think",
                    help=f"comma-separated, from {','.join(tasks.VARIANTS)} (think-long: a 47-token think block)")
    ap.add_argument("--n", type=int, default=8, help="examples per (variant, depth) cell")
    ap.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--dump-failures", type=int, default=0, metavar="N",
                    help="save up to N failing examples per row (prompt tail, output, expected answer) "
                         "in the JSON's rows[].failures (default 0: none)")
    ap.add_argument("--out-json")
    ap.add_argument("--out-md")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    proc = None
    url = a.url
    if a.launch:
        proc, url = launch(a.model, max(lengths) + 64, a.server_args.split(), Path(a.server_log))
    try:
        res = evaluate(url, a.policies.split(","), lengths, [float(x) for x in a.depths.split(",")],
                       a.variants.split(","), a.n, a.seed, a.concurrency, dump_failures=a.dump_failures)
    finally:
        if proc is not None:
            stop(proc)
    res["model"] = a.model
    meta = Path(a.model) / "train_meta.json"
    if meta.exists():
        res["train_meta"] = json.loads(meta.read_text())
    md = markdown(res, f"Task accuracy through SGLang `sgl_sparse` (model {a.model}; synthetic recall task, tiny model trained by train_tiny.py)")
    report.emit(res, md, a.out_json, a.out_md)


if __name__ == "__main__":
    main()
