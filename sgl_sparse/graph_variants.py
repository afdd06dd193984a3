"""Two decode CUDA graphs per batch size: with and without the query-aware blocks.

With `query_aware.<policy>.cuda_graphs: true`, quest/asyncspade/lfps's selection is
captured into the decode graphs. Without CUDA-graph conditional nodes (torch 2.11,
graph_gate.py) a captured block runs at every replay, whatever the batch holds: on
the H100 ~25 near-empty launches per layer, which cost `full` batches 11-25% of
their throughput (bench/README.md, "Session 8"). SGLang's decode graph runner keys
its graphs by a variant label beside the batch size (its LoRA / no-LoRA pair, DSA's
dense / sparse pair). These hooks add our pair to that label:

- capture: every batch size is captured twice, first with the query-aware blocks
  (the larger graph, so the second reuses its memory pool), then without them
  (`SparseAttnBackend.capturing_graph_variant`);
- replay: the runner's variant choice appends which one this batch needs
  (`SparseState.step_query_aware`: does the batch set up for this forward hold a
  quest/asyncspade/lfps row), and the backend plans FlashInfer into that
  variant's wrappers (`SparseAttnBackend.use_dense_graph_wrappers`).

A batch without such rows then replays a graph that is the stock one plus our
two-segment launch; with them, the graph that has the blocks. SGLANG_SPARSE_QA_GRAPH_VARIANTS=0
captures one graph per size with the blocks (the behaviour before), for A/B runs.
"""

from __future__ import annotations

from typing import Any, Optional

from sgl_sparse.kernels._utils import env_switch
from sgl_sparse import compat

ENABLED = env_switch("QA_GRAPH_VARIANTS", True)
_QA, _NO_QA = "sgl_sparse_qa", "sgl_sparse_no_qa"
#: The variant label's position in capture_one_shape(size, forward, stream_idx,
#: variant_label, ...) after `forward` (both supported SGLang versions).
_LABEL_ARG = 1


def wanted(backend: Any) -> bool:
    """Whether `backend` (a SparseAttnBackend) has captured query-aware blocks that a
    second graph variant can leave out."""
    qa = getattr(backend, "qa", None)
    return bool(ENABLED and backend.dense is not None and qa is not None and qa.device is not None
                and compat.has_dense_decode_graph_wrappers(backend.dense))


def label(base: Optional[str], query_aware: bool) -> str:
    """SGLang's own variant label (LoRA's, or None) with ours appended."""
    ours = _QA if query_aware else _NO_QA
    return ours if base is None else f"{base}+{ours}"


def _sparse_backend(runner: Any) -> Any:
    """The runner's SparseAttnBackend when it captures two variants; None for every
    other runner (speculative draft runners, other backends)."""
    if type(runner).__name__ != "DecodeCudaGraphRunner":
        return None
    backend = getattr(runner, "attn_backend", None)
    return backend if getattr(backend, "graph_variants", False) else None


def capture_one_shape(original, runner, size, forward, *args, **kwargs):
    """AROUND hook of DecodeCudaGraphRunner.capture_one_shape: both variants."""
    backend = _sparse_backend(runner)
    if backend is None:
        return original(runner, size, forward, *args, **kwargs)
    args, positional = list(args), len(args) > _LABEL_ARG
    base = args[_LABEL_ARG] if positional else kwargs.pop("variant_label", None)
    for query_aware in (True, False):
        if positional:
            args[_LABEL_ARG] = label(base, query_aware)
        else:
            kwargs["variant_label"] = label(base, query_aware)
        with backend.capturing_graph_variant(query_aware):
            original(runner, size, forward, *args, **kwargs)
    return None


def resolve_variant(original, runner, forward_batch, *args, **kwargs):
    """AROUND hook of DecodeCudaGraphRunner._resolve_lora_variant: the variant of
    this batch, in every graph key the runner makes (can_run_graph, replay)."""
    base = original(runner, forward_batch, *args, **kwargs)
    backend = _sparse_backend(runner)
    if backend is None:
        return base
    return label(base, backend.state.step_query_aware())
