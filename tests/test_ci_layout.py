"""CI runs tests/kernels under the first SGLang version only (.ci/run): sound only
while importing them loads neither SGLang nor the compatibility layer, directly or
through the modules they test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import glob, importlib, json, sys
sys.path.insert(0, ".")
for f in sorted(glob.glob("tests/kernels/test_*.py")):
    importlib.import_module(f[:-3].replace("/", "."))
print(json.dumps(sorted(m for m in sys.modules
                        if m == "sglang" or m.startswith("sglang.") or m == "sgl_sparse.compat")))
"""


def test_kernel_tests_load_neither_sglang_nor_the_compat_layer():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    loaded = json.loads(out)
    assert loaded == [], f"tests/kernels load {loaded[:5]}: run them under every SGLang version in .ci/run"
