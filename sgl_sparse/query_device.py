"""Decode selection of quest, asyncspade and lfps that SGLang's decode CUDA graphs
can capture: the request knobs read by row from SparseState's device columns, the
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

Per forward (at its first layer, QueryAwareDevice._forward; see there why that is
safe under CUDA graphs): the knobs by row, the slot -> row maps, the masks and
ranges, in one launch (kernels/qa_forward.py; the torch classes below are its
reference, tests/kernels/test_qa_forward.py). Per layer, decode, only:
  select   quest       fold the key at n - 1 into its page's bounds, page scores of
                       this query (group max), Top pages -> a_pos (sinks first)
           asyncspade  the selection its previous step stored for this one
           lfps        ρ, candidates from the tables, exact q.k on them, Top-k
                       -> a_pos (sgl_sparse/lfps_device.py)
  finish   lfps        bypassed heads output V̄, the tables' update (Eq. 10)
           asyncspade  push this query and predict the next one (one launch,
                       kernels/asyncspade_predict.py), score [sink, next
                       b_start) with it, Top-K -> the store, for the next step
Under a CUDA graph every block above is a conditional node (graph_gate.only_if):
per layer one gate on "the batch has a live quest/asyncspade/lfps row", and
inside it one per policy, so a replay without such rows costs a few nodes per
layer instead of the policies' kernels, and `full` traffic on a server with the
captured path stays at stock speed. Hence the in-place outputs of select().
Where no conditional node can be captured (torch without the API, e.g. the H100
image's 2.11; graph_gate.flag) every block runs at every step, so every kernel on
these paths takes the slots' / rows' liveness (n = 0, an empty range, slot or
source row -1) and its programs for a slot or row without a live one return at
once: a replay without quest / asyncspade / lfps rows costs per layer 16
near-empty launches and no torch op (bench/kernels/count_query_aware_ops.py;
it was 13 launches and 159 ops, lfps's tables over [slots, Hkv, max_context]).
Same selections as the torch path (the CPU path and this one's oracle,
tests/test_query_device.py), listed in ascending position order: the Top pages /
tokens come from kernels/topk_range.py, whose work per slot is bounded by the
slot's live range (a slot without a row costs O(1)), not by max_pages /
max_context as torch.topk's is.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

from sgl_sparse.kernels._utils import env_count, env_switch, env_value
from sgl_sparse.config import QUEST_PAGE
from sgl_sparse.decision import DecodePlan, StoreLists
from sgl_sparse import graph_gate
from sgl_sparse.graph_gate import only_if
from sgl_sparse.lfps_device import LfpsDevice, LfpsForward
from sgl_sparse.policies.base import QUERY_AWARE_IDS, PolicyId

#: asyncspade's next-step selection on a side CUDA stream (on unless
#: SGLANG_SPARSE_ASPD_SIDE_STREAM=0). Its first H100 run (session 6) hit an illegal
#: memory access in the 8-layer overlap test, whose timing replays then ran graphs
#: over freed tensors; with that test fixed it passed on the H100 (same selections
#: as the main-stream path, 66% of the shorter phase hidden) and served a 32768 x 8
#: e2e without error (bench/README.md, "Session 7").
ASPD_SIDE_STREAM = env_switch("ASPD_SIDE_STREAM", True)
#: Side streams the layers' selections alternate over (SGLANG_SPARSE_ASPD_SIDE_STREAMS,
#: 1-4, default 1). On one stream a layer's Top-K (latency-bound: a few hundred
#: programs walking their rows) waits for the previous layer's scoring (bandwidth-
#: bound) and the next layer's scoring for it; on two, layer l + 1's scoring runs
#: beside layer l's Top-K. Measured in session 22 with persistent scoring programs,
#: which kept the streams from overlapping at all: no difference (1.328x vs 1.339x
#: stock, H200, 32768 x 8); one until it is measured with the short programs.
ASPD_SIDE_STREAMS = env_count("ASPD_SIDE_STREAMS", 1, 1, 4)
#: asyncspade with index keys: the scoring pass also counts, per (slot, KV head), the
#: 64-bin histogram of the top 6 bits of the scores it writes (kernels/token_scores.py
#: HIST), and the Top-K reads it (topk_range's h_top) instead of its first serial pass
#: over each row. Only where the Top-K runs the kernel that takes it anyway
#: (topk_range.takes_htop: serving's 32K+ rows, unsplit). Same selections bit for bit.
#: The copies' widths it runs for: int8 by default (H200, 32768 x 8, session 24: 1.560x
#: stock against 1.519x without). Not 4-bit: there the count costs the pass more than
#: the Top-K saves (session 25: 49.7 -> 68.7 us a layer, against 858 -> 667 us of Top-K
#: over 28 layers; end to end 1.862x stock without it, 1.760x with, same run).
#: SGLANG_SPARSE_TOPK_HIST_FROM_SCORES=1 counts for both widths, =0 for neither.
TOPK_HIST_FROM_SCORES: frozenset = (frozenset({8}) if env_value("TOPK_HIST_FROM_SCORES") is None
                                    else frozenset({8, 4}) if env_switch("TOPK_HIST_FROM_SCORES", True)
                                    else frozenset())
#: With asyncspade's side streams, the decode graphs are captured on the device's
#: highest-priority stream (compat.capture_graphs_at_high_priority): a default-priority
#: stream is the lowest, so only a main stream above it lets the block scheduler give
#: the main stream's kernels the SMs the scoring's programs free, instead of the
#: scoring's next ones. SGLANG_SPARSE_ASPD_HIGH_PRIORITY_MAIN=0 leaves SGLang's stream.
ASPD_HIGH_PRIORITY_MAIN = env_switch("ASPD_HIGH_PRIORITY_MAIN", True)
#: With asyncspade's side streams under a decode CUDA graph, the main stream joins them
#: at the end of the captured forward (compat.add_capture_tail_hook: after the LM head)
#: instead of in the last layer's attention, where o_proj, the MLP, the final norm and
#: the LM head (~190 us at 32768 x 8, H200) wait behind the last layer's scoring and the
#: last group's Top-K (545 us there) though none of them reads what those write
#: (session 27's timeline). Eager forwards still join in the last layer: an extend
#: right after may reassign a slot the side stream is still scoring. Off until
#: measured end to end (SGLANG_SPARSE_ASPD_JOIN_AFTER_FORWARD=1).
ASPD_JOIN_AFTER_FORWARD = env_switch("ASPD_JOIN_AFTER_FORWARD", False)

#: The policies this module serves: every query-aware one (the plugin offers them
#: with decode CUDA graphs on where the config opts in).
POLICIES = tuple(QUERY_AWARE_IDS)


class RowKnobs:
    """The batch rows' knobs, gathered once per forward from SparseState."""

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
        # for per-layer gathers of [bs, ...] tensors without a fill row: slots
        # without a row read row 0 (or nothing when bs == 0); callers mask them
        self.b_any = self.b.clamp(max=max(bs - 1, 0))

    def take(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """x [bs, ...] -> [S, ...]: each slot's row (fill where none)."""
        return torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])[self.b]

    def slot_or(self, other: int, where: torch.Tensor | None = None) -> torch.Tensor:
        """[S] int32: the slot index where it has a row (and `where`), else `other`."""
        ok = self.valid if where is None else self.valid & where
        return torch.where(ok, self.ids, other)


