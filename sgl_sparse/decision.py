"""The per-step decision: state rows + last token -> the attention plan of the step.

Runs once per decode step (not per layer), entirely as tensor ops on device, so it
is recorded into SGLang's decode CUDA graphs and replays with whatever mix of
policies the batch holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_sparse.policies import MODULES, query_aware, sfi
from sgl_sparse.policies.base import StepInputs
from sgl_sparse.state import SparseState


@dataclass(frozen=True)
class StoreLists:
    """INDEXED rows whose lists a store holds by slot (asyncspade's next-step
    selections, written by its side stream): row b's are ``pos[rows[b]]`` (and the
    pool slots ``slots[rows[b]]``), ``count[rows[b]]`` long; ``rows[b] < 0``: the
    plan's own a_pos / a_len_per_head. The decode reads them there
    (``two_segment_decode(a_lists=...)``) instead of a per-layer copy."""

    rows: torch.Tensor  # [bs] int32
    pos: torch.Tensor  # [R, Hkv, W] int32
    count: torch.Tensor  # [R, Hkv] int32
    slots: Optional[torch.Tensor] = None  # [R, Hkv, W] int32


@dataclass
class DecodePlan:
    """Which keys each request of the batch attends at this step (all [bs] int32).

    Two segments per request, the shape the two-segment decode kernel consumes:
        A: a_slot == -1: positions [0, a_len) in place  -- sink tokens
         a_slot >= 0: the first a_len rows of the request's compact buffer
                      (SFI: sink + selected tokens, all before b_start)
         a_slot == -2 (INDEXED; quest, asyncspade, lfps): per KV head h the
                      positions a_pos[b, h, :a_len_per_head[b, h]] read in place
                      through req_to_token (ascending, all < b_start, the sink
                      positions included). Chosen per layer: the step's plan has
                      a_pos None and a_len 0 for these rows; the backend fills
                      both in a per-layer copy (`with_indexed`).
      B: positions [b_start, b_end)    -- recent window, or the whole sequence
    `full` is A empty and B = [0, n). A and B never overlap.
    """

    a_len: torch.Tensor
    b_start: torch.Tensor
    b_end: torch.Tensor
    a_slot: Optional[torch.Tensor] = None
    # Kernel-facing form (when the caller gives num_kv_heads): A's length per KV head.
    a_len_per_head: Optional[torch.Tensor] = None
    # SFI slow steps: the compact slot whose query buffer takes this step's query
    # (-1: nothing to save).
    q_save_slot: Optional[torch.Tensor] = None
    # INDEXED rows: [bs, Hkv, K] int32 positions (per layer, see above).
    a_pos: Optional[torch.Tensor] = None
    # The same lists as pool slots (req_to_token applied; kernels/indexed_slots.py),
    # where the kernel path made them: what the decode kernel gathers from fastest.
    a_slots: Optional[torch.Tensor] = None
    # INDEXED rows reading their lists from a store instead (per layer, see StoreLists).
    a_lists: Optional[StoreLists] = None

    def attended(self) -> torch.Tensor:
        """Tokens per row (INDEXED rows: segment B only until a layer fills A)."""
        return self.a_len + (self.b_end - self.b_start)

    def indexed(self) -> torch.Tensor:
        """[bs] bool: rows whose segment A is a per-head position set."""
        if self.a_slot is None:
            return torch.zeros_like(self.b_end, dtype=torch.bool)
        return self.a_slot == query_aware.INDEXED

    def indexed_lists(self) -> dict:
        """two_segment_decode's keyword arguments for the INDEXED rows' lists: the pool
        slots where they were mapped, else the positions."""
        st = self.a_lists
        if self.a_slots is not None:
            lists = {"a_pos": self.a_slots, "a_pos_slots": True}
            if st is not None:
                lists["a_lists"] = (st.rows, st.slots, st.count)
            return lists
        return {"a_pos": self.a_pos, **({"a_lists": (st.rows, st.pos, st.count)} if st is not None else {})}

    def with_indexed(self, a_pos: torch.Tensor, a_len_per_head: torch.Tensor,
                     a_slots: Optional[torch.Tensor] = None, a_lists: Optional[StoreLists] = None) -> "DecodePlan":
        """This layer's plan: INDEXED rows read a_pos / a_len_per_head (other rows'
        entries of both are ignored), and a_slots where the lists were mapped; rows
        of ``a_lists`` read theirs from a store."""
        return dataclasses.replace(self, a_pos=a_pos, a_len_per_head=a_len_per_head, a_slots=a_slots,
                                   a_lists=a_lists)

    def materialized(self) -> "DecodePlan":
        """The same plan with a_lists' rows copied into a_pos / a_slots /
        a_len_per_head (what gather_selection did each layer): for the reference
        attention and the tests' position sets. Torch ops."""
        st = self.a_lists
        if st is None:
            return self
        take = st.rows >= 0
        src = st.rows.clamp(min=0).long()
        width = min(st.pos.shape[2], self.a_pos.shape[2])
        a_len = torch.where(take[:, None], st.count[src].clamp(max=width), self.a_len_per_head)
        a_pos = self.a_pos.clone()
        a_pos[take, :, :width] = st.pos[src[take], :, :width]
        a_slots = None
        if self.a_slots is not None:
            a_slots = self.a_slots.clone()
            a_slots[take, :, :width] = st.slots[src[take], :, :width]
        return dataclasses.replace(self, a_pos=a_pos, a_len_per_head=a_len, a_slots=a_slots, a_lists=None)


