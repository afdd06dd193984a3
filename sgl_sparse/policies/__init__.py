"""Per-request decode policies.

Each policy module owns two things:
  * ``init_row``: request metadata (+ its token ids) -> the initial state row, on the
    host, once when the request enters a batch;
  * ``windowed``: the per-step decision as tensor ops on device (no host sync), from
    the state rows and the token generated last (``forward_batch.input_ids``).
"""

from sgl_sparse.policies.base import PolicyId, RowInit, StepInputs
from sgl_sparse.policies import asyncspade, full, lfps, quest, sadas, sfi, streaming

MODULES = {"full": full, "streaming": streaming, "sadas": sadas, "sfi": sfi,
           "quest": quest, "asyncspade": asyncspade, "lfps": lfps}

__all__ = ["MODULES", "PolicyId", "RowInit", "StepInputs"]
