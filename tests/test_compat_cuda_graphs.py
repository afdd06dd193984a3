"""compat.decode_cuda_graphs_enabled on real ServerArgs records of the installed
SGLang (0.5.17 resolves flags into cuda_graph_config; 0.5.23 may keep raw fields):
the query-aware policies are offered on CUDA only when decode graphs are off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server import server_env
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


@pytest.mark.parametrize("flags, enabled", [
    ([], True),
    (["--disable-cuda-graph"], False),
    (["--cuda-graph-backend-decode", "disabled"], False),
])
def test_decode_cuda_graphs_enabled(tmp_path, flags, enabled):
    model = make_tiny_qwen3(tmp_path / "m", seed=2)
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(model), *flags], env=server_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is enabled
