"""
The per-step decode plan in one launch
======================================

``sgl_sparse.decision.plan_decode`` turns each request's state row and the token
it generated last into the two-segment plan of the step (and advances SADAS's
think/latch and SFI's slow/fast counters). In PyTorch that is ~50 tiny kernels
per decode step -- one gather per state column, then masks and ``where``s -- all
captured in every decode CUDA graph. At short context the whole decode step is
~2.6 ms and those launches cost ~0.07 ms of it (H100 profile, 512 x 8), which
every `full` request pays. This kernel computes the same plan, state updates
included, in a single launch: one program per ``BLOCK`` batch slots, each slot
reads its state row once and writes its plan and updated row.

The PyTorch ``plan_decode`` stays the CPU serving path and this kernel's
oracle (``tests/kernels/test_plan_step.py`` compares both on random states).

Batch slots are distinct requests except CUDA-graph padding slots, which all
point at row 0 (a zero `full` row whose update writes back the same zeros), so
programs never race on a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["plan_step"]

# decision.PolicyId values (kept literal: kernels do not import the serving package).
_STREAMING = tl.constexpr(1)
_SADAS = tl.constexpr(2)
_SFI = tl.constexpr(3)
_QUEST = tl.constexpr(4)
_ASYNCSPADE = tl.constexpr(5)
_LFPS = tl.constexpr(6)
_INDEXED = tl.constexpr(-2)  # DecodePlan.a_slot of rows whose segment A is a per-head position set


@triton.jit(do_not_specialize=["bs", "vocab", "think_start", "think_end"])
def _plan_step_kernel(
    rows_ptr, tok_ptr, n_ptr,
    policy_ptr, window_ptr, sink_ptr, think_ptr, latch_ptr,
    budget_ptr, t_max_ptr, triggers_ptr, since_ptr, slot_ptr, sel_ready_ptr, sel_count_ptr,
    saved_n_ptr, prompt_q_ptr, fresh_ptr, keep_prompt_ptr, prompt_n_ptr, phase_ptr, table_ptr,
    max_ctx_ptr, qa_steps_ptr, dense_until_ptr,  # query-aware policies' columns (read only when HAS_QA)
    out_ptr,  # int32 [5, bs]: a_len, b_start, b_end, a_slot, q_save_slot
    a_len_h_ptr,  # int32 [bs, HKV]
    bs, vocab, think_start, think_end,
    HKV: tl.constexpr, HKV_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_QA: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < bs
    r = tl.load(rows_ptr + offs, mask=valid, other=0).to(tl.int64)
    tok = tl.load(tok_ptr + offs, mask=valid, other=0).to(tl.int64)
    n = tl.load(n_ptr + offs, mask=valid, other=0).to(tl.int32)

    pol = tl.load(policy_ptr + r, mask=valid, other=0).to(tl.int32)
    window = tl.load(window_ptr + r, mask=valid, other=0)
    sink = tl.load(sink_ptr + r, mask=valid, other=0)
    think = tl.load(think_ptr + r, mask=valid, other=0).to(tl.int1)
    latch = tl.load(latch_ptr + r, mask=valid, other=0).to(tl.int1)
    budget = tl.load(budget_ptr + r, mask=valid, other=0)
    t_max = tl.load(t_max_ptr + r, mask=valid, other=0)
    triggers = tl.load(triggers_ptr + r, mask=valid, other=0).to(tl.int1)
    since = tl.load(since_ptr + r, mask=valid, other=0)
    slot = tl.load(slot_ptr + r, mask=valid, other=-1)
    sel_ready = tl.load(sel_ready_ptr + r, mask=valid, other=0).to(tl.int1)
    sel_count = tl.load(sel_count_ptr + r, mask=valid, other=0)
    saved_n = tl.load(saved_n_ptr + r, mask=valid, other=0)
    prompt_q = tl.load(prompt_q_ptr + r, mask=valid, other=0)
    fresh = tl.load(fresh_ptr + r, mask=valid, other=0).to(tl.int1)
    keep_prompt = tl.load(keep_prompt_ptr + r, mask=valid, other=0).to(tl.int1)
    prompt_n = tl.load(prompt_n_ptr + r, mask=valid, other=0)
    phase = tl.load(phase_ptr + r, mask=valid, other=0)

    # SADAS (policies/sadas.update): S_t and F_t from y_{t-1}, before the plan.
    sadas = pol == _SADAS
    is_start = sadas & (tok == think_start)
    is_end = sadas & (tok == think_end)
    think = tl.where(is_start, 1, tl.where(is_end, 0, think.to(tl.int32))).to(tl.int1)
    latch = latch | is_end

    # SFI (policies/sfi.decide): slow on a sentence-ending y_{t-1} or an exhausted
    # refresh budget; sparse when a selection is ready and does not cover n.
    sfi = pol == _SFI
    tok_c = tl.minimum(tl.maximum(tok, 0), vocab - 1)
    hit = triggers & (tl.load(table_ptr + tok_c, mask=valid, other=0) != 0) & (tok < vocab)
    slow = sfi & (hit | (since >= t_max))
    compact = sfi & (~slow) & sel_ready & (slot >= 0) & (sink + budget + window < n)

    # SFI counters (decision._advance_sfi).
    new_since = tl.where(slow, tl.where(fresh, phase, 0), tl.where(sfi, since + 1, since))
    new_saved = tl.where(slow, n, saved_n)
    new_prompt_q = tl.where(slow & (~fresh) & (~keep_prompt), 0, prompt_q)
    new_prompt_n = tl.where(slow & fresh, n, prompt_n)
    new_fresh = fresh & (~sfi)

    # Query-aware policies (policies/query_aware.decide): an indexed segment A, the
    # positions chosen per layer later; dense without a store slot, past the store's
    # context, when the budget covers n or min_saving keeps it dense (dense_until), or
    # at asyncspade's first step (no prediction).
    indexed = sfi & (pol < 0)  # all false, typed like the other masks
    if HAS_QA:
        max_ctx = tl.load(max_ctx_ptr + r, mask=valid, other=0)
        qa_steps = tl.load(qa_steps_ptr + r, mask=valid, other=0)
        dense_until = tl.load(dense_until_ptr + r, mask=valid, other=0)
        qa = (pol == _QUEST) | (pol == _ASYNCSPADE) | (pol == _LFPS)
        ready = (pol != _ASYNCSPADE) | (qa_steps >= 1)
        indexed = qa & ready & (slot >= 0) & (n <= max_ctx) & (sink + budget + window < n) & (dense_until < n)
        tl.store(qa_steps_ptr + r, tl.where(pol > 0, qa_steps + 1, qa_steps), mask=valid)

    # The plan (decision.plan_decode).
    windowed = (pol == _STREAMING) | (sadas & (~latch)) | compact | indexed
    b_start = tl.where(windowed, tl.maximum(n - window, 0), 0)
    a_len = tl.where(compact, sel_count, tl.where(windowed & (~indexed), tl.minimum(sink, b_start), 0))
    a_slot = tl.where(compact, slot, tl.where(indexed, _INDEXED, -1))
    q_save = tl.where(slow & (slot >= 0), slot, -1)

    tl.store(think_ptr + r, think.to(tl.int8), mask=valid)
    tl.store(latch_ptr + r, latch.to(tl.int8), mask=valid)
    tl.store(since_ptr + r, new_since, mask=valid)
    tl.store(saved_n_ptr + r, new_saved, mask=valid)
    tl.store(prompt_q_ptr + r, new_prompt_q, mask=valid)
    tl.store(prompt_n_ptr + r, new_prompt_n, mask=valid)
    tl.store(fresh_ptr + r, new_fresh.to(tl.int8), mask=valid)

    tl.store(out_ptr + offs, a_len, mask=valid)
    tl.store(out_ptr + bs + offs, b_start, mask=valid)
    tl.store(out_ptr + 2 * bs + offs, n, mask=valid)
    tl.store(out_ptr + 3 * bs + offs, a_slot, mask=valid)
    tl.store(out_ptr + 4 * bs + offs, q_save, mask=valid)
    heads = tl.arange(0, HKV_P2)
    tl.store(a_len_h_ptr + offs[:, None] * HKV + heads[None, :],
             tl.broadcast_to(a_len[:, None], (BLOCK, HKV_P2)), mask=valid[:, None] & (heads[None, :] < HKV))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # bool columns are read and written as bytes (0/1), the storage torch uses.
    return t.view(torch.int8) if t.dtype == torch.bool else t


def plan_step(state, req_pool_indices: torch.Tensor, last_token: torch.Tensor, seq_lens: torch.Tensor,
              think_ids: tuple, num_kv_heads: int, block: int = 128):
    """The plan of one decode step for every batch slot, and the state rows advanced.

    ``state``: a ``SparseState`` (its column tensors are read and updated in
    place). Returns int32 tensors (a_len, b_start, b_end, a_slot, q_save_slot)
    of shape [bs] and a_len_per_head [bs, num_kv_heads]. No host sync: safe to
    capture in a CUDA graph.
    """
    bs = req_pool_indices.shape[0]
    dev = req_pool_indices.device
    out = torch.empty(5, bs, dtype=torch.int32, device=dev)
    a_len_h = torch.empty(bs, num_kv_heads, dtype=torch.int32, device=dev)
    if bs == 0:
        return (*out.unbind(0), a_len_h)
    start = think_ids[0] if think_ids[0] is not None else -1
    end = think_ids[1] if think_ids[1] is not None else -1
    # One BLOCK for every batch size: one compiled variant, not one per captured size.
    s = state
    # The query-aware policies' state columns, where this SparseState has them.
    max_ctx, qa_steps = getattr(s, "max_context", None), getattr(s, "qa_steps", None)
    dense_until = getattr(s, "dense_until", None)
    has_qa = max_ctx is not None and qa_steps is not None and dense_until is not None
    _plan_step_kernel[(triton.cdiv(bs, block),)](
        req_pool_indices, last_token, seq_lens,
        s.policy, s.window, s.sink, _as_bytes(s.think), _as_bytes(s.latch),
        s.budget, s.t_max, _as_bytes(s.triggers), s.since_slow, s.slot, _as_bytes(s.sel_ready), s.sel_count,
        s.saved_n, s.prompt_q, _as_bytes(s.fresh), _as_bytes(s.keep_prompt), s.prompt_n, s.refresh_phase,
        _as_bytes(s.trigger_table),
        max_ctx if has_qa else s.saved_n, qa_steps if has_qa else s.saved_n, dense_until if has_qa else s.saved_n,
        out, a_len_h,
        bs, s.trigger_table.shape[0], start, end,
        HKV=num_kv_heads, HKV_P2=triton.next_power_of_2(num_kv_heads), BLOCK=block, HAS_QA=has_qa,
    )
    return (*out.unbind(0), a_len_h)
