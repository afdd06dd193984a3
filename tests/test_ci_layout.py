"""CI runs the tests marked sglang_independent (tests/kernels and the modules that declare
the mark) under the first SGLang version only (.ci/run, tests/ci_legs.py): sound only
while importing them loads neither SGLang, nor the compatibility layer, nor a package
whose version differs between the SGLang versions, directly or through the modules they
test. (While they run, tests/ci_legs.py blocks those imports.)"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import importlib, json, sys
import pytest
sys.path.insert(0, ".")
from tests.ci_legs import blocked_modules, is_blocked
blocked = blocked_modules()
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except pytest.skip.Exception:  # a module that skips itself here (no promtool): imported up to there
        pass
print(json.dumps(sorted(m for m in sys.modules if is_blocked(m, blocked))))
"""


def _declares_mark(path: Path) -> bool:
    """A module-level `pytestmark` naming pytest.mark.sglang_independent."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return "sglang_independent" in ast.unparse(node.value)
    return False


def marked_modules() -> list[str]:
    files = sorted(ROOT.glob("tests/kernels/test_*.py")) + [p for p in sorted(ROOT.glob("tests/test_*.py"))
                                                             if _declares_mark(p)]
    return [p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in files]


def test_marked_tests_load_neither_sglang_nor_the_compat_layer():
    names = marked_modules()
    assert "tests.test_query_device" in names and "tests.kernels.test_plan_step" in names, names
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(names)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"the {len(names)} modules marked sglang_independent load {loaded[:5]}: " \
                         "unmark the module that does (.ci/run then runs it under every SGLang version)"


def test_the_guard_blocks_sglang_in_a_marked_test(tmp_path):
    """A marked test importing the compat layer (already loaded by then), or a Python
    subprocess of it (a server) doing so, fails; unmarked, the same test passes."""
    (tmp_path / "test_probe.py").write_text(
        "import subprocess, sys\n"
        "import pytest\n"
        "from sgl_sparse import plugin  # noqa: F401  (loads sgl_sparse.compat at collection)\n"
        "from tests.server import server_env\n"
        "MARK = pytest.mark.sglang_independent\n"
        "@MARK\n"
        "def test_compat():\n"
        "    from sgl_sparse import compat  # noqa: F401\n"
        "@MARK\n"
        "def test_plugin_again():\n"
        "    import sgl_sparse.plugin  # noqa: F401\n"
        "@MARK\n"
        "def test_subprocess():\n"
        "    subprocess.run([sys.executable, '-c', 'import sglang'], check=True)\n"
        "@MARK\n"
        "def test_server_env():\n"
        "    subprocess.run([sys.executable, '-c', 'import sgl_sparse.plugin'], env=server_env(), check=True)\n"
        "@MARK\n"
        "def test_harmless_subprocess():\n"
        "    subprocess.run([sys.executable, '-c', 'import torch'], env=server_env(), check=True)\n"
        "def test_unmarked():\n"
        "    from sgl_sparse import compat  # noqa: F401\n"
        "    subprocess.run([sys.executable, '-c', 'import sgl_sparse.compat'], env=server_env(), check=True)\n"
    )
    (tmp_path / "conftest.py").write_text(
        "from tests.ci_legs import (pytest_configure, pytest_runtest_call, pytest_runtest_setup,  # noqa: F401\n"
        "                           pytest_runtest_teardown)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    report = out.stdout
    for name in ("test_compat", "test_plugin_again", "test_subprocess", "test_server_env"):
        assert f"FAILED test_probe.py::{name} " in report or f"FAILED test_probe.py::{name}\n" in report, report[-4000:]
    for name in ("test_harmless_subprocess", "test_unmarked"):
        assert f"PASSED test_probe.py::{name}" in report, report[-4000:]
    assert "2 passed" in report and "4 failed" in report, report[-4000:]


def test_modules_starting_servers_are_not_marked():
    """Cheap static backstop: a module that starts SGLang is never marked."""
    for path in sorted(ROOT.glob("tests/test_*.py")):
        if _declares_mark(path):
            text = path.read_text()
            for needle in ("running_server", "launch_server", "sglang.", "server_env"):
                assert needle not in text, f"{path.name} is marked sglang_independent but mentions {needle}"
