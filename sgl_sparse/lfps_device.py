"""lfps's decode step on the device path (query_device.QueryAwareDevice): the
same math as the host-grouped torch path (queryaware/lfps.py step +
update_tables, driven by query_serving.py), over the policy's store slots with
static shapes only, so that SGLang's decode CUDA graphs can capture it.

The torch path sizes its work by the group's longest sequence and reads a dense
[g, n_max, Hkv, D] view of the keys, both host-decided. Here, per layer, one
program per (slot, KV head) in every launch (the priorities' and C1's: several,
each a chunk of the row):
  ρ           kernels/lfps_sparsity.py's formula, the sink and local keys read in
              place, in the tables' first launch (a program of its own a row)
  tables      kernels/lfps_tables.lfps_priority: the bypass (group mean of ρ
              above eps), Eq. (8)'s thresholds (the tables' moments in one
              pass), C0 / C1 and the priorities
              Φ_ver + Φ_sla over the valid range [sink, n) only; where C1 fits
              the `candidates` budget (the usual case), C1 listed ascending, and
              where it also fits `budget`, C2 = C1 listed too
  C1 buffer   kernels/topk_range.py over [sink, n) of the other rows: the
              `candidates` best by Φ_ver + Φ_sla, ascending (the torch path's
              topk of the same set)
  exact q.k   kernels/token_scores.token_scores_at on C1 only (group max)
  C2          topk_range of those scores, Top-`budget`, ascending (the rows
              whose C2 is not all of C1)
  segment A   kernels/lfps_tables.lfps_select_out: sinks, then C2 below
              b_start, straight into the slot's batch row of a_pos / a_len;
              and |C1| and n - sink added to the slot's `scored` sums
  finish      kernels/lfps_tables.lfps_finish: bypassed heads output V̄;
              Eq. (10) in place on the slots' tables
Slots without an indexed row this step get n = 0 and budget 0: every program of
theirs returns at once (reads nothing, writes nothing), so a step pays for its
live slots only, and a batch without an lfps row pays eight near-empty launches
per layer, the queries read in place by the slots' batch rows (it was ~150 torch ops over [slots, Hkv, max_context]:
bench/kernels/count_query_aware_ops.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_sparse.decision import DecodePlan

if TYPE_CHECKING:
    from sgl_sparse.query_device import RowKnobs, SlotRows
    from sgl_sparse.query_store import LfpsStore


class LfpsForward:
    """lfps's per-forward tensors over its slots (nothing here depends on the layer)."""

    def __init__(self, store: LfpsStore, state, sr: SlotRows, knobs: RowKnobs, plan: DecodePlan,
                 indexed: torch.Tensor, req_pool_indices: torch.Tensor):
        self.sr = sr
        sel = sr.mine & indexed  # [bs]: the batch rows selected by lfps this step
        on = sr.take(sel, False)  # [S]: the slot's row is selected this step
        self.row = sr.b  # [S] the slot's batch row (read where on only)
        self.rpi = sr.take(req_pool_indices)  # 0 (the padding row) where none
        i32 = torch.int32
        self.n = torch.where(on, sr.take(knobs.n), 0).to(i32)  # 0: no program of the slot does anything
        self.sink = sr.take(knobs.sink).to(i32)
        self.local = (sr.take(knobs.recent) - 1).clamp(min=0).to(i32)  # window = local + 1 (policies/lfps.py)
        self.budget = torch.where(on, sr.take(knobs.budget), 0).to(i32)
        self.b_start = sr.take(plan.b_start).to(i32)
        self.zero = torch.zeros_like(self.n)
        # float knobs by request row: the padding row's are 0 (its slots are off)
        self.r = state.lfps_r[self.rpi]
        self.eps = state.lfps_eps[self.rpi]
        self.a = state.lfps_a[self.rpi]
        self.c_max = torch.full_like(self.n, store.cfg.candidates)


class LfpsSelection(NamedTuple):
    """One layer's select -> finish hand-over (per slot)."""

    bypass: torch.Tensor  # [S, Hkv] int8
    cand: torch.Tensor  # [S, Hkv, C] int32: C1 positions, ascending
    idx: torch.Tensor  # [S, Hkv, K] int32: C2 as indices into cand, ascending, the first `count`
    count: torch.Tensor  # [S, Hkv] int32: |C2| (0 on bypassed heads)


