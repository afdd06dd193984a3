"""
``selector_stats`` with each (row, KV head) split over several programs
======================================================================

``selector_scores._selector_stats`` walks a whole row ~8 times in one program
(two medians by radix select, then two sweeps for the sums): at 32K-128K rows and
a few hundred programs that walk is latency-bound. Here the row is cut into
``S`` slices (grid ``(R, H, S)``, ``_split.py``) and the work into launches
(``PHASE``), each one's results read by the next:

* 0-2: the median of the key norms, the select's split steps (``H[0]``, ``H[1]``,
  the survivors gathered);
* 3-4: its last two digits over slices of the survivors (``H[2]``, ``H[3]``;
  ``_split.low_pass``: key norms share their top 16 bits by the thousands);
* 5: every program picks the median from the histograms (slice 0 stores it),
  then the MAD's first step over ``|norm - median|`` (``H[4]``);
* 6-9: the MAD's other steps, the same way (``H[5]``, survivors, ``H[6]``, ``H[7]``);
* 10: every program picks the MAD (slice 0 stores it); its slice's partial
  sums of the unnormalized evidence and prior;
* 11: the normalizers ``s_e``, ``s_p`` (sums of the partials, the same order in
  every program); the slice's partial ``<e, d>``, ``|d|^2``;
* 12 (grid ``(R, H, 1)``): ``lam`` and the five stats, 0 for an empty row.

The medians are the exact elements the single program finds; the sums add the
same terms in another order (per slice, then over the slices): equal to fp32
rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._split import slice_bounds, split_select_done, split_select_step
from .selector_scores import TINY, _prior_knobs, _terms

__all__ = ["selector_stats_split", "PHASES"]

_PART_TILE = tl.constexpr(32)  # >= the split count (_split.STATS_RULE.max_splits)
_PART_TILE_HOST = 32


@triton.jit
def _slice_sum(PART, NSPLIT, c):
    """Column c of the row's [NSPLIT, 4] partial sums, summed (one fixed order)."""
    sl = tl.arange(0, _PART_TILE)
    return tl.sum(tl.load(PART + sl * 4 + c, mask=sl < NSPLIT, other=0.0), 0)


