"""deploy/prometheus rules, checked and unit-tested with the real promtool
(Debian package `prometheus`; .ci/run installs it and requires it)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

if PROMTOOL is None:
    if os.environ.get("SGL_SPARSE_REQUIRE_PROMTOOL") == "1":
        raise RuntimeError("promtool is required here (apt-get install prometheus)")
    pytest.skip("promtool not installed (Debian package 'prometheus')", allow_module_level=True)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_rules_are_valid():
    out = _promtool("check", "rules", "sgl-sparse-rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 21 rules found" in out.stdout


def test_rule_unit_tests_pass():
    out = _promtool("test", "rules", "sgl-sparse-rules.test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
