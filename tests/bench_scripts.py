"""Import a benchmark script from bench/ as a module, for the tests that run its
--smoke or call its helpers. The scripts are not a package (each runs as
`python bench/<dir>/<name>.py`), so they are loaded from their files; their own
folder goes on sys.path first, as running them puts it there (their sibling
imports: `_bench_env`, `shapes`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(relpath: str) -> ModuleType:
    """``relpath`` under bench/ (e.g. "kernels/bench_decode.py"). Registered in
    sys.modules under its file's stem (dataclasses look their module up there)."""
    path = BENCH / relpath
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
