"""SFI's Selector (ALGORITHMS.md §1, steps 1-6), vectorized over requests, KV heads,
GQA groups and the evidence window.

Pure tensor ops on whatever device the inputs live on: no host round trip, no
per-request Python loop. The compute dtype is the dtype of `logits` (float32 on
the serving path; the tests run the same code in float64 against a loop-by-loop
float64 transcription of the formulas).

Shapes: r requests, H KV heads, G query heads per KV head, w window queries, N
key positions (the longest sequence among the r requests; shorter ones are
masked by their candidate range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_NEG_INF = float("-inf")
# The Selector's per-request knobs, in SelectorKnobs' order (SfiPolicy field names).
KNOB_NAMES = ("beta", "alpha", "kappa", "zeta", "clip", "nms_gamma", "nms_radius", "excl_eta", "excl_tau", "eps")


def knob_values(spec) -> list[float]:
    """One request's knobs as a row of SparseState.sfi_knobs."""
    return [float(getattr(spec, f)) for f in KNOB_NAMES]


@dataclass
class SelectorKnobs:
    """Per-request knobs as [r] tensors (requests may override any of them)."""

    beta: torch.Tensor
    alpha: torch.Tensor
    kappa: torch.Tensor
    zeta: torch.Tensor
    clip: torch.Tensor
    nms_gamma: torch.Tensor
    nms_radius: torch.Tensor  # int64
    excl_eta: torch.Tensor
    excl_tau: torch.Tensor
    eps: torch.Tensor
    nms_radius_max: int  # host copy of max(nms_radius): loop bound, no device sync

    def first(self, m: int) -> "SelectorKnobs":
        """The knobs of the first `m` rows (views)."""
        out = {f: getattr(self, f)[:m] for f in self.__dataclass_fields__ if f != "nms_radius_max"}
        return SelectorKnobs(**out, nms_radius_max=self.nms_radius_max)

    @classmethod
    def from_specs(cls, specs: Sequence, device, dtype) -> "SelectorKnobs":
        """The specs' knobs (the start-up warm-up's and the tests'; a refresh gathers
        them from the state: `from_table`)."""
        # One pinned host->device copy, asynchronous: a pageable copy would make the
        # host wait for the GPU work already queued (the decode step in flight).
        # Rows padded to 4 entries: each knob's tensor starts 16-byte aligned, so
        # Triton compiles one variant whatever the number of requests.
        rows = len(specs)
        host = torch.zeros(len(KNOB_NAMES), -(-rows // 4) * 4, dtype=torch.float64)
        host[:, :rows] = torch.tensor([[float(getattr(s, f)) for s in specs] for f in KNOB_NAMES],
                                      dtype=torch.float64).view(len(KNOB_NAMES), rows)
        cols = to_device(host, device).to(dtype)[:, :rows]
        out = dict(zip(KNOB_NAMES, cols.unbind(0)))
        out["nms_radius"] = out["nms_radius"].round().to(torch.int64)
        return cls(**out, nms_radius_max=max((s.nms_radius for s in specs), default=0))

    @classmethod
    def from_table(cls, table: torch.Tensor, ridx: torch.Tensor, nms_radius_max: int) -> "SelectorKnobs":
        """Rows `ridx` of a [rows, len(KNOB_NAMES)] device table written at admission
        (SparseState.sfi_knobs): what `from_specs` gives, gathered on the device, so
        a refresh builds no host tensor and copies nothing to the device for them."""
        m = ridx.shape[0]
        cols = torch.empty(len(KNOB_NAMES), -(-m // 4) * 4, dtype=table.dtype, device=table.device)
        cols[:, :m] = table[ridx].t()  # rows padded to 4: see from_specs
        out = dict(zip(KNOB_NAMES, cols[:, :m].unbind(0)))
        out["nms_radius"] = out["nms_radius"].round().to(torch.int64)
        return cls(**out, nms_radius_max=nms_radius_max)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """Host tensor -> device without a host/device synchronization (pinned, async)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _b(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """[r] -> [r, 1, ..., 1] with `ndim` dims in total, for broadcasting."""
    return x.view(-1, *([1] * (ndim - 1)))


def candidate_mask(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """A_t as a mask [r, 1, N]: positions lo <= j < hi (lo = sink, hi = n - recent)."""
    pos = torch.arange(n, device=lo.device)
    return ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :]


def evidence_power_mean(logits: torch.Tensor, allowed: torch.Tensor, qmask: torch.Tensor,
                        beta: torch.Tensor) -> torch.Tensor:
    """Step 1, first half: logits [r, H, G, w, N] -> u [r, H, N] (0 off A_t).

    p_i = softmax of query i's logits over A_t; the G query heads of a group are
    averaged (GQA aggregation [ours]); u_j = mean_i p_i(j)^beta over the valid
    window queries. (kernels.window_evidence computes the same u from the keys.)
    """
    lg = logits.masked_fill(~allowed[:, :, None, None, :], _NEG_INF)
    p = torch.softmax(lg, dim=-1).nan_to_num(0.0)  # a query with no allowed key: all 0
    p = p.mean(dim=2)  # [r, H, w, N]
    b = _b(beta, 4)
    qm = qmask[:, None, :, None].to(p.dtype)
    nq = qm.sum(dim=2).clamp(min=1.0)
    return (p.pow(b) * qm).sum(dim=2) / nq


def normalize_evidence(u: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Step 1, second half: e = u^(1/beta), normalized on A_t."""
    e = u.pow(1.0 / _b(beta, 3))
    return e / e.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)


def evidence(logits: torch.Tensor, allowed: torch.Tensor, qmask: torch.Tensor,
             beta: torch.Tensor) -> torch.Tensor:
    """Step 1. logits [r, H, G, w, N], allowed [r, 1, N], qmask [r, w] -> e [r, H, N]."""
    return normalize_evidence(evidence_power_mean(logits, allowed, qmask, beta), beta)


def _masked_lower_median(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Lower median over the allowed positions of the last dim ([r, H, N] -> [r, H, 1])."""
    return torch.nanmedian(x.masked_fill(~allowed, float("nan")), dim=-1, keepdim=True).values


def prior(norms: torch.Tensor, allowed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
          knobs: SelectorKnobs) -> torch.Tensor:
    """Step 2. norms [r, H, N] (key norms per KV head) -> pi [r, H, N], normalized on A_t.

    g_j = (1 + z_j^2)^(-1/2), z_j = max(0, (|k_j| - med) / mad) with med the (lower)
    median and mad the (lower) median absolute deviation over A_t; z = 0 where
    mad = 0. f(x) = exp(-alpha x^kappa) (1 - x + eps)^zeta with x in [0, 1] the
    position within A_t (1 = most recent; x = 1 when |A_t| = 1).
    """
    r, _, n = norms.shape
    med = _masked_lower_median(norms, allowed)
    mad = _masked_lower_median((norms - med).abs(), allowed)
    z = torch.where(mad > 0, (norms - med) / torch.where(mad > 0, mad, 1.0), 0.0).clamp(min=0.0)
    g = (1.0 + z * z).rsqrt()
    pos = torch.arange(n, device=norms.device, dtype=norms.dtype)
    span = (hi - 1 - lo).to(norms.dtype)
    x = torch.where(_b(span, 2) > 0, (pos[None, :] - _b(lo, 2).to(norms.dtype)) / _b(span, 2).clamp(min=1), 1.0)
    x = x.clamp(0.0, 1.0)[:, None, :]  # [r, 1, N]
    f = torch.exp(-_b(knobs.alpha, 3) * x.pow(_b(knobs.kappa, 3))) * (1.0 - x + _b(knobs.eps, 3)).pow(_b(knobs.zeta, 3))
    pi = (g * f).masked_fill(~allowed, 0.0)
    return pi / pi.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(pi.dtype).tiny)


def fuse(e: torch.Tensor, pi: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Steps 3-4. q = (1 - lam) e + lam pi, lam = clip(<e, e - pi> / |e - pi|^2, 0, c)."""
    d = e - pi
    den = (d * d).sum(dim=-1, keepdim=True)
    num = (e * d).sum(dim=-1, keepdim=True)
    lam = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
    lam = torch.minimum(lam.clamp(min=0.0), _b(clip, 3))
    return (1.0 - lam) * e + lam * pi


def log_scores(q: torch.Tensor, allowed: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Step 5 (first line): s = log(q + eps) on A_t, -inf elsewhere."""
    return torch.log(q + _b(eps, 3)).masked_fill(~allowed, _NEG_INF)


def soft_nms(s: torch.Tensor, allowed: torch.Tensor, gamma: torch.Tensor,
             radius: torch.Tensor, r_max: int) -> torch.Tensor:
    """s_j <- s_j - gamma (m_j - s_j), m_j = max of s over |k - j| <= radius (within A_t).

    `r_max` >= every radius, known on the host (the loop bound)."""
    m = s
    for d in range(1, r_max + 1):
        on = _b(radius >= d, 3)
        left = torch.nn.functional.pad(s[..., :-d], (d, 0), value=_NEG_INF)
        right = torch.nn.functional.pad(s[..., d:], (0, d), value=_NEG_INF)
        m = torch.where(on, torch.maximum(m, torch.maximum(left, right)), m)
    out = s - _b(gamma, 3) * (m - s)
    return out.masked_fill(~allowed, _NEG_INF)


def exclusivity(s: torch.Tensor, allowed: torch.Tensor, eta: torch.Tensor,
                tau: torch.Tensor) -> torch.Tensor:
    """s_{h,j} <- s_{h,j} + eta log softmax_h(s_{h,j} / tau), across the KV heads."""
    finite = s.masked_fill(~allowed, 0.0)  # keeps -inf - -inf out of the softmax
    log_rho = torch.log_softmax(finite / _b(tau, 3), dim=1)
    return (finite + _b(eta, 3) * log_rho).masked_fill(~allowed, _NEG_INF)


def refined_scores_from_evidence(u, norms, lo, hi, knobs: SelectorKnobs) -> torch.Tensor:
    """Steps 1 (normalization) to 5 from the power mean u [r, H, N]."""
    allowed = candidate_mask(lo, hi, u.shape[-1])
    e = normalize_evidence(u, knobs.beta)
    pi = prior(norms.to(u.dtype), allowed, lo, hi, knobs)
    s = log_scores(fuse(e, pi, knobs.clip), allowed, knobs.eps)
    s = soft_nms(s, allowed, knobs.nms_gamma, knobs.nms_radius, knobs.nms_radius_max)
    return exclusivity(s, allowed, knobs.excl_eta, knobs.excl_tau)


def refined_scores(logits, norms, lo, hi, qmask, knobs: SelectorKnobs) -> torch.Tensor:
    """Steps 1-5: the score each candidate is ranked by, [r, H, N] (-inf off A_t)."""
    allowed = candidate_mask(lo, hi, logits.shape[-1])
    u = evidence_power_mean(logits, allowed, qmask, knobs.beta)
    return refined_scores_from_evidence(u, norms, lo, hi, knobs)


def select(logits, norms, lo, hi, qmask, budget: torch.Tensor, knobs: SelectorKnobs,
           k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-6 from the window logits; see `select_from_evidence`."""
    allowed = candidate_mask(lo, hi, logits.shape[-1])
    u = evidence_power_mean(logits, allowed, qmask, knobs.beta)
    return select_from_evidence(u, norms, lo, hi, budget, knobs, k_max)


def select_from_evidence(u, norms, lo, hi, budget: torch.Tensor, knobs: SelectorKnobs,
                         k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-6 from the evidence power mean u [r, H, N]; see `top_k_positions`."""
    return top_k_positions(refined_scores_from_evidence(u, norms, lo, hi, knobs), lo, hi, budget, k_max)


def top_k_positions(s: torch.Tensor, lo, hi, budget: torch.Tensor, k_max: int,
                    k_min: int = 0, use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 6: Top-K per KV head of the refined scores s [r, H, N]. Returns
    (positions [r, H, k_max] ascending in the first `count` entries and 0 after,
    count [r]) with count = min(budget, |A_t|).

    `k_max` (>= every budget) is a host-known bound so no shape depends on data;
    `k_min` (<= every budget, host-known) allows an unordered top-k (torch path).
    `use_kernel` (default: fp32 CUDA scores): the Triton top-k over each row's
    [lo, hi) (kernels/topk_range.py), whose cost is bounded by |A_t| rather than
    N and that lists ascending positions itself (no sort); the torch path below
    is its oracle. Both rely on the scores being finite exactly on A_t.
    """
    n = s.shape[-1]
    k = min(k_max, n)
    count = torch.minimum(budget.to(torch.int64), (hi - lo).clamp(min=0).to(torch.int64))
    if use_kernel is None:
        use_kernel = s.is_cuda and s.dtype == torch.float32
    if use_kernel:
        from sgl_sparse.kernels.topk_range import topk_range

        i32 = torch.int32
        pos, _ = topk_range(s.to(torch.float32), lo.to(i32).contiguous(), hi.to(i32).contiguous(),
                            budget.clamp(max=k_max).to(i32).contiguous(), max(1, k_max), one_block=False)
        return pos[..., :k_max].long(), count
    # Scores are finite exactly on A_t, so when no row's budget is below k the
    # unordered top-k is enough: its finite entries are the kept set. Otherwise
    # the best `count` of each row are a prefix of the sorted top-k.
    prefix = torch.arange(k, device=s.device)[None, None, :] < count[:, None, None]
    if k_min >= k:
        vals, idx = torch.topk(s, k, dim=-1, sorted=False)
        valid = torch.isfinite(vals)
    else:
        idx = torch.topk(s, k, dim=-1, sorted=True).indices
        valid = prefix
    # Ascending positions within the kept prefix (sequential reads when packing).
    big = torch.iinfo(torch.int64).max
    pos = torch.sort(torch.where(valid, idx, big), dim=-1).values
    pos = torch.where(prefix, pos, 0)
    if k < k_max:
        pos = torch.nn.functional.pad(pos, (0, k_max - k))
    return pos, count
