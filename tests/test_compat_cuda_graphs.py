"""compat.decode_cuda_graphs_enabled on real ServerArgs records of the installed
SGLang (0.5.17 resolves flags into cuda_graph_config; 0.5.23 may keep raw fields):
the query-aware policies are offered on CUDA only when decode graphs are off. Each flag
set is resolved in a process of its own, forked after one import of SGLang's server args
(tests/forked_runs.py)."""

from __future__ import annotations

import json

import pytest

from tests.forked_runs import Run, run_forked
from tests.tiny_model import make_tiny_qwen3

pytestmark = pytest.mark.timeout(300)

SNIPPET = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sgl_sparse import compat
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
sa = ServerArgs.from_cli_args(p.parse_args(["--model-path", sys.argv[1], "--device", "cpu", *sys.argv[2:]]))
if hasattr(sa, "resolve_once"):
    sa.resolve_once()
print(json.dumps(compat.decode_cuda_graphs_enabled(sa)))
"""


CASES = [
    ([], True),
    (["--disable-cuda-graph"], False),
    (["--cuda-graph-backend-decode", "disabled"], False),
]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """SNIPPET's output for each flag set of CASES, each run in its own directory."""
    model = make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2)
    runs = [Run(args=["-c", str(model), *flags], cwd=tmp_path_factory.mktemp("run"), code=SNIPPET)
            for flags, _ in CASES]
    return run_forked(runs, preload=["sglang.srt.server_args"])


@pytest.mark.parametrize("case", range(len(CASES)), ids=["default", "disable-cuda-graph", "backend-decode-disabled"])
def test_decode_cuda_graphs_enabled(resolved, case):
    out, (_, enabled) = resolved[case], CASES[case]
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is enabled