@triton.jit(do_not_specialize=["NSPLIT", "stride_r", "stride_h"])
def _selector_stats_split(
    U, NORMS, LO, HI, BETA, ALPHA, KAPPA, ZETA, CLIP, EPS, STATS, SCRATCH,
    HIST,  # [R, H, 8, NSPLIT, 256] int32: the median's four digits, then the MAD's
    PART,  # [R, H, NSPLIT, 4] fp32: each slice's se, sp, num, den
    NSPLIT, stride_r, stride_h, stride_sr, stride_sh,
    PHASE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_s = tl.program_id(2)
    lo = tl.load(LO + cur_r)
    hi = tl.load(HI + cur_r)
    has = hi > lo
    hi = tl.maximum(hi, lo)
    a, b = slice_bounds(lo, hi, cur_s, NSPLIT, BLOCK_N)
    u_row = U + cur_r * stride_r + cur_h * stride_h
    n_row = NORMS + cur_r * stride_r + cur_h * stride_h
    scr = SCRATCH + cur_r * stride_r + cur_h * stride_h
    st = STATS + cur_r * stride_sr + cur_h * stride_sh
    rh = (cur_r * tl.num_programs(1) + cur_h).to(tl.int64)
    h_med = HIST + rh * (8 * NSPLIT * 256)  # [4, NSPLIT, 256]: a digit's histograms each
    h_mad = h_med + 4 * NSPLIT * 256
    part = PART + rh * (NSPLIT * 4)
    k = (hi - lo - 1) // 2  # the lower median's rank
    if PHASE < 5:
        split_select_step(n_row, a, b, 0.0, k, h_med, NSPLIT, cur_s, scr, 0, PHASE, BLOCK_N)
    elif PHASE == 5:
        bits, _ = split_select_done(h_med, NSPLIT, cur_s, k)
        med = bits.to(tl.float32, bitcast=True)
        if cur_s == 0:  # read by the later phases; nothing here reads it
            tl.store(st + 3, med)
        split_select_step(n_row, a, b, med, k, h_mad, NSPLIT, cur_s, scr, 1, 0, BLOCK_N)
    elif PHASE < 10:
        # The median's survivors in SCR are dead: phase 7 overwrites them with the MAD's.
        split_select_step(n_row, a, b, tl.load(st + 3), k, h_mad, NSPLIT, cur_s, scr, 1, PHASE - 5, BLOCK_N)
    elif PHASE < 12:
        med = tl.load(st + 3)
        if PHASE == 10:
            bits, _ = split_select_done(h_mad, NSPLIT, cur_s, k)
            mad = bits.to(tl.float32, bitcast=True)
            if cur_s == 0:
                tl.store(st + 4, mad)
        else:
            mad = tl.load(st + 4)
            s_e = tl.maximum(_slice_sum(part, NSPLIT, 0), TINY)
            s_p = tl.maximum(_slice_sum(part, NSPLIT, 1), TINY)
        inv_beta, alpha, kappa, zeta, eps = _prior_knobs(BETA, ALPHA, KAPPA, ZETA, EPS, cur_r)
        span = hi - 1 - lo
        acc0 = tl.zeros([BLOCK_N], tl.float32)
        acc1 = tl.zeros([BLOCK_N], tl.float32)
        for n0 in range(a, b, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            e_hat, p_hat = _terms(u_row, n_row, offs, offs < b, lo, span, inv_beta, alpha, kappa, zeta, eps, med, mad)
            if PHASE == 10:
                acc0 += e_hat
                acc1 += p_hat
            else:  # the single program's order of operations: products of d = e - pi
                e = e_hat / s_e
                d = e - p_hat / s_p
                acc0 += e * d
                acc1 += d * d
        tl.store(part + cur_s * 4 + (PHASE - 10) * 2, tl.sum(acc0, 0))
        tl.store(part + cur_s * 4 + (PHASE - 10) * 2 + 1, tl.sum(acc1, 0))
    else:
        s_e = tl.maximum(_slice_sum(part, NSPLIT, 0), TINY)
        s_p = tl.maximum(_slice_sum(part, NSPLIT, 1), TINY)
        num_s = _slice_sum(part, NSPLIT, 2)
        den_s = _slice_sum(part, NSPLIT, 3)
        lam = tl.where(den_s > 0, num_s / tl.where(den_s > 0, den_s, 1.0), 0.0)
        lam = tl.minimum(tl.maximum(lam, 0.0), tl.load(CLIP + cur_r))
        tl.store(st + 0, tl.where(has, s_e, 0.0))
        tl.store(st + 1, tl.where(has, s_p, 0.0))
        tl.store(st + 2, tl.where(has, lam, 0.0))
        tl.store(st + 3, tl.where(has, tl.load(st + 3), 0.0))
        tl.store(st + 4, tl.where(has, tl.load(st + 4), 0.0))


#: The launches, in order (the last one on grid (R, H, 1)).
PHASES = tuple(range(13))


def selector_stats_split(u, norms, lo, hi, knobs, stats, splits: int, block_n: int, num_warps: int) -> None:
    """``selector_stats``' work with ``splits`` programs per (row, head) (fp32 /
    int32 contiguous arguments prepared by ``selector_stats``)."""
    r, h, _ = u.shape
    assert 1 < splits <= _PART_TILE_HOST
    scratch = torch.empty_like(u)
    hist = torch.empty((r, h, 8, splits, 256), dtype=torch.int32, device=u.device)
    part = torch.empty((r, h, splits, 4), dtype=torch.float32, device=u.device)
    args = (u, norms, lo, hi, knobs.beta, knobs.alpha, knobs.kappa, knobs.zeta, knobs.clip, knobs.eps, stats,
            scratch, hist, part, splits, u.stride(0), u.stride(1), stats.stride(0), stats.stride(1))
    for phase in PHASES:
        grid = (r, h, splits if phase < PHASES[-1] else 1)
        _selector_stats_split[grid](*args, PHASE=phase, BLOCK_N=block_n, num_warps=num_warps)
