"""
``topk_range`` in two launches: a sampled band, one counting / gathering pass, a select within the band
=====================================================================================================

The same output as ``topk_range._topk_range_kernel`` (bit for bit: positions,
order, which cutoff ties are kept, counts), grid ``(R, H, S)``, slice ``s`` of a
row covering ``[a, b)`` (``_split.slice_bounds``).

Why: on an H100 the radix select's 256-bin histograms and prefix-sum compactions
cost ~2.2-2.5 us per 4096-block over the load, a plain count nothing
(``bench/kernels/micro_radix_ops.py``); the four-pass select (two histograms, the
survivors' gather, the placing prefix sum) runs four such passes over every row.
Here two do, and the histograms run over a narrow band only:

* launch A: every program sorts a sample of ``SAMPLE`` keys of its row (the same
  sample in every slice) and takes two keys ``ka <= kb`` that bracket the k-th
  with high probability (sample ranks ``k SAMPLE / n -/+ (3 sqrt(.) + 8)``). One
  pass over its slice counts the finite entries, those with a key below ``ka``
  (kept for sure), and gathers the band ``ka <= key <= kb`` to the slice's own
  part of the scratch row (``SCR[a - lo:]``, in position order);
* launch B: from the slices' counts, if ``above < k <= above + band`` the k-th
  key ``t`` lies in the band: a radix select over the band's entries only (a
  few % of the row); else (a sample far off: rare, never wrong) the
  single-program select over the whole row. Then each slice places its kept
  positions: keys below ``t`` and the first ties by position, offset by what the
  slices before it keep (their ``above`` counts plus their band entries below /
  equal to ``t``), exactly as ``topk_split``'s phase 3.

Rows with nothing to select (``k = 0``) return at once in both launches; slice 0
stores the count. Graph capturable: the grid and buffers depend on shapes only.
Off by default (``SGLANG_SPARSE_TOPK_BAND=1`` turns it on in ``topk_range``) until
it is measured end to end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._radix import _pick_digit, count_keys, digit_histogram, load_key, place_kept, radix_select, topk_bounds
from ._split import slice_bounds

__all__ = ["topk_range_band", "SAMPLE"]

#: Keys sampled per row (one sort of this many per program in launch A).
SAMPLE = 1024
# The band's passes walk its entries in blocks this wide (a band is a few % of a row).
BLOCK_B = tl.constexpr(256)
# Key of a non-finite sample entry: after every finite key (KEY_DESC keys of finite
# values are at most 0xFF7FFFFF, -FLT_MAX's).
NOT_FINITE = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _band_keys(row, lo, n, k, SAMPLE_N: tl.constexpr):
    """(ka, kb) uint32 as int64: every finite key below ka is kept, none above kb, if
    the sample is representative (launch B checks)."""
    j = tl.arange(0, SAMPLE_N)
    pos = lo + ((j.to(tl.int64) * n) // SAMPLE_N).to(tl.int32)
    _, bits, ok = load_key(row, pos, j < SAMPLE_N, 0.0, 2)
    key = tl.where(ok, bits.to(tl.uint32, bitcast=True).to(tl.int64), NOT_FINITE)
    srt = tl.sort(key, 0)
    fin = tl.sum(ok.to(tl.int32), 0)
    r = k.to(tl.float32) * SAMPLE_N / n.to(tl.float32)
    d = 3.0 * tl.sqrt(r + 1.0) + 8.0
    ra = tl.floor(r - d).to(tl.int32)
    rb = tl.ceil(r + d).to(tl.int32)
    ka = tl.sum(tl.where(j == ra, srt, 0), 0)  # ra < 0: 0, no key is below it
    kb = tl.where(rb < fin, tl.sum(tl.where(j == rb, srt, 0), 0), NOT_FINITE - 1)
    return ka, kb


@triton.jit
def _band_hist(scr, lo, hi, CNT, NSPLIT, prefix, shift, FILTER: tl.constexpr, BLOCK_N: tl.constexpr):
    """digit_histogram over the band entries of every slice (SCR[a_s - lo:][:band_s])."""
    h = tl.zeros([256], dtype=tl.int32)
    for s2 in range(0, NSPLIT):
        a2, _ = slice_bounds(lo, hi, s2, NSPLIT, BLOCK_N)
        c2 = tl.load(CNT + s2 * 3 + 1)
        h += digit_histogram(scr, a2 - lo, a2 - lo + c2, 0.0, prefix, shift, 2, FILTER, BLOCK_B)
    return h


@triton.jit(do_not_specialize=["N", "K_MAX", "NSPLIT", "stride_r", "stride_h", "stride_cr", "stride_ch",
                               "stride_or", "stride_oh", "stride_lr"])
def _topk_band_kernel(
    S,  # [R, H, N] fp32 scores, stride 1 along N
    LO,  # [R] int32
    HI,  # [R] int32
    BUDGET,  # [R] int32
    SCR,  # [R, H, N] fp32 scratch: each slice's band entries at its own offset
    CNT,  # [R, H, NSPLIT, 3] int32: finite, band, above per slice
    OUT,  # [R, H, K_MAX] int32
    OUT_LEN,  # [R, H] int32
    N,
    K_MAX,
    NSPLIT,
    stride_r,
    stride_h,
    stride_cr,
    stride_ch,
    stride_or,
    stride_oh,
    stride_lr,
    PHASE: tl.constexpr,
    SAMPLE_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_s = tl.program_id(2)
    lo, hi, k = topk_bounds(LO, HI, BUDGET, N, K_MAX, cur_r)
    if k <= 0:  # nothing to select: both launches return at once
        if PHASE == 1:
            if cur_s == 0:
                tl.store(OUT_LEN + cur_r * stride_lr + cur_h, 0)
        return
    row = S + cur_r.to(tl.int64) * stride_r + cur_h.to(tl.int64) * stride_h
    scr = SCR + cur_r.to(tl.int64) * stride_cr + cur_h.to(tl.int64) * stride_ch
    cnt = CNT + (cur_r * tl.num_programs(1) + cur_h).to(tl.int64) * (NSPLIT * 3)
    a, b = slice_bounds(lo, hi, cur_s, NSPLIT, BLOCK_N)
    if PHASE == 0:
        ka, kb = _band_keys(row, lo, hi - lo, k, SAMPLE_N)
        fin = tl.zeros([BLOCK_N], dtype=tl.int32)
        above = tl.zeros([BLOCK_N], dtype=tl.int32)
        band = tl.zeros([], dtype=tl.int32)
        for n0 in range(a, b, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            v, bits, ok = load_key(row, offs, offs < b, 0.0, 2)
            u = bits.to(tl.uint32, bitcast=True).to(tl.int64)
            fin += ok.to(tl.int32)
            above += (ok & (u < ka)).to(tl.int32)
            inb = (ok & (u >= ka) & (u <= kb)).to(tl.int32)
            tl.store(scr + (a - lo) + band + tl.cumsum(inb, 0) - inb, v, mask=inb != 0)
            band += tl.sum(inb, 0)
        tl.store(cnt + cur_s * 3 + 0, tl.sum(fin, 0))
        tl.store(cnt + cur_s * 3 + 1, band)
        tl.store(cnt + cur_s * 3 + 2, tl.sum(above, 0))
    else:
        sl = tl.arange(0, 8)
        f_tot = tl.zeros([8], dtype=tl.int32)
        b_tot = tl.zeros([8], dtype=tl.int32)
        a_tot = tl.zeros([8], dtype=tl.int32)
        a_before = tl.zeros([8], dtype=tl.int32)
        for s0 in range(0, NSPLIT, 8):
            m = (s0 + sl) < NSPLIT
            f_tot += tl.load(cnt + (s0 + sl) * 3 + 0, mask=m, other=0)
            b_tot += tl.load(cnt + (s0 + sl) * 3 + 1, mask=m, other=0)
            ab = tl.load(cnt + (s0 + sl) * 3 + 2, mask=m, other=0)
            a_tot += ab
            a_before += tl.where((s0 + sl) < cur_s, ab, 0)
        k = tl.minimum(k, tl.sum(f_tot, 0))
        n_above = tl.sum(a_tot, 0)
        n_band = tl.sum(b_tot, 0)
        out = OUT + cur_r.to(tl.int64) * stride_or + cur_h * stride_oh
        if k > 0:
            if (n_above < k) & (k <= n_above + n_band):
                # The k-th key is in the band: the radix select over its entries only.
                kk = k - 1 - n_above
                h = _band_hist(scr, lo, hi, cnt, NSPLIT, 0, 24, False, BLOCK_N)
                kk, prefix = _pick_digit(h, kk, 0)
                h = _band_hist(scr, lo, hi, cnt, NSPLIT, prefix, 16, True, BLOCK_N)
                kk, prefix = _pick_digit(h, kk, prefix)
                h = _band_hist(scr, lo, hi, cnt, NSPLIT, prefix, 8, True, BLOCK_N)
                kk, prefix = _pick_digit(h, kk, prefix)
                h = _band_hist(scr, lo, hi, cnt, NSPLIT, prefix, 0, True, BLOCK_N)
                kk, key = _pick_digit(h, kk, prefix)
                t = key.to(tl.uint32, bitcast=True)
                ties = kk + 1
                # What the slices before this one keep: their entries below the band,
                # and their band entries below t or tied with it (in position order).
                less = tl.zeros([], dtype=tl.int32)
                seen = tl.zeros([], dtype=tl.int32)
                for s2 in range(0, cur_s):
                    a2, _b2 = slice_bounds(lo, hi, s2, NSPLIT, BLOCK_N)
                    l2, e2 = count_keys(scr + (a2 - lo), 0, tl.load(cnt + s2 * 3 + 1), t, BLOCK_B)
                    less += l2
                    seen += e2
                written = tl.sum(a_before, 0) + less + tl.minimum(seen, ties)
            else:
                # The sample missed: the whole row's select (its passes read the row
                # only: the scratch holds the other slices' bands).
                h = digit_histogram(row, lo, hi, 0.0, 0, 24, 2, False, BLOCK_N)
                key, rank = radix_select(row, lo, hi, h, k - 1, 0.0, scr, 2, False, BLOCK_N)
                t = key.to(tl.uint32, bitcast=True)
                ties = rank + 1
                less, seen = count_keys(row, lo, a, t, BLOCK_N)
                written = less + tl.minimum(seen, ties)
            place_kept(row, a, b, t, ties, out, written, seen, BLOCK_N)
        if cur_s == 0:
            tl.store(OUT_LEN + cur_r * stride_lr + cur_h, k)


def topk_range_band(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: torch.Tensor, k_max: int,
                    out: torch.Tensor, out_len: torch.Tensor, splits: int, block_n: int, num_warps: int) -> None:
    """``topk_range``'s work in two launches of ``splits`` programs per (row, head)
    (arguments checked by ``topk_range``; ``scores`` non-empty)."""
    r, h, n = scores.shape
    scratch = torch.empty_like(scores)
    counts = torch.empty((r, h, splits, 3), dtype=torch.int32, device=scores.device)
    for phase in (0, 1):
        _topk_band_kernel[(r, h, splits)](
            scores, lo, hi, budget, scratch, counts, out, out_len,
            n, k_max, splits,
            scores.stride(0), scores.stride(1), scratch.stride(0), scratch.stride(1),
            out.stride(0), out.stride(1), out_len.stride(0),
            PHASE=phase, SAMPLE_N=SAMPLE, BLOCK_N=block_n, num_warps=num_warps,  # SAMPLE read per call (tests shrink it)
        )
