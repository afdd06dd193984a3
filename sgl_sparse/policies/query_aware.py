"""What quest, asyncspade and lfps share in the per-step decision.

Each of them attends sink + a per-(row, KV head) position set chosen in the layer
(segment A, `DecodePlan.a_slot == INDEXED`) + the last `window` positions in place
(segment B). The step-level decision (here, device ops) only says whether a row is
indexed this step; the positions are chosen per layer in the backend
(sgl_sparse/query_aware.py).
"""

from __future__ import annotations

import torch

# covers / dense_at: the host twins of `decide`'s length tests
from sgl_sparse.policies.base import PolicyId, RowInit, covers, dense_at, dense_until  # noqa: F401

INDEXED = -2  # DecodePlan.a_slot of an indexed row


def init_row(policy: PolicyId, spec, window: int) -> RowInit:
    return RowInit(policy=policy, window=window, sink=spec.sink, budget=spec.budget, spec=spec,
                   dense_until=dense_until(spec.sink, spec.budget, window, spec.min_saving))


def windowed(step):
    return None  # indexed rows are decided in `decide`


def decide(policy: torch.Tensor, slot: torch.Tensor, sink: torch.Tensor, budget: torch.Tensor,
           window: torch.Tensor, n: torch.Tensor, max_context: torch.Tensor,
           qa_steps: torch.Tensor, dense_until: torch.Tensor) -> torch.Tensor:
    """[bs] bool: the row attends an indexed segment A this step. Device ops only.

    Dense instead when the row has no store slot, outgrew its store, its budget
    covers the sequence or a sparse step would skip less than its min_saving of it
    (`dense_until`), or (asyncspade) no prediction exists yet: its first decode step
    after admission attends everything and predicts the next query."""
    mine = (policy == PolicyId.QUEST) | (policy == PolicyId.ASYNCSPADE) | (policy == PolicyId.LFPS)
    ready = (policy != PolicyId.ASYNCSPADE) | (qa_steps >= 1)
    return (mine & ready & (slot >= 0) & (n <= max_context) & (sink + budget + window < n)
            & (dense_until < n))
