"""Decode selection of quest and asyncspade that SGLang's decode CUDA graphs can
capture: the request knobs read by row from SparseState's device columns, the
keys read in place by the Triton kernels.

query_serving.QueryAwareRuntime's host groups (one per policy and knob set, sizes
from the batch's longest sequence) would be frozen into a captured graph; here
nothing depends on the host but the batch size (fixed per graph) and static
config (store slots, capacity, max_context). The work runs over the policy's
store slots (SlotRows: slot -> the batch row holding it, built on the device), so
its cost is bounded by the slots reserved, not by the batch. Slots without a row
this step (their request not in the batch, padding, other policies, no slot, a
sequence past the store) are masked: the kernels skip them (slot < 0, an empty
range) and their store writes go to a scratch slot.

Per layer, decode:
  select   quest       fold the key at n - 1 into its page's bounds, page scores of
                       this query (group max), Top pages -> a_pos (sinks first)
           asyncspade  the selection its previous step stored for this one
  finish   asyncspade  push this query, predict the next one, score [sink, next
                       b_start) with it, Top-K -> the store, for the next step
Same selections as the torch path (the CPU path and this one's oracle,
tests/test_query_device.py), listed in ascending position order: the Top pages /
tokens come from kernels/topk_range.py, whose work per slot is bounded by the
slot's live range (a slot without a row costs O(1)), not by max_pages /
max_context as torch.topk's is.
"""

from __future__ import annotations

import torch

from sgl_sparse.config import GRAPH_CAPTURABLE, QUEST_PAGE
from sgl_sparse.decision import DecodePlan
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.queryaware import asyncspade as aspd

#: The policies this module serves (the plugin offers them with decode CUDA graphs
#: on); lfps stays on the host-grouped torch path.
POLICIES = tuple(PolicyId[name.upper()] for name in GRAPH_CAPTURABLE)


class RowKnobs:
    """The batch rows' knobs, gathered once per layer call from SparseState."""

    def __init__(self, state, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor):
        rows = req_pool_indices.long()
        self.rows = rows
        self.policy = state.policy[rows]
        self.slot = state.slot[rows]
        self.sink = state.sink[rows]
        self.budget = state.budget[rows]
        self.recent = state.window[rows]
        self.n = seq_lens.to(torch.int32)
        # the store serves the row: a slot, and a sequence that fits it
        self.live = (self.slot >= 0) & (self.n <= state.max_context[rows])
        self.aspd_window = state.qa_window[rows]
        self.aspd_ridge = state.qa_ridge[rows]

    def mine(self, policy: PolicyId) -> torch.Tensor:
        return (self.policy == int(policy)) & self.live


class SlotRows:
    """Store slot -> the batch row that holds it this step, on the device. The
    policy's work runs over its store's slots, not over the batch: its cost is
    bounded by the slots the operator reserved, whatever the batch size or mix."""

    def __init__(self, knobs: RowKnobs, policy: PolicyId, num_slots: int):
        bs = knobs.n.shape[0]
        dev = knobs.n.device
        self.mine = knobs.mine(policy)  # [bs]
        # A slot belongs to one request, so the real writes never collide; the rows
        # that are not the policy's all land on the extra entry, dropped.
        b = torch.full((num_slots + 1,), bs, dtype=torch.int64, device=dev)
        b[torch.where(self.mine, knobs.slot.long(), num_slots)] = torch.arange(bs, device=dev)
        self.b = b[:num_slots]  # [S]; bs: no row this step
        self.valid = self.b < bs
        self.ids = torch.arange(num_slots, device=dev, dtype=torch.int32)

    def take(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """x [bs, ...] -> [S, ...]: each slot's row (fill where none)."""
        return torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])[self.b]

    def slot_or(self, other: int, where: torch.Tensor | None = None) -> torch.Tensor:
        """[S] int32: the slot index where it has a row (and `where`), else `other`."""
        ok = self.valid if where is None else self.valid & where
        return torch.where(ok, self.ids, other)


