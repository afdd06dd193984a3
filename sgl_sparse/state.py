"""Per-request policy state: device tensors indexed by SGLang's ``req_pool_idx``.

A row is written when its request enters a batch (every extend chunk rewrites the
whole row, so a reused row never inherits a finished request's state) and released
when SGLang returns the row to its free list (finish, abort, retraction).

Release is host bookkeeping only: with the overlap scheduler a forward that still
reads the row may be in flight on another stream, so the device row is left as is
until the row's next owner overwrites it, in stream order, at admission.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable, Sequence

import torch

from sgl_sparse.config import SparseServerConfig
from sgl_sparse.policies.base import PolicyId, RowInit


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
        self._lock = threading.Lock()
        # Host mirror of each live row's policy knobs; `latched` follows SADAS's
        # latch as generated tokens reach the host (it may lag the device by a step).
        self._active: dict[int, RowInit] = {}
        self._scanned: dict[int, int] = {}
        self._queued: tuple[list[int], list[RowInit]] = ([], [])
        self._step_kernel_rows: list[int] | None = None
        # Per live row: [decode steps, sum of per-step retention] (host-side stats).
        self._stats: dict[int, list[float]] = {}
        self.metrics = None  # sgl_sparse.metrics.SchedulerMetrics when --enable-metrics

    # ---- admission / release (host side, once per request) -------------------
    def enqueue(self, rows: Sequence[int], inits: Sequence[RowInit]) -> None:
        """Scheduler side: rows of an extend batch about to run (host only)."""
        with self._lock:
            self._queued[0].extend(rows)
            self._queued[1].extend(inits)

    def admit_queued(self) -> None:
        """Backend side, in the forward that follows: write the queued rows."""
        with self._lock:
            rows, inits = self._queued
            self._queued = ([], [])
        self.admit(rows, inits)

    def admit(self, rows: Sequence[int], inits: Sequence[RowInit]) -> None:
        """Write whole rows for requests entering a batch. No host sync."""
        if not rows:
            return
        for r in rows:
            if not 0 < r < self.num_rows:
                raise IndexError(f"req_pool_idx {r} outside [1, {self.num_rows})")
        idx = torch.tensor(rows, dtype=torch.int64)
        host = {
            "policy": torch.tensor([int(i.policy) for i in inits], dtype=torch.int8),
            "window": torch.tensor([i.window for i in inits], dtype=torch.int32),
            "sink": torch.tensor([i.sink for i in inits], dtype=torch.int32),
            "think": torch.tensor([i.think for i in inits], dtype=torch.bool),
            "latch": torch.tensor([i.latch for i in inits], dtype=torch.bool),
        }
        pin = self.device.type == "cuda"
        idx = idx.pin_memory().to(self.device, non_blocking=True) if pin else idx
        for name, values in host.items():
            values = values.pin_memory().to(self.device, non_blocking=True) if pin else values
            getattr(self, name).index_copy_(0, idx, values)
        newly = []
        with self._lock:
            for r, i in zip(rows, inits):
                r = int(r)
                if r not in self._active:  # not a later chunk of the same request
                    newly.append(i.policy)
                    self._stats[r] = [0, 0.0]
                self._active[r] = i
                self._scanned[r] = 0
        if self.metrics is not None:
            for p in newly:
                self.metrics.on_admit(p.name.lower())

    def set_step_rows(self, rows: Sequence[int], seq_lens: Sequence[int], new_tokens: Sequence) -> None:
        """Scheduler side, per decode batch: which slots need the sparse kernel.

        A slot whose plan is dense this step -- `full`, a window covering the whole
        sequence, a SADAS request the host already saw latch -- can go through the
        stock dense kernel and give exactly its output. ``new_tokens[i]`` are the
        generated ids of slot i (scanned incrementally for SADAS's `</think>`).
        """
        end_id = self.think_ids[1]
        mask = []
        per_policy: dict[str, list[int]] = {}
        fallbacks: Counter[tuple[str, str]] = Counter()
        with self._lock:
            for r, n, toks in zip(rows, seq_lens, new_tokens):
                r, n = int(r), int(n)
                row = self._active.get(r)
                if row is None:
                    mask.append(0)
                    continue
                if row.policy == PolicyId.SADAS and not row.latch and end_id is not None:
                    seen = self._scanned.get(r, 0)
                    if any(int(t) == end_id for t in toks[seen:]):
                        row = self._active[r] = RowInit(row.policy, row.window, row.sink, row.think, True)
                    self._scanned[r] = len(toks)
                # The host twin of decision.plan_decode: the device plan is windowed
                # exactly when n > window + sink (then a_len + window < n).
                name = row.policy.name.lower()
                windowed = False
                if row.policy == PolicyId.SADAS and row.latch:
                    fallbacks[(name, "sadas_latched")] += 1
                elif row.policy != PolicyId.FULL and row.window + row.sink >= n:
                    fallbacks[(name, "window_covers_sequence")] += 1
                elif row.policy != PolicyId.FULL:
                    windowed = True
                mask.append(int(windowed))
                attended = row.window + row.sink if windowed else n
                agg = per_policy.setdefault(name, [0, 0, 0])
                agg[0] += 1
                agg[1] += attended
                agg[2] += n
                st = self._stats.get(r)
                if st is not None:
                    st[0] += 1
                    st[1] += attended / max(n, 1)
            self._step_kernel_rows = mask
        if self.metrics is not None:
            self.metrics.on_step(per_policy, fallbacks)

    def take_step_kernel_rows(self) -> list[int] | None:
        with self._lock:
            rows, self._step_kernel_rows = self._step_kernel_rows, None
        return rows

    def release(self, rows: Iterable[int]) -> None:
        done = []
        with self._lock:
            for r in rows:
                row = self._active.pop(int(r), None)
                self._scanned.pop(int(r), None)
                st = self._stats.pop(int(r), None)
                if row is not None:
                    done.append((row.policy.name.lower(), st[1] / st[0] if st and st[0] else None))
        if self.metrics is not None:
            for policy, retention in done:
                self.metrics.on_release(policy, retention)

    def release_all(self) -> None:
        with self._lock:
            rows = list(self._active)
        self.release(rows)

    # ---- introspection (metrics, leak checks) ---------------------------------
    def active_count(self) -> int:
        with self._lock:
            return len(self._active)

    def active_by_policy(self) -> dict[str, int]:
        with self._lock:
            c = Counter(i.policy.name.lower() for i in self._active.values())
        return dict(c)
