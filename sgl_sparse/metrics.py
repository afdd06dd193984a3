"""Prometheus collectors, exported on SGLang's own `/metrics` (`--enable-metrics`).

SGLang runs the tokenizer manager and each scheduler in separate processes and
serves `/metrics` with prometheus-client's multiprocess collector; collectors made
here after SGLang set `PROMETHEUS_MULTIPROC_DIR` join that registry. Labels are
bounded: policy, model_name, and a fixed set of reasons -- never a request id.

Everything is counted on the host from facts the scheduler already has (each row's
policy and knobs, the batch's sequence lengths, the generated ids): no device
sync is added to the decode step.
"""

from __future__ import annotations

from typing import Optional

_RETENTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0)
def _reject_reasons() -> frozenset[str]:
    """Reasons a request is rejected: the field its metadata got wrong (a bounded set:
    the fields of the policy models), or unknown_field / type / other."""
    from sgl_sparse.config import _POLICY_MODELS

    fields = {f for m in _POLICY_MODELS.values() for f in m.model_fields}
    return frozenset(fields | {"unknown_field", "type", "other"})


REJECT_REASONS = _reject_reasons()


class SchedulerMetrics:
    """Per-policy decode statistics, one instance per scheduler process."""

    def __init__(self, model_name: str):
        from prometheus_client import Counter, Gauge, Histogram

        labels = ["policy", "model_name"]
        self.model_name = model_name
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
        self.active_requests = Gauge(
            "sglang_sparse_active_requests", "Requests holding sgl_sparse state, by policy.", labels,
            multiprocess_mode="livesum")

    def on_step(self, per_policy: dict[str, list[int]], fallbacks: dict[tuple[str, str], int]) -> None:
        for policy, (steps, attended, cached, slow) in per_policy.items():
            self.decode_steps.labels(policy, self.model_name).inc(steps)
            if slow:
                self.slow_steps.labels(policy, self.model_name).inc(slow)
            self.attended_tokens.labels(policy, self.model_name).inc(attended)
            self.cached_tokens.labels(policy, self.model_name).inc(cached)
        for (policy, reason), n in fallbacks.items():
            self.dense_fallback_steps.labels(policy, self.model_name, reason).inc(n)

    def on_admit(self, policy: str) -> None:
        self.active_requests.labels(policy, self.model_name).inc()

    def on_release(self, policy: str, mean_retention: Optional[float]) -> None:
        self.active_requests.labels(policy, self.model_name).dec()
        if mean_retention is not None:
            self.request_retention.labels(policy, self.model_name).observe(mean_retention)


_rejected = None


def count_rejected(reason: str, model_name: str) -> None:
    """Tokenizer-manager side: a request refused with HTTP 400 for its metadata."""
    global _rejected
    if _rejected is None:
        from prometheus_client import Counter

        _rejected = Counter("sglang_sparse_rejected_requests_total",
                            "Requests refused for invalid sparse metadata, by reason.", ["reason", "model_name"])
    _rejected.labels(reason if reason in REJECT_REASONS else "other", model_name).inc()
