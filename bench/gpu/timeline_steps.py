"""Where a profile's slow steps go: a ``profile_decode.py --timeline`` CSV cut into
decode steps, and each step longer than ``--above`` times the median step broken
down by kernel.

A step ends with the LM head's GEMM (the one kernel a step launches once over the
whole batch on the main stream: ``--step-end``, a substring of its name). SFI's
bursts (session 32's ``slow_bursts``: a slow step, then the step carrying the
Selector's refresh) show up as two such steps every ``T_max + 1``.

    python3 bench/gpu/timeline_steps.py bench/results/profile_decode_h200_130000x4_fp8_sfi_pinned_timeline_s33.csv.gz
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import statistics
import sys
from typing import Iterable


def read_rows(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    rows.sort(key=lambda r: float(r["start_us"]))
    return rows


def cut_steps(rows: Iterable[dict], step_end: str) -> list[list[dict]]:
    """Kernels grouped into steps, each closed by a kernel whose name holds ``step_end``
    (kernels after the last one are dropped: a partial step)."""
    steps, cur = [], []
    for r in rows:
        cur.append(r)
        if step_end in r["name"]:
            steps.append(cur)
            cur = []
    return steps


def span_us(step: list[dict]) -> float:
    return max(float(r["start_us"]) + float(r["dur_us"]) for r in step) - float(step[0]["start_us"])


def breakdown(step: list[dict], top: int) -> list[dict]:
    """The step's kernels by total device time (names cut at 80 characters)."""
    ms, calls = collections.Counter(), collections.Counter()
    for r in step:
        ms[r["name"][:80]] += float(r["dur_us"]) / 1000
        calls[r["name"][:80]] += 1
    return [{"name": n, "ms": round(v, 3), "calls": calls[n]} for n, v in ms.most_common(top)]


def summarize(path: str, step_end: str, above: float, top: int) -> dict:
    steps = cut_steps(read_rows(path), step_end)
    if not steps:
        raise SystemExit(f"{path}: no kernel named like {step_end!r}: no step boundary (--step-end)")
    spans = [span_us(s) / 1000 for s in steps]
    median = statistics.median(spans)
    slow = []
    for i, (s, sp) in enumerate(zip(steps, spans)):
        if sp > above * median:
            busy = sum(float(r["dur_us"]) for r in s) / 1000
            slow.append({"step": i, "span_ms": round(sp, 3), "busy_ms": round(busy, 3),
                         "above_median_ms": round(sp - median, 3), "kernels": breakdown(s, top)})
    return {"timeline": path, "steps": len(steps), "median_step_ms": round(median, 3), "slow_steps": slow}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("timeline", help="profile_decode.py --timeline CSV (plain or .gz)")
    p.add_argument("--step-end", default="nvjet_sm90_tst_384x8", help="substring of the kernel closing a step")
    p.add_argument("--above", type=float, default=1.5, help="a slow step: span above this times the median")
    p.add_argument("--top", type=int, default=12, help="kernels listed per slow step")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    out = summarize(a.timeline, a.step_end, a.above, a.top)
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return
    print(f"{out['steps']} steps, median {out['median_step_ms']} ms")
    for s in out["slow_steps"]:
        print(f"step {s['step']}: span {s['span_ms']} ms ({s['above_median_ms']} above the median), "
              f"busy {s['busy_ms']} ms")
        for k in s["kernels"]:
            print(f"  {k['ms']:8.3f} ms  x{k['calls']:<4d} {k['name']}")


if __name__ == "__main__":
    main()
