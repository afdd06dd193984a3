"""pyflakes' errors (ruff's F rules: undefined names, unused imports and variables,
statements after a return) and syntax errors (E9) in the package, the kernels and the
tests. Session 53 found two assertions of tests/test_forked_runs.py stranded after a
helper's `return`, unreachable and naming variables of another function: this makes
that a failure. (bench/ is left out: its timing lambdas close over names deleted
after the timing, which pyflakes reads as undefined.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang_independent

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff not installed (the `test` extra; the CI install script installs it)")
    return [exe]


def test_no_pyflakes_errors():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "F,E9", "--output-format", "concise",
                          "sgl_sparse", "kernels", "tests", "sgl_sparse_entry.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_bench_scripts_import_nothing_unused():
    """bench/ under the rules its timing lambdas do not trip: unused imports, redefined
    and unused names, syntax errors (session 55 removed six unused imports there)."""
    out = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "F401,F811,F841,E9", "--output-format", "concise",
                          "bench"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
