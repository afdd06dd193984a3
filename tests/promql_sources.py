"""Every PromQL expression the project ships: dashboards/*.json and deploy/prometheus.

Used by tests/test_metrics_e2e.py to evaluate each one against a real Prometheus.
Expressions are returned in the form they can be evaluated outside Grafana / the
rule engine:

* dashboards: Grafana's template variables replaced (`$model_name`, `$policy` ->
  `.*`, i.e. "All"; `$__rate_interval` -> a fixed window); a variable's
  `label_values(metric, label)` becomes `count by (label) (metric)`;
* alert rules: `bool` added to every comparison, so an alert that is not firing
  still returns its 0/1 series (the point is that the expression computes on the
  real metrics, not that the alert fires on a tiny CPU server).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
RULES = ROOT / "deploy" / "prometheus" / "sgl-sparse-rules.yaml"

_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$", re.S)
_COMPARISON = re.compile(r"(>=|<=|==|!=|>|<)")


def substitute(expr: str, rate_interval: str) -> str:
    expr = expr.replace("$__rate_interval", rate_interval)
    return expr.replace("$model_name", ".*").replace("$policy", ".*")


def with_bool(expr: str) -> str:
    """`a > 0.5` -> `a > bool 0.5`, outside label matchers and strings."""
    out, depth, quote, i = [], 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(expr[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
            out.append(c)
        elif c == "{":
            depth += 1
            out.append(c)
        elif c == "}":
            depth -= 1
            out.append(c)
        elif depth == 0 and (m := _COMPARISON.match(expr, i)) and not expr[i:].startswith("=~"):
            op = m.group(1)
            out.append(op)
            i += len(op)
            if not re.match(r"\s*bool\b", expr[i:]):
                out.append(" bool")
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def dashboard_exprs(rate_interval: str = "1m") -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target and query variable of dashboards/*.json."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())
        for var in d.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = _LABEL_VALUES.match(q.strip())
            assert m, f"{path.name} variable {var['name']}: not label_values(metric, label): {q}"
            yield (f"{path.name} variable {var['name']}",
                   substitute(f"count by ({m.group(2)}) ({m.group(1)})", rate_interval))
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                yield f"{path.name} panel {panel['title']!r} {t['refId']}", substitute(t["expr"], rate_interval)


def rule_exprs() -> Iterator[tuple[str, str]]:
    """(where, expr) for every recording rule (as is) and alert (comparisons as bool)."""
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                yield f"record {rule['record']}", rule["expr"]
            else:
                yield f"alert {rule['alert']}", with_bool(rule["expr"])


def recorded_names() -> list[str]:
    return [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r]
