"""
The Selector's MAD from the median's histograms: one pass over the row, not three
==================================================================================

``selector_scores._selector_stats`` finds the lower median ``med`` of the key norms
``x_j, j in [lo, hi)`` by a radix select (``_radix.py``): a 256-bin histogram of the
top key digit over the row, a second one of the next digit among the values in the
picked top bin, then the values sharing those 16 bits gathered. The MAD, the lower
median of ``d_j = fl(|x_j - med|)``, used to take the same three passes over the
row. Here it takes one, when the median's two histograms already pin it down:

1. The two histograms partition the key line into bins (the top digit's 256 bins,
   the median's own top bin replaced by its 256 second-digit bins), each with a
   count. A bin is a key range [klo, khi], so a value range; ``fl(|x - med|)`` is
   monotone on either side of ``med``, so every value in the bin has its ``d`` in
   [dlo, dhi], the deviations of the bin's ends (0 for the bin holding ``med``).
2. The k-th smallest ``d`` (k = the lower median's rank) lies between ``T_lo``, the
   k-th smallest ``dlo`` counted with the bins' counts, and ``T_hi``, the k-th
   smallest ``dhi`` (each ``d_j`` is >= its bin's dlo and <= its dhi); both by a
   bisection on the key bits over the 512 bins (no pass over the row).
3. One pass over the row: ``below`` = #{d_j < T_lo}, and the ``d_j`` in
   [T_lo, T_hi] gathered to the scratch row; the MAD is the (k - below)-th smallest
   of those (the radix select over the gathered values only).

Exact whatever the data: step 3 checks ``below <= k < below + gathered`` (the
values below, gathered and above are ordered by key, so then the MAD is among
the gathered); if not (only for inputs outside the proof's premises: negative
norms), or if the bins predict more than a quarter of the row gathered (the MAD's
ends fall in the coarse top-digit bins, e.g. a median near a power of 4 with a
wide spread), the select runs as before (:func:`radix_mad`). The gathered count
is at most the predicted count (the sum of the bins whose [dlo, dhi] meets
[T_lo, T_hi]): for norms spread within the median's top bin (a factor 4 of
values, e.g. log-normal norms with sigma 0.3) it is ~1% of the row.

Keys are ``fl32 bits & 0x7FFFFFFF`` as in ``_radix.py`` (KEY_MAGNITUDE /
KEY_ABS_DEV); compared as int32, they order like the values, +inf below NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._radix import _pick_digit, digit_histogram, gather_prefix16, load_key, radix_select, select_low16

_INF_KEY = tl.constexpr(0x7F800000)
_MAX_KEY = tl.constexpr(0x7FFFFFFF)


@triton.jit
def median_with_histograms(X, lo, hi, SCR, BLOCK_N: tl.constexpr):
    """``_radix.radix_select``'s gathering path for the lower median of the
    magnitudes X[j], j in [lo, hi) (hi > lo), returning what the MAD's bracket reads:
    (median key bits, top-digit histogram, the median's top digit, the second-digit
    histogram within that top bin)."""
    k = (hi - lo - 1) // 2
    h_top = digit_histogram(X, lo, hi, 0.0, 0, 24, 0, False, BLOCK_N)
    k, top = _pick_digit(h_top, k, 0)
    h_next = digit_histogram(X, lo, hi, 0.0, top, 16, 0, True, BLOCK_N)
    k, prefix = _pick_digit(h_next, k, top)
    # Every thread is done reading SCR (a previous select) before it is rewritten;
    # then the CTA's global stores are visible to all its threads (bar.sync).
    tl.debug_barrier()
    cnt = gather_prefix16(X, lo, hi, 0.0, prefix, SCR, 0, 0, BLOCK_N)
    tl.debug_barrier()
    bits, _ = select_low16(SCR, cnt, k, prefix, 0, BLOCK_N)
    return bits, h_top, top, h_next


@triton.jit
def _dev_key(v, med):
    """The key of fl(|v - med|), as load_key(KEY_ABS_DEV) computes it per value."""
    return tl.abs(v - med).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _bin_deviations(klo, khi, med, med_key):
    """[dlo, dhi] (keys) bounding fl(|x - med|) over the values x whose key is in [klo, khi]."""
    d_lo = _dev_key(klo.to(tl.float32, bitcast=True), med)
    d_hi = _dev_key(khi.to(tl.float32, bitcast=True), med)
    # Right of med: the low end is nearest; left: the high end; med's own bin: 0. Bins
    # starting at +inf / NaN keys: +inf's key (a NaN's deviation key is larger still).
    lower = tl.where(klo > med_key, tl.where(klo >= _INF_KEY, _INF_KEY, d_lo), tl.where(khi < med_key, d_hi, 0))
    upper = tl.where(khi >= _INF_KEY, _MAX_KEY, tl.maximum(d_lo, d_hi))
    return lower, upper


@triton.jit
def _kth_key(keys_a, count_a, keys_b, count_b, k):
    """The k-th smallest (0-based) of two multisets of keys in [0, 2^31) given as
    (key, count) bins: the smallest t with #{key <= t} > k, bit by bit from the top."""
    t = k * 0
    for b in range(30, -1, -1):
        probe = t | ((1 << b) - 1)
        n_le = tl.sum(tl.where(keys_a <= probe, count_a, 0), 0) + tl.sum(tl.where(keys_b <= probe, count_b, 0), 0)
        t = tl.where(n_le <= k, t | (1 << b), t)
    return t


