"""Every operator switch the code reads (``env_switch`` / ``env_count`` / ``env_value``
in ``kernels/`` and ``sgl_sparse/``) has a row in the README's "Environment switches"
table with the code's default, and the table names no switch the code no longer reads:
an operator reading the README finds every knob, and only real ones."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.sglang_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
READERS = ("env_switch", "env_count", "env_value")


def _code_switches() -> dict[str, set]:
    """name -> the defaults its calls give (``on`` / ``off`` / a count; ``None`` for an
    ``env_value`` read, whose default is the code's own logic)."""
    found: dict[str, set] = {}
    for path in sorted((ROOT / "kernels").rglob("*.py")) + sorted((ROOT / "sgl_sparse").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in READERS and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            if path.name == "_utils.py" and path.parent.name == "kernels":
                continue  # the readers themselves
            defaults = found.setdefault(node.args[0].value, set())
            if getattr(node.func, "id", getattr(node.func, "attr", None)) == "env_value":
                defaults.add(None)
            elif len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                value = node.args[1].value
                defaults.add(("on" if value else "off") if isinstance(value, bool) else str(value))
    return found


def _readme_table() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Environment switches", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `SGLANG_SPARSE_([A-Z0-9_]+)` \| ([^|]+) \|", section, re.M)
    assert rows, "the README's environment switches table is empty"
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), "a switch listed twice"
    return {name: default.strip() for name, default in rows}


def test_every_switch_is_documented_with_its_default():
    code, table = _code_switches(), _readme_table()
    assert len(code) >= 20, sorted(code)  # the scan found the switches at all
    assert sorted(set(code) - set(table)) == [], "switches read by the code, missing from the README"
    assert sorted(set(table) - set(code)) == [], "README rows for switches the code does not read"
    checked = 0
    for name, defaults in code.items():
        if None in defaults:  # read raw first (TOPK_HIST_FROM_SCORES): its row says what unset means
            continue
        assert len(defaults) == 1, (name, defaults)  # one default wherever it is read
        assert table[name] == next(iter(defaults)), (name, table[name], defaults)
        checked += 1
    # the ones read raw, whose default is the code's own choice: each row says what unset means
    assert sorted(n for n, d in code.items() if None in d) == ["BALANCE_ONE_GRID", "TOPK_HIST_FROM_SCORES"]
    assert checked == len(code) - 2
