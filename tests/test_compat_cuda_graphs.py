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


# Prefill CUDA graphs under sgl_sparse (plugin.server_args_input), on real ServerArgs of
# the installed release, for a CUDA device (resolution does not touch the GPU): the
# breakable graph (SGLang's CUDA default) is left as SGLang resolves it, a `full` prefill
# graph is turned off before resolution, SGLANG_SPARSE_PREFILL_CUDA_GRAPHS=0 turns any
# off; decode graphs stay as asked.
PREFILL_SNIPPET = r"""
import argparse, json, os, sys
if sys.argv[2] == "@opt-out":  # the operator's switch, set before the hooks run
    os.environ["SGLANG_SPARSE_PREFILL_CUDA_GRAPHS"] = "0"
    del sys.argv[2]
from sglang.srt.plugins import load_plugins
load_plugins()  # as launch_server does before it builds the record: this package's hooks
from sglang.srt.server_args import ServerArgs
from sgl_sparse import compat
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
sa = ServerArgs.from_cli_args(p.parse_args(["--model-path", sys.argv[1], *sys.argv[2:]]))
if hasattr(sa, "resolve_once"):
    sa.resolve_once()
print(json.dumps([compat.prefill_cuda_graphs_enabled(sa), compat.decode_cuda_graphs_enabled(sa),
                  compat.prefill_cuda_graph_backend(sa)]))
"""

CUDA_SPARSE = ["--device", "cuda", "--attention-backend", "sgl_sparse"]
# (flags, prefill graphs, decode graphs, the warning's words or None); None for prefill
# graphs: as SGLang resolves them for its own backend on this host (the control, case 0:
# on a machine without CUDA 0.5.17's default is not the breakable graph)
PREFILL_CASES = [
    (["--device", "cuda", "--attention-backend", "flashinfer"], None, True, None),
    (["--device", "cuda", "--attention-backend", "flashinfer", "--cuda-graph-backend-prefill", "breakable"],
     True, True, None),
    (CUDA_SPARSE, None, True, None),
    (CUDA_SPARSE + ["--cuda-graph-backend-prefill", "breakable"], True, True, None),
    (CUDA_SPARSE + ["--cuda-graph-backend-prefill", "full"], False, True, "captures attention itself"),
    (CUDA_SPARSE + ["--disable-prefill-cuda-graph"], False, True, None),
    (CUDA_SPARSE + ["--disable-cuda-graph"], False, False, None),
    (["@opt-out", *CUDA_SPARSE, "--cuda-graph-backend-prefill", "breakable"], False, True,
     "SGLANG_SPARSE_PREFILL_CUDA_GRAPHS=0: prefill runs eagerly"),
]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """SNIPPET's output for each flag set of CASES, then PREFILL_SNIPPET's for each of
    PREFILL_CASES, each run in its own directory (one SGLang import for all)."""
    model = make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2)
    runs = [Run(args=["-c", str(model), *flags], cwd=tmp_path_factory.mktemp("run"), code=code)
            for code, cases in ((SNIPPET, CASES), (PREFILL_SNIPPET, PREFILL_CASES)) for flags, *_ in cases]
    return run_forked(runs, preload=["sglang.srt.server_args"])


@pytest.mark.parametrize("case", range(len(CASES)), ids=["default", "disable-cuda-graph", "backend-decode-disabled"])
def test_decode_cuda_graphs_enabled(resolved, case):
    out, (_, enabled) = resolved[case], CASES[case]
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is enabled


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)),
                         ids=["stock-default", "stock-breakable-asked", "sparse-default", "sparse-breakable-asked",
                              "sparse-full-asked", "sparse-flag", "sparse-no-graphs", "sparse-opt-out"])
def test_prefill_cuda_graphs_under_sgl_sparse(resolved, case):
    out, (_, prefill, decode, warning) = resolved[len(CASES) + case], PREFILL_CASES[case]
    assert out.returncode == 0, out.stderr[-2000:]
    got_prefill, got_decode, backend = json.loads(out.stdout.strip().splitlines()[-1])
    if prefill is None:  # SGLang's own default on this host, the same under sgl_sparse as stock
        control = json.loads(resolved[len(CASES)].stdout.strip().splitlines()[-1])
        assert [got_prefill, backend] == [control[0], control[2]]
    else:
        assert got_prefill is prefill
    assert got_decode is decode
    if prefill is True:
        assert backend == "breakable"
    # Both of the plugin's prefill warnings say "prefill runs eagerly".
    assert ("prefill runs eagerly" in out.stderr) is (warning is not None)
    assert warning is None or warning in out.stderr


