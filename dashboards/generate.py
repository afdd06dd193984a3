#!/usr/bin/env python3
"""The Grafana dashboards of sgl_sparse: the one source of dashboards/*.json.

    python dashboards/generate.py            write dashboards/*.json
    python dashboards/generate.py --check    exit 1 if a committed JSON differs from this file
    python dashboards/generate.py --typescript DIR
                                             also write DIR/<name>.ts: each dashboard as a
                                             TypeScript literal typed with Grafana's published
                                             @grafana/schema types, for `tsc --noEmit`
                                             (dashboards/typecheck/, tests/test_dashboards.py)

Plain Python, no dashboard library: panels are a few dicts, and every PromQL
expression in them is evaluated against a real Prometheus scraping a real server
by tests/test_metrics_e2e.py. Metric names: README "Metrics" (sglang_sparse_*)
and SGLang's own `sglang:*` (labels model_name, ...). After editing, run this
script and deploy/sync_chart_files.sh (the Helm chart ships copies).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model_name=~"$model_name"'
PSEL = 'model_name=~"$model_name", policy=~"$policy"'
RATE = "$__rate_interval"


def sglang(name: str, sel: str = SEL) -> str:
    """A selector for SGLang's own `sglang:<name>` metric. Prometheus stores it as
    `sglang_<name>` when it negotiates OpenMetrics 1.0 with prometheus-client (which
    then escapes the colon; Prometheus 2.x does), as `sglang:<name>` otherwise: match both."""
    return f'{{__name__=~"sglang[:_]{name}", {sel}}}'

Json = dict[str, Any]


# ---- building blocks ---------------------------------------------------------------
def target(expr: str, legend: str, ref: str) -> Json:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "range": True, "refId": ref}


def timeseries(title: str, description: str, exprs: list[tuple[str, str]], unit: str,
               *, w: int = 12, h: int = 8, min_: float | None = 0, max_: float | None = None) -> Json:
    defaults: Json = {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                               "showPoints": "never", "spanNulls": False}}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["mean", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(exprs)],
    }


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}}


def layout(panels: list[Json]) -> list[Json]:
    """Left to right, top to bottom; rows span the width. Ids in order."""
    x = y = line_h = 0
    for i, p in enumerate(panels, start=1):
        g = p["gridPos"]
        if p["type"] == "row" or x + g["w"] > 24:
            x, y, line_h = 0, y + line_h, 0
        g["x"], g["y"] = x, y
        p["id"] = i
        if p["type"] == "row":
            y += g["h"]
            continue
        x += g["w"]
        line_h = max(line_h, g["h"])
    return panels


def variables(with_policy: bool) -> list[Json]:
    def query_var(name: str, label: str, query: str) -> Json:
        return {
            "type": "query", "name": name, "label": label, "datasource": DS,
            "query": {"qryType": 1, "query": query, "refId": f"{name}-var"},
            "refresh": 2, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": ["All"], "value": ["$__all"]}, "sort": 1,
            "options": [], "hide": 0,
        }

    out = [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "hide": 0, "options": [], "refresh": 1, "regex": ""},
        query_var("model_name", "Model", "label_values(sglang_sparse_decode_steps_total, model_name)"),
    ]
    if with_policy:
        out.append(query_var("policy", "Policy",
                             f'label_values(sglang_sparse_decode_steps_total{{{SEL}}}, policy)'))
    return out


def dashboard(uid: str, title: str, description: str, panels: list[Json], with_policy: bool = True) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["sglang", "sgl-sparse"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": variables(with_policy)},
        "annotations": {"list": []},
        "links": [{"title": "sgl_sparse dashboards", "type": "dashboards", "tags": ["sgl-sparse"],
                   "asDropdown": True, "includeVars": True, "keepTime": True, "icon": "external link",
                   "targetBlank": False, "tooltip": ""}],
        "panels": layout(panels),
    }


def per_policy_ratio(num: str, den: str) -> str:
    return (f"sum by (policy) (rate({num}{{{PSEL}}}[{RATE}]))\n"
            f"  / sum by (policy) (rate({den}{{{PSEL}}}[{RATE}]))")


def quantile(q: float, metric: str, by: str, sel: str = PSEL) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{RATE}])))"


# ---- the dashboards -------------------------------------------------------------------
def overview() -> Json:
    panels = [
        row("Throughput and latency"),
        timeseries("Generated tokens / s (SGLang)", "All requests of the server: rate of sglang:generation_tokens_total.",
                   [(f"sum by (model_name) (rate({sglang('generation_tokens_total')}[{RATE}]))", "{{model_name}}")],
                   "tps"),
        timeseries("Decode tokens / s by policy",
                   "Request decode steps per second (one generated token each), by the request's policy.",
                   [(f"sum by (policy) (rate(sglang_sparse_decode_steps_total{{{PSEL}}}[{RATE}]))", "{{policy}}")],
                   "tps"),
        timeseries("TPOT p50 / p90 by policy",
                   "Per finished request: (finish - first token) / (output tokens - 1), by policy.",
                   [(quantile(0.5, "sglang_sparse_time_per_output_token_seconds", "policy"), "p50 {{policy}}"),
                    (quantile(0.9, "sglang_sparse_time_per_output_token_seconds", "policy"), "p90 {{policy}}")],
                   "s"),
        timeseries("Decode step period p90 by batch mix",
                   "Host time between consecutive decode forwards, by the batch's policies: only full, only "
                   "sparse, or mixed. SGLang's inter-token latency p90 for reference.",
                   [(quantile(0.9, "sglang_sparse_decode_step_duration_seconds", "mix", SEL), "p90 {{mix}}"),
                    (f"histogram_quantile(0.9, sum by (le) (rate({sglang('inter_token_latency_seconds_bucket')}[{RATE}])))",
                     "p90 inter-token latency (SGLang)")],
                   "s"),
        row("What the policies do"),
        timeseries("Slow-step ratio by policy",
                   "Share of decode steps that ran dense to refresh the selection (SFI).",
                   [(per_policy_ratio("sglang_sparse_slow_steps_total", "sglang_sparse_decode_steps_total"), "{{policy}}")],
                   "percentunit", max_=1),
        timeseries("Retention by policy",
                   "Tokens attended / tokens in cache, token-weighted over all decode steps.",
                   [(per_policy_ratio("sglang_sparse_attended_tokens_total", "sglang_sparse_cached_tokens_total"), "{{policy}}")],
                   "percentunit", max_=1),
        timeseries("Dense fallbacks / s by policy and reason",
                   "Decode steps of a sparse policy served by the dense kernel, and why.",
                   [(f"sum by (policy, reason) (rate(sglang_sparse_dense_fallback_steps_total{{{PSEL}}}[{RATE}]))",
                     "{{policy}}: {{reason}}")],
                   "ops"),
        timeseries("Rejected requests / s by reason",
                   "HTTP 400 for invalid custom_params.sparse metadata, by the field at fault.",
                   [(f"sum by (reason) (rate(sglang_sparse_rejected_requests_total{{{SEL}}}[{RATE}]))", "{{reason}}")],
                   "reqps"),
        row("Queue and memory"),
        timeseries("Requests running / queued (SGLang)", "sglang:num_running_reqs and sglang:num_queue_reqs.",
                   [(f"sum by (model_name) ({sglang('num_running_reqs')})", "running {{model_name}}"),
                    (f"sum by (model_name) ({sglang('num_queue_reqs')})", "queued {{model_name}}")],
                   "short", w=8),
        timeseries("Requests with sgl_sparse state by policy", "sglang_sparse_active_requests.",
                   [(f"sum by (policy) (sglang_sparse_active_requests{{{PSEL}}})", "{{policy}}")],
                   "short", w=8),
        timeseries("KV cache usage (SGLang)", "sglang:token_usage: share of the KV pool in use.",
                   [(f"max by (model_name) ({sglang('token_usage')})", "{{model_name}}")],
                   "percentunit", w=8, max_=1),
        row("Kernels"),
        timeseries("Kernel compiles by phase",
                   "Triton compiles of sgl_sparse's kernels: startup (warm-ups, graph capture) or serving "
                   "(a decode batch waited for it, 0.3-1 s; the server log names the kernel).",
                   [(f"sum by (phase) (increase(sglang_sparse_kernel_compiles_total{{{SEL}}}[{RATE}]))", "{{phase}}")],
                   "short", w=8, h=6),
        timeseries("Decode forwards / s by attention path",
                   "dense: FlashInfer alone; kernel: sgl_sparse's kernel alone; kernel_balanced: the kernel "
                   "with balanced splits (SFI slow rows beside fast ones; all-slow long rows over fp8); "
                   "mixed: both; qa: both "
                   "with the query-aware blocks; qa_<policy>: both with that policy's blocks alone; "
                   "qa*_kernel: those blocks with the kernel alone (every row indexed); reference: the CPU path.",
                   [(f"sum by (path) (rate(sglang_sparse_decode_forwards_total{{{SEL}}}[{RATE}]))", "{{path}}")],
                   "ops", w=8, h=6),
        timeseries("Balanced launches / s",
                   "kernel_balanced forwards, and those whose device gate ran the balanced launch (a slow row "
                   "among fast ones); the others ran the plain launch beside it (SGLANG_SPARSE_BALANCE_GATE).",
                   [(f"sum (rate(sglang_sparse_decode_forwards_total{{{SEL},path=\"kernel_balanced\"}}[{RATE}]))",
                     "kernel_balanced forwards"),
                    (f"sum (rate(sglang_sparse_balanced_launches_total{{{SEL}}}[{RATE}]))", "balanced launch ran")],
                   "ops", w=8, h=6),
        timeseries("SFI refresh graph captures",
                   "New refresh shapes captured into CUDA graphs; the decode step of each waited for it "
                   "(an eager run plus the capture). A steady rate means shapes churn past the 256 kept.",
                   [(f"sum by (model_name) (increase(sglang_sparse_refresh_graph_captures_total{{{SEL}}}[{RATE}]))",
                     "{{model_name}}")],
                   "short", w=8, h=6),
    ]
    return dashboard("sgl-sparse-overview", "sgl_sparse / Overview",
                     "Throughput, TPOT, slow-step ratio and retention by policy; SGLang queue and KV usage.", panels)


def policy_drilldown() -> Json:
    panels = [
        row("Latency"),
        timeseries("TPOT quantiles",
                   "Per finished request: (finish - first token) / (output tokens - 1).",
                   [(quantile(q, "sglang_sparse_time_per_output_token_seconds", "policy"), f"p{round(q * 100)} {{{{policy}}}}")
                    for q in (0.5, 0.9, 0.99)],
                   "s"),
        timeseries("Mean TPOT", "sum / count of sglang_sparse_time_per_output_token_seconds.",
                   [(per_policy_ratio("sglang_sparse_time_per_output_token_seconds_sum",
                                      "sglang_sparse_time_per_output_token_seconds_count"), "{{policy}}")],
                   "s"),
        row("Sparsity"),
        timeseries("Retention: token-weighted and per request",
                   "Tokens attended / in cache over all steps; and the median over finished requests of "
                   "their mean retention.",
                   [(per_policy_ratio("sglang_sparse_attended_tokens_total", "sglang_sparse_cached_tokens_total"),
                     "token-weighted {{policy}}"),
                    (quantile(0.5, "sglang_sparse_request_retention_ratio", "policy"), "request median {{policy}}")],
                   "percentunit", max_=1),
        timeseries("Slow-step ratio", "Slow steps / decode steps.",
                   [(per_policy_ratio("sglang_sparse_slow_steps_total", "sglang_sparse_decode_steps_total"), "{{policy}}")],
                   "percentunit", max_=1),
        timeseries("Dense fallback ratio by reason",
                   "Share of the policy's decode steps served by the dense kernel, by reason.",
                   [(f"sum by (policy, reason) (rate(sglang_sparse_dense_fallback_steps_total{{{PSEL}}}[{RATE}]))\n"
                     f"  / on (policy) group_left sum by (policy) (rate(sglang_sparse_decode_steps_total{{{PSEL}}}[{RATE}]))",
                     "{{policy}}: {{reason}}")],
                   "percentunit", max_=1),
        timeseries("Decode steps / s", "Request decode steps per second.",
                   [(f"sum by (policy) (rate(sglang_sparse_decode_steps_total{{{PSEL}}}[{RATE}]))", "{{policy}}")],
                   "ops"),
        timeseries("Backend host time per decode forward",
                   "Host time sgl_sparse spends preparing one decode forward (admission, SFI refresh launches, "
                   "routing, FlashInfer's plan): when it exceeds the step's GPU work, the GPU waits.",
                   [(quantile(q, "sglang_sparse_decode_prepare_duration_seconds", "model_name", SEL),
                     f"p{round(q * 100)}") for q in (0.5, 0.99)],
                   "s"),
        row("SFI Selector and compact buffers"),
        timeseries("Selector refresh latency",
                   "One refresh of the compact buffers (all layers, all rows due) before a decode step.",
                   [(quantile(q, "sglang_sparse_selector_refresh_duration_seconds", "model_name", SEL),
                     f"p{round(q * 100)}") for q in (0.5, 0.99)],
                   "s", w=8),
        timeseries("Selector rows and runs / s",
                   "Rows whose compact buffer was refreshed, and Selector runs (each refreshes every row due "
                   "before one decode step). A run has a fixed cost whatever its rows (~2.6 ms of host time "
                   "at one row on an H100): many runs of few rows (sentence triggers scattered over the "
                   "batch, a large refresh_groups) cost more per row than one run for many.",
                   [(f"sum by (model_name) (rate(sglang_sparse_selector_refreshed_rows_total{{{SEL}}}[{RATE}]))",
                     "rows {{model_name}}"),
                    (f"sum by (model_name) (rate(sglang_sparse_selector_refresh_duration_seconds_count{{{SEL}}}[{RATE}]))",
                     "runs {{model_name}}")],
                   "ops", w=8),
        timeseries("Compact buffer memory", "Bytes of compact slots held by live sfi requests, of all reserved.",
                   [(f"sum by (model_name) (sglang_sparse_compact_buffer_in_use_bytes{{{SEL}}})", "in use {{model_name}}"),
                    (f"sum by (model_name) (sglang_sparse_compact_buffer_capacity_bytes{{{SEL}}})", "capacity {{model_name}}")],
                   "bytes", w=8),
        timeseries("Query-aware store memory",
                   "Bytes reserved at start-up for each query-aware policy's per-request store "
                   "(asyncspade's int8 index keys included), taken out of SGLang's KV pool budget.",
                   [(f"sum by (policy, model_name) (sglang_sparse_query_store_capacity_bytes{{{PSEL}}})",
                     "{{policy}} {{model_name}}")],
                   "bytes", w=8),
        timeseries("lfps: share of positions scored exactly",
                   "Per finished lfps request: positions scored exactly (its candidates C1) over the positions "
                   "past the sinks, summed over its sparse decode steps, layers and KV heads (the LFPS "
                   "paper's Table 4). What lfps's selection reads besides its score tables.",
                   [(quantile(q, "sglang_sparse_lfps_scored_fraction", "model_name", SEL), f"p{round(q * 100)}")
                    for q in (0.5, 0.9)],
                   "percentunit", w=8, max_=1),
    ]
    return dashboard("sgl-sparse-policy", "sgl_sparse / Policy drill-down",
                     "One or more policies in detail: TPOT, retention, slow steps, fallbacks, Selector, compact buffers.",
                     panels)


DASHBOARDS = {"sgl-sparse-overview": overview, "sgl-sparse-policy": policy_drilldown}


def render(d: Json) -> str:
    return json.dumps(d, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---- TypeScript for tsc --noEmit ---------------------------------------------------------
_TS_HEADER = """\
// Generated by dashboards/generate.py --typescript: do not edit.
import type { Dashboard, DataQuery, FieldConfig, Panel, RowPanel } from '@grafana/schema';
import type {
  FieldConfig as TimeSeriesFieldConfig,
  Options as TimeSeriesOptions,
} from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