class LfpsDevice:
    def __init__(self, store: LfpsStore):
        self.store = store
        m = store.cfg.max_context
        self.c = max(1, min(store.cfg.candidates, m))  # static |C1| buffer
        self.k = max(1, min(store.cfg.capacity, self.c))  # static Top-k width (budget < capacity)
        self._sel: LfpsSelection | None = None

    def forward(self, state, sr: SlotRows, knobs: RowKnobs, plan: DecodePlan, indexed: torch.Tensor,
                req_pool_indices: torch.Tensor) -> LfpsForward:
        return LfpsForward(self.store, state, sr, knobs, plan, indexed, req_pool_indices)

    def select(self, li: int, f: LfpsForward, q3: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
               scale: float, a_pos: torch.Tensor, a_len: torch.Tensor, a_slots: torch.Tensor | None = None) -> None:
        """Segment A of the live slots' batch rows, IN PLACE into a_pos [bs, Hkv, >= capacity]
        and a_len [bs, Hkv] (bypassed heads: a_len 0, V̄ after the attention), and as
        pool slots into a_slots (shaped as a_pos) where given."""
        from sgl_sparse.kernels.lfps_sparsity import RhoFrom
        from sgl_sparse.kernels.lfps_tables import lfps_priority, lfps_select_out
        from sgl_sparse.kernels.token_scores import token_scores_at
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.store
        s, hkv = f.n.shape[0], k_cache.shape[1]
        dev = q3.device
        # each slot reads its row's query in place (slots without a row: row 0's, unused: n = 0)
        # 1. ρ (in the tables' first launch); 2-3. the bypass, C0, C1 and the priorities
        rho = torch.empty(s, q3.shape[1], dtype=torch.float32, device=dev)
        rho_from = RhoFrom(q3, k_cache, req_to_token, f.rpi, f.local, store.kbar[li], store.sigma_hat2[li], scale,
                           q_rows=f.sr.b_any)
        # C1 where it fits its budget (the usual case) listed by the priorities' own
        # launches, and C2 = C1 where C1 also fits C2's; topk_range selects the other
        # rows only
        cand = torch.empty(s, hkv, self.c, dtype=torch.int32, device=dev)  # read below n_c1 only
        n_c1 = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        listed = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        idx = torch.empty(s, hkv, self.k, dtype=torch.int32, device=dev)  # read below count only
        count = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        all_c1 = torch.empty(s, hkv, dtype=torch.int32, device=dev)
        prio, bypass = lfps_priority(rho, f.eps, f.a, store.ver[li], store.sla[li], f.n, f.sink,
                                     c1_list=(f.c_max, cand, n_c1, listed), c2_list=(f.budget, idx, count, all_c1),
                                     rho_from=rho_from,
                                     shift=None if store.shift is None else store.shift[li])
        cand, n_c1 = topk_range(prio, f.sink, f.n, f.c_max, self.c, out=cand, out_len=n_c1, skip=listed)
        # 4. exact q.k on C1 (group max), Top-budget -> C2 (candidate indices, ascending); past n_c1: -inf
        # slots without a row (budget 0: their Top-k reads nothing) write nothing
        rank = token_scores_at(q3, k_cache, req_to_token, f.rpi, cand, scale, cand_len=n_c1, q_rows=f.sr.b_any,
                               row_on=f.budget)
        idx, count = topk_range(rank, f.zero, f.c_max, f.budget, self.k, out=idx, out_len=count, skip=all_c1)
        self._sel = LfpsSelection(bypass, cand, idx, count)
        # and the scored fraction's sums of each live slot (|C1|, n - sink), no launch of their own
        lfps_select_out(f.row, f.n, f.sink, f.b_start, cand, idx, count, bypass, a_pos, a_len, store.cfg.capacity,
                        slots=None if a_slots is None else (req_to_token, f.rpi, a_slots),
                        scored=(n_c1, store.scored))

    def finish(self, li: int, f: LfpsForward, q3: torch.Tensor, o3: torch.Tensor, k_cache: torch.Tensor,
               req_to_token: torch.Tensor, scale: float) -> None:
        """After this layer's attention (and its select): V̄ on the bypassed heads
        of the live slots' rows, then Eq. (10) on their tables [ours: the tables
        learn from the steps that used them]."""
        from sgl_sparse.kernels.lfps_tables import lfps_finish

        store, sel = self.store, self._sel
        lfps_finish(q3, o3, k_cache, req_to_token, f.rpi, f.row, f.n, f.r, sel.cand, sel.idx, sel.count,
                    sel.bypass, store.vbar[li], store.ver[li], store.sla[li], scale, tscale=store.tscale[li],
                    shift=None if store.shift is None else store.shift[li])
