"""`asyncspade` (ALGORITHMS.md §4): the row-level part of the policy. The math
(query prediction, scoring, Top-K) is sgl_sparse/queryaware/asyncspade.py; the
per-layer serving glue is sgl_sparse/query_aware.py."""

from __future__ import annotations

from sgl_sparse.config import AsyncSpadePolicy
from sgl_sparse.policies import query_aware
from sgl_sparse.policies.base import PolicyId, RowInit

ID = PolicyId.ASYNCSPADE


def init_row(spec: AsyncSpadePolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    return query_aware.init_row(ID, spec, spec.recent)


windowed = query_aware.windowed
