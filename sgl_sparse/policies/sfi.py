"""`sfi` (Slow-Fast Inference, ALGORITHMS.md §1): the per-step slow/fast decision.

Step t is slow iff y_{t-1} is a sentence-ending id (when triggers are on), or the
last `t_max` steps were all fast, or it is the request's first decode step (the
row starts with since_slow = t_max). The first slow step restarts the count at the
row's `refresh_phase` (refresh_groups), later ones at 0. A slow step attends
densely; the Selector then refreshes the compact buffer
(sgl_sparse.selector.refresh) before the next step. A fast step attends sink +
selected (compact buffer, segment A) and the `recent` last positions in place
(segment B).

The host replays the same rule from the generated ids it receives (`HostMirror`)
to know, without a device sync, which requests need a Selector run and what to
count in the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from sgl_sparse.config import SfiPolicy
# dense_at: the host's alone for SFI; the device needs no twin of it, its plan is
# sparse only after a Selector run, which the host queues only past `dense_until`
# (n only grows).
from sgl_sparse.policies.base import PolicyId, RowInit, StepInputs, covers, dense_at, dense_until  # noqa: F401

ID = PolicyId.SFI


def init_row(spec: SfiPolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    return RowInit(
        policy=ID, window=spec.recent, sink=spec.sink, budget=spec.budget, t_max=spec.t_max,
        triggers=spec.sentence_triggers, spec=spec, keep_prompt=spec.prompt_evidence == "every",
        dense_until=dense_until(spec.sink, spec.budget, spec.recent, spec.min_saving),
    )


def windowed(step: StepInputs):
    return None  # fast steps read a compact segment: see `decide`


def decide(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(slow, sparse) masks for this step's SFI rows. Device ops only."""
    mine = step.policy == ID
    table = step.trigger_table
    tok = step.last_token.clamp(0, table.shape[0] - 1)
    hit = step.triggers & table[tok] & (step.last_token < table.shape[0])
    slow = mine & (hit | (step.since_slow >= step.t_max))
    n = step.seq_len
    sparse = (mine & ~slow & step.sel_ready & (step.slot >= 0)
              & (step.sink + step.budget + step.window < n))
    return slow, sparse


@dataclass
class HostMirror:
    """The host's replay of `decide` for one SFI request, from the ids it has seen.

    Decode step j of the request consumes generated id `output_ids[base + j]`; the
    host evaluates step j once that id is known and step j has been launched
    (j < steps launched), so with SGLang's overlap scheduler it learns about step
    k-1 while preparing step k -- in time to run the Selector before step k.
    """

    init: RowInit
    base: int  # generated ids the request had when (re)admitted
    since_slow: int = 0
    evaluated: int = 0
    launched_lens: list = field(default_factory=list)  # seq_len of launched, unevaluated steps
    refresh_n: Optional[int] = None  # a slow step at this length wants a Selector run
    # That slow step is not the request's first decode step: the device has dropped
    # the prompt's queries, so the Selector's window is the step's query alone
    # (never with prompt_evidence "every": the prompt's queries stay in the window).
    refresh_later: bool = False
    selection: int = 0  # tokens in the compact buffer after the last Selector run (0: none)
    slow_steps: int = 0
    steps: int = 0
    retention_sum: float = 0.0

    def __post_init__(self):
        self.since_slow = self.init.t_max

    def advance(self, output_ids: Sequence[int], table: np.ndarray) -> list[tuple[bool, int]]:
        """Evaluate every step whose input id is now known; returns (slow, n) per step."""
        out = []
        known = len(output_ids) - self.base
        while self.evaluated < min(known, self.evaluated + len(self.launched_lens)):
            n = self.launched_lens.pop(0)
            tok = int(output_ids[self.base + self.evaluated])
            hit = self.init.triggers and 0 <= tok < len(table) and bool(table[tok])
            slow = hit or self.since_slow >= self.init.t_max
            first = self.evaluated == 0  # the device's `fresh` row
            self.since_slow = (self.init.refresh_phase if first else 0) if slow else self.since_slow + 1
            self.evaluated += 1
            if slow:
                self.slow_steps += 1
                i = self.init
                if not dense_at(i, n) and i.slot >= 0:
                    self.refresh_n = n
                    self.refresh_later = self.evaluated > 1 and not i.keep_prompt
            out.append((slow, n))
        return out

    def next_step(self) -> tuple[bool, bool]:
        """(may be slow, surely slow) for the step about to launch, after the launched
        ones the host has not evaluated yet. Without sentence triggers the device's
        decision depends on the counter alone, so the host replays it exactly; with
        them any step may be slow (its input id is still being generated)."""
        s, j, slow = self.since_slow, self.evaluated, False
        for _ in range(len(self.launched_lens) + 1):
            slow = s >= self.init.t_max
            s = (self.init.refresh_phase if j == 0 else 0) if slow else s + 1
            j += 1
        return slow or self.init.triggers, slow

    def attended(self, slow: bool, n: int) -> int:
        """Tokens the device attended at a step the host has evaluated."""
        i = self.init
        if slow or not self.selection or i.slot < 0 or dense_at(i, n):
            return n
        return min(n, self.selection + i.window)


def sentence_trigger_table(tokenizer, suffixes: Sequence[str], vocab_size: int) -> np.ndarray:
    """Bool [vocab]: ids whose decoded text ends with one of `suffixes` (built once)."""
    n = max(vocab_size, len(tokenizer))
    table = np.zeros(n, dtype=bool)
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    ends = tuple(suffixes)
    for i, t in zip(ids, texts):
        if t.endswith(ends):
            table[i] = True
    return table
