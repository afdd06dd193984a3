"""Request metadata -> initial state rows, for the requests of an extend batch.

Runs on the host in the scheduler process, once per extend/prefill batch, before
the forward that uses the rows. The tokenizer-side hook has already validated and
completed the metadata; it is parsed again here because that is the object the
scheduler holds, and a malformed request is served as `full` rather than allowed
to disturb the batch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from sgl_sparse import compat
from sgl_sparse.config import REQUEST_KEY, SparseConfigError, SparseServerConfig, parse_request_policy
from sgl_sparse.policies import MODULES, RowInit
from sgl_sparse.policies.base import PolicyId

logger = logging.getLogger(__name__)


def request_policy_raw(req: Any) -> Any:
    params = getattr(req.sampling_params, "custom_params", None)
    return params.get(REQUEST_KEY) if isinstance(params, dict) else None


_SPEC_ATTR = "_sgl_sparse_spec"


def request_spec(req: Any, cfg: SparseServerConfig):
    """The request's validated policy, or None (served as `full`) if it is invalid.

    Parsed once per request and kept on the Req: it is read when the Req is made
    (radix namespace) and again at each extend chunk (admission).
    """
    if hasattr(req, _SPEC_ATTR):
        return getattr(req, _SPEC_ATTR)
    try:
        spec = parse_request_policy(request_policy_raw(req), cfg)
    except SparseConfigError as e:  # unreachable through the HTTP API (400 there)
        logger.error("sgl_sparse: request %s has invalid metadata (%s); serving it as 'full'",
                     getattr(req, "rid", "?"), e)
        spec = None
    setattr(req, _SPEC_ATTR, spec)
    return spec


def row_for_request(
    req: Any, cfg: SparseServerConfig, think_ids: tuple[Optional[int], Optional[int]]
) -> RowInit:
    spec = request_spec(req, cfg)
    if spec is None:
        return RowInit(policy=PolicyId.FULL)
    prompt, output = compat.token_ids(req)
    init = MODULES[spec.policy].init_row(spec, prompt, output, think_ids)
    return dataclasses.replace(init, prefill_end=len(prompt) + len(output))


def rows_for_batch(
    reqs: list, cfg: SparseServerConfig, think_ids: tuple[Optional[int], Optional[int]]
) -> tuple[list[int], list[RowInit], list[int]]:
    """(rows, initial states, generated ids each request already has)."""
    rows, inits, bases = [], [], []
    for req in reqs:
        idx = compat.req_pool_idx(req)
        if idx is None:
            continue
        rows.append(int(idx))
        inits.append(row_for_request(req, cfg, think_ids))
        bases.append(len(compat.token_ids(req)[1]))
    return rows, inits, bases
