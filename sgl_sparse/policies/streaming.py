"""`streaming` (StreamingLLM): sink tokens + a sliding window of recent tokens."""

from __future__ import annotations

from sgl_sparse.config import StreamingPolicy
from sgl_sparse.policies.base import PolicyId, RowInit, StepInputs

ID = PolicyId.STREAMING


def init_row(spec: StreamingPolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    return RowInit(policy=ID, window=spec.window, sink=spec.sink)


def windowed(step: StepInputs):
    return step.policy == ID
