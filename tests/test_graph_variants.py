"""Decode CUDA graphs per batch size and attention paths (sgl_sparse/graph_variants.py).

On CPU no graph can be captured, so this checks the parts that decide which graph a
forward replays, against the installed SGLang:
- SparseState.step_query_aware(_policies): the query-aware policies of the batch set up last;
- the hooks on the real DecodeCudaGraphRunner: capture_one_shape runs once per variant
  (the query-aware blocks first) under keys that differ by our label, and
  _resolve_lora_variant appends the label of the variant the backend set up
  (tests/test_route_variants.py: how the backend chooses it);
- the signatures and FlashInfer attribute the hooks rely on (drift between SGLang
  releases fails here, not on a GPU).
Stand-ins (test only): the SparseAttnBackend of a CUDA server (it builds SGLang's
FlashInfer backend, which cannot exist on a CPU machine) is a namespace with the three
members the hooks use; its FlashInfer backend, a dict of per-size wrappers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sgl_sparse.policies import PolicyId
from tests.server import server_env
from tests.test_query_device import HKV, LENS, Twin

SNIPPET = r"""
import contextlib, inspect, json
from types import SimpleNamespace
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sgl_sparse import graph_variants
from sgl_sparse.backend import SparseAttnBackend

out = {}
cap = list(inspect.signature(DecodeCudaGraphRunner.capture_one_shape).parameters)
out["capture_params"] = cap[:5]
out["resolve_params"] = list(inspect.signature(DecodeCudaGraphRunner._resolve_lora_variant).parameters)
src = inspect.getsource(FlashInferAttnBackend)
out["flashinfer_per_size_wrappers"] = ("self.decode_cuda_graph_metadata = {}" in src
                                       and "self.decode_cuda_graph_metadata[bs] = decode_wrappers" in src)

# the hooks on the real runner class, its own _resolve_lora_variant as `original`
runner = object.__new__(DecodeCudaGraphRunner)
runner.record_nolora_graph = False
step = {"qa": False}
seen = []

@contextlib.contextmanager
def capturing(qa):
    seen.append(("enter", qa))
    yield
    seen.append(("exit", qa))

VARIANTS = ("qa", "mixed", "dense", "kernel")
step = {"variant": "mixed"}
runner.attn_backend = SimpleNamespace(graph_variants=VARIANTS, capturing_graph_variant=capturing,
                                      step_graph_variant=lambda: step["variant"])
keys = []
def original(r, size, forward, stream_idx=None, variant_label=None, *rest):
    keys.append([size, stream_idx, variant_label, list(seen[-1])])
graph_variants.capture_one_shape(original, runner, 8, None, None, None)
graph_variants.capture_one_shape(original, runner, 4, None, stream_idx=None, variant_label="lora")
out["captured"] = keys
fb = SimpleNamespace(lora_ids=None)
out["resolved"] = []
for v in VARIANTS:
    step["variant"] = v
    out["resolved"].append(graph_variants.resolve_variant(DecodeCudaGraphRunner._resolve_lora_variant, runner, fb))
runner.attn_backend.graph_variants = ()  # a server capturing one graph per size: untouched
out["resolved_off"] = graph_variants.resolve_variant(DecodeCudaGraphRunner._resolve_lora_variant, runner, fb)

# the backend's FlashInfer wrappers per (variant, size): remembered after a capture,
# put back before a replay's plan
be = object.__new__(SparseAttnBackend)
be.dense = SimpleNamespace(decode_cuda_graph_metadata={})
be._dense_graph_wrappers = {}
for v in ("qa", "mixed"):
    be.dense.decode_cuda_graph_metadata[8] = f"wrappers-{v}"  # FlashInfer's capture makes new wrappers
    be.keep_dense_graph_wrappers(8, v)
installed = []
for v in ("qa", "mixed", "qa"):
    be.use_dense_graph_wrappers(8, v)
    installed.append(be.dense.decode_cuda_graph_metadata[8])
out["installed"] = installed
print(json.dumps(out))
"""


def test_step_query_aware_follows_the_batch():
    twin = Twin(group=2, use_kernels=False)
    gen = torch.Generator().manual_seed(0)
    st = twin.st
    assert not st.step_query_aware()  # nothing live yet
    twin.admit(torch.randn(sum(LENS.values()), HKV * 2, 16, generator=gen).half())
    assert st.step_query_aware()  # live quest/asyncspade/lfps rows, no batch set up yet
    full_row, quest_row, lfps_row = 7, 1, 6
    assert st.step_query_aware_policies() == {PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS}
    aspd_row = 4
    Q, A, L = PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS
    for rows, want in (([full_row], set()), ([full_row, quest_row], {Q}), ([lfps_row], {L}),
                       ([quest_row, aspd_row, full_row], {Q, A}), ([full_row, 11], set())):  # 11: no request
        st.set_step_rows(rows, [LENS.get(r, 1) + 1 for r in rows], [[] for _ in rows])
        assert st.step_query_aware() is bool(want), rows
        assert st.step_query_aware_policies() == want, rows
        assert st.step_query_aware_policies() == want  # read, not taken: the runner and the backend both ask


@pytest.mark.timeout(300)
def test_hooks_on_the_real_decode_graph_runner(tmp_path):
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=server_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["capture_params"] == ["self", "size", "forward", "stream_idx", "variant_label"]
    assert res["resolve_params"] == ["self", "forward_batch"]
    assert res["flashinfer_per_size_wrappers"]
    # each size once per variant, the largest (query-aware) graph first, each inside its variant
    labels = ["sgl_sparse_qa", "sgl_sparse_mixed", "sgl_sparse_dense", "sgl_sparse_kernel"]
    assert res["captured"] == (
        [[8, None, lab, ["enter", v]] for lab, v in zip(labels, ("qa", "mixed", "dense", "kernel"))]
        + [[4, None, "lora+" + lab, ["enter", v]] for lab, v in zip(labels, ("qa", "mixed", "dense", "kernel"))])
    assert res["resolved"] == labels
    assert res["resolved_off"] is None
    assert res["installed"] == ["wrappers-qa", "wrappers-mixed", "wrappers-qa"]
