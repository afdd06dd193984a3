"""Per-request policy state: device tensors indexed by SGLang's ``req_pool_idx``.

A row is written when its request enters a batch (every extend chunk rewrites the
whole row, so a reused row never inherits a finished request's state) and released
when SGLang returns the row to its free list (finish, abort, retraction).

Release is host bookkeeping only: with the overlap scheduler a forward that still
reads the row may be in flight on another stream, so the device row is left as is
until the row's next owner overwrites it, in stream order, at admission.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from sgl_sparse.compact import CompactStore
from sgl_sparse.config import SparseServerConfig
from sgl_sparse.policies import query_aware, sfi
from sgl_sparse.policies.base import QUERY_AWARE_IDS, PolicyId, RowInit
from sgl_sparse.selector.core import KNOB_NAMES, knob_values

# set_step_rows runs per decode step and row: Enum attribute lookups and
# Enum.name are slow properties there, members are singletons (compare with `is`).
_POLICY_NAMES = {p: p.name.lower() for p in PolicyId}
_FULL, _SADAS, _SFI = PolicyId.FULL, PolicyId.SADAS, PolicyId.SFI
_QUERY_AWARE = frozenset(QUERY_AWARE_IDS)

logger = logging.getLogger(__name__)


def _knob(init: RowInit, policy: PolicyId, name: str, default):
    """A request knob of `policy` (SparseState.qa_window, lfps_r, ...); default elsewhere."""
    if init.policy != policy or init.spec is None:
        return default
    return getattr(init.spec, name)


class SparseState:
    def __init__(self, num_rows: int, device: torch.device | str,
                 config: SparseServerConfig | None = None):
        self.config = config or SparseServerConfig()
        self.think_ids = (self.config.think_start_id, self.config.think_end_id)
        self.num_rows = num_rows
        self.device = torch.device(device)
        z = lambda dt: torch.zeros(num_rows, dtype=dt, device=self.device)  # noqa: E731
        # Row 0 is SGLang's CUDA-graph padding row: it stays all-zero (= FULL, no
        # think state), so padded slots of a captured batch are dense and inert.
        self.policy = z(torch.int8)
        self.window = z(torch.int32)
        self.sink = z(torch.int32)
        self.think = z(torch.bool)
        self.latch = z(torch.bool)
        # SFI (see policies/sfi.py); `window` holds its `recent`.
        self.budget = z(torch.int32)
        self.t_max = z(torch.int32)
        self.triggers = z(torch.bool)
        self.since_slow = z(torch.int32)
        self.fresh = z(torch.bool)  # no decode step yet: the prompt's queries are evidence
        self.refresh_phase = z(torch.int32)  # since_slow after the first slow step (RowInit)
        # The Selector's knobs per row (selector.core.KNOB_NAMES), written at admission so
        # that a refresh gathers them on the device instead of copying them each time.
        self.sfi_knobs = torch.zeros(num_rows, len(KNOB_NAMES), dtype=torch.float32, device=self.device)
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        self.sel_ready = z(torch.bool)
        self.sel_count = z(torch.int32)
        self.saved_n = z(torch.int32)  # sequence length at the last slow step
        self.prompt_q = z(torch.int32)  # prompt queries saved for the first Selector run
        # prompt_evidence "every": the saved prompt queries stay evidence at later slow
        # steps; prompt_n is the length at the first slow step (the prompt's j-th last
        # query sits at position prompt_n - 2 - j, j >= 0).
        self.keep_prompt = z(torch.bool)
        self.prompt_n = z(torch.int32)
        # Query-aware policies (policies/query_aware.py): the longest sequence the
        # row's store slot serves sparse, and decode steps since admission
        # (asyncspade's first step has no predicted selection yet).
        self.max_context = z(torch.int32)
        self.qa_steps = z(torch.int32)
        # ... and the longest sequence it attends densely (RowInit.dense_until: the
        # budget's reach or, with min_saving, further); SFI's is the host's alone.
        self.dense_until = z(torch.int32)
        # asyncspade's request knobs the decode step reads per row on the device
        # (query_device.py; inside CUDA graphs no host-built group can carry them):
        # W, the past queries regressed from, and the relative ridge strength.
        self.qa_window = z(torch.int32)
        self.qa_ridge = z(torch.float32)
        # lfps's, likewise: table decay r, sink-bypass threshold eps, threshold
        # scale a (its sink, budget and local window are the columns above).
        self.lfps_r = z(torch.float32)
        self.lfps_eps = z(torch.float32)
        self.lfps_a = z(torch.float32)
        # Bool [vocab] sentence-ending ids and the compact buffers: set by the backend
        # once the tokenizer and the model shape are known.
        self.trigger_table = torch.zeros(1, dtype=torch.bool, device=self.device)
        self.trigger_table_host = np.zeros(1, dtype=bool)
        self.compact: Optional[CompactStore] = None
        self._free_slots: list[int] = list(range(self.config.compact.slots))[::-1]
        # Query stores (sgl_sparse/query_store.py), set by the backend, and their
        # free slots per policy.
        self.query_stores: dict[PolicyId, object] = {}
        self._qa_free: dict[PolicyId, list[int]] = {
            p: list(range(self._qa_config(p).slots))[::-1] for p in QUERY_AWARE_IDS
        }
        self._sfi: dict[int, sfi.HostMirror] = {}
        self._refresh: dict[int, int] = {}  # row -> sequence-length bound for the Selector
        self._refresh_later: set[int] = set()  # ... whose slow step was not the first (window: 1 query)
        # Query-aware rows extended by a chunk that was not their prompt's last: their
        # store's prompt state waits for that chunk (query_serving.plan_extend)
        self._prompt_pending: set[int] = set()
        self._lock = threading.Lock()
        self._admissions = 0  # SFI rows admitted with refresh_groups > 1 (dealt into groups)
        # Host mirror of each live row's policy knobs; `latched` follows SADAS's
        # latch as generated tokens reach the host (it may lag the device by a step).
        self._active: dict[int, RowInit] = {}
        self._scanned: dict[int, int] = {}
        self._queued: tuple[list[int], list[RowInit], list[int]] = ([], [], [])
        self._step_kernel_rows: list[int] | None = None
        self._step_untracked = False  # see step_rows_tracked
        # The quest/asyncspade/lfps policies of the last decode batch set up: the
        # decode CUDA-graph variant its forward replays (step_query_aware_policies).
        self._step_query_aware: frozenset[PolicyId] | None = None
        self._step_balance = False  # see step_balance
        self._step_dense_keys = 0  # see step_dense_keys
        self._step_slow_sfi = [False, True]
        self._step_rows: list[int] | None = None  # rows of the decode batch, in order
        # Per live row: [decode steps, sum of per-step retention] (host-side stats).
        self._stats: dict[int, list[float]] = {}
        # Called with the slots of released lfps requests, before any later admission
        # can take them (lfps_scored.ScoredFractionReads.read: their scored-fraction
        # sums; set by the backend)
        self.on_lfps_released: Optional[Callable[[list[int]], None]] = None
        self.metrics = None  # sgl_sparse.metrics.SchedulerMetrics when --enable-metrics

    # ---- admission / release (host side, once per request) -------------------
    def enqueue(self, rows: Sequence[int], inits: Sequence[RowInit],
                bases: Optional[Sequence[int]] = None) -> None:
        """Scheduler side: rows of an extend batch about to run (host only)."""
        with self._lock:
            self._queued[0].extend(rows)
            self._queued[1].extend(inits)
            self._queued[2].extend(bases if bases is not None else [0] * len(rows))

    def admit_queued(self) -> tuple[list[int], list[RowInit]]:
        """Backend side, in the forward that follows: write the queued rows."""
        with self._lock:
            rows, inits, bases = self._queued
            self._queued = ([], [], [])
        return self.admit(rows, inits, bases)

    def _with_phase(self, row: int, init: RowInit) -> RowInit:
        """SFI with refresh_groups G > 1: admissions are dealt round-robin into
        G' = min(G, t_max) groups; group g's first refresh interval is shortened by
        g * (t_max + 1) // G' steps, so a batch admitted together refreshes one group
        per step it refreshes on instead of every row at once. A later extend chunk
        of the same request keeps its phase."""
        if init.policy != PolicyId.SFI:
            return init
        groups = min(init.spec.refresh_groups, init.t_max)
        if groups <= 1:
            return init
        with self._lock:
            prev = self._active.get(row)
            if prev is not None and prev.policy == PolicyId.SFI:  # a live row: the same request
                phase = prev.refresh_phase
            else:
                phase = (self._admissions % groups) * (init.t_max + 1) // groups
                self._admissions += 1
        return dataclasses.replace(init, refresh_phase=phase)

    def _qa_config(self, policy: PolicyId):
        return getattr(self.config.query_aware, policy.name.lower())

    def _free_list(self, policy: PolicyId) -> Optional[list[int]]:
        if policy == PolicyId.SFI:
            return self._free_slots
        return self._qa_free.get(policy)

    def _with_slot(self, row: int, init: RowInit) -> RowInit:
        """An SFI / query-aware row keeps its slot across extend chunks; a new one
        takes a free slot of its policy's store, or none (then it is served dense)."""
        free = self._free_list(init.policy)
        if free is None:
            return init
        with self._lock:
            prev = self._active.get(row)
            if prev is not None and prev.policy == init.policy and prev.slot >= 0:
                slot = prev.slot
            else:
                slot = free.pop() if free else -1
        if init.policy in QUERY_AWARE_IDS:
            return dataclasses.replace(init, slot=slot, max_context=self._qa_config(init.policy).max_context)
        return dataclasses.replace(init, slot=slot)

    def admit(self, rows: Sequence[int], inits: Sequence[RowInit],
              bases: Optional[Sequence[int]] = None) -> tuple[list[int], list[RowInit]]:
        """Write whole rows for requests entering a batch. No host sync.

        `bases[i]`: generated ids request i already has (a retracted request
        re-admitted), so SFI's host mirror knows which id each decode step reads.
        Returns the rows and their initial state (with compact slots assigned)."""
        if not rows:
            return [], []
        bases = list(bases) if bases is not None else [0] * len(rows)
        for r in rows:
            if not 0 < r < self.num_rows:
                raise IndexError(f"req_pool_idx {r} outside [1, {self.num_rows})")
        inits = [self._with_phase(int(r), self._with_slot(int(r), i)) for r, i in zip(rows, inits)]
        idx = torch.tensor(rows, dtype=torch.int64)
        col = lambda name, dt: torch.tensor([getattr(i, name) for i in inits], dtype=dt)  # noqa: E731
        host = {
            "policy": torch.tensor([int(i.policy) for i in inits], dtype=torch.int8),
            "window": col("window", torch.int32),
            "sink": col("sink", torch.int32),
            "think": col("think", torch.bool),
            "latch": col("latch", torch.bool),
            "budget": col("budget", torch.int32),
            "t_max": col("t_max", torch.int32),
            "triggers": col("triggers", torch.bool),
            # First decode step is slow: since_slow starts at t_max.
            "since_slow": col("t_max", torch.int32),
            "fresh": torch.ones(len(inits), dtype=torch.bool),
            "refresh_phase": col("refresh_phase", torch.int32),
            "sfi_knobs": torch.tensor([knob_values(i.spec) if i.policy == PolicyId.SFI else [0.0] * len(KNOB_NAMES)
                                       for i in inits], dtype=torch.float64).float(),
            "slot": col("slot", torch.int32),
            "sel_ready": torch.zeros(len(inits), dtype=torch.bool),
            "sel_count": torch.zeros(len(inits), dtype=torch.int32),
            "saved_n": torch.zeros(len(inits), dtype=torch.int32),
            "prompt_q": torch.zeros(len(inits), dtype=torch.int32),
            "keep_prompt": col("keep_prompt", torch.bool),
            "prompt_n": torch.zeros(len(inits), dtype=torch.int32),
            "max_context": col("max_context", torch.int32),
            "qa_steps": torch.zeros(len(inits), dtype=torch.int32),
            "dense_until": col("dense_until", torch.int32),
            "qa_window": torch.tensor([_knob(i, PolicyId.ASYNCSPADE, "window", 0) for i in inits],
                                      dtype=torch.int32),
            "qa_ridge": torch.tensor([_knob(i, PolicyId.ASYNCSPADE, "ridge", 0.0) for i in inits],
                                     dtype=torch.float32),
            **{f"lfps_{k}": torch.tensor([_knob(i, PolicyId.LFPS, k, 0.0) for i in inits], dtype=torch.float32)
               for k in ("r", "eps", "a")},
        }
        pin = self.device.type == "cuda"
        idx = idx.pin_memory().to(self.device, non_blocking=True) if pin else idx
        for name, values in host.items():
            values = values.pin_memory().to(self.device, non_blocking=True) if pin else values
            getattr(self, name).index_copy_(0, idx, values)
        newly = []
        with self._lock:
            for r, i, base in zip(rows, inits, bases):
                r = int(r)
                if r not in self._active:  # not a later chunk of the same request
                    newly.append(i.policy)
                    self._stats[r] = [0, 0.0]
                self._active[r] = i
                self._scanned[r] = 0
                self._refresh.pop(r, None)
                self._refresh_later.discard(r)
                if i.policy == PolicyId.SFI:
                    self._sfi[r] = sfi.HostMirror(i, base)
        if self.metrics is not None:
            for p in newly:
                self.metrics.on_admit(p.name.lower())
        return list(rows), inits

    def set_step_rows(self, rows: Sequence[int], seq_lens: Sequence[int], new_tokens: Sequence) -> None:
        """Scheduler side, per decode batch: route each slot, account the steps.

        Routing (`take_step_kernel_rows`): 0 = the stock dense kernel serves the
        slot and gives exactly its output -- `full`, a window covering the whole
        sequence, a SADAS request the host already saw latch; 1 = the two-segment
        kernel; 2 = the stock kernel attends, the two-segment launch only records
        what SFI needs later (key norms). ``new_tokens[i]`` are the generated ids of
        slot i (scanned incrementally for SADAS's `</think>` and SFI's triggers).
        """
        end_id = self.think_ids[1]
        mask = []
        untracked = False
        per_policy: dict[str, list[int]] = {}
        fallbacks: Counter[tuple[str, str]] = Counter()

        def count(name: str, attended: int, n: int, slow: bool = False, row: int = -1):
            agg = per_policy.setdefault(name, [0, 0, 0, 0])
            agg[0] += 1
            agg[1] += attended
            agg[2] += n
            agg[3] += int(slow)
            st = self._stats.get(row)
            if st is not None:
                st[0] += 1
                st[1] += attended / max(n, 1)

        active = self._active
        query_aware: set[PolicyId] = set()
        with self._lock:
            # (an SFI kernel row may be slow, every kernel row surely is): _sfi_step
            self._step_slow_sfi = [False, True]
            for r, n, toks in zip(rows, seq_lens, new_tokens):
                r, n = int(r), int(n)
                row = active.get(r)
                if row is None:
                    mask.append(0)
                    untracked = True
                    continue
                pol = row.policy
                if pol is _SFI:
                    mask.append(self._sfi_step(r, n, toks, count, fallbacks))
                    continue
                if pol in _QUERY_AWARE:
                    query_aware.add(pol)
                    mask.append(self._query_aware_step(r, row, n, count, fallbacks))
                    continue
                # full / streaming / sadas
                windowed = 0
                if pol is not _FULL:
                    if pol is _SADAS and not row.latch and end_id is not None:
                        seen = self._scanned.get(r, 0)
                        if any(int(t) == end_id for t in toks[seen:]):
                            row = active[r] = dataclasses.replace(row, latch=True)
                        self._scanned[r] = len(toks)
                    # The host twin of decision.plan_decode: the device plan is
                    # windowed exactly when n > window + sink (then a_len + window < n).
                    if pol is _SADAS and row.latch:
                        fallbacks[(_POLICY_NAMES[pol], "sadas_latched")] += 1
                    elif row.window + row.sink >= n:
                        fallbacks[(_POLICY_NAMES[pol], "window_covers_sequence")] += 1
                    else:
                        windowed = 1
                mask.append(windowed)
                count(_POLICY_NAMES[pol], row.window + row.sink if windowed else n, n, row=r)
            self._step_kernel_rows = mask
            self._step_untracked = untracked
            self._step_rows = list(map(int, rows))
            self._step_query_aware = frozenset(query_aware)
            may, surely = self._step_slow_sfi
            # Rows of the kernel that are not SFI's (windows, indexed) are fast here.
            surely = surely and all(m == 0 or self._active.get(int(r)) is None
                                    or self._active[int(r)].policy is _SFI for r, m in zip(rows, mask))
            kernel_rows = sum(m == 1 for m in mask)
            self._step_balance = may and not surely and kernel_rows > 1
            self._step_dense_keys = (sum(int(n) for n, m in zip(seq_lens, mask) if m == 1)
                                     if may and surely and kernel_rows > 1 else 0)
        if self.metrics is not None:
            self.metrics.on_step(per_policy, fallbacks)

    def _sfi_step(self, r: int, n: int, toks, count, fallbacks) -> int:
        """SFI's host side of one decode step (lock held): evaluate the steps whose
        input id arrived, queue a Selector run after a slow one, route this step."""
        m = self._sfi[r]
        i = m.init
        for slow, n_j in m.advance(toks, self.trigger_table_host):
            attended = m.attended(slow, n_j)
            if not slow and attended == n_j:
                reason = ("no_compact_slot" if i.slot < 0 else
                          "budget_covers_sequence" if sfi.covers(i.sink, i.budget, i.window, n_j) else
                          "saving_below_minimum" if sfi.dense_at(i, n_j) else
                          "selection_pending")
                fallbacks[("sfi", reason)] += 1
            count("sfi", attended, n_j, slow, r)
        if m.refresh_n is not None:
            # The Selector reads keys below the slow step's length (on device); the
            # current length bounds the shapes.
            self._refresh[r] = n
            if m.refresh_later:
                self._refresh_later.add(r)
            else:
                self._refresh_later.discard(r)
            candidates = max(0, m.refresh_n - i.window - i.sink)
            m.selection = min(i.sink, m.refresh_n) + min(i.budget, candidates)
            m.refresh_n = None
        route = 0 if i.slot < 0 else 2 if sfi.dense_at(i, n) else 1
        if route == 1:
            may, surely = m.next_step()
            self._step_slow_sfi[0] |= may
            self._step_slow_sfi[1] &= surely
        m.launched_lens.append(n)
        return route

    def _query_aware_step(self, r: int, i: RowInit, n: int, count, fallbacks) -> int:
        """Host twin of policies.query_aware.decide (lock held): why a row is dense,
        or the tokens its indexed plan may attend. The exact count of an indexed step
        is known on the device only (quest's clipped boundary pages, lfps's |C2| and
        sink bypass): the host counts the plan's bound, sink + budget + recent.
        Routing: 1 (the two-segment kernel, its indexed segment A) when indexed,
        else 0 (the stock dense kernel: exactly `full`)."""
        name = i.policy.name.lower()
        st = self._stats.get(r)
        reason = None
        if i.slot < 0:
            reason = "no_store_slot"
        elif n > i.max_context:
            reason = "context_exceeds_store"
        elif query_aware.covers(i.sink, i.budget, i.window, n):
            reason = "budget_covers_sequence"
        elif query_aware.dense_at(i, n):
            reason = "saving_below_minimum"
        elif i.policy == PolicyId.ASYNCSPADE and st is not None and st[0] == 0:
            reason = "prediction_pending"
        if reason is not None:
            fallbacks[(name, reason)] += 1
            count(name, n, n, row=r)
            return 0
        count(name, min(i.sink, n - i.window) + i.budget + i.window, n, row=r)
        return 1

    def take_step_rows(self) -> list[int] | None:
        """Rows of the decode batch whose forward comes next, in batch order."""
        with self._lock:
            rows, self._step_rows = self._step_rows, None
        return rows

    def take_refresh(self) -> tuple[dict[int, int], set[int]]:
        """Rows whose compact buffer the Selector must refresh before the next
        step, with a host bound on their sequence length; and those of them whose
        slow step was not their first decode step (their evidence window is that
        step's query alone)."""
        with self._lock:
            out, self._refresh = self._refresh, {}
            later, self._refresh_later = self._refresh_later, set()
            pending = {r: n for r, n in out.items() if r in self._active}
        return pending, later & pending.keys()

    def take_step_kernel_rows(self) -> list[int] | None:
        with self._lock:
            rows, self._step_kernel_rows = self._step_kernel_rows, None
        return rows

    def release(self, rows: Iterable[int]) -> None:
        done, lfps_slots = [], []
        with self._lock:
            for r in rows:
                row = self._active.pop(int(r), None)
                self._scanned.pop(int(r), None)
                self._sfi.pop(int(r), None)
                self._refresh.pop(int(r), None)
                self._refresh_later.discard(int(r))
                self._prompt_pending.discard(int(r))
                st = self._stats.pop(int(r), None)
                free = self._free_list(row.policy) if row is not None else None
                if free is not None and row.slot >= 0:
                    free.append(row.slot)
                    if row.policy == PolicyId.LFPS:
                        lfps_slots.append(row.slot)
                if row is not None:
                    done.append((row.policy.name.lower(), st[1] / st[0] if st and st[0] else None))
            if lfps_slots and self.on_lfps_released is not None:
                try:  # under the lock: before any admission
                    self.on_lfps_released(lfps_slots)
                except Exception:  # noqa: BLE001 -- a metric's read must not fail a request's release
                    logger.exception("sgl_sparse: reading lfps's scored fraction at release failed")
        if self.metrics is not None:
            for policy, retention in done:
                self.metrics.on_release(policy, retention)

    def release_all(self) -> None:
        with self._lock:
            rows = list(self._active)
        self.release(rows)

    # ---- SFI set-up (backend, once the tokenizer and the model shape are known) --
    def set_trigger_table(self, table: np.ndarray) -> None:
        self.trigger_table_host = table
        self.trigger_table = torch.from_numpy(table).to(self.device)

    def row_init(self, row: int) -> RowInit:
        with self._lock:
            return self._active[row]

    # ---- introspection (metrics, leak checks) ---------------------------------
    def active_count(self) -> int:
        with self._lock:
            return len(self._active)

    def step_rows_tracked(self) -> bool:
        """Whether every row of the decode step about to run holds a state row, i.e.
        the device plan of each is its policy's (a row without one is routed to the
        stock kernel, and must stay there: its plan columns are not its own)."""
        with self._lock:
            return not self._step_untracked

    def step_balance(self) -> bool:
        """Whether the decode step about to run may hold a long kernel row among short
        ones -- an SFI slow step (dense) beside fast steps -- so that the kernel should
        balance its splits (kernels.two_segment_decode's ``balance``): some SFI row
        on the kernel may be slow (sentence triggers: any step may be; pinned by
        ``t_max``: the host knows) and not every kernel row surely is. Read like
        step_query_aware, by the variant choice of the same forward."""
        with self._lock:
            return self._step_balance

    def step_dense_keys(self) -> int:
        """The keys of the decode step about to run when every one of its kernel rows
        (more than one) is surely an SFI slow step, i.e. attends its whole sequence
        (slow ratios pinned by ``t_max``: a batch admitted together is slow together);
        0 otherwise. The backend balances such a step where that is faster
        (kernels.dense_step_balances): all rows alike, step_balance says no."""
        with self._lock:
            return self._step_dense_keys

    def step_query_aware(self) -> bool:
        """Whether the decode forward about to run needs the query-aware blocks: its
        batch holds a quest/asyncspade/lfps row (see step_query_aware_policies)."""
        return bool(self.step_query_aware_policies())

    def step_query_aware_policies(self) -> frozenset[PolicyId]:
        """The query-aware policies (quest/asyncspade/lfps) of the decode forward about
        to run: the blocks its graph variant must hold (graph_variants.choose). Read
        (not taken) by the decode graph runner's variant choice and by the backend's
        metadata init of the same forward, which must agree; before any decode batch,
        those of the live requests."""
        with self._lock:
            v = self._step_query_aware
            if v is None:
                v = frozenset(i.policy for i in self._active.values() if i.policy in _QUERY_AWARE)
        return v

    def has_active(self, policies) -> bool:
        """Whether any live request uses one of ``policies`` (per-step fast path)."""
        with self._lock:
            return any(i.policy in policies for i in self._active.values())

    def active_by_policy(self) -> dict[str, int]:
        with self._lock:
            c = Counter(i.policy.name.lower() for i in self._active.values())
        return dict(c)

    def compact_slots_in_use(self) -> int:
        with self._lock:
            return self.config.compact.slots - len(self._free_slots)

    def mark_prompt_chunks(self, pending: Iterable[int], done: Iterable[int]) -> None:
        """Query-aware rows whose extend chunk was not their prompt's last (their prompt
        state waits), and those whose last chunk built it (RowInit.prefill_end)."""
        with self._lock:
            self._prompt_pending.update(int(r) for r in pending)
            self._prompt_pending.difference_update(int(r) for r in done)

    def prompts_pending(self) -> int:
        """Live query-aware rows still waiting for their prompt's last chunk. A
        request decoding while counted here would select from a store without its
        prompt state: the leak and e2e tests read this as 0 whenever decoding."""
        with self._lock:
            return len(self._prompt_pending)

    def query_slots_in_use(self) -> dict[str, int]:
        """Store slots held by live requests, per query-aware policy."""
        with self._lock:
            return {p.name.lower(): self._qa_config(p).slots - len(self._qa_free[p]) for p in QUERY_AWARE_IDS}

    def request_stats(self, row: int) -> Optional[dict]:
        """Policy, slow-step ratio and mean retention of a live request so far."""
        with self._lock:
            init, st, m = self._active.get(row), self._stats.get(row), self._sfi.get(row)
            if init is None:
                return None
            steps = st[0] if st else 0
            return {
                "policy": init.policy.name.lower(),
                "decode_steps": steps,
                # SFI only: the other policies have no slow/fast distinction.
                "slow_step_ratio": m.slow_steps / m.evaluated if m and m.evaluated else None,
                "mean_retention": st[1] / steps if steps else None,
            }
