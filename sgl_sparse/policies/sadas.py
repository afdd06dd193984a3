"""`sadas`: sliding window while thinking, full attention once `</think>` was generated.

Paper (ALGORITHMS.md §2), per request, from the previous token y_{t-1}:
    S_t = 1 if y = <think>;  0 if y = </think>;  S_{t-1} otherwise
    F_t = F_{t-1} or (y = </think>),  F_0 = 0
    attention: window of the last W tokens (+ sink [ours]) while F_t = 0, full once F_t = 1.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from sgl_sparse.config import SadasPolicy
from sgl_sparse.policies.base import PolicyId, RowInit, StepInputs

ID = PolicyId.SADAS


def _last_index(ids: np.ndarray, token: int) -> int:
    hits = np.flatnonzero(ids == token)
    return int(hits[-1]) if hits.size else -1


def init_row(
    spec: SadasPolicy, prompt_ids: Sequence[int], output_ids: Sequence[int],
    think_ids: tuple[Optional[int], Optional[int]],
) -> RowInit:
    """State at admission, derived from every token the request already has.

    Prompt [ours]: a prompt whose last control token is `</think>` (e.g. a chat
    template with thinking switched off) has concluded thinking: full attention.
    One that ends inside `<think>` (or has none) starts in window mode (F_0 = 0).
    Generated tokens (a request re-admitted after retraction) replay the latch.
    """
    start, end = think_ids
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    # A re-admitted (retracted) request re-prefills its generated tokens too: all of
    # them are consumed before its next decode step, so all of them set the state.
    out = np.asarray(output_ids, dtype=np.int64)
    seen = np.concatenate([prompt, out])
    think = _last_index(seen, start) > _last_index(seen, end)
    latch = _last_index(prompt, end) > _last_index(prompt, start) or bool((out == end).any())
    return RowInit(policy=ID, window=spec.window, sink=spec.sink, think=think, latch=latch)


def update(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Equations (1)-(2) for the SADAS rows of the batch; other rows are unchanged."""
    mine = step.policy == ID
    is_start = mine & (step.last_token == step.think_start_id)
    is_end = mine & (step.last_token == step.think_end_id)
    think = torch.where(is_start, True, torch.where(is_end, False, step.think))
    latch = step.latch | is_end
    return think, latch


def windowed(step: StepInputs):
    return (step.policy == ID) & ~step.latch
