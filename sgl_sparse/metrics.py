"""Prometheus collectors, exported on SGLang's own `/metrics` (`--enable-metrics`).

SGLang runs the tokenizer manager and each scheduler in separate processes and
serves `/metrics` with prometheus-client's multiprocess collector; collectors made
here after SGLang set `PROMETHEUS_MULTIPROC_DIR` join that registry. Labels are
bounded: policy, model_name, a decode batch's policy `mix` (3 values), a kernel
compile's `phase` (2) and a fixed set of reasons -- never a request id. README
"Metrics" lists every metric.

Everything is counted on the host from facts the scheduler already has (each row's
policy and knobs, the batch's sequence lengths, the generated ids, host clocks):
no device sync is added to the decode step. The one device-side timing, the SFI
Selector's, uses CUDA events that are read only once they have completed.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

from sgl_sparse.device_reads import DeviceReads

_RETENTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0)
# lfps's scored fraction: the paper's Table 4 has a few % of the context scored.
_SCORED_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
# Seconds per output token / per decode step: GPU decode (ms) up to a loaded CPU box.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
# One decode step's period: finer where GPU decode steps fall (1-50 ms, ~15% apart), so
# that histogram_quantile's p99 can tell a slow step of 1.3x a dense one from 1.5x.
_STEP_BUCKETS = (0.0005, 0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045,
                 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0115, 0.013, 0.015, 0.0175, 0.02, 0.025,
                 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 5.0)
# One Selector refresh (all layers, the rows refreshed before a step).
_SELECTOR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0)

# Host time to prepare one decode forward (tens of microseconds to a refresh's launches).
_PREPARE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                    0.025, 0.05, 0.1)

# `mix` label of the decode step histogram: which policies shared the batch.
MIX_FULL, MIX_SPARSE, MIX_MIXED = "full", "sparse", "mixed"


def _reject_reasons() -> frozenset[str]:
    """Reasons a request is rejected: the field its metadata got wrong (a bounded set:
    the fields of the policy models), or unknown_field / type / other."""
    from sgl_sparse.config import _POLICY_MODELS

    fields = {f for m in _POLICY_MODELS.values() for f in m.model_fields}
    return frozenset(fields | {"unknown_field", "type", "other"})


REJECT_REASONS = _reject_reasons()


def batch_mix(policies) -> str:
    """The `mix` label of a decode step from the policies of its rows."""
    names = set(policies)
    if names <= {"full"}:
        return MIX_FULL
    return MIX_MIXED if "full" in names else MIX_SPARSE


# graph_variants' paths (their values) and the CPU reference path: every series from 0.
DECODE_PATHS = ("dense", "kernel", "kernel_balanced", "mixed", "qa", "qa_quest", "qa_asyncspade", "qa_lfps",
                "qa_kernel", "qa_quest_kernel", "qa_asyncspade_kernel", "qa_lfps_kernel",
                "qa_kernel_balanced", "qa_quest_kernel_balanced", "qa_asyncspade_kernel_balanced",
                "qa_lfps_kernel_balanced", "reference")


class SchedulerMetrics:
    """Per-policy decode statistics of one scheduler process: attention-TP rank 0 of
    the first pipeline stage (the backend makes none on the other ranks, whose
    batches are the same). With DP attention each DP group has its own, over its own
    requests, and the multiprocess registry sums them."""

    def __init__(self, model_name: str, tp_ranks: int = 1):
        from prometheus_client import Counter, Gauge, Histogram

        labels = ["policy", "model_name"]
        self.model_name = model_name
        # Every rank of the attention-TP group holds an equal share of the compact
        # buffers (its KV heads): the byte gauges report the group's, this rank's x tp.
        self.tp_ranks = max(1, int(tp_ranks))
        self.decode_steps = Counter(
            "sglang_sparse_decode_steps_total", "Request decode steps, by policy.", labels)
        self.slow_steps = Counter(
            "sglang_sparse_slow_steps_total",
            "Request decode steps that ran dense to refresh the selection (SFI), by policy.", labels)
        self.attended_tokens = Counter(
            "sglang_sparse_attended_tokens_total", "KV tokens attended, summed over request decode steps.", labels)
        self.cached_tokens = Counter(
            "sglang_sparse_cached_tokens_total", "KV tokens in cache, summed over request decode steps.", labels)
        self.dense_fallback_steps = Counter(
            "sglang_sparse_dense_fallback_steps_total",
            "Request decode steps of a sparse policy served by the dense kernel, by reason.",
            labels + ["reason"])
        self.request_retention = Histogram(
            "sglang_sparse_request_retention_ratio",
            "Mean over a finished request's decode steps of tokens attended / tokens in cache.",
            labels, buckets=_RETENTION_BUCKETS)
        self.lfps_scored = Histogram(
            "sglang_sparse_lfps_scored_fraction",
            "lfps, per finished request: positions scored exactly (|C1|) over positions past the sinks, "
            "summed over its selected decode steps, layers and KV heads.",
            ["model_name"], buckets=_SCORED_BUCKETS)
        self.active_requests = Gauge(
            "sglang_sparse_active_requests", "Requests holding sgl_sparse state, by policy.", labels,
            multiprocess_mode="livesum")
        self.tpot = Histogram(
            "sglang_sparse_time_per_output_token_seconds",
            "Per finished request: (finish - first token) / (output tokens - 1), scheduler host clock.",
            labels, buckets=_LATENCY_BUCKETS)
        self.step_duration = Histogram(
            "sglang_sparse_decode_step_duration_seconds",
            "Host time between the starts of two consecutive decode forwards with no other forward "
            "between them, by the policy mix of the first (full / sparse / mixed).",
            ["mix", "model_name"], buckets=_STEP_BUCKETS)
        self.selector_duration = Histogram(
            "sglang_sparse_selector_refresh_duration_seconds",
            "One SFI Selector refresh (all layers, every row refreshed before a decode step); "
            "CUDA: device time between events, CPU: wall clock.",
            ["model_name"], buckets=_SELECTOR_BUCKETS)
        self.prepare_duration = Histogram(
            "sglang_sparse_decode_prepare_duration_seconds",
            "Host time the backend spends preparing one decode forward before it is enqueued "
            "(state admission, SFI refresh launches, routing, the dense backend's plan).",
            ["model_name"], buckets=_PREPARE_BUCKETS)
        self.selector_rows = Counter(
            "sglang_sparse_selector_refreshed_rows_total",
            "Request rows whose compact buffer the SFI Selector refreshed.", ["model_name"])
        # Gauges of one scheduler process each; livesum adds the DP groups'.
        self.compact_in_use = Gauge(
            "sglang_sparse_compact_buffer_in_use_bytes",
            "Bytes of SFI compact-buffer slots held by live sfi requests, on all GPUs of the TP group.", ["model_name"],
            multiprocess_mode="livesum")
        self.compact_capacity = Gauge(
            "sglang_sparse_compact_buffer_capacity_bytes",
            "Bytes of all SFI compact-buffer slots reserved at start-up, on all GPUs of the TP group.", ["model_name"],
            multiprocess_mode="livesum")
        self.query_store_capacity = Gauge(
            "sglang_sparse_query_store_capacity_bytes",
            "Bytes of a query-aware policy's per-request store reserved at start-up (asyncspade's "
            "int8 index keys included), on all GPUs of the TP group, by policy.", labels,
            multiprocess_mode="livesum")
        self.kernel_compiles = Counter(
            "sglang_sparse_kernel_compiles_total",
            "Triton compiles of sgl_sparse's kernels, by phase: startup, or serving (a class of "
            "arguments the start-up warm-ups missed: the batch waited for the compile).",
            ["phase", "model_name"])
        self._compile_children = {phase: self.kernel_compiles.labels(phase, model_name)
                                  for phase in ("startup", "serving")}  # both series from 0
        self.decode_forwards = Counter(
            "sglang_sparse_decode_forwards_total",
            "Decode forwards by the attention path they ran: dense (FlashInfer alone), kernel "
            "(sgl_sparse's kernel alone), kernel_balanced (the kernel with balanced splits: a step "
            "where an SFI slow step may run beside fast ones, or an all-slow step of long rows over fp8, "
            "compact.balance_splits), mixed (both), "
            "qa (both with the query-aware blocks), qa_<policy>, qa[_<policy>]_kernel (those blocks with the "
            "kernel alone), qa[_<policy>]_kernel_balanced (balanced: SGLANG_SPARSE_QA_JOIN), "
            "reference (the CPU reference path).",
            ["path", "model_name"])
        self._path_children = {path: self.decode_forwards.labels(path, model_name) for path in DECODE_PATHS}
        self.balanced_launches = Counter(
            "sglang_sparse_balanced_launches_total",
            "Decode forwards on the kernel_balanced path whose device gate ran the balanced launch "
            "(a request's share of the programs differed from the heuristic's splits: an SFI slow row "
            "among fast ones, an all-slow step of long rows); the others ran the plain launch beside it "
            "(SGLANG_SPARSE_BALANCE_GATE). Read from the device every 16 such forwards.", ["model_name"])
        self._balanced_launches_child = self.balanced_launches.labels(model_name)  # from 0
        self.refresh_graph_captures = Counter(
            "sglang_sparse_refresh_graph_captures_total",
            "SFI refresh shapes captured into CUDA graphs (compact.refresh_graphs); the decode step "
            "each was captured on waited for it (an eager run plus the capture).", ["model_name"])
        self._captures_child = self.refresh_graph_captures.labels(model_name)  # from 0
        self._lfps_scored_child = self.lfps_scored.labels(model_name)  # from 0: its rate is 0, not absent
        self._slot_bytes = 0
        self._slots_in_use = 0
        self._last_decode_t: Optional[float] = None
        self._last_mix: Optional[str] = None
        self._selector_reads = DeviceReads(self._observe_selector, "sgl_sparse-selector-time")
        # labels() locks and hashes per call: the per-step series, resolved once.
        self._step_children: dict[str, tuple] = {}  # policy -> on_step's counters
        self._mix_children: dict[str, object] = {}  # mix -> step_duration

    def on_decode_path(self, path: str) -> None:
        """The backend, once per decode forward, with the path it runs (DECODE_PATHS)."""
        self._path_children[path].inc()

    def on_balanced_launches(self, count: int) -> None:
        """balanced_launches.BalancedLaunchCount's reads (its thread): forwards whose gate
        ran the balanced launch since the previous read."""
        self._balanced_launches_child.inc(count)

    def on_refresh_graph_capture(self) -> None:
        """selector.graphs.RefreshGraphs, after each capture."""
        self._captures_child.inc()

    def on_kernel_compile(self, serving: bool) -> None:
        """compile_watch's listener (in whichever thread compiled)."""
        self._compile_children["serving" if serving else "startup"].inc()

    # ---- per decode step (scheduler, host) ------------------------------------
    def on_step(self, per_policy: dict[str, list[int]], fallbacks: dict[tuple[str, str], int]) -> None:
        for policy, (steps, attended, cached, slow) in per_policy.items():
            c = self._step_children.get(policy)
            if c is None:
                c = self._step_children[policy] = tuple(
                    m.labels(policy, self.model_name)
                    for m in (self.decode_steps, self.slow_steps, self.attended_tokens, self.cached_tokens))
            c[0].inc(steps)
            if slow:
                c[1].inc(slow)
            c[2].inc(attended)
            c[3].inc(cached)
        for (policy, reason), n in fallbacks.items():
            self.dense_fallback_steps.labels(policy, self.model_name, reason).inc(n)
        if per_policy:
            self._last_mix = batch_mix(per_policy)

    def on_forward(self, is_decode: bool, compact=None, compact_slots_in_use: int = 0,
                   now: Optional[float] = None) -> None:
        """Scheduler, as each forward batch is built (before on_step of a decode).

        The interval between two decode batches in a row is the previous decode
        step's period as the scheduler lives it (its forward, sampling and the
        scheduling around them); an extend or idle batch in between breaks the
        chain, so prefill time is never counted as a decode step. `compact` (the
        SFI CompactStore, or None) and its slots in use update the buffer gauges."""
        now = time.perf_counter() if now is None else now
        self.observe_compact(compact, compact_slots_in_use)
        if is_decode and self._last_decode_t is not None and self._last_mix is not None:
            h = self._mix_children.get(self._last_mix)
            if h is None:
                h = self._mix_children[self._last_mix] = self.step_duration.labels(self._last_mix, self.model_name)
            h.observe(now - self._last_decode_t)
        self._last_decode_t = now if is_decode else None
        if not is_decode:
            self._last_mix = None

    # ---- per request (scheduler, host) ----------------------------------------
    def on_admit(self, policy: str) -> None:
        self.active_requests.labels(policy, self.model_name).inc()

    def on_release(self, policy: str, mean_retention: Optional[float]) -> None:
        self.active_requests.labels(policy, self.model_name).dec()
        if mean_retention is not None:
            self.request_retention.labels(policy, self.model_name).observe(mean_retention)

    def on_lfps_scored(self, fraction: float) -> None:
        """An lfps request's scored fraction (lfps_scored.ScoredFractionReads, at its
        release; on CUDA from device_reads' thread once the copy has completed)."""
        self._lfps_scored_child.observe(fraction)

    def on_request_finished(self, policy: str, tpot_seconds: Optional[float]) -> None:
        if tpot_seconds is not None:
            self.tpot.labels(policy, self.model_name).observe(tpot_seconds)

    # ---- SFI compact buffers and Selector --------------------------------------
    def set_compact_store(self, store) -> None:
        """Capacity of the compact store (sgl_sparse.compact.CompactStore), once."""
        # k, v (or lists): [layers, slots, ...]; q, q_prompt: [layers, slots + 1, ...] (a scratch slot).
        slot = store.selection_bytes() // store.slots
        slot += (store.q.nbytes + store.q_prompt.nbytes) // (store.slots + 1)
        self._slot_bytes = slot * self.tp_ranks
        self.compact_capacity.labels(self.model_name).set(self._slot_bytes * store.slots)
        self.compact_in_use.labels(self.model_name).set(0)

    def set_query_store(self, policy: str, nbytes: int) -> None:
        """Bytes of one query-aware policy's store on this rank (query_store.nbytes), once."""
        self.query_store_capacity.labels(policy, self.model_name).set(nbytes * self.tp_ranks)

    def observe_compact(self, compact, slots_in_use: int) -> None:
        """Per forward and after each release: slots change at admission (in the
        forward) and at release; the gauge is written only when the count moves."""
        if compact is None:
            return
        if not self._slot_bytes:
            self.set_compact_store(compact)
        if slots_in_use != self._slots_in_use:
            self._slots_in_use = slots_in_use
            self.compact_in_use.labels(self.model_name).set(slots_in_use * self._slot_bytes)

    @contextlib.contextmanager
    def time_selector(self, device: torch.device, rows: int) -> Iterator[None]:
        """Time one Selector refresh. CUDA: two events around the enqueued work,
        observed once the second has completed (device_reads.DeviceReads: never a
        synchronize, nor a wait for the next refresh)."""
        self.selector_rows.labels(self.model_name).inc(rows)
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self.selector_duration.labels(self.model_name).observe(time.perf_counter() - t0)
            return
        if torch.cuda.is_current_stream_capturing():
            yield
            return
        start, end = DeviceReads.event(timing=True), DeviceReads.event(timing=True)
        start.record()
        yield
        end.record()
        self._selector_reads.put((start, end), end)

    def _observe_selector(self, events: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        """A refresh's (start, end) events, both completed."""
        self.selector_duration.labels(self.model_name).observe(events[0].elapsed_time(events[1]) / 1e3)


_rejected = None


def count_rejected(reason: str, model_name: str) -> None:
    """Tokenizer-manager side: a request refused with HTTP 400 for its metadata."""
    global _rejected
    if _rejected is None:
        from prometheus_client import Counter

        _rejected = Counter("sglang_sparse_rejected_requests_total",
                            "Requests refused for invalid sparse metadata, by reason.", ["reason", "model_name"])
    _rejected.labels(reason if reason in REJECT_REASONS else "other", model_name).inc()