class _QuestForward:
    """quest's per-forward tensors over its slots (nothing here depends on the layer)."""

    def __init__(self, store, sr: SlotRows, knobs: RowKnobs, plan: DecodePlan, indexed: torch.Tensor,
                 req_pool_indices: torch.Tensor, cap: int):
        self.sr = sr
        self.rpi = sr.take(req_pool_indices)
        self.n = sr.take(knobs.n)
        self.slot_live = sr.slot_or(-1)  # bounds: every step of a live row
        self.sel = sr.mine & indexed  # [bs]
        self.sink = sr.take(knobs.sink).to(torch.int32)
        self.b_start = sr.take(plan.b_start).to(torch.int32)
        # candidate pages hold a position in [sink, b_start)
        self.first = torch.div(self.sink, QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        self.last = torch.div(self.b_start + QUEST_PAGE - 1, QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        self.slot_sel = sr.slot_or(-1, sr.take(self.sel, False))
        # slots not selected this step: an empty range
        self.last_sel = torch.where(self.slot_sel >= 0, self.last, self.first)
        self.pages = torch.div(sr.take(knobs.budget), QUEST_PAGE, rounding_mode="floor").to(torch.int32)
        # static k: enough pages for any budget the store's capacity admits (+1: a
        # page clipped by the sink leaves room for one more)
        self.k = max(1, min(store.max_pages, cap // QUEST_PAGE + 1))
        self.out_row = torch.where(self.slot_sel >= 0, sr.b, -1)  # slot -> the batch row it writes, -1: none


class _AspdForward:
    """asyncspade's per-forward tensors: the batch rows reading their stored
    selection (select), and the slots computing the next one (finish)."""

    def __init__(self, store, sr: SlotRows, knobs: RowKnobs, indexed: torch.Tensor, req_pool_indices: torch.Tensor):
        # select: the rows that read their selection
        sel = sr.mine & indexed
        self.src = torch.where(sel, knobs.slot, -1).to(torch.int32)  # -1: the row keeps its a_pos / a_len
        # finish: over the slots
        self.sr = sr
        self.slot = sr.slot_or(store.scratch_slot).long()  # slots without a row write the scratch slot
        self.push = sr.slot_or(-1)  # the prediction skips slots without a row (no push, q_hat = 0)
        # the request's W (<= the ring's): the newest W + 1 queries of the ring
        W = store.ring.shape[2]
        self.count_cap = torch.clamp(sr.take(knobs.aspd_window).long() + 1, max=W)
        self.ridge = sr.take(knobs.aspd_ridge)[:, None]
        self.sink = sr.take(knobs.sink).to(torch.int32)
        self.next_b = torch.clamp(sr.take(knobs.n) + 1 - sr.take(knobs.recent), min=0).to(torch.int32)
        self.hi = torch.where(sr.valid, self.next_b, 0).to(torch.int32)  # slots without a row: nothing scored
        self.rpi = sr.take(req_pool_indices)
        self.budget = sr.take(knobs.budget).to(torch.int32)
        # the group Top-K's rows (topk_layers > 1): layer g of a group is rows
        # [g * slots, (g + 1) * slots) of its scores, and rows g * (slots + 1) + slot of
        # the store's sel_pos / sel_count from the group's first layer on
        self.group = _AspdGroupRows.of(self, store)


class _AspdGroupRows:
    """_AspdForward's per-slot tensors tiled over the layers of a Top-K group (the
    same for every layer of a forward); a group of g < G layers (the last) reads the
    first g * slots rows."""

    @staticmethod
    def of(f, store) -> "_AspdGroupRows | None":
        """f's group rows under store's topk_layers; None when each layer selects alone."""
        return _AspdGroupRows(f, store.topk_layers, store.rows) if store.topk_layers > 1 else None

    def __init__(self, f: _AspdForward, layers: int, store_rows: int):
        self.sink = f.sink.repeat(layers)
        self.hi = f.hi.repeat(layers)
        self.budget = f.budget.repeat(layers)
        self.next_b = f.next_b.repeat(layers)
        self.rpi = f.rpi.repeat(layers)
        push = f.push.repeat(layers)
        layer = torch.arange(layers, device=push.device, dtype=push.dtype).repeat_interleave(f.push.shape[0])
        self.push = torch.where(push >= 0, push + layer * store_rows, -1)


class QueryAwareDevice:
    def __init__(self, state, cap: int):
        self.state = state
        self.cap = cap
        self.quest = state.query_stores.get(PolicyId.QUEST)
        self.aspd = state.query_stores.get(PolicyId.ASYNCSPADE)
        lfps_store = state.query_stores.get(PolicyId.LFPS)
        self.lfps = LfpsDevice(lfps_store) if lfps_store is not None else None
        #: the policies served here, in PolicyId order
        self.policies: tuple[PolicyId, ...] = tuple(
            p for p, x in ((PolicyId.QUEST, self.quest), (PolicyId.ASYNCSPADE, self.aspd), (PolicyId.LFPS, self.lfps))
            if x is not None)
        #: the policies whose blocks the forwards run (None: all of them); the backend
        #: narrows it while SGLang captures a `qa_<policy>` decode graph (graph_variants.py)
        self.only: frozenset[PolicyId] | None = None
        self._plan: DecodePlan | None = None  # the step plan _fwd was computed for
        self._fwd_quest: _QuestForward | None = None
        self._fwd_aspd: _AspdForward | None = None
        self._fwd_lfps: LfpsForward | None = None
        # 0-dim bool device flags of this forward (graph_gate.flag): the policy has
        # a live row; any of them has (None where conditional nodes are unavailable)
        self._on: dict[PolicyId, torch.Tensor | None] = {}
        self._any: torch.Tensor | None = None
        # one policy this forward: its own flag is the whole gate, no inner gates (two nodes each)
        self._inner = len(self.policies) > 1
        self._aspd_arrivals = None
        self._sides: list[torch.cuda.Stream] = []  # none: the selection runs on the main stream
        self._aspd_topk_side: torch.cuda.Stream | None = None  # the stream of the last group Top-K (topk_layers)
        self._side_pending = False
        # the backend's capture tail hook joins captured forwards (ASPD_JOIN_AFTER_FORWARD)
        self.join_after_forward = False
        if self.aspd is not None:
            from sgl_sparse.kernels.asyncspade_predict import make_arrivals

            ring = self.aspd.ring  # [L, R, W, Hq, D]
            # asyncspade_predict's per-ring-row counters: allocated here, before any
            # graph capture, and left zeroed by every launch
            self._aspd_arrivals = make_arrivals(self.aspd.rows, ring.device)
            # q_hat per layer: the side stream reads layer l's while the main stream
            # predicts layer l + 1's
            self._qhat = torch.empty(ring.shape[0], self.aspd.cfg.slots, *ring.shape[3:], dtype=torch.float32,
                                     device=ring.device)
            self._last_layer = ring.shape[0] - 1
            if self.aspd.remote and ring.device.type == "cuda":
                # the selection on its cache GPU (query_aware.asyncspade.cache_device): streams
                # there, forked from and joined to the serving GPU's main stream by events
                self._sides = [torch.cuda.Stream(device=self.aspd.cache_device) for _ in range(ASPD_SIDE_STREAMS)]
            elif ring.device.type == "cuda" and ASPD_SIDE_STREAM:
                self._sides = [torch.cuda.Stream(device=ring.device) for _ in range(ASPD_SIDE_STREAMS)]

    @property
    def wants_high_priority_main(self) -> bool:
        """asyncspade's selection runs on side streams beside the main stream, which
        should then rank above them (ASPD_HIGH_PRIORITY_MAIN): the backend captures
        SGLang's decode graphs at high priority (compat.capture_graphs_at_high_priority)."""
        return bool(self._sides) and ASPD_HIGH_PRIORITY_MAIN and not self.aspd.remote

    @property
    def wants_join_after_forward(self) -> bool:
        """Side streams to join after the captured forward (ASPD_JOIN_AFTER_FORWARD):
        the backend registers join_pending as SGLang's capture tail hook."""
        return bool(self._sides) and ASPD_JOIN_AFTER_FORWARD

    def join_pending(self) -> None:
        """Join the side streams if this forward forked them and has not joined yet."""
        if self._side_pending:
            self._join_side()

    def _forward(self, plan: DecodePlan, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The per-forward tensors (knobs by row, slot -> row maps, masks, ranges),
        computed at the first layer of a forward and reused by the others.

        Keyed on the step plan OBJECT, which the backend builds once per forward
        (init_forward_metadata_in_graph -> plan_decode) and passes to every layer.
        Under CUDA graphs that call is part of the captured region, like the layers:
        at capture, Python builds one plan, the first layer computes these tensors
        (its ops are captured, reading the graph's static inputs and SparseState's
        columns in place) and the later layers read the tensors it produced; at
        replay no Python runs and the captured ops recompute them from the current
        inputs, before the first layer's kernels, in the same order. Eager forwards
        get a new plan object, hence fresh tensors. A key that changes between
        replays on the host (a counter bumped in init_forward_metadata_out_graph)
        would NOT work: replays skip this Python, so it would never be seen. The
        plan is held (not its id()), so a later plan cannot reuse its address.

        One launch builds all of them (_forward_fused), ungated: the policies'
        flags are computed from its output, and every layer's work that reads a
        policy's tensors is gated on that policy's flag."""
        if self._plan is plan:
            return
        if self._side_pending:  # a forward that stopped before its last layer
            self._join_side()
        self._fwd_quest = self._fwd_aspd = self._fwd_lfps = None
        self._on = {}
        self._forward_fused(plan, req_pool_indices, seq_lens)
        flags = list(self._on.values())  # all None or none (graph_gate.flag)
        self._any = None if not flags or flags[0] is None else functools.reduce(operator.or_, flags)
        self._inner = len(self._on) > 1
        self._plan = plan

    def _forward_fused(self, plan: DecodePlan, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """All three policies' per-forward tensors in one launch (kernels/qa_forward.py:
        one program per store slot finds the slot's batch row and writes its fields),
        instead of ~155 small torch ops that every captured replay ran whatever the
        batch held. Same values as _forward_torch's classes (its reference). The
        flags are read from the kernel's `valid` rows, so the gates (where
        conditional nodes exist) wait for it like every later block."""
        from sgl_sparse.kernels.qa_forward import qa_forward
        from sgl_sparse.policies import query_aware

        fw = qa_forward(
            self.state, req_pool_indices.contiguous(), seq_lens.contiguous(), plan.b_start.contiguous(),
            plan.a_slot.contiguous() if plan.a_slot is not None else None, indexed_id=query_aware.INDEXED,
            page=QUEST_PAGE, quest_slots=self.quest.cfg.slots if self.quest is not None else None,
            aspd_slots=self.aspd.cfg.slots if self.aspd is not None else None,
            aspd_scratch=self.aspd.scratch_slot if self.aspd is not None else 0,
            aspd_ring_w=self.aspd.ring.shape[2] if self.aspd is not None else 1,
            lfps_slots=self.lfps.store.cfg.slots if self.lfps is not None else None,
            lfps_candidates=self.lfps.store.cfg.candidates if self.lfps is not None else 0)
        for pid, key, attr in ((PolicyId.QUEST, "quest", "_fwd_quest"),
                               (PolicyId.ASYNCSPADE, "asyncspade", "_fwd_aspd"),
                               (PolicyId.LFPS, "lfps", "_fwd_lfps")):
            # a `qa_<policy>` graph (self.only): the other policies' blocks are left out
            if key not in fw or (self.only is not None and pid not in self.only):
                continue
            f = fw[key]
            f.sr = f  # the per-layer code reads the slot -> row map as f.sr.b_any
            f.row = f.b  # lfps: the slot's batch row (bs: none)
            if pid == PolicyId.QUEST:
                # static k: as _QuestForward
                f.k = max(1, min(self.quest.max_pages, self.cap // QUEST_PAGE + 1))
            if pid == PolicyId.ASYNCSPADE:  # as _AspdForward
                f.group = _AspdGroupRows.of(f, self.aspd)
            self._on[pid] = graph_gate.flag(f.valid)
            setattr(self, attr, f)

    def _forward_torch(self, plan: DecodePlan, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The per-forward tensors as torch ops: the reference that
        tests/kernels/test_qa_forward.py checks _forward_fused against (serving
        never calls it)."""
        knobs = RowKnobs(self.state, req_pool_indices, seq_lens)
        indexed = plan.indexed()
        if self.quest is not None:
            sr = SlotRows(knobs, PolicyId.QUEST, self.quest.cfg.slots)
            self._on[PolicyId.QUEST] = graph_gate.flag(sr.valid)
            with only_if(self._on[PolicyId.QUEST]):
                self._fwd_quest = _QuestForward(self.quest, sr, knobs, plan, indexed, req_pool_indices, self.cap)
        if self.aspd is not None:
            sr = SlotRows(knobs, PolicyId.ASYNCSPADE, self.aspd.cfg.slots)
            self._on[PolicyId.ASYNCSPADE] = graph_gate.flag(sr.valid)
            with only_if(self._on[PolicyId.ASYNCSPADE]):
                self._fwd_aspd = _AspdForward(self.aspd, sr, knobs, indexed, req_pool_indices)
        if self.lfps is not None:
            sr = SlotRows(knobs, PolicyId.LFPS, self.lfps.store.cfg.slots)
            self._on[PolicyId.LFPS] = graph_gate.flag(sr.valid)
            with only_if(self._on[PolicyId.LFPS]):
                self._fwd_lfps = self.lfps.forward(self.state, sr, knobs, plan, indexed, req_pool_indices)

    def _gate(self, policy: PolicyId):
        """A policy's block inside the per-layer gate on any policy's flag."""
        return only_if(self._on[policy]) if self._inner else contextlib.nullcontext()

    def select(self, li: int, plan: DecodePlan, q3: torch.Tensor, k_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               a_pos: torch.Tensor, a_len: torch.Tensor, scale: float, *, slots: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, StoreLists | None]:
        """Fill this layer's quest, asyncspade and lfps INDEXED rows of a_pos
        [bs, Hkv, cap] and a_len [bs, Hkv] IN PLACE (other rows' a_len as given;
        their a_pos entries may change: nothing reads a_pos beyond a_len), and
        return both (and a_slots, below). In place, because under a CUDA graph a skipped block (no row
        of the policy this step) must leave valid outputs behind: the inputs.

        slots: the same lists as pool slots too (a_slots, the third result, else
        None), written by the producers in the same pass (kernels/indexed_slots.py
        is their definition): what the decode gathers from fastest, without a
        launch of its own. Only the entries below a_len of the rows filled here are
        written; nothing else of it is read (other rows are not INDEXED, or their
        a_len is the plan's 0).

        Where asyncspade's store keeps pool slots (query_store.ASPD_LISTS_IN_PLACE, which
        decides at start-up), its rows are not copied: the fourth result
        (else None) names their store rows, which the decode reads in place (written
        by the previous step's side stream, joined before this forward; this step's
        side stream forks after the layer's attention, in finish)."""
        self._forward(plan, req_pool_indices, seq_lens)
        a_slots = torch.empty_like(a_pos) if slots else None
        lists = None
        f = self._fwd_aspd
        if f is not None and self.aspd.sel_slot is not None:
            # f.src: -1 for every row but asyncspade's selected ones, every forward
            store = self.aspd
            lists = StoreLists(f.src, store.sel_pos[li], store.sel_count[li], store.sel_slot[li])
        with only_if(self._any):
            if self._fwd_quest is not None:
                with self._gate(PolicyId.QUEST):
                    self._quest(li, self._fwd_quest, q3, k_cache, req_to_token, a_pos, a_len, a_slots)
            if self._fwd_aspd is not None and lists is None:
                with self._gate(PolicyId.ASYNCSPADE):
                    from sgl_sparse.kernels.gather_selection import gather_selection

                    # one launch; rows without a selection return at once
                    gather_selection(self._fwd_aspd.src, self.aspd.sel_pos[li], self.aspd.sel_count[li], a_pos,
                                     a_len, slots=None if a_slots is None else (req_to_token, req_pool_indices,
                                                                                a_slots))
            if self._fwd_lfps is not None:
                with self._gate(PolicyId.LFPS):
                    self.lfps.select(li, self._fwd_lfps, q3, k_cache, req_to_token, scale, a_pos, a_len, a_slots)
        return a_pos, a_len, a_slots, lists

    def _quest(self, li, f: _QuestForward, q3, k_cache, req_to_token, a_pos, a_len, a_slots=None):
        from sgl_sparse.kernels.quest_pages import expand_selection, quest_bounds_decode, quest_page_scores
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.quest
        kmin, kmax = store.kmin[li], store.kmax[li]
        # Every step of a live row folds its new key in, covered steps included: a
        # row whose budget covered it at first must find all its pages current later.
        quest_bounds_decode(k_cache, req_to_token, f.rpi, f.slot_live, f.n, kmin, kmax)
        # [first, last) of the selected slots only (what topk_range reads); queries read in place
        scores = quest_page_scores(q3.to(kmin.dtype), kmin, kmax, f.slot_sel, f.first, f.last, fill=False,
                                   q_rows=f.sr.b_any)
        # the best `pages` pages, ascending; slots not selected this step: an empty range
        idx, n_pages = topk_range(scores, f.first, f.last_sel, f.pages, f.k,
                                  out=torch.empty(scores.shape[0], scores.shape[1], f.k, dtype=torch.int32,
                                                  device=scores.device))
        # straight into the selected slots' batch rows; the other slots' programs return at once
        # (the programs are slots: their request is the slot's, f.rpi)
        expand_selection(None, idx, f.k, f.b_start, a_pos, a_len, page=QUEST_PAGE, n_sink=f.sink, count=n_pages,
                         out_rows=f.out_row, slots=None if a_slots is None else (req_to_token, f.rpi, a_slots))

    def finish(self, li: int, q3: torch.Tensor, o3: torch.Tensor, k_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> None:
        """After the attention: lfps's sink bypass and table update, asyncspade's
        selection of the next step. Runs after this layer's select(), whose
        forward tensors it reads."""
        with only_if(self._any):
            if self._fwd_lfps is not None:
                with self._gate(PolicyId.LFPS):
                    self.lfps.finish(li, self._fwd_lfps, q3, o3, k_cache, req_to_token, scale)
            if self._fwd_aspd is not None:
                with self._gate(PolicyId.ASYNCSPADE):
                    self._aspd_predict(li, q3)
        if self._fwd_aspd is not None:
            self._aspd_next(li, k_cache, req_to_token, scale)

    def _aspd_predict(self, li: int, q3: torch.Tensor) -> None:
        """Push this query into the slot's ring and predict the next one: one launch
        (ring_push_window + predict_next_query of the torch path), on the main
        stream, where q3 lives."""
        from sgl_sparse.kernels.asyncspade_predict import asyncspade_predict

        store, f = self.aspd, self._fwd_aspd
        asyncspade_predict(store.ring[li], store.total[li], q3, f.push, f.ridge, q_rows=f.sr.b_any,
                           count_cap=f.count_cap, arrivals=self._aspd_arrivals, out=self._qhat[li])

    def _aspd_next(self, li: int, k_cache: torch.Tensor, req_to_token: torch.Tensor, scale: float) -> None:
        """The next step's selection from q_hat. On CUDA it runs on a side stream,
        off the critical path (ALGORITHMS.md §4): forked here, after the layer's
        prediction, it overlaps the main stream's later layers, and joins it once,
        after the last layer (a captured graph must join every fork before it
        ends; the next step's select of this layer reads what it writes). It reads
        only what outlives the forward (q_hat of this layer, the KV pool,
        req_to_token, this forward's slot tensors) and writes only the store's
        selection of this layer, which nothing reads before the join."""
        if not self._sides:
            with only_if(self._on[PolicyId.ASYNCSPADE]):
                self._aspd_select_next(li, k_cache, req_to_token, scale)
            return
        # layers alternate over the side streams (ASPD_SIDE_STREAMS); each stream's
        # temporaries are allocated and freed on it, so no block crosses streams
        side = self._sides[li % len(self._sides)]
        side.wait_stream(torch.cuda.current_stream())
        group = self.aspd.topk_layers
        if group > 1 and len(self._sides) > 1:
            if li % group == group - 1 or li == self._last_layer:
                # the group's Top-K reads the scores every stream wrote
                for other in self._sides:
                    if other is not side:
                        side.wait_stream(other)
                self._aspd_topk_side = side
            elif li >= group and self._aspd_topk_side is not side:
                # this layer's row of the scores is free once the previous group's Top-K has read it
                side.wait_stream(self._aspd_topk_side)
        # on the cache GPU no conditional node: its flag lives on the serving GPU (the
        # kernels' programs for slots without a row return at once either way)
        gate = None if self.aspd.remote else self._on[PolicyId.ASYNCSPADE]
        with torch.cuda.stream(side), only_if(gate):
            self._aspd_select_next(li, k_cache, req_to_token, scale)
        self._side_pending = True
        if li == self._last_layer and not (self.join_after_forward and torch.cuda.is_current_stream_capturing()):
            self._join_side()

    def _join_side(self) -> None:
        for side in self._sides:
            torch.cuda.current_stream().wait_stream(side)
        self._side_pending = False

    def _aspd_hist(self, li: int) -> bool:
        """Whether layer li's scoring counts h_top for its group's Top-K
        (TOPK_HIST_FROM_SCORES): index keys on, and the Top-K over the group's rows
        (the last group may be shorter) runs the kernel that reads it. Host sizes
        only: the same at every step, captured or not."""
        from sgl_sparse.kernels.topk_range import takes_htop

        store = self.aspd
        if store.htop is None or (4 if store.ksmooth is not None else 8) not in TOPK_HIST_FROM_SCORES:
            return False
        group = store.topk_layers
        layers = min(group, self._last_layer + 1 - (li - li % group))
        slots, heads = store.htop.shape[1:3]
        return takes_htop(store.cfg.max_context, layers * slots * heads, store.htop.device)

    def _aspd_select_next(self, li: int, k_cache: torch.Tensor, req_to_token: torch.Tensor, scale: float) -> None:
        """Score [sink, next b_start) with this layer's q_hat, Top-K -> the store."""
        from sgl_sparse.kernels.index_keys import index_token_scores
        from sgl_sparse.kernels.token_scores import token_scores

        store = self.aspd
        f = self._fwd_aspd
        q_hat = self._qhat[li]
        n_max = store.cfg.max_context
        group = store.topk_layers
        g = li % group
        # the group's Top-K reads layer li's histograms from row g of store.htop
        hist = self._aspd_hist(li)
        out = store.scores[g] if store.scores is not None else None
        # the pass's programs on the side stream: short ones (blocks_per_program) or
        # persistent ones, per_sm a SM (fewer leave room for the main stream)
        launch = dict(programs_per_sm=store.cfg.score_programs_per_sm,
                      blocks_per_program=store.cfg.score_blocks_per_program)
        # [sink, hi) only (what topk_range reads): slots without a row cost O(1), not max_context
        if store.index_keys:  # from the slot's int8 / 4-bit copies, the new positions copied on the way
            scores = index_token_scores(q_hat, k_cache, req_to_token, f.rpi, f.sink, f.hi, scale, n_max,
                                        store.kq[li], store.kscale[li], store.filled[li], out=out,
                                        **launch,
                                        ksmooth=store.ksmooth[li] if store.ksmooth is not None else None,
                                        h_top=store.htop[g] if hist else None)
        else:
            scores = token_scores(q_hat, k_cache, req_to_token, f.rpi, f.sink, f.hi, scale, n_max, fill=False,
                                  out=out, **launch)
        if group == 1:
            rows, first, n_layers = f, li, 1
        elif g == group - 1 or li == self._last_layer:
            # the group's layers [li - g, li] in one launch over their rows
            rows, first, n_layers = f.group, li - g, g + 1
            scores = store.scores[:n_layers].flatten(0, 1)
        else:
            return
        self._aspd_topk(scores, rows, first, n_layers, hist, k_cache.shape[1], req_to_token)

    def _aspd_topk(self, scores: torch.Tensor, rows, first: int, n_layers: int, hist: bool,
                   num_kv_heads: int, req_to_token: torch.Tensor) -> None:
        """The Top-K of layers [first, first + n_layers) over their scores' rows, into
        the store. rows: the launch's ranges and store rows (sink, hi, budget, next_b,
        push), in the scores' row order."""
        from sgl_sparse.kernels.quest_pages import expand_selection
        from sgl_sparse.kernels.topk_range import topk_range

        store = self.aspd
        n = scores.shape[0]
        cap = store.sel_pos.shape[-1]
        k = max(1, min(cap, store.cfg.max_context))
        sink = rows.sink[:n]
        # the scoring launches' histograms of the group's layers, rows in the scores' order:
        # they scored [f.sink, f.hi) per slot, the same ranges as rows.sink / rows.hi per
        # (layer, slot) (_AspdGroupRows tiles f's), so h_top counts exactly this range.
        # splits=1: takes_htop chose the layers only where the Top-K runs unsplit anyway.
        extra = dict(h_top=store.htop[:n_layers].flatten(0, 1), splits=1) if hist else {}
        if store.remote:
            # on the cache GPU nothing is allocated under the serving GPU's capture
            # (AsyncSpadeStore.topk_out): the store's output and scratch, unsplit (the
            # split kernel allocates its slices' histograms)
            out = store.topk_out[:n]
            extra = dict(extra, scratch=store.topk_scratch[:n], splits=1)
        else:
            out = torch.empty(n, num_kv_heads, k, dtype=torch.int32, device=scores.device)
        # the best `budget` tokens of [sink, hi), ascending; slots without a row: hi = 0, O(1)
        idx, n_tok = topk_range(scores, sink, rows.hi[:n], rows.budget[:n], k, out=out, **extra)
        # straight into the store (layer first + j's rows from row j * (slots + 1) of
        # these views); slots without a row: their programs return at once
        layers = slice(first, first + n_layers)
        # with ASPD_LISTS_IN_PLACE their pool slots too, what the decode reads
        slots = None if store.sel_slot is None else (req_to_token, rows.rpi[:n],
                                                     store.sel_slot[layers].flatten(0, 1))
        expand_selection(None, idx, k, rows.next_b[:n], store.sel_pos[layers].flatten(0, 1),
                         store.sel_count[layers].flatten(0, 1), page=1, n_sink=sink, count=n_tok,
                         out_rows=rows.push[:n], slots=slots)
