"""
Selector scores: SFI's Selector steps 1 (normalization) to 5, fused
===================================================================

From the evidence power mean ``u`` and the key norms (both ``[R, H, N]`` fp32,
``R`` = layers x requests) to the refined score every candidate is ranked by
(``sgl_sparse.selector.core.refined_scores_from_evidence`` is the PyTorch
reference; the formulas are in ALGORITHMS.md §1). The PyTorch path costs ~40
launches and as many passes over ``[R, H, N]`` per layer chunk, and its two
masked medians are full sorts; here it is three launches:

1. ``_selector_stats``, one program per (row, KV head) (several when the rows
   are long and few: ``selector_stats_split.py``): the lower median of the
   key norms on ``A = [lo, hi)`` and their lower median absolute deviation, both
   by a radix select on the fp32 bit pattern (4 histogram passes of 8 bits each:
   the values are >= 0, so their bits order like the values; exact, the same
   element ``torch.nanmedian`` returns; after the top 16 bits the few values left
   are gathered, so the last two passes read those only; the MAD's select takes one
   pass over A where the median's two histograms bracket it, ``_mad_bracket.py``),
   then the evidence and prior
   normalizers and the fusion weight ``lam`` (two passes, the reference's order
   of operations: sums of ``d = e - pi`` products, no cancellation-prone
   expansion).
2. ``_selector_fused``, one program per (row, block of positions) covering all
   KV heads: the fused score ``log((1 - lam) e + lam pi + eps)``, ``-inf`` off ``A``.
3. ``_selector_refine``, same grid: Soft-NMS against the neighbourhood maximum
   (neighbours read back from step 2's output, a halo of ``radius`` positions)
   and cross-head exclusivity (a log-softmax over the heads of the block).

Length-dependent integer arguments are not specialized (``do_not_specialize``):
one compiled variant serves every sequence length. Powers are ``exp2(y * log2(x))`` (``x >= 0``; ``0 ** y = 0`` for ``y > 0``),
so results match the fp32 PyTorch path to float rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._mad_bracket import bracketed_mad, median_with_histograms
from ._radix import digit_histogram, radix_select
from ._split import STATS_RULE, resolve_splits
from ._utils import next_pow2

__all__ = ["selector_scores", "selector_stats"]

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: the reference's clamp
_NSTATS = 5  # per (row, head): evidence sum, prior sum, lam, median, MAD


@triton.jit
def _pow(x, y):
    """x ** y for x >= 0 (0 -> 0 when y > 0)."""
    return tl.where(x > 0, tl.exp2(y * tl.log2(tl.where(x > 0, x, 1.0))), 0.0)


@triton.jit
def _lower_median(X, lo, hi, center, SCR, ABS_DEV: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr):
    """Lower median of v_j, j in [lo, hi) (hi > lo), v = X[j] or |X[j] - center|: the
    radix select of ``_radix.py`` on the magnitude bits (v >= 0), k = (hi - lo - 1) // 2."""
    KEY: tl.constexpr = 1 if ABS_DEV else 0
    h = digit_histogram(X, lo, hi, center, 0, 24, KEY, False, BLOCK_N)
    bits, _ = radix_select(X, lo, hi, h, (hi - lo - 1) // 2, center, SCR, KEY, GATHER, BLOCK_N)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _position(pos, lo, span):
    """x in [0, 1]: the position within A (1 = most recent; 1 when |A| = 1)."""
    # Correctly rounded division, as torch's: near the tail 1 - x is ~1/span, and the
    # GPU's default approximate division (2 ulp) made it off by ~1% at 128K.
    x = tl.where(span > 0, tl.math.div_rn((pos - lo).to(tl.float32), tl.maximum(span, 1).to(tl.float32)), 1.0)
    return tl.minimum(tl.maximum(x, 0.0), 1.0)


@triton.jit
def _prior_hat(nrm, x, alpha, kappa, zeta, eps, med, mad):
    """Unnormalized prior g(|k|) f(x) (broadcasting)."""
    z = tl.where(mad > 0, tl.maximum((nrm - med) / tl.where(mad > 0, mad, 1.0), 0.0), 0.0)
    g = 1.0 / tl.sqrt(1.0 + z * z)
    return g * tl.exp(-alpha * _pow(x, kappa)) * _pow(1.0 - x + eps, zeta)


@triton.jit
def _terms(U, NORMS, offs, ok, lo, span, inv_beta, alpha, kappa, zeta, eps, med, mad):
    """One head's unnormalized evidence u^(1/beta) and prior at positions `offs` (0 where not ok)."""
    u = tl.load(U + offs, mask=ok, other=0.0)
    nrm = tl.load(NORMS + offs, mask=ok, other=0.0)
    p_hat = _prior_hat(nrm, _position(offs, lo, span), alpha, kappa, zeta, eps, med, mad)
    return _pow(u, inv_beta), tl.where(ok, p_hat, 0.0)


@triton.jit
def _prior_knobs(BETA, ALPHA, KAPPA, ZETA, EPS, cur_r):
    """Row cur_r's knobs for _terms: (1 / beta, alpha, kappa, zeta, eps)."""
    return (1.0 / tl.load(BETA + cur_r), tl.load(ALPHA + cur_r), tl.load(KAPPA + cur_r), tl.load(ZETA + cur_r),
            tl.load(EPS + cur_r))


@triton.jit(do_not_specialize=["stride_r", "stride_h"])
def _selector_stats(
    U, NORMS, LO, HI, BETA, ALPHA, KAPPA, ZETA, CLIP, EPS, STATS, SCRATCH,
    stride_r, stride_h, stride_sr, stride_sh,
    BLOCK_N: tl.constexpr, GATHER: tl.constexpr, MAD_BRACKET: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    lo = tl.load(LO + cur_r)
    hi = tl.load(HI + cur_r)
    st = STATS + cur_r * stride_sr + cur_h * stride_sh
    # No candidates (hi <= lo): every loop below is empty and the stats are
    # stored as 0; every score of the row is -inf whatever they are.
    has = hi > lo
    hi = tl.maximum(hi, lo)
    u_row = U + cur_r * stride_r + cur_h * stride_h
    n_row = NORMS + cur_r * stride_r + cur_h * stride_h
    scr = SCRATCH + cur_r * stride_r + cur_h * stride_h  # a row as long as U's
    if MAD_BRACKET:  # the MAD's one pass over the row bracketed by the median's histograms (_mad_bracket.py)
        med_bits, h_top, top, h_next = median_with_histograms(n_row, lo, hi, scr, BLOCK_N)
        med = med_bits.to(tl.float32, bitcast=True)
        mad_bits, _ = bracketed_mad(n_row, lo, hi, med_bits, h_top, top, h_next, scr, BLOCK_N)
        mad = mad_bits.to(tl.float32, bitcast=True)
    else:
        med = _lower_median(n_row, lo, hi, 0.0, scr, False, GATHER, BLOCK_N)
        mad = _lower_median(n_row, lo, hi, med, scr, True, GATHER, BLOCK_N)
    inv_beta, alpha, kappa, zeta, eps = _prior_knobs(BETA, ALPHA, KAPPA, ZETA, EPS, cur_r)
    span = hi - 1 - lo
    se = tl.zeros([BLOCK_N], tl.float32)
    sp = tl.zeros([BLOCK_N], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        e_hat, p_hat = _terms(u_row, n_row, offs, offs < hi, lo, span, inv_beta, alpha, kappa, zeta, eps, med, mad)
        se += e_hat
        sp += p_hat
    s_e = tl.maximum(tl.sum(se, 0), TINY)
    s_p = tl.maximum(tl.sum(sp, 0), TINY)
    num = tl.zeros([BLOCK_N], tl.float32)
    den = tl.zeros([BLOCK_N], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        e_hat, p_hat = _terms(u_row, n_row, offs, offs < hi, lo, span, inv_beta, alpha, kappa, zeta, eps, med, mad)
        e = e_hat / s_e
        d = e - p_hat / s_p
        num += e * d
        den += d * d
    num_s = tl.sum(num, 0)
    den_s = tl.sum(den, 0)
    lam = tl.where(den_s > 0, num_s / tl.where(den_s > 0, den_s, 1.0), 0.0)
    lam = tl.minimum(tl.maximum(lam, 0.0), tl.load(CLIP + cur_r))
    tl.store(st + 0, tl.where(has, s_e, 0.0))
    tl.store(st + 1, tl.where(has, s_p, 0.0))
    tl.store(st + 2, tl.where(has, lam, 0.0))
    tl.store(st + 3, tl.where(has, med, 0.0))
    tl.store(st + 4, tl.where(has, mad, 0.0))


@triton.jit
def _score_at(U, NORMS, row_off, stride_h, offs_h, mask_h, pos, lo, hi, span, inv_beta, alpha, kappa, zeta, eps,
              s_e, s_p, lam, med, mad):
    """Fused log score [BLOCK_H, BLOCK_N] at positions `pos`, -inf off A (and for padded heads)."""
    in_a = (pos >= lo) & (pos < hi)
    ok = mask_h[:, None] & in_a[None, :]
    ptr = row_off + offs_h[:, None] * stride_h + pos[None, :]
    u = tl.load(U + ptr, mask=ok, other=0.0)
    nrm = tl.load(NORMS + ptr, mask=ok, other=0.0)
    e = _pow(u, inv_beta) / s_e[:, None]
    x = _position(pos, lo, span)[None, :]
    pi = _prior_hat(nrm, x, alpha, kappa, zeta, eps, med[:, None], mad[:, None]) / s_p[:, None]
    lamc = lam[:, None]
    q = (1.0 - lamc) * e + lamc * pi
    return tl.where(ok, tl.log(q + eps), float("-inf"))


@triton.jit
def _row_block(LO, HI, H, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's row, its block of positions, all heads, and the row's A = [lo, hi)."""
    cur_r = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    return cur_r, offs_n, offs_h, offs_h < H, tl.load(LO + cur_r), tl.load(HI + cur_r)


@triton.jit(do_not_specialize=["N", "stride_r", "stride_h"])
def _selector_fused(
    U, NORMS, LO, HI, BETA, ALPHA, KAPPA, ZETA, EPS, STATS, S,
    H, N,
    stride_r, stride_h, stride_sr, stride_sh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Steps 1-5 (first line): s = log(q + eps) on A, -inf elsewhere, for all heads of a block."""
    cur_r, offs_n, offs_h, mask_h, lo, hi = _row_block(LO, HI, H, BLOCK_H, BLOCK_N)
    st = STATS + cur_r * stride_sr + offs_h * stride_sh
    inv_beta, alpha, kappa, zeta, eps = _prior_knobs(BETA, ALPHA, KAPPA, ZETA, EPS, cur_r)
    s = _score_at(U, NORMS, cur_r * stride_r, stride_h, offs_h, mask_h, offs_n, lo, hi, hi - 1 - lo,
                  inv_beta, alpha, kappa, zeta, eps,
                  tl.load(st + 0, mask=mask_h, other=1.0), tl.load(st + 1, mask=mask_h, other=1.0),
                  tl.load(st + 2, mask=mask_h, other=0.0), tl.load(st + 3, mask=mask_h, other=0.0),
                  tl.load(st + 4, mask=mask_h, other=0.0))
    tl.store(S + cur_r * stride_r + offs_h[:, None] * stride_h + offs_n[None, :], s,
             mask=mask_h[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["N", "stride_r", "stride_h"])
def _selector_refine(
    S, LO, HI, GAMMA, RADIUS, ETA, TAU, OUT,
    H, N,
    stride_r, stride_h,
    R_LIMIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Soft-NMS (neighbours read from S, -inf off A and past the ends), then cross-head exclusivity.

    The halo is the row's own radius, a loop bound read at run time: one binary for
    every radius a request may ask for (R_LIMIT, the config's bound, only clamps a
    bad value). A compile-time halo took one binary per radius bucket, eight
    compiled at start-up (18 s of Triton on an empty cache, 11 s of it the 64 halo's
    unrolled loop), and every row of a launch read the group's largest halo."""
    cur_r, offs_n, offs_h, mask_h, lo, hi = _row_block(LO, HI, H, BLOCK_H, BLOCK_N)
    row = S + cur_r * stride_r + offs_h[:, None] * stride_h
    in_a = (offs_n >= lo) & (offs_n < hi)
    ok = mask_h[:, None] & in_a[None, :]
    s = tl.load(row + offs_n[None, :], mask=ok, other=float("-inf"))
    radius = tl.minimum(tl.maximum(tl.load(RADIUS + cur_r), 0), R_LIMIT)
    m = s
    for d in range(1, radius + 1):
        pl = offs_n - d
        pr = offs_n + d
        left = tl.load(row + pl[None, :], mask=mask_h[:, None] & ((pl >= lo) & (pl < hi))[None, :],
                       other=float("-inf"))
        right = tl.load(row + pr[None, :], mask=mask_h[:, None] & ((pr >= lo) & (pr < hi))[None, :],
                        other=float("-inf"))
        m = tl.maximum(m, tl.maximum(left, right))
    s = tl.where(ok, s - tl.load(GAMMA + cur_r) * (m - s), 0.0)
    # Exclusivity: log-softmax over the KV heads of s / tau (padded heads excluded).
    t = tl.where(mask_h[:, None], s / tl.load(TAU + cur_r), float("-inf"))
    t_max = tl.max(t, 0)
    lse = t_max + tl.log(tl.sum(tl.exp(t - t_max[None, :]), 0))
    out = tl.where(ok, s + tl.load(ETA + cur_r) * (t - lse[None, :]), float("-inf"))
    tl.store(OUT + cur_r * stride_r + offs_h[:, None] * stride_h + offs_n[None, :], out,
             mask=mask_h[:, None] & (offs_n < N)[None, :])


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def selector_stats(u: torch.Tensor, norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, knobs,
                   *, block_n: int = 1024, gather: bool = True, num_warps: int = 4,
                   splits: int | None = None, mad_bracket: bool = True) -> torch.Tensor:
    """Per (row, KV head): [evidence sum, prior sum, lam, norm median, norm MAD] as ``[R, H, 5]`` fp32.

    ``knobs``: a ``sgl_sparse.selector.core.SelectorKnobs`` with ``[R]`` tensors.
    ``gather``: the medians' last two radix passes read the values left after the
    top 16 bits only (a scratch the size of ``u``); ``False``: every pass reads
    all of A (the previous kernel; ``bench_selector.py --stats-ab`` times both).
    ``splits``: programs per (row, head) (``selector_stats_split.py``: the same
    medians, the sums to fp32 rounding); default ``_split.resolve_splits``: ``split_count`` of ``N`` and
    ``R x H`` under ``_split.STATS_RULE`` (1 unless the rows are long and few; always 1
    with ``SGL_SPARSE_SPLIT_ROWS=0``); ``gather=False`` runs unsplit.
    ``mad_bracket`` (single program, with ``gather``): the MAD's select in one pass
    over the row, bracketed by the median's histograms (``_mad_bracket.py``; the same
    element); ``False``: its three passes as the median's (the previous kernel).
    """
    r, h, n = u.shape
    assert u.is_contiguous() and u.dtype == torch.float32 and norms.shape == u.shape
    norms = _f32(norms)
    stats = torch.empty(r, h, _NSTATS, dtype=torch.float32, device=u.device)
    if r == 0 or n == 0:
        return stats
    splits = resolve_splits(splits, n, r * h, u.device, STATS_RULE) if gather else 1
    if splits > 1:
        from types import SimpleNamespace

        from .selector_stats_split import selector_stats_split

        k32 = SimpleNamespace(**{f: _f32(getattr(knobs, f)) for f in ("beta", "alpha", "kappa", "zeta", "clip", "eps")})
        selector_stats_split(u, norms, _i32(lo), _i32(hi), k32, stats, splits, block_n, num_warps)
        return stats
    scratch = torch.empty_like(u) if gather else u
    _selector_stats[(r, h)](
        u, norms, _i32(lo), _i32(hi), _f32(knobs.beta), _f32(knobs.alpha), _f32(knobs.kappa), _f32(knobs.zeta),
        _f32(knobs.clip), _f32(knobs.eps), stats, scratch,
        u.stride(0), u.stride(1), stats.stride(0), stats.stride(1),
        BLOCK_N=block_n, GATHER=gather, MAD_BRACKET=gather and mad_bracket, num_warps=num_warps,
    )
    return stats


#: The largest Soft-NMS radius a request may ask for (config.SfiPolicy.nms_radius).
NMS_RADIUS_LIMIT = 64


def selector_scores(u: torch.Tensor, norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, knobs,
                    *, block_n: int = 256, num_warps: int = 4, splits: int | None = None) -> torch.Tensor:
    """Refined Selector scores ``[R, H, N]`` fp32 (-inf off ``A = [lo, hi)``), as
    ``refined_scores_from_evidence(u, norms, lo, hi, knobs)``.

    Args:
        u: ``[R, H, N]`` fp32 evidence power mean (0 off A), contiguous.
        norms: ``[R, H, N]`` key norms (same layout).
        lo, hi: ``[R]`` candidate range per row.
        knobs: ``SelectorKnobs`` with ``[R]`` tensors (each row's Soft-NMS radius
            read on the device: one binary for every radius).
        splits: the stats' programs per (row, head) (:func:`selector_stats`).
    """
    r, h, n = u.shape
    norms, lo32, hi32 = _f32(norms), _i32(lo), _i32(hi)
    stats = selector_stats(u, norms, lo32, hi32, knobs, splits=splits)
    out = torch.empty_like(u)
    if r == 0 or n == 0:
        return out
    grid = (r, triton.cdiv(n, block_n))
    fused = torch.empty_like(u)
    common = dict(BLOCK_H=next_pow2(h), BLOCK_N=block_n, num_warps=num_warps)
    _selector_fused[grid](
        u, norms, lo32, hi32, _f32(knobs.beta), _f32(knobs.alpha), _f32(knobs.kappa), _f32(knobs.zeta),
        _f32(knobs.eps), stats, fused, h, n,
        u.stride(0), u.stride(1), stats.stride(0), stats.stride(1), **common,
    )
    refine_args = (fused, lo32, hi32, _f32(knobs.nms_gamma), _i32(knobs.nms_radius), _f32(knobs.excl_eta),
                   _f32(knobs.excl_tau), out, h, n, u.stride(0), u.stride(1))
    _selector_refine[grid](*refine_args, R_LIMIT=NMS_RADIUS_LIMIT, **common)
    return out
