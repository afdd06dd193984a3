"""Serving glue of the query-aware policies (quest, asyncspade, lfps): keeps their
per-request stores current as keys are written, and chooses each layer's indexed
segment A (DecodePlan.a_slot == INDEXED) for the rows of a decode batch.

Host side, once per forward: which batch rows belong to which policy group (rows
of one group share the request knobs, so the math of sgl_sparse/queryaware/ runs
once per group with scalar knobs). Device side, per layer: tensor ops only.

  extend (after the chunk's KV is written), per row of the chunk (the prompt's last
  chunk only, RowInit.prefill_end, but asyncspade's query window):
    quest       bounds of every page of [0, n) recomputed from the pool (a radix
                prefix hit's pages included); with kernels every quest row of the
                forward in one launch a layer (kernels.quest_bounds_update)
    asyncspade  query window <- the chunk's last W + 1 queries; the forward's rows in
                one ring_load a layer, their index copies' resets and smoothing
                (int4) in few ops (AspdExtend, memory-capped)
    lfps        tables, K̄, V̄, σ̂² from the chunk's last s queries (Eq. 4, §4.2); the
                forward's rows of the same knobs and s in one init_tables call a
                layer, padded to the longest (LfpsExtend, memory-capped)
  decode, layer by layer:
    select      quest: bounds of the current page, then pages by this query;
                asyncspade: the selection predicted at the previous step;
                lfps: candidates from the tables, exact q.k, Top-k
    (attention over segment A and B)
    finish      lfps: sink bypass (heads output V̄) and the table update (Eq. 10);
                asyncspade: push this query, predict the next one, select for the
                next step (positions < its b_start = n + 1 - recent)
A row outside every group (no slot, longer than its store) is dense in the plan.
The ring, tables and selections are written only by their own slot's request.

With kernels (CUDA; tests: the Triton interpreter) all three run on
query_device.QueryAwareDevice instead: all rows at once, knobs read by row on the
device, so SGLang's decode CUDA graphs can capture them; no groups are built then.
The torch groups stay the CPU path and that path's oracle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sgl_sparse.decision import DecodePlan
from sgl_sparse.kernels import indexed_slots
from sgl_sparse.kernels.index_keys import channel_smoothing, quantize_keys, smoothed_codes, smoothed_query
from sgl_sparse.kernels.quest_pages import quest_bounds_update
from sgl_sparse.policies import quest, query_aware
from sgl_sparse.policies.base import PolicyId, RowInit
from sgl_sparse.query_device import POLICIES as DEVICE_POLICIES
from sgl_sparse.query_device import QueryAwareDevice
from sgl_sparse.queryaware import asyncspade as aspd
from sgl_sparse.queryaware import lfps as lfps_math
from sgl_sparse.selector.core import to_device


@dataclass
class Group:
    """Batch rows of one policy with identical knobs (host-built, once per forward)."""

    policy: PolicyId
    spec: Any
    batch_idx: torch.Tensor  # [g] int64: positions in the batch
    slots: torch.Tensor  # [g] int64: store slots
    n_max: int  # longest sequence of the group (host)


@dataclass
class ExtendRow:
    policy: PolicyId
    spec: Any
    req_row: int
    slot: int
    n: int  # sequence length after this chunk
    q_start: int  # the chunk's queries in the forward's q
    q_end: int
    # the prompt's last chunk (RowInit.prefill_end): the one that builds the store's
    # prompt state; an earlier chunk only feeds asyncspade's query ring
    last: bool = True


def lfps_knobs(spec) -> lfps_math.LfpsKnobs:
    return lfps_math.LfpsKnobs(s=spec.s, r=spec.r, eps=spec.eps, a=spec.a, n_local=spec.local, n_sink=spec.sink)


# The most an lfps extend call's logits ([rows, Hq, s, n_max] fp32; their masked copy
# and softmax are as large) take at once: one call for 8 rows of 32768 would hold 8 rows'
# worth, where the loop of a row at a time held one. A call takes one row at least.
LFPS_EXTEND_BYTES = 256 << 20


@dataclass
class LfpsExtend:
    """lfps extend rows of one forward that one init_tables call a layer initializes
    (plan_extend): the same knobs with s = the queries each takes, keys padded to
    the longest row's n."""

    knobs: lfps_math.LfpsKnobs
    n_max: int
    req_rows: torch.Tensor  # [b] int64, on the device
    slots: torch.Tensor  # [b]
    n: torch.Tensor  # [b]
    q_rows: torch.Tensor  # [b, s]: each row's last s queries in the forward's q
    valid: torch.Tensor  # [b, n_max] bool: positions < n