def test_attention_parallel_before_sglang_publishes_it():
    """Outside a launched server (nothing published in runtime_context) the model
    runner's own ranks; a bare object: one rank. Inside one, tests/
    test_tensor_parallel_e2e.py checks the published ranks through a TP-2 server."""
    from types import SimpleNamespace

    from sgl_sparse import compat

    runner = SimpleNamespace(ps=SimpleNamespace(tp_rank=1, tp_size=4, pp_rank=0))
    assert compat.attention_parallel(runner) == (1, 4, 0)
    assert compat.attention_parallel(SimpleNamespace()) == (0, 1, 0)



PRIORITY_SNIPPET = r"""
import json
import torch
from sglang.srt.distributed import parallel_state
from sgl_sparse import compat

seen = []

def recorder(self, graph_capture_context=None, stream=None):
    seen.append([graph_capture_context, stream])
    return "entered"

parallel_state.GroupCoordinator.graph_capture = recorder
# no CUDA stream can exist here: the stream class records the priority asked instead
torch.cuda.is_available = lambda: True
torch.cuda.Stream = lambda priority=0: ["stream", priority]
twice = compat.capture_graphs_at_high_priority() and compat.capture_graphs_at_high_priority()
wrapped = parallel_state.GroupCoordinator.graph_capture
out = dict(twice=twice, wraps_original=wrapped.__wrapped__ is recorder, result=wrapped(object()))
wrapped(object(), stream="theirs")
wrapped(object(), "context")
print(json.dumps(dict(out, seen=seen)))
"""


def test_graph_capture_at_high_priority_gives_sglangs_capture_a_high_priority_stream(tmp_path):
    """compat.capture_graphs_at_high_priority on the installed SGLang's own
    GroupCoordinator (in a process with the CPU stand-ins): where SGLang passes no
    stream (its decode graph runner) the capture gets one made at the highest priority
    (PyTorch maps -64 to its highest); a stream or context the caller passes is left
    alone; a second call does not wrap twice."""
    res, = run_forked([Run(args=[], cwd=str(tmp_path), code=PRIORITY_SNIPPET)],
                      preload=["sglang.srt.distributed.parallel_state"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["twice"] and out["wraps_original"] and out["result"] == "entered"
    assert out["seen"] == [[None, ["stream", -64]], [None, "theirs"], ["context", None]]


TAIL_HOOK_SNIPPET = r"""
import inspect, json, re
from types import SimpleNamespace
from sglang.srt.model_executor import model_runner
from sglang.srt.model_executor.runner import decode_cuda_graph_runner
from sgl_sparse import compat

runner_src = inspect.getsource(model_runner.ModelRunner.__init__)
capture_src = inspect.getsource(decode_cuda_graph_runner.DecodeCudaGraphRunner)
# run_once: `out = forward(...)`, then every capture tail hook with that output, then `return out`
m = re.search(r"out = forward\((?:.|\n)*?\)\n(?P<tail>(?:.|\n)*?)return out", capture_src)
calls_hooks = bool(m) and re.search(r"for (\w+) in self\.model_runner\.capture_tail_hooks:\s*\n\s*\1\(self, out,",
                                    m["tail"]) is not None
seen = []
r = SimpleNamespace(capture_tail_hooks=[])
added = compat.add_capture_tail_hook(r, lambda *a: seen.append(len(a)))
for hook in r.capture_tail_hooks:
    hook("runner", "out", "batch", 8)
print(json.dumps(dict(inits=bool(re.search(r"self\.capture_tail_hooks\s*=\s*\[\]", runner_src)),
                      calls_hooks=calls_hooks, added=added, seen=seen,
                      missing=compat.add_capture_tail_hook(SimpleNamespace(), print))))
"""


def test_capture_tail_hook_runs_after_the_captured_forward(tmp_path):
    """compat.add_capture_tail_hook against the installed SGLang: ModelRunner starts
    with an empty capture_tail_hooks list, and the decode graph runner's captured
    run_once calls each hook with the forward's output right after model.forward
    (where query_device joins asyncspade's side streams with
    SGLANG_SPARSE_ASPD_JOIN_AFTER_FORWARD=1); the hook added runs with SGLang's four
    arguments; a runner without the list gets nothing added."""
    res, = run_forked([Run(args=[], cwd=str(tmp_path), code=TAIL_HOOK_SNIPPET)],
                      preload=["sglang.srt.model_executor.model_runner"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == dict(inits=True, calls_hooks=True, added=True, seen=[4], missing=False)