@triton.jit
def radix_mad(X, lo, hi, med, SCR, BLOCK_N: tl.constexpr):
    """The lower median of fl(|X[j] - med|), j in [lo, hi): the radix select of
    ``_radix.py`` (three passes over the row, then the gathered values)."""
    h = digit_histogram(X, lo, hi, med, 0, 24, 1, False, BLOCK_N)
    bits, _ = radix_select(X, lo, hi, h, (hi - lo - 1) // 2, med, SCR, 1, True, BLOCK_N)
    return bits


@triton.jit
def bracketed_mad(X, lo, hi, med_bits, h_top, top, h_next, SCR, BLOCK_N: tl.constexpr):
    """The lower median of fl(|X[j] - med|), j in [lo, hi) (hi > lo), as key bits, from
    the median's histograms (:func:`median_with_histograms`; module doc), and whether
    it fell back to :func:`radix_mad`."""
    med = med_bits.to(tl.float32, bitcast=True)
    n = hi - lo
    k = (n - 1) // 2
    bins = tl.arange(0, 256)
    # The top digit's bins but the median's (their keys < 2^31: top < 128, the
    # others hold no value), then the second digit's within the median's top bin.
    klo_a = (bins & 127) << 24
    cnt_a = tl.where((bins == top) | (bins >= 128), 0, h_top)
    klo_b = (top << 24) | (bins << 16)
    lo_a, hi_a = _bin_deviations(klo_a, klo_a | 0xFFFFFF, med, med_bits)
    lo_b, hi_b = _bin_deviations(klo_b, klo_b | 0xFFFF, med, med_bits)
    t_lo = _kth_key(lo_a, cnt_a, lo_b, h_next, k)
    t_hi = _kth_key(hi_a, cnt_a, hi_b, h_next, k)
    meets_a = (lo_a <= t_hi) & (hi_a >= t_lo)
    meets_b = (lo_b <= t_hi) & (hi_b >= t_lo)
    predicted = tl.sum(tl.where(meets_a, cnt_a, 0), 0) + tl.sum(tl.where(meets_b, h_next, 0), 0)
    fallback = predicted * 4 > n
    mad_bits = med_bits * 0
    if not fallback:
        tl.debug_barrier()  # every thread is done reading the median's survivors in SCR
        below = tl.zeros([BLOCK_N], dtype=tl.int32)
        cnt = k * 0
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            v, bits, ok = load_key(X, offs, offs < hi, med, 1)
            below += (ok & (bits < t_lo)).to(tl.int32)
            keep = (ok & (bits >= t_lo) & (bits <= t_hi)).to(tl.int32)
            tl.store(SCR + cnt + tl.cumsum(keep, 0) - keep, v, mask=keep != 0)
            cnt += tl.sum(keep, 0)
        tl.debug_barrier()  # the gathered values visible to every thread
        k_in = k - tl.sum(below, 0)
        fallback = (k_in < 0) | (k_in >= cnt)
        if not fallback:
            h = digit_histogram(SCR, 0, cnt, 0.0, 0, 24, 0, False, BLOCK_N)
            mad_bits, _ = radix_select(SCR, 0, cnt, h, k_in, 0.0, SCR, 0, False, BLOCK_N)
    if fallback:
        mad_bits = radix_mad(X, lo, hi, med, SCR, BLOCK_N)
    return mad_bits, fallback