// A schema type as it reads in JSON: string enums (GraphDrawStyle, SortOrder, ...)
// become the union of their values; every other type, optional field and excess
// property check is kept.
type AsJson<T> = T extends string ? `${T}` : T extends object ? { [K in keyof T]: AsJson<T[K]> } : T;

// Panel.targets is Record<string, unknown> in the dashboard schema: pin the
// Prometheus query fields Grafana's Prometheus data source reads.
type PromQuery = AsJson<DataQuery> & {
  expr: string;
  legendFormat?: string;
  range?: boolean;
};
// Panel with its options and field config typed by the timeseries panel's schema.
type TimeSeriesPanel = Omit<Panel, 'type' | 'options' | 'fieldConfig' | 'targets'> & {
  type: 'timeseries';
  options: AsJson<TimeSeriesOptions>;
  fieldConfig: {
    defaults: AsJson<FieldConfig & { custom?: TimeSeriesFieldConfig }>;
    overrides: [];
  };
  targets: PromQuery[];
};
"""


def typescript(name: str, d: Json) -> str:
    lines = [_TS_HEADER]
    refs = []
    for p in d["panels"]:
        var = f"panel{p['id']}"
        kind = "RowPanel" if p["type"] == "row" else "TimeSeriesPanel"
        # A fresh object literal per panel: tsc checks excess properties against its type.
        lines.append(f"const {var}: {kind} = {json.dumps(p, indent=2, sort_keys=True)};\n")
        refs.append(var)
    body = json.dumps({**d, "panels": "__PANELS__"}, indent=2, sort_keys=True)
    body = body.replace('"__PANELS__"', f"[{', '.join(refs)}]")
    lines.append(f"export const dashboard: AsJson<Dashboard> = {body};\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--typescript", metavar="DIR", type=Path)
    args = ap.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        d = build()
        path = HERE / f"{name}.json"
        text = render(d)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
        if args.typescript:
            args.typescript.mkdir(parents=True, exist_ok=True)
            (args.typescript / f"{name}.ts").write_text(typescript(name, d))
    if stale:
        print("stale (run dashboards/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
