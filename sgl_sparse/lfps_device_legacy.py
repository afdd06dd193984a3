"""A/B baseline only: lfps's device path as it was before kernels/lfps_tables.py
(the table work as ~150 torch ops over [slots, Hkv, max_context] per layer), kept
so that one GPU run can time both (tests/kernels/test_query_device_graph.py::
test_query_aware_replay_cost_per_layer); selected by SGLANG_SPARSE_QA_LEGACY=1
(query_device.LEGACY). Not used otherwise; delete once the GPU numbers are in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_sparse.decision import DecodePlan
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.queryaware.lfps import candidates

if TYPE_CHECKING:
    from sgl_sparse.query_device import RowKnobs, SlotRows
    from sgl_sparse.query_store import LfpsStore


class LfpsForward:
    """lfps's per-forward tensors over its slots (nothing here depends on the layer)."""

    def __init__(self, store: LfpsStore, state, sr: SlotRows, knobs: RowKnobs, plan: DecodePlan,
                 indexed: torch.Tensor, req_pool_indices: torch.Tensor):
        self.sr = sr
        sel = sr.mine & indexed  # [bs]: the batch rows selected by lfps this step
        self.sel2 = sel[:, None]
        self.sel3 = sel[:, None, None]
        self.j = torch.where(sel, knobs.slot, 0).long()  # batch row -> its slot
        on = sr.take(sel, False)  # [S]: the slot's row is selected this step
        self.on2 = on[:, None]
        self.rpi = sr.take(req_pool_indices)  # 0 (the padding row) where none
        i32 = torch.int32
        self.n = torch.where(on, sr.take(knobs.n), 0).to(i32)  # 0: nothing read
        self.sink = sr.take(knobs.sink).to(i32)
        self.local = (sr.take(knobs.recent) - 1).clamp(min=0).to(i32)  # window = local + 1 (policies/lfps.py)
        self.budget = torch.where(on, sr.take(knobs.budget), 0).to(i32)
        self.b_start = sr.take(plan.b_start).to(i32)
        self.zero = torch.zeros_like(self.n)
        # float knobs by request row: the padding row's are 0 (its slots are off)
        self.r = state.lfps_r[self.rpi][:, None, None]
        self.eps = state.lfps_eps[self.rpi][:, None]
        self.a = state.lfps_a[self.rpi][:, None, None]
        # the tables' valid positions [sink, n) and Φ_sla(i) = sla[n - 2 - i] (queryaware.lfps.table_views)
        m = store.cfg.max_context
        pos = torch.arange(m, device=self.n.device)
        n = self.n.long()[:, None]
        self.valid = ((pos[None, :] >= self.sink.long()[:, None]) & (pos[None, :] < n))[:, None, :]
        off = n - 2 - pos[None, :]
        self.sla_idx = off.clamp(0, m - 1)[:, None, :]
        self.sla_ok = (off >= 0)[:, None, :]
        self.c_max = torch.full_like(self.n, store.cfg.candidates)
        self.last = self.n.long()[:, None, None] - 1  # the current query's index


class LfpsSelection(NamedTuple):
    """One layer's select -> finish hand-over (per slot)."""

    bypass: torch.Tensor  # [S, Hkv] bool
    positions: torch.Tensor  # [S, Hkv, K] int64: C2 ascending, 0 past count
    count: torch.Tensor  # [S, Hkv] int32: |C2| (0 on bypassed heads)
    weights: torch.Tensor  # [S, Hkv, K] fp32: w_i on C2 (group mean softmax over C2)