def padded_calls(ns: list[int], row_bytes: int, cap_bytes: int) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of rows (lengths ns, longest first) that one call pads to
    its first's length: as many as keep row_bytes a row and position within
    cap_bytes, one row at least (lfps's and asyncspade's extends)."""
    calls, lo = [], 0
    for i in range(1, len(ns)):
        if (i + 1 - lo) * row_bytes * ns[lo] > cap_bytes:
            calls.append((lo, i))
            lo = i
    if ns:
        calls.append((lo, len(ns)))
    return calls


def padded_locs(req_to_token: torch.Tensor, req_rows: torch.Tensor, n_max: int,
                valid: torch.Tensor) -> torch.Tensor:
    """The pool slots of rows' positions [0, n_max), a row's first again past its n:
    the slots there are anyone's (an fp8 cache's may hold NaN or inf), and a masked
    product or a max over them must see a finite key of the row's own."""
    locs = req_to_token[req_rows, :n_max]
    return torch.where(valid, locs, locs[:, :1]).long()


def lfps_extend_calls(rows: list[ExtendRow], num_q_heads: int,
                      cap_bytes: int) -> list[tuple[lfps_math.LfpsKnobs, list[ExtendRow]]]:
    """lfps extend rows by init_tables call: its knobs (s = min(spec.s, the chunk's
    queries)) and rows. The math takes the knobs and s as scalars, so only rows
    equal in all of them share a call; each call's rows longest first, so that it
    pads to lengths alike, and as many as keep its logits within cap_bytes."""
    by_knobs: dict[tuple, tuple[lfps_math.LfpsKnobs, list[ExtendRow]]] = {}
    for e in rows:
        kn = lfps_knobs(e.spec)
        kn = dataclasses.replace(kn, s=min(kn.s, e.q_end - e.q_start))
        by_knobs.setdefault(dataclasses.astuple(kn), (kn, []))[1].append(e)
    calls: list[tuple[lfps_math.LfpsKnobs, list[ExtendRow]]] = []
    for kn, group in by_knobs.values():
        group.sort(key=lambda e: -e.n)
        row_bytes = num_q_heads * kn.s * 4  # a row's logits per key position
        calls += [(kn, group[lo:hi]) for lo, hi in padded_calls([e.n for e in group], row_bytes, cap_bytes)]
    return calls


# The most an asyncspade extend call's gathered keys take at once as fp32 ([rows, n_max,
# Hkv, D]: the smoothing's max |k| of int4 copies; their copy and |k| are as large): one
# call for 32 rows of 32768 would hold 32 rows' worth, where the loop of a row at a
# time held one. A call takes one row at least.
ASPD_EXTEND_BYTES = 256 << 20


@dataclass
class AspdSmooth:
    """One channel_smoothing call of asyncspade's extend: consecutive rows of its
    AspdExtend (longest first), keys padded to the first's n."""

    n_max: int
    req_rows: torch.Tensor  # [b] int64, on the device
    valid: torch.Tensor  # [b, n_max] bool: positions < n
    side_slots: torch.Tensor  # [b] their slots where the smoothing lives (the cache GPU's, if remote)


@dataclass
class AspdExtend:
    """asyncspade extend rows of one forward (plan_extend), the prompts' last chunks
    first, each part longest first: one ring_load a layer for all, the last chunks'
    index copies reset in one op and their smoothing (int4) in calls of rows padded
    to the call's longest."""

    slots: torch.Tensor  # [b] int64, on the device (the ring's rows)
    count: torch.Tensor  # [b]: the chunk's last queries each ring takes, c <= W
    q_rows: torch.Tensor  # [b, W]: the right-aligned window's queries in the forward's q
    q_ok: torch.Tensor  # [b, W] bool: the window's last c entries (the left pad reads a taken query)
    side_slots: Optional[torch.Tensor]  # [b'] the last chunks' slots where the index copies live (index_keys only)
    smooth: list[AspdSmooth]  # the rows of n > 0 (int4 only)
    empty: Optional[torch.Tensor]  # side slots of rows with n == 0 (their smoothing: 1), if any


