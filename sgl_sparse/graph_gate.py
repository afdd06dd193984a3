"""Work inside SGLang's decode CUDA graphs that runs only when the batch needs it.

A decode graph is captured once per batch size and replayed for whatever mix of
policies the batch holds, so work captured for one policy (quest's page bounds,
asyncspade's prediction and scoring, lfps's tables: ~10-150 small kernels per
layer) would run, on empty inputs, in every step of every request: `full`
traffic on a server with the captured query-aware path paid 13% of its decode
throughput for it (bench/README.md, "Query-aware run 4").

`only_if(flag)` makes the block the body of a CUDA conditional node (CUDA >= 12.4,
through PyTorch's `CUDAGraph.begin_capture_to_if_node`): at replay the body runs
only where the 0-dim bool `flag`, computed on the device earlier in the same
graph, is true; skipped, it costs one tiny kernel that sets the condition plus
the node. Outside a capture (eager forwards, CPU) the block just runs.

A gated block must be safe to skip: its effects are in-place writes that nothing
reads when the flag is false, and the tensors it creates are read only by blocks
gated on the same flag. Bodies nest (PyTorch captures each on a child stream).

SGLANG_SPARSE_GRAPH_CONDITIONALS=0 captures every block unconditionally (the
behaviour before conditional nodes), for A/B runs or a driver that refuses them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from sgl_sparse.kernels._utils import env_switch

logger = logging.getLogger(__name__)

ENABLED = env_switch("GRAPH_CONDITIONALS", True)
# PyTorch's API for conditional nodes (absent from e.g. the H100 image's torch 2.11)
_HAS_API = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node") and hasattr(
    torch.cuda.CUDAGraph, "get_currently_capturing_graph")
_warned = False


def flag(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x.any()`` as a gate flag for :func:`only_if`; None (no op, the gate always
    runs) where no conditional node can be captured: a CPU tensor, gates
    disabled, or a PyTorch without the API. The flag is computed once per forward
    and read by every layer's gates, so where it cannot be used it is not computed."""
    global _warned
    if not (x.is_cuda and ENABLED):
        return None
    if not _HAS_API:
        if not _warned:
            _warned = True
            logger.warning("sgl_sparse: torch %s has no CUDA-graph conditional nodes; query-aware work inside "
                           "decode CUDA graphs runs at every step, whatever the batch holds", torch.__version__)
        return None
    return x.any()


@contextlib.contextmanager
def only_if(flag: Optional[torch.Tensor]) -> Iterator[None]:
    """Run the block; under CUDA-graph capture, as a conditional node on `flag`
    (a 0-dim bool CUDA tensor from :func:`flag`), so replays skip it where `flag`
    is false. `flag` None: the block just runs."""
    graph = None
    if flag is not None and ENABLED and torch.cuda.is_current_stream_capturing():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    if graph is None:
        yield
        return
    graph.begin_capture_to_if_node(flag)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()