class LegacyLfpsDevice:
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
               scale: float, a_pos: torch.Tensor, a_len: torch.Tensor) -> None:
        pos, cnt = self._select(li, f, q3, k_cache, req_to_token, scale)
        width = pos.shape[-1]
        a_pos[..., :width] = torch.where(f.sel3, pos[f.j], a_pos[..., :width])
        torch.where(f.sel2, cnt[f.j], a_len, out=a_len)

    def _select(self, li: int, f: LfpsForward, q3: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment A per slot: (positions [S, Hkv, capacity] int32, a_len [S, Hkv] int32)."""
        from sgl_sparse.kernels.lfps_sparsity import lfps_head_sparsity
        from sgl_sparse.kernels.quest_pages import expand_selection
        from sgl_sparse.kernels.token_scores import token_scores_at
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.store
        s, hkv = f.n.shape[0], k_cache.shape[1]
        q = f.sr.take_any(q3)  # [S, Hq, D]; slots without a row: masked (n = 0)
        # 1. sink bypass: group mean of ρ above eps [ours: GQA aggregation]
        rho = lfps_head_sparsity(q, k_cache, req_to_token, f.rpi, f.n, f.sink, f.local, store.kbar[li],
                                 store.sigma_hat2[li], scale)
        bypass = rho.view(s, hkv, -1).mean(-1) > f.eps
        # 2-3. C0, C1 from the tables
        ver = store.ver[li]
        sla = torch.where(f.sla_ok, torch.gather(store.sla[li], -1, f.sla_idx.expand(-1, hkv, -1)), 0.0)
        _, c1 = candidates(ver, sla, f.valid, f.a)
        prio = torch.where(c1 & ~bypass[..., None], ver + sla, float("-inf"))
        cand = torch.empty(s, hkv, self.c, dtype=torch.int32, device=q.device)  # read below n_c1 only
        cand, n_c1 = topk_range(prio, f.sink, f.n, f.c_max, self.c, out=cand)
        # 4. exact q.k on C1 (group max), Top-budget -> C2 (candidate indices, ascending)
        rank = token_scores_at(q, k_cache, req_to_token, f.rpi, cand, scale, cand_len=n_c1)
        idx, count = topk_range(rank, f.zero, n_c1.amax(1), f.budget, self.k)  # idx zero past count
        keep = torch.arange(self.k, device=q.device) < count[..., None]
        pos = torch.where(keep, torch.gather(cand, -1, idx).long(), 0)
        # Eq. (10)'s w_i: each query head's softmax over C2, the group's mean [ours]
        tok = req_to_token[f.rpi[:, None, None], pos].long()
        keys = k_cache[tok, torch.arange(hkv, device=q.device)[None, :, None]]  # [S, Hkv, K, D]
        lg = torch.einsum("shgd,shkd->shgk", q.float().view(s, hkv, -1, q.shape[-1]), keys.float()) * scale
        w = torch.softmax(lg.masked_fill(~keep[:, :, None, :], float("-inf")), -1).nan_to_num(0.0).mean(2)
        self._sel = LfpsSelection(bypass, pos, count, w)
        a_pos = torch.empty(s, hkv, store.cfg.capacity, dtype=torch.int32, device=q.device)
        a_len = torch.empty(s, hkv, dtype=torch.int32, device=q.device)
        expand_selection(None, idx, self.k, f.b_start, a_pos, a_len, page=1, n_sink=f.sink, cand_pos=cand,
                         count=count)
        return a_pos, torch.where(bypass, 0, a_len)  # bypassed heads: V̄ after the attention

    def finish(self, li: int, f: LfpsForward, q3: torch.Tensor, o3: torch.Tensor, k_cache: torch.Tensor,
               req_to_token: torch.Tensor, scale: float) -> None:
        """After this layer's attention (and its select): V̄ on the bypassed heads
        of the batch rows, then Eq. (10) on the slots' tables."""
        store, sel = self.store, self._sel
        hkv = sel.bypass.shape[1]
        grp = o3.shape[1] // hkv
        bypass = (sel.bypass[f.j] & f.sel2).repeat_interleave(grp, dim=1)[..., None]  # [bs, Hq, 1]
        vbar = store.vbar[li][f.j].to(o3.dtype).repeat_interleave(grp, dim=1)
        o3.copy_(torch.where(bypass, vbar, o3))
        # Tables learn from the steps that used them [ours]: other slots are multiplied by 1, added 0.
        active = f.on2 & ~sel.bypass & (sel.count > 0)  # [S, Hkv]
        keep = (torch.arange(sel.positions.shape[-1], device=o3.device) < sel.count[..., None]) & active[..., None]
        inc = torch.where(keep, sel.weights - 0.5 / sel.count.clamp(min=1)[..., None], 0.0)
        decay = torch.where(active[..., None], f.r, 1.0)
        ver, sla = store.ver[li], store.sla[li]
        ver.mul_(decay).scatter_add_(-1, sel.positions, inc)
        off = f.last - sel.positions  # the slash offset of each C2 position
        ok = keep & (off >= 0) & (off < sla.shape[-1])
        sla.mul_(decay).scatter_add_(-1, torch.where(ok, off, 0), torch.where(ok, inc, 0.0))
