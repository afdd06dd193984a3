"""`lfps` (ALGORITHMS.md §3): the row-level part of the policy. The math (tables,
head sparsity, candidates, Top-k, update) is sgl_sparse/queryaware/lfps.py; the
per-layer serving glue is sgl_sparse/query_aware.py."""

from __future__ import annotations

from sgl_sparse.config import LfpsPolicy
from sgl_sparse.policies import query_aware
from sgl_sparse.policies.base import PolicyId, RowInit

ID = PolicyId.LFPS


def init_row(spec: LfpsPolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    # Segment B: the `local` keys of w_local and the current token's own key.
    return query_aware.init_row(ID, spec, spec.local + 1)


windowed = query_aware.windowed
