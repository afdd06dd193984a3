"""dashboards/: generated from dashboards/generate.py, type-checked with `tsc --noEmit`
against Grafana's published @grafana/schema types (versions pinned in
dashboards/typecheck/package-lock.json; npm installs them on first use).

The PromQL of every panel is evaluated against a real Prometheus in
tests/test_metrics_e2e.py; here: the files, their variables and their types.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
TYPECHECK = DASHBOARDS / "typecheck"


def _load() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def test_committed_json_is_what_the_generator_writes():
    out = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(_load()) == {"sgl-sparse-overview.json", "sgl-sparse-policy.json"}


def test_variables_and_units():
    for name, d in _load().items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert list(variables) == ["datasource", "model_name", "policy"], name
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for panel in d["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            for t in panel["targets"]:
                # every sgl_sparse selector honours the model (and, where labelled, policy) filters
                for sel in re.findall(r"sglang_sparse_[a-z_]+\{([^}]*)\}", t["expr"]):
                    assert 'model_name=~"$model_name"' in sel, (panel["title"], t["expr"])


def test_metric_names_exist():
    """Only metrics this package exports (sgl_sparse/metrics.py) or SGLang's own."""
    source = (ROOT / "sgl_sparse" / "metrics.py").read_text()
    ours = set(re.findall(r'"(sglang_sparse_[a-z_]+)"', source))
    for name, d in _load().items():
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                for metric in re.findall(r"sglang_sparse_[a-z_]+", t["expr"]):
                    base = re.sub(r"_(bucket|sum|count)$", "", metric)
                    assert metric in ours or base in ours, (name, panel["title"], metric)


@pytest.fixture(scope="module")
def tsc() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        if os.environ.get("SGL_SPARSE_REQUIRE_NPM") == "1":
            raise RuntimeError("npm is required here (apt-get install npm)")
        pytest.skip("npm not installed")
    binary = TYPECHECK / "node_modules" / ".bin" / "tsc"
    if not binary.exists():
        out = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=TYPECHECK,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
    return binary


def test_dashboards_typecheck_against_grafana_schema(tsc, tmp_path):
    generated = TYPECHECK / "generated"
    shutil.rmtree(generated, ignore_errors=True)
    subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--typescript", str(generated)],
                   check=True, timeout=60)
    out = subprocess.run([str(tsc), "-p", str(TYPECHECK), "--pretty", "false"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert sorted(p.name for p in generated.glob("*.ts")) == ["sgl-sparse-overview.ts", "sgl-sparse-policy.ts"]


def test_typecheck_rejects_a_broken_dashboard(tsc):
    """The check has teeth: an unknown panel field and a wrong enum value fail."""
    generated = TYPECHECK / "generated"
    subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--typescript", str(generated)],
                   check=True, timeout=60)
    path = generated / "sgl-sparse-policy.ts"
    good = path.read_text()
    try:
        bad = good.replace('"drawStyle": "line"', '"drawStyle": "lines"', 1).replace(
            '"title": "Latency"', '"titel": "Latency"', 1)
        assert bad != good
        path.write_text(bad)
        out = subprocess.run([str(tsc), "-p", str(TYPECHECK), "--pretty", "false"], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode != 0
        assert "'\"lines\"' is not assignable" in out.stdout and "'\"titel\"' does not exist" in out.stdout, out.stdout
    finally:
        path.write_text(good)