def warm_up_extend_kernels(stores: dict, k_pool: torch.Tensor, req_to_token: torch.Tensor) -> None:
    """Compile quest's extend kernel at start-up, in the argument classes plan_extend
    passes it (its fields 16-byte aligned), so that no prefill waits for Triton: on the
    H200 the first quest prefills did, twice, 0.3 s each (session 57). Slot -1 and an
    empty range: nothing is written. k_pool: a layer's key buffer, as on_extend gets it."""
    store = stores.get(PolicyId.QUEST)
    if store is None:
        return
    dev = k_pool.device
    req, slot, lo, hi = (torch.full((1,), v, dtype=torch.int64, device=dev) for v in (0, -1, 0, 0))
    quest_bounds_update(k_pool, req_to_token, req, slot, lo, hi, store.kmin[0], store.kmax[0])


def prepend_sink(pos: torch.Tensor, count: torch.Tensor, sink: torch.Tensor, b_start: torch.Tensor,
                 k_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment A from a selection of non-sink positions: [0, min(sink, b_start))
    then the selected positions below b_start. pos [g, Hkv, K] ascending in the
    first count [g, Hkv]; sink, b_start [g] -> ([g, Hkv, k_out] int32, [g, Hkv] int32)."""
    g, hkv, k = pos.shape
    dev = pos.device
    b = b_start.long()[:, None, None]
    keep = (torch.arange(k, device=dev)[None, None, :] < count[..., None]) & (pos.long() < b)
    kept = keep.sum(-1)  # ascending: the kept entries are a prefix
    s = torch.minimum(sink.long(), b_start.long())[:, None, None]
    j = torch.arange(k_out, device=dev)[None, None, :]
    src = (j - s).clamp(0, max(k - 1, 0))
    moved = torch.gather(pos.long(), -1, src.expand(g, hkv, -1)) if k else torch.zeros_like(j.expand(g, hkv, -1))
    out = torch.where(j < s, j, moved)
    total = (s[..., 0] + kept).clamp(max=k_out)
    out = torch.where(j < total[..., None], out, 0)
    return out.to(torch.int32), total.to(torch.int32)


class QueryAwareRuntime:
    def __init__(self, state, use_kernels: Optional[bool] = None):
        self.state = state
        self.stores = state.query_stores
        self.cap = max((s.cfg.capacity for s in self.stores.values()), default=1)
        self.groups: list[Group] = []
        self.extend_rows: list[ExtendRow] = []
        # (pool rows, slots, first, end positions) of this forward's quest extend rows on
        # the device, for one bounds launch a layer (kernels only; plan_extend)
        self._quest_extend: Optional[tuple[torch.Tensor, ...]] = None
        self._lfps_extend: list[LfpsExtend] = []
        self._aspd_extend: Optional[AspdExtend] = None
        self._lfps_out: dict[int, lfps_math.LfpsStep] = {}
        if use_kernels is None:
            use_kernels = state.device.type == "cuda"
        on_device = use_kernels and any(p in self.stores for p in DEVICE_POLICIES)
        self.device = QueryAwareDevice(state, self.cap) if on_device else None
        # The device path runs this forward: the batch has its rows, or the forward
        # may be a CUDA-graph capture / replay (whose work cannot depend on the batch).
        self.device_active = False

    def active(self) -> bool:
        """Per-layer selection to do this decode forward."""
        return bool(self.groups) or self.device_active

    # ---- host, once per forward ----------------------------------------------------
    def plan_step(self, rows: list[int], seq_lens: list[int], device: torch.device,
                  graphed: bool = False) -> None:
        """Decode: group the batch's query-aware rows that may be indexed this step
        (lfps), keep their stores current (quest: every step, covered or not) or
        predict for the next one (asyncspade); with kernels, only whether the
        device path runs. `graphed`: the forward may be a CUDA-graph capture or
        replay, so the device path runs whatever the batch."""
        buckets: dict[tuple, list[tuple[int, int, int]]] = {}
        self.device_active = self.device is not None and graphed
        for b, (r, n) in enumerate(zip(rows, seq_lens)):
            init = self._init(r)
            if init is None or init.policy not in self.stores or init.slot < 0 or n > init.max_context:
                continue
            if self.device is not None and init.policy in DEVICE_POLICIES:
                self.device_active = True
                continue
            # quest's bounds follow every key (a covered row is indexed later)
            if init.policy == PolicyId.LFPS and query_aware.dense_at(init, n):
                continue
            buckets.setdefault((init.policy, init.spec), []).append((b, init.slot, n))
        self.groups = [
            Group(p, spec, torch.tensor([b for b, _, _ in m], dtype=torch.int64, device=device),
                  torch.tensor([s for _, s, _ in m], dtype=torch.int64, device=device), max(n for _, _, n in m))
            for (p, spec), m in buckets.items()
        ]

    def plan_idle_step(self, graphed: bool) -> None:
        """Decode with no live quest/asyncspade/lfps request: no groups, and the
        device path only where the forward may be captured: a graph captured now
        is replayed when such requests arrive."""
        self.groups = []
        self.device_active = self.device is not None and graphed

    def plan_extend(self, order: list[int], seq_lens: list[int], ext_lens: list[int],
                    admitted: tuple[list[int], list[RowInit]]) -> None:
        want = {int(r): i for r, i in zip(*admitted)
                if i.policy in self.stores and i.slot >= 0}
        self.extend_rows = []
        start, pending, done = 0, [], []
        for r, n, ext in zip(order, seq_lens, ext_lens):
            i = want.get(int(r))
            if i is not None:
                # a chunk of a chunked prefill that is not the prompt's last builds no
                # prompt state: the last rebuilds it from every key of [0, n) (at
                # 32768 x 32 in chunks of 8192, lfps's tables were built 4 times a
                # prompt, over 2.5 prompts' keys)
                last = n >= i.prefill_end
                (done if last else pending).append(int(r))
                if n <= i.max_context:
                    self.extend_rows.append(
                        ExtendRow(i.policy, i.spec, int(r), i.slot, int(n), start, start + ext, last))
            start += ext
        self.state.mark_prompt_chunks(pending, done)
        self._quest_extend = None
        self._lfps_extend = []
        self._aspd_extend = None
        if self.extend_rows:
            # One copy for all rows, not pageable and so not stream-synchronizing: a
            # synchronizing copy per row and layer (8 rows x 28 layers a chunk at
            # 32768 x 8) stalled the host behind the GPU through the whole prefill.
            # With kernels, quest's rows are bounded in one launch a layer: their pool
            # rows, slots, first and end positions, each field contiguous, first in the
            # copy and padded to an even count: 16-byte aligned whatever the rows, the
            # pointer class warm_up_extend_kernels compiled (Triton keys its binaries
            # on it; fields 8 bytes off compiled mid-prefill, 0.3 s, session 57)
            quest_rows = [e for e in self.extend_rows if e.policy == PolicyId.QUEST and e.last] if self.device else []
            nq = len(quest_rows) + len(quest_rows) % 2
            pad = [0] * (nq - len(quest_rows))
            quest_fields = [[e.req_row for e in quest_rows] + pad, [e.slot for e in quest_rows] + pad,
                            [0] * nq, [e.n for e in quest_rows] + pad]
            fields = []
            # lfps's rows in few init_tables calls a layer (a call a row and layer, over
            # a hundred small ops each, made its prefill 18-23% slower than stock's):
            # each call's pool rows, slots, lengths and query rows, after quest's
            lfps_rows = [e for e in self.extend_rows if e.policy == PolicyId.LFPS and e.last]
            hq = self.stores[PolicyId.LFPS].sigma_hat2.shape[-1] if lfps_rows else 0
            lfps_calls = lfps_extend_calls(lfps_rows, hq, LFPS_EXTEND_BYTES)
            for kn, call in lfps_calls:
                fields += [[e.req_row for e in call], [e.slot for e in call], [e.n for e in call],
                           [q for e in call for q in range(e.q_end - kn.s, e.q_end)]]
            # asyncspade's rows in one ring_load a layer (a row and layer took ~15 small
            # ops: its prefill 5% slower than stock's at 32768 x 32), every chunk's (a
            # last chunk shorter than W takes the queries before it from the ring), the
            # last chunks first and each part longest first (the smoothing's calls pad
            # to their first): slots, ring counts, pool rows, lengths, then each row's
            # window of W queries, right-aligned, its left pad (c < W) reading the
            # row's first taken query (masked to 0 on each layer)
            aspd_rows = sorted((e for e in self.extend_rows if e.policy == PolicyId.ASYNCSPADE),
                               key=lambda e: (not e.last, -e.n))
            w = self.stores[PolicyId.ASYNCSPADE].ring.shape[2] if aspd_rows else 0
            takes = [self._ring_take(e) for e in aspd_rows]
            fields += [[e.slot for e in aspd_rows], takes, [e.req_row for e in aspd_rows], [e.n for e in aspd_rows],
                       [max(e.q_end - w + j, e.q_end - c) if c else 0 for e, c in zip(aspd_rows, takes)
                        for j in range(w)]]
            host = torch.tensor([x for f in quest_fields for x in f] + [x for f in fields for x in f],
                                dtype=torch.int64)
            dev = to_device(host, self.state.device)
            if quest_rows:
                self._quest_extend = dev[: 4 * nq].view(4, nq)[:, : len(quest_rows)].unbind(0)
            at = 4 * nq
            for kn, call in lfps_calls:
                b = len(call)
                req, slots, n = dev[at: at + 3 * b].view(3, b).unbind(0)
                q_rows = dev[at + 3 * b: at + (3 + kn.s) * b].view(b, kn.s)
                at += (3 + kn.s) * b
                n_max = call[0].n  # longest first
                valid = torch.arange(n_max, device=dev.device)[None, :] < n[:, None]
                self._lfps_extend.append(LfpsExtend(kn, n_max, req, slots, n, q_rows, valid))
            if aspd_rows:
                b = len(aspd_rows)
                self._aspd_extend = self._plan_aspd(aspd_rows, dev[at: at + (4 + w) * b], w)

    def _plan_aspd(self, rows: list[ExtendRow], dev: torch.Tensor, w: int) -> AspdExtend:
        """AspdExtend of the rows (the prompts' last chunks first, each part longest
        first) from their fields in the forward's copy."""
        store = self.stores[PolicyId.ASYNCSPADE]
        b = len(rows)
        slots, count, req, n = dev[: 4 * b].view(4, b).unbind(0)
        q_rows = dev[4 * b:].view(b, w)
        q_ok = torch.arange(w, device=dev.device)[None, :] >= w - count[:, None]
        side_slots, smooth, empty = None, [], None
        nl = sum(e.last for e in rows)  # the prompts' last chunks (first): their index copies are reset
        if store.index_keys and nl:
            # the index copies may live on another GPU (store.remote): their slots there,
            # copied once per forward (device to device, ordered by both streams)
            side = store.filled.device
            side_slots = slots[:nl] if side == slots.device else slots[:nl].to(side, non_blocking=True)
            if store.ksmooth is not None:
                # rows of n == 0 (last) in no call: they have no keys to gather
                ns = [e.n for e in rows[:nl] if e.n > 0]
                hkv, d = store.ksmooth.shape[-2:]
                for lo, hi in padded_calls(ns, hkv * d * 4, ASPD_EXTEND_BYTES):
                    valid = torch.arange(ns[lo], device=dev.device)[None, :] < n[lo:hi, None]
                    smooth.append(AspdSmooth(ns[lo], req[lo:hi], valid, side_slots[lo:hi]))
                if len(ns) < nl:  # no key to gather: channel_smoothing's 1 (a chunk of no token: not seen served)
                    empty = side_slots[len(ns):]
        return AspdExtend(slots, count, q_rows, q_ok, side_slots, smooth, empty)

    def _ring_take(self, e: ExtendRow) -> int:
        """The chunk's last queries an asyncspade row's ring takes (0 for the others)."""
        if e.policy != PolicyId.ASYNCSPADE:
            return 0
        return min(self.stores[e.policy].ring.shape[2], e.q_end - e.q_start)

    def _init(self, row: int) -> Optional[RowInit]:
        with self.state._lock:
            return self.state._active.get(row)

    # ---- extend, per layer ---------------------------------------------------------
    def on_extend(self, li: int, q3: torch.Tensor, k_cache, v_cache, req_to_token, scale: float,
                  v_scale: Optional[float] = None) -> None:
        """The prompt's selection state of each query-aware row extended this forward.
        ``scale``: the layer's softmax scale times an fp8 cache's k_scale, as the decode
        selections take it (they score the keys as stored); ``v_scale``: the values'
        (lfps's V̄ is output as it is)."""
        if self._quest_extend is not None:
            # every quest row's pages of [0, n) at once (the torch loop below: a row
            # at a time, ~10 small ops each: 0.7 s of a 64 x 2048 prefill, session 51)
            req, slot, lo, hi = self._quest_extend
            store = self.stores[PolicyId.QUEST]
            quest_bounds_update(k_cache, req_to_token, req, slot, lo, hi, store.kmin[li], store.kmax[li])
        for call in self._lfps_extend:
            self._lfps_init(li, call, q3, k_cache, v_cache, req_to_token, scale, v_scale)
        if self._aspd_extend is not None:
            self._aspd_init(li, self._aspd_extend, q3, k_cache, req_to_token)
        # quest without kernels (the CPU path, and its oracle): a row at a time
        for e in self.extend_rows:
            if e.policy != PolicyId.QUEST or not e.last or self._quest_extend is not None:
                continue
            store = self.stores[e.policy]
            locs = req_to_token[e.req_row, : e.n].long()
            pages = -(-e.n // quest.PAGE)
            lo, hi = quest.page_bounds(k_cache[locs], e.n, pages)
            store.kmin[li, e.slot, :, :pages] = lo.to(store.kmin.dtype)
            store.kmax[li, e.slot, :, :pages] = hi.to(store.kmax.dtype)

    def _aspd_init(self, li: int, a: AspdExtend, q3: torch.Tensor, k_cache, req_to_token) -> None:
        """The rings of the forward's asyncspade rows, their index copies reset and
        smoothed (int4), as a row at a time but in a few ops for all."""
        store = self.stores[PolicyId.ASYNCSPADE]
        # ring_load writes the whole window into the ring (its left pad into the slots
        # past c, masked wherever read): zeros there, as a zeroed window gave them
        win = torch.where(a.q_ok[:, :, None, None], q3[a.q_rows], 0.0)
        aspd.ring_load(store.ring[li], store.total[li], a.slots, win, a.count)
        if a.side_slots is None:  # no index copies, or no prompt's last chunk
            return
        with store.cache_writes(k_cache.device):  # on the cache GPU, if the selection runs there
            # the slots' key copies are their previous owners' (index_fill_: `t[idx] = 0`
            # would copy the scalar from the host, waiting for the stream)
            store.filled[li].index_fill_(0, a.side_slots, 0)
            if store.ksmooth is None:
                return
            for c in a.smooth:  # the prompt so far, radix-cache hits included
                locs = padded_locs(req_to_token, c.req_rows, c.n_max, c.valid)  # a row's max: the same
                # [b, n_max, Hkv, D] as n_max positions of [b, Hkv, D]: the max over them
                f = channel_smoothing(k_cache[locs].transpose(0, 1))
                store.ksmooth[li].index_copy_(0, c.side_slots, f.to(store.ksmooth.device))
            if a.empty is not None:
                store.ksmooth[li].index_fill_(0, a.empty, 1.0)

    def _lfps_init(self, li: int, c: LfpsExtend, q3: torch.Tensor, k_cache, v_cache, req_to_token,
                   scale: float, v_scale: Optional[float]) -> None:
        """The tables, K̄, V̄ and σ̂² of one call's rows, from their keys padded to n_max."""
        store = self.stores[PolicyId.LFPS]
        # init_tables' priors multiply keys by their masks, where 0 * NaN would be NaN
        locs = padded_locs(req_to_token, c.req_rows, c.n_max, c.valid)
        values = v_cache[locs]
        if v_scale is not None:
            values = values.float() * v_scale
        lfps_math.init_tables(q3[c.q_rows], k_cache[locs], values, c.n, scale, store.cfg.max_context, c.knobs,
                              out=store.layer(li), rows=c.slots)
        # the tables as written: true values (index_fill_: `t[idx] = 1.0` would copy
        # the scalar from the host, waiting for the stream)
        store.tscale[li].index_fill_(0, c.slots, 1.0)
        if store.shift is not None:
            # the statistics' power sums about the tables' means over [0, n): not the
            # slot's previous owner's, which only the rounding would pay for
            valid = c.valid[:, None, :]
            means = [torch.where(valid, t[li, c.slots, :, : c.n_max], 0.0).sum(-1) / c.n[:, None]
                     for t in (store.ver, store.sla)]
            store.shift[li].index_copy_(0, c.slots, torch.stack(means, -1))

    # ---- decode, per layer ---------------------------------------------------------
    def select(self, li: int, plan: DecodePlan, q3: torch.Tensor, k_cache, req_to_token,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> DecodePlan:
        """This layer's plan: a_pos / a_len_per_head of the INDEXED rows (the other
        rows keep the step plan's a_len_per_head: the kernel reads it for every row)."""
        bs, hkv = q3.shape[0], k_cache.shape[1]
        # The device path writes the indexed rows of a_len IN PLACE, into the step
        # plan's tensor (every layer overwrites those rows; the others keep the plan's
        # values), and with quest every row of a_pos: no clone / fill of its own then.
        # In place because its blocks may be skipped at replay (graph_gate.py).
        fresh = self.device_active
        if fresh and self.device.quest is not None:
            a_pos = torch.empty(bs, hkv, self.cap, dtype=torch.int32, device=q3.device)
        else:
            a_pos = torch.zeros(bs, hkv, self.cap, dtype=torch.int32, device=q3.device)
        if plan.a_len_per_head is not None:
            a_len = plan.a_len_per_head if fresh else plan.a_len_per_head.clone()
        else:
            a_len = torch.zeros(bs, hkv, dtype=torch.int32, device=q3.device)
        self._lfps_out = {}
        # The decode kernel gathers fastest from pool slots (kernels/indexed_slots.py),
        # written by the device path's producers with the positions; the device path
        # only: its forwards hold no host groups.
        a_slots = lists = None
        if self.device_active:
            slots = not self.groups and indexed_slots.ENABLED and plan.a_slot is not None
            a_pos, a_len, a_slots, lists = self.device.select(li, plan, q3, k_cache, req_to_token, req_pool_indices,
                                                              seq_lens, a_pos, a_len, scale, slots=slots)
        indexed = plan.indexed() if self.groups else None
        for gi, g in enumerate(self.groups):
            store = self.stores[g.policy]
            cap = store.cfg.capacity
            rpi = req_pool_indices[g.batch_idx].long()
            n = seq_lens[g.batch_idx].long()
            b_start = plan.b_start[g.batch_idx]
            sink = torch.full_like(n, g.spec.sink)
            if g.policy == PolicyId.QUEST:
                self._quest_current_page(li, store, g, k_cache, req_to_token, rpi, n)
                pages = -(-g.n_max // quest.PAGE)
                scores = quest.page_scores(q3[g.batch_idx], store.kmin[li, g.slots, :, :pages],
                                           store.kmax[li, g.slots, :, :pages])
                pos, cnt = quest.select_positions(scores, sink, b_start, torch.full_like(n, g.spec.budget), cap)
            elif g.policy == PolicyId.ASYNCSPADE:
                pos, cnt = store.sel_pos[li, g.slots], store.sel_count[li, g.slots]
            else:
                keys = k_cache[req_to_token[rpi, : g.n_max].long()]  # [g, n_max, Hkv, D]
                res = lfps_math.step(store.layer(li), q3[g.batch_idx], keys, n, torch.full_like(n, g.spec.budget),
                                     g.spec.budget, store.cfg.candidates, scale, lfps_knobs(g.spec), rows=g.slots)
                self._lfps_out[gi] = res
                pos, cnt = prepend_sink(res.positions, res.counts, sink, b_start, cap)
                cnt = torch.where(res.bypass, 0, cnt)  # replaced by V̄ after the attention
            a_pos[g.batch_idx, :, : pos.shape[-1]] = pos
            a_len[g.batch_idx] = torch.where(indexed[g.batch_idx, None], cnt, a_len[g.batch_idx])
        return plan.with_indexed(a_pos, a_len, a_slots, lists)

    def _quest_current_page(self, li, store, g: Group, k_cache, req_to_token, rpi, n) -> None:
        """Bounds of the page holding the key just written (position n - 1), from
        its keys in the pool: a page is rebuilt from its own keys as it fills."""
        page = (n - 1) // quest.PAGE
        pos = page[:, None] * quest.PAGE + torch.arange(quest.PAGE, device=n.device)[None, :]
        ok = (pos < n[:, None])[:, :, None, None]
        keys = k_cache[torch.gather(req_to_token[rpi], 1, pos.clamp(max=req_to_token.shape[1] - 1)).long()]
        keys = keys.to(store.kmin.dtype)  # the bounds' dtype holds every key's value (fp8 too)
        lo = torch.where(ok, keys, float("inf")).amin(1)
        hi = torch.where(ok, keys, float("-inf")).amax(1)
        store.kmin[li, g.slots, :, page] = lo
        store.kmax[li, g.slots, :, page] = hi

    def finish(self, li: int, plan: DecodePlan, q3: torch.Tensor, o3: torch.Tensor, k_cache, req_to_token,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
        indexed = plan.indexed() if self.groups else None
        hkv = k_cache.shape[1]
        if self.device_active:
            self.device.finish(li, q3, o3, k_cache, req_to_token, req_pool_indices, seq_lens, scale)
        for gi, g in enumerate(self.groups):
            store = self.stores[g.policy]
            n = seq_lens[g.batch_idx].long()
            if g.policy == PolicyId.LFPS:
                res = self._lfps_out[gi]
                mine = indexed[g.batch_idx]
                bypass = res.bypass & mine[:, None]  # [g, Hkv]
                grp = o3.shape[1] // hkv
                vbar = store.vbar[li, g.slots].to(o3.dtype).repeat_interleave(grp, dim=1)  # [g, Hq, Dv]
                rows_o = o3[g.batch_idx]
                o3[g.batch_idx] = torch.where(bypass.repeat_interleave(grp, dim=1)[..., None], vbar, rows_o)
                # Tables learn from the steps that used them [ours]: dense steps leave them.
                res = res._replace(counts=torch.where(mine[:, None], res.counts, 0))
                lfps_math.update_tables(store.layer(li), res, n, lfps_knobs(g.spec), rows=g.slots)
                # the scored fraction's sums, as the device path adds them (lfps_select_out)
                denom = (n - g.spec.sink).clamp(min=1)[:, None].expand_as(res.scored)
                add = torch.stack([res.scored, denom], -1).to(torch.float64)
                store.scored[g.slots] += torch.where(mine[:, None, None], add, 0.0)
            elif g.policy == PolicyId.ASYNCSPADE:
                self._predict(li, store, g, q3, k_cache, req_to_token, req_pool_indices, n, scale)

    def _predict(self, li, store, g: Group, q3, k_cache, req_to_token, req_pool_indices, n, scale) -> None:
        w = g.spec.window + 1  # W regressors + the target (queryaware.asyncspade's ring)
        window, count = aspd.ring_push_window(store.ring[li], store.total[li], q3[g.batch_idx], g.slots)
        q_hat = aspd.predict_next_query(window[:, -w:], count.clamp(max=w), g.spec.ridge)
        rpi = req_pool_indices[g.batch_idx].long()
        keys = k_cache[req_to_token[rpi, : g.n_max].long()]
        sink = torch.full_like(n, g.spec.sink)
        next_b = (n + 1 - g.spec.recent).clamp(min=0)  # b_start of the next step
        if store.ksmooth is not None:  # 4-bit copies: as the device path's, computed on the fly
            f = store.ksmooth[li, g.slots].to(keys.device)  # the cache GPU's, if the selection runs there
            kq, kscale = smoothed_codes(keys, f[:, None])
            scores = aspd.score_index_positions(*smoothed_query(q_hat, f), kq, kscale, n, sink, next_b, scale)
        elif store.index_keys:
            # the copies the device path keeps are these, computed on the fly here
            kq, kscale = quantize_keys(keys)
            scores = aspd.score_index_positions(*quantize_keys(q_hat), kq, kscale, n, sink, next_b, scale)
        else:
            scores = aspd.score_positions(q_hat, keys, n, sink, next_b, scale)
        pos, cnt = aspd.select_topk(scores, torch.full_like(n, g.spec.budget), g.spec.budget)
        cap = store.cfg.capacity
        pos, cnt = prepend_sink(pos, cnt, sink, next_b, cap)
        store.sel_pos[li, g.slots] = pos
        store.sel_count[li, g.slots] = cnt