class QueryAwareDevice:
    def __init__(self, state, cap: int):
        self.state = state
        self.cap = cap
        self.quest = state.query_stores.get(PolicyId.QUEST)
        self.aspd = state.query_stores.get(PolicyId.ASYNCSPADE)

    def select(self, li: int, plan: DecodePlan, q3: torch.Tensor, k_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               a_pos: torch.Tensor, a_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a_pos [bs, Hkv, cap] / a_len [bs, Hkv] with this layer's quest and
        asyncspade INDEXED rows filled in (other rows as given)."""
        knobs = RowKnobs(self.state, req_pool_indices, seq_lens)
        indexed = plan.indexed()
        if self.quest is not None:
            a_pos, a_len = self._quest(li, plan, knobs, indexed, q3, k_cache, req_to_token, req_pool_indices,
                                       a_pos, a_len)
        if self.aspd is not None:
            sel = knobs.mine(PolicyId.ASYNCSPADE) & indexed
            slot = torch.where(sel, knobs.slot, self.aspd.scratch_slot).long()
            width = self.aspd.sel_pos.shape[-1]
            pos = self.aspd.sel_pos[li][slot]
            a_pos[..., :width] = torch.where(sel[:, None, None], pos, a_pos[..., :width])
            a_len = torch.where(sel[:, None], self.aspd.sel_count[li][slot], a_len)
        return a_pos, a_len

    def _quest(self, li, plan, knobs: RowKnobs, indexed, q3, k_cache, req_to_token, req_pool_indices,
               a_pos, a_len):
        from sgl_sparse.kernels.quest_pages import expand_selection, quest_bounds_decode, quest_page_scores
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.quest
        kmin, kmax = store.kmin[li], store.kmax[li]
        sr = SlotRows(knobs, PolicyId.QUEST, store.cfg.slots)
        rpi, n = sr.take(req_pool_indices), sr.take(knobs.n)
        # Every step of a live row folds its new key in, covered steps included: a
        # row whose budget covered it at first must find all its pages current later.
        quest_bounds_decode(k_cache, req_to_token, rpi, sr.slot_or(-1), n, kmin, kmax)
        sel = sr.mine & indexed
        sink = sr.take(knobs.sink).to(torch.int32)
        b_start = sr.take(plan.b_start).to(torch.int32)
        # candidate pages hold a position in [sink, b_start)
        first = torch.div(sink, QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        last = torch.div(b_start + QUEST_PAGE - 1, QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        slot_sel = sr.slot_or(-1, sr.take(sel, False))
        scores = quest_page_scores(sr.take(q3).to(kmin.dtype), kmin, kmax, slot_sel, first, last)
        # static k: enough pages for any budget the store's capacity admits (+1: a
        # page clipped by the sink leaves room for one more)
        k = max(1, min(store.max_pages, self.cap // QUEST_PAGE + 1))
        pages = torch.div(sr.take(knobs.budget), QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        # the best `pages` pages, ascending; slots not selected this step: an empty range
        idx, n_pages = topk_range(scores, first, torch.where(slot_sel >= 0, last, first), pages, k,
                                  out=torch.empty(scores.shape[0], scores.shape[1], k, dtype=torch.int32,
                                                  device=scores.device))
        pos = a_pos.new_empty((sr.b.shape[0], *a_pos.shape[1:]))
        cnt = a_len.new_empty((sr.b.shape[0], a_len.shape[1]))
        expand_selection(None, idx, k, b_start, pos, cnt, page=QUEST_PAGE, n_sink=sink, count=n_pages)
        j = torch.where(sel, knobs.slot, 0).long()  # back to the batch rows
        a_pos = torch.where(sel[:, None, None], pos[j], a_pos)
        a_len = torch.where(sel[:, None], cnt[j], a_len)
        return a_pos, a_len

    def finish(self, li: int, q3: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
        """asyncspade, after the attention: the selection of the next step."""
        if self.aspd is None:
            return
        from sgl_sparse.kernels.quest_pages import expand_selection
        from sgl_sparse.kernels.token_scores import token_scores
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.aspd
        knobs = RowKnobs(self.state, req_pool_indices, seq_lens)
        sr = SlotRows(knobs, PolicyId.ASYNCSPADE, store.cfg.slots)
        slot = sr.slot_or(store.scratch_slot).long()  # slots without a row write the scratch slot
        ring, total = store.ring[li], store.total[li]
        aspd.ring_push(ring, total, sr.take(q3), rows=slot)
        window, count = aspd.ring_window(ring[slot], total[slot])
        # the request's W (<= the ring's): the newest W + 1 queries of the ring
        count = torch.minimum(count, sr.take(knobs.aspd_window).long() + 1)
        q_hat = aspd.predict_next_query(window, count, sr.take(knobs.aspd_ridge)[:, None])
        sink = sr.take(knobs.sink).to(torch.int32)
        next_b = torch.clamp(sr.take(knobs.n) + 1 - sr.take(knobs.recent), min=0).to(torch.int32)  # next b_start
        hi = torch.where(sr.valid, next_b, 0).to(torch.int32)  # slots without a row: nothing scored
        n_max = store.cfg.max_context
        scores = token_scores(q_hat.float(), k_cache, req_to_token, sr.take(req_pool_indices), sink, hi, scale,
                              n_max)
        cap = store.sel_pos.shape[-1]
        k = max(1, min(cap, n_max))
        # the best `budget` tokens of [sink, hi), ascending; slots without a row: hi = 0, O(1)
        idx, n_tok = topk_range(scores, sink, hi, sr.take(knobs.budget).to(torch.int32), k,
                                out=torch.empty(slot.shape[0], k_cache.shape[1], k, dtype=torch.int32,
                                                device=q3.device))
        pos = torch.empty(slot.shape[0], k_cache.shape[1], cap, dtype=torch.int32, device=q3.device)
        cnt = torch.empty(slot.shape[0], k_cache.shape[1], dtype=torch.int32, device=q3.device)
        expand_selection(None, idx, k, next_b, pos, cnt, page=1, n_sink=sink, count=n_tok)
        store.sel_pos[li][slot] = pos
        store.sel_count[li][slot] = cnt
