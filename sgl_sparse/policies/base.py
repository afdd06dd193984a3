from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional

import torch


class PolicyId(IntEnum):
    # Row 0 of the request pool is SGLang's CUDA-graph padding row and stays zero:
    # FULL must be 0 so padded batch slots behave as dense and change no state.
    FULL = 0
    STREAMING = 1
    SADAS = 2
    SFI = 3
    # Query-aware policies: segment A is a per-(row, KV head) position set chosen
    # each layer from the query (DecodePlan.a_slot == INDEXED).
    QUEST = 4
    ASYNCSPADE = 5
    LFPS = 6


QUERY_AWARE_IDS = (PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS)


@dataclass(frozen=True)
class RowInit:
    """Initial per-request state, one row of SparseState."""

    policy: PolicyId
    window: int = 0
    sink: int = 0
    think: bool = False  # SADAS S_t: inside a <think> block
    latch: bool = False  # SADAS F_t: a </think> was seen -> full attention for good
    # SFI (window = recent): Top-K budget, refresh budget, sentence triggers on/off,
    # the validated request policy (Selector knobs) and its compact-buffer slot.
    budget: int = 0
    t_max: int = 0
    triggers: bool = False
    spec: Any = None
    keep_prompt: bool = False  # SFI prompt_evidence "every": the prompt's queries stay evidence
    # SFI: since_slow after the first slow step (0: the next slow step t_max fast
    # steps later; set at admission from refresh_groups, see state._with_phase).
    refresh_phase: int = 0
    # SFI and the query-aware policies: the longest sequence the request attends
    # densely (`dense_until`): the budget's reach, or further where a sparse step
    # would save less than min_saving.
    dense_until: int = 0
    slot: int = -1  # SFI: compact slot; quest/asyncspade/lfps: slot of the policy's query store
    # Query-aware policies (window = the recent positions of segment B): the longest
    # sequence their store can serve sparse (0: none).
    max_context: int = 0
    # The request's length once its extend is complete (prompt + tokens generated so
    # far; admission.row_for_request): a chunk ending before it is not the prompt's
    # last (chunked prefill), and the query-aware stores build their prompt state
    # (quest's page bounds, lfps's tables, asyncspade's smoothing) at the last chunk
    # only, since no decode step reads it before. 0: unknown, every chunk is the last.
    prefill_end: int = 0

    def __post_init__(self):
        # The host's per-step loop compares members by identity (state.set_step_rows).
        object.__setattr__(self, "policy", PolicyId(self.policy))


def covers(sink: int, budget: int, window: int, n: int) -> bool:
    """Sink + budget + window (SFI's recent, the query-aware policies' recent or
    lfps's local + 1) reach every token: the row is dense by definition (exactly `full`)."""
    return sink + budget + window >= n


def dense_at(init: RowInit, n: int) -> bool:
    """A sparse request attends densely at length n: its budget covers n, or a sparse
    step would skip less than its min_saving of it (n <= init.dense_until)."""
    return covers(init.sink, init.budget, init.window, n) or n <= init.dense_until


def dense_until(sink: int, budget: int, window: int, min_saving: float) -> int:
    """The longest sequence a sparse request attends densely (RowInit.dense_until):
    its plan's reach (sink + budget + window), or the longest n at which a sparse step
    would read more than 1 - min_saving of the keys (the policies' `min_saving`)."""
    reach = sink + budget + window
    return max(reach, math.floor(reach / (1.0 - min_saving) + 1e-9))


@dataclass
class StepInputs:
    """What one decode step's decision may read; all device tensors of shape [bs]."""

    policy: torch.Tensor  # int8
    window: torch.Tensor  # int32
    sink: torch.Tensor  # int32
    think: torch.Tensor  # bool
    latch: torch.Tensor  # bool
    last_token: torch.Tensor  # int64: y_{t-1}, this step's input id
    think_start_id: Optional[int]
    think_end_id: Optional[int]
    seq_len: Optional[torch.Tensor] = None  # int32 n, this step's token included
    # SFI
    budget: Optional[torch.Tensor] = None  # int32
    t_max: Optional[torch.Tensor] = None  # int32
    triggers: Optional[torch.Tensor] = None  # bool
    since_slow: Optional[torch.Tensor] = None  # int32: fast steps since the last slow one
    slot: Optional[torch.Tensor] = None  # int32 compact slot, -1: none
    sel_ready: Optional[torch.Tensor] = None  # bool: the slot holds a selection
    sel_count: Optional[torch.Tensor] = None  # int32: tokens in it (sink + selected)
    trigger_table: Optional[torch.Tensor] = None  # bool [vocab]: sentence-ending ids
