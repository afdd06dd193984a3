"""Per-policy aggregation, thresholds and the end-of-run summary.

Locust keeps its own statistics (the custom TTFT/TPOT/E2E entries, CSV/HTML), but
they are bucketed and mix all request types in one failure ratio. This keeps the
raw samples per policy so that percentiles are exact, the error rate counts
requests only, and expected rejections and client aborts are counted apart.
Worker processes (``--processes``) ship their samples to the master with
``drain()``/``merge()``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from .mix import Threshold


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: Sequence[float]) -> dict[str, Optional[float]]:
    return {
        "n": len(values),
        "mean": (sum(values) / len(values)) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


@dataclass
class PolicySamples:
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    by_scenario: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "completed": self.completed, "failed": self.failed, "aborted": self.aborted,
            "by_scenario": dict(self.by_scenario), "failures": dict(self.failures),
        }

    def merge(self, d: dict[str, Any]) -> None:
        self.ttft_ms += d["ttft_ms"]
        self.tpot_ms += d["tpot_ms"]
        self.e2e_ms += d["e2e_ms"]
        self.prompt_tokens += d["prompt_tokens"]
        self.output_tokens += d["output_tokens"]
        self.completed += d["completed"]
        self.failed += d["failed"]
        self.aborted += d["aborted"]
        self.by_scenario.update(d["by_scenario"])
        self.failures.update(d["failures"])


class Results:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.policies: dict[str, PolicySamples] = {}
        # invalid-metadata case label -> how it was answered ("HTTP 400", "in-stream 400")
        self.rejections: dict[str, Counter] = {}
        # invalid metadata that was not answered with 400: always an error
        self.not_rejected: dict[str, Counter] = {}
        # scenario -> [completed requests, prompt tokens, output tokens]: shows the
        # lengths the server actually saw against the configured targets
        self.lengths: dict[str, list[int]] = {}

    def _p(self, label: str) -> PolicySamples:
        return self.policies.setdefault(label, PolicySamples())

    # ---- recording --------------------------------------------------------------
    def completed(self, label: str, scenario: str, *, ttft_ms: float, tpot_ms: Optional[float],
                  e2e_ms: float, prompt_tokens: Optional[int], output_tokens: int) -> None:
        p = self._p(label)
        p.completed += 1
        p.by_scenario[scenario] += 1
        p.ttft_ms.append(ttft_ms)
        if tpot_ms is not None:
            p.tpot_ms.append(tpot_ms)
        p.e2e_ms.append(e2e_ms)
        if prompt_tokens is not None:
            p.prompt_tokens.append(prompt_tokens)
        p.output_tokens += output_tokens
        n = self.lengths.setdefault(scenario, [0, 0, 0])
        n[0] += 1
        n[1] += prompt_tokens or 0
        n[2] += output_tokens

    def failed(self, label: str, scenario: str, reason: str) -> None:
        p = self._p(label)
        p.failed += 1
        p.by_scenario[scenario] += 1
        p.failures[reason[:200]] += 1

    def aborted(self, label: str, scenario: str, output_tokens: int) -> None:
        p = self._p(label)
        p.aborted += 1
        p.by_scenario[scenario] += 1
        p.output_tokens += output_tokens

    def rejected(self, case: str, how: str) -> None:
        self.rejections.setdefault(case, Counter())[how] += 1

    def accepted_invalid(self, case: str, what: str) -> None:
        self.not_rejected.setdefault(case, Counter())[what[:200]] += 1

    # ---- distributed runs -------------------------------------------------------
    def drain(self) -> dict[str, Any]:
        """Everything recorded since the last drain, as JSON-able data; then empty."""
        data = {
            "policies": {k: v.to_json() for k, v in self.policies.items()},
            "rejections": {k: dict(v) for k, v in self.rejections.items()},
            "not_rejected": {k: dict(v) for k, v in self.not_rejected.items()},
            "lengths": self.lengths,
        }
        self.clear()
        return data

    def merge(self, data: dict[str, Any]) -> None:
        for label, d in data.get("policies", {}).items():
            self._p(label).merge(d)
        for case, c in data.get("rejections", {}).items():
            self.rejections.setdefault(case, Counter()).update(c)
        for case, c in data.get("not_rejected", {}).items():
            self.not_rejected.setdefault(case, Counter()).update(c)
        for scenario, n in data.get("lengths", {}).items():
            mine = self.lengths.setdefault(scenario, [0, 0, 0])
            for i, v in enumerate(n):
                mine[i] += v

    # ---- summary ----------------------------------------------------------------
    def totals(self) -> dict[str, int]:
        ps = self.policies.values()
        rejected = sum(sum(c.values()) for c in self.rejections.values())
        not_rejected = sum(sum(c.values()) for c in self.not_rejected.values())
        completed = sum(p.completed for p in ps)
        failed = sum(p.failed for p in ps)
        aborted = sum(p.aborted for p in ps)
        return {
            "requests": completed + failed + aborted + rejected + not_rejected,
            "completed": completed, "failed": failed, "aborted": aborted,
            "rejected_as_expected": rejected, "invalid_not_rejected": not_rejected,
            "errors": failed + not_rejected,
        }

    def error_rate(self) -> float:
        t = self.totals()
        return t["errors"] / t["requests"] if t["requests"] else 0.0

    def summary(self, duration_s: float, order: Iterable[str] = ()) -> dict[str, Any]:
        labels = [x for x in order if x in self.policies] + sorted(set(self.policies) - set(order))
        policies = {}
        for label in labels:
            p = self.policies[label]
            tpot = _dist(p.tpot_ms)
            policies[label] = {
                "completed": p.completed, "failed": p.failed, "aborted": p.aborted,
                "by_scenario": dict(sorted(p.by_scenario.items())),
                "ttft_ms": _dist(p.ttft_ms), "tpot_ms": tpot, "e2e_ms": _dist(p.e2e_ms),
                "prompt_tokens_mean": (sum(p.prompt_tokens) / len(p.prompt_tokens)) if p.prompt_tokens else None,
                "output_tokens": p.output_tokens,
                # aggregate rate of this policy's traffic over the run ...
                "output_tokens_per_s": p.output_tokens / duration_s if duration_s > 0 else None,
                # ... and one request's decode speed at the median
                "decode_tokens_per_s_p50": (1e3 / tpot["p50"]) if tpot["p50"] else None,
                "failures": dict(p.failures.most_common()),
            }
        return {
            "duration_s": duration_s,
            "totals": self.totals(),
            "error_rate": self.error_rate(),
            "policies": policies,
            "rejections": {k: dict(v) for k, v in sorted(self.rejections.items())},
            "invalid_not_rejected": {k: dict(v) for k, v in sorted(self.not_rejected.items())},
            "scenario_lengths": {
                s: {"completed": n, "prompt_tokens_mean": pt / n, "output_tokens_mean": ot / n}
                for s, (n, pt, ot) in sorted(self.lengths.items()) if n
            },
        }


def check_thresholds(summary: dict[str, Any], labels: Sequence[str], *, max_error_rate: Optional[float],
                     tpot_p50: Threshold, tpot_p95: Threshold, ttft_p95: Threshold) -> list[str]:
    """Human-readable violations; empty when every given threshold holds."""
    out: list[str] = []
    if max_error_rate is not None and summary["error_rate"] > max_error_rate:
        t = summary["totals"]
        out.append(f"error rate {summary['error_rate']:.4f} ({t['errors']}/{t['requests']}) > {max_error_rate}")
    checks = (("tpot_ms", "p50", tpot_p50, "TPOT"), ("tpot_ms", "p95", tpot_p95, "TPOT"),
              ("ttft_ms", "p95", ttft_p95, "TTFT"))
    for label in labels:
        for key, q, threshold, what in checks:
            limit = threshold.for_label(label)
            if limit is None:
                continue
            value = summary["policies"].get(label, {}).get(key, {}).get(q)
            if value is None:
                out.append(f"{label}: no {what} samples to check {q} <= {limit:g} ms against")
            elif value > limit:
                out.append(f"{label}: {what} {q} {value:.1f} ms > {limit:g} ms")
    return out


def _fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(summary: dict[str, Any]) -> str:
    head = ("policy", "ok", "fail", "abort", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95",
            "E2E p50", "prompt tok", "out tok/s", "decode tok/s")
    rows = [head]
    for label, p in summary["policies"].items():
        rows.append((
            label, str(p["completed"]), str(p["failed"]), str(p["aborted"]),
            _fmt(p["ttft_ms"]["p50"]), _fmt(p["ttft_ms"]["p95"]),
            _fmt(p["tpot_ms"]["p50"], ".2f"), _fmt(p["tpot_ms"]["p95"], ".2f"),
            _fmt(p["e2e_ms"]["p50"]), _fmt(p["prompt_tokens_mean"], ".0f"),
            _fmt(p["output_tokens_per_s"]), _fmt(p["decode_tokens_per_s_p50"]),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    t = summary["totals"]
    lines.append("")
    lines.append(
        f"requests {t['requests']} in {summary['duration_s']:.1f}s: completed {t['completed']}, "
        f"client-aborted {t['aborted']}, rejected as expected {t['rejected_as_expected']}, "
        f"errors {t['errors']} (error rate {summary['error_rate']:.4f}); times in ms"
    )
    if summary["scenario_lengths"]:
        lines.append("  mean tokens of completed requests: " + "; ".join(
            f"{s} {v['prompt_tokens_mean']:.0f} in / {v['output_tokens_mean']:.0f} out"
            for s, v in summary["scenario_lengths"].items()))
    for case, how in summary["rejections"].items():
        lines.append(f"  invalid {case}: " + ", ".join(f"{k} x{v}" for k, v in sorted(how.items())))
    for case, what in summary["invalid_not_rejected"].items():
        lines.append(f"  NOT REJECTED {case}: " + ", ".join(f"{k} x{v}" for k, v in what.items()))
    for label, p in summary["policies"].items():
        for reason, n in p["failures"].items():
            lines.append(f"  FAILED {label}: {reason} x{n}")
    return "\n".join(lines)
