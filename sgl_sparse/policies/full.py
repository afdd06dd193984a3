"""`full`: dense attention over the whole cache."""

from __future__ import annotations

from sgl_sparse.config import FullPolicy
from sgl_sparse.policies.base import PolicyId, RowInit, StepInputs

ID = PolicyId.FULL


def init_row(spec: FullPolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    return RowInit(policy=ID)


def windowed(step: StepInputs):
    return None  # never restricts attention