def plan_decode(
    state: SparseState,
    req_pool_indices: torch.Tensor,
    last_token: torch.Tensor,
    seq_lens: torch.Tensor,
    think_ids: tuple[Optional[int], Optional[int]],
    num_kv_heads: Optional[int] = None,
    use_kernel: Optional[bool] = None,
) -> DecodePlan:
    """This step's plan for every batch slot; advances the rows' state on device.

    On CUDA (with `num_kv_heads`) one Triton launch (kernels/plan_step.py) does
    what the tensor ops below do in ~50 launches; they remain the CPU path and
    its oracle."""
    if use_kernel is None:
        use_kernel = seq_lens.is_cuda and num_kv_heads is not None
    if use_kernel:
        from sgl_sparse.kernels.plan_step import plan_step

        a_len, b_start, b_end, a_slot, q_save, a_len_h = plan_step(
            state, req_pool_indices, last_token, seq_lens, think_ids, num_kv_heads)
        return DecodePlan(a_len=a_len, b_start=b_start, b_end=b_end, a_slot=a_slot,
                          a_len_per_head=a_len_h, q_save_slot=q_save)
    rows = req_pool_indices.long()
    step = StepInputs(
        policy=state.policy[rows],
        window=state.window[rows],
        sink=state.sink[rows],
        think=state.think[rows],
        latch=state.latch[rows],
        last_token=last_token.long(),
        think_start_id=think_ids[0] if think_ids[0] is not None else -1,
        think_end_id=think_ids[1] if think_ids[1] is not None else -1,
        seq_len=seq_lens.to(torch.int32),
        budget=state.budget[rows],
        t_max=state.t_max[rows],
        triggers=state.triggers[rows],
        since_slow=state.since_slow[rows],
        slot=state.slot[rows],
        sel_ready=state.sel_ready[rows],
        sel_count=state.sel_count[rows],
        trigger_table=state.trigger_table,
    )
    # Transitions first: step t attends according to F_t, which includes y_{t-1}.
    for module in MODULES.values():
        if hasattr(module, "update"):
            step.think, step.latch = module.update(step)
    # Padded CUDA-graph slots all point at row 0 (FULL): their update is a no-op
    # and they never share a row with a real request.
    state.think[rows] = step.think
    state.latch[rows] = step.latch
    slow, compact = sfi.decide(step)
    _advance_sfi(state, rows, step, slow)
    n = step.seq_len
    indexed = query_aware.decide(step.policy, step.slot, step.sink, step.budget, step.window, n,
                                 state.max_context[rows], state.qa_steps[rows], state.dense_until[rows])
    qa_steps = state.qa_steps[rows]
    state.qa_steps[rows] = torch.where(step.policy > 0, qa_steps + 1, qa_steps)  # padding row 0 stays 0

    windowed = torch.zeros_like(step.latch)
    for module in MODULES.values():
        mask = module.windowed(step)
        if mask is not None:
            windowed |= mask
    windowed |= compact | indexed
    zero = torch.zeros_like(n)
    b_start = torch.where(windowed, torch.clamp(n - step.window, min=0), zero)
    a_len = torch.where(compact, step.sel_count,
                        torch.where(windowed & ~indexed, torch.minimum(step.sink, b_start), zero))
    a_slot = torch.where(compact, step.slot, torch.where(indexed, query_aware.INDEXED, -1))
    plan = DecodePlan(a_len=a_len, b_start=b_start, b_end=n, a_slot=a_slot,
                      q_save_slot=torch.where(slow & (step.slot >= 0), step.slot, -1))
    if num_kv_heads is not None:
        plan.a_len_per_head = a_len[:, None].expand(-1, num_kv_heads).contiguous()
    return plan


def _advance_sfi(state: SparseState, rows: torch.Tensor, step: StepInputs, slow: torch.Tensor) -> None:
    """SFI's per-row counters after this step's decision (other rows unchanged)."""
    mine = step.policy == sfi.ID
    fresh = state.fresh[rows]
    # The first slow step (a fresh row's) restarts the count at the row's phase.
    restart = torch.where(fresh, state.refresh_phase[rows], 0)
    state.since_slow[rows] = torch.where(slow, restart,
                                         torch.where(mine, step.since_slow + 1, step.since_slow))
    state.saved_n[rows] = torch.where(slow, step.seq_len, state.saved_n[rows])
    # The prompt's queries are evidence for the first slow step only (unless the row
    # keeps them: prompt_evidence "every"), whose length places them for later ones.
    state.prompt_q[rows] = torch.where(slow & ~fresh & ~state.keep_prompt[rows], 0, state.prompt_q[rows])
    state.prompt_n[rows] = torch.where(slow & fresh, step.seq_len, state.prompt_n[rows])
    state.fresh[rows] = fresh & ~mine
