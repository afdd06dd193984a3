"""
Exact radix select over fp32 keys, shared by the Selector's medians
(``selector_scores._lower_median``) and the ragged top-k (``topk_range``)
=========================================================================

One Triton program selects the k-th smallest *key* (0-based) of
``v_j, j in [lo, hi)``, one digit per pass from the top: a histogram of the
digit among the values whose higher bits equal the prefix found so far, then
the bin holding the k-th (:func:`digit_hist`, :func:`pick_digit`, any digit
width). Exact whatever the data (ties included), and whatever the widths: the
counts are integer counts over the same 32-bit keys, so any cut of the key into
digits finds the same key and the same rank.

Digit widths. :func:`radix_select` (the Selector's medians, the split select of
``_split.py``, ``topk_range`` with ``small_digits=False``) takes 8-bit digits:
two 256-bin passes over the row, then (GATHER) the values sharing the top 16
bits copied to a scratch row and the last two digits read from there.
:func:`radix_select_small` (``topk_range``'s ``small_digits``, its default) takes 6-bit digits over
the row: two 64-bin passes, the values sharing the top 12 bits gathered, then
7 + 7 + 6 bits over those alone. Why: ``tl.histogram`` (Triton's warp-level
histogram) takes one ballot per bin-index bit per value, then each lane ANDs
those ballots into the indicator of every bin it owns and popcounts it -- about
log2(bins) + (bins / 32) x log2(bins) operations per value. The passes over the
whole row are the select's main cost (compute-bound on the GPU, bench/README
"Where the Top-K's time goes"), and per pass a 64-bin histogram compiles to
fewer instructions than a 256-bin one (sm_90 PTX of triton 3.7, 1024-blocks, 4
warps: a pass's loop body ~570 instructions vs ~800, 48 ballots vs 64, 16
popcounts vs 64). The price: 16x more survivors after 12 bits than after 16
(1/8 of an octave: still a small share of a row of scores), read by three passes
instead of two. On an H200 it takes 0.83x the time of 8-bit digits over
asyncspade's rows (``bench/kernels/bench_topk.py`` times both; bench/README
"Session 23"). Digits narrower than 5 bits save
nothing more: the ballots never go below 5 per value (a warp's 32 lanes).

Keys (``KEY``, a constexpr):

* ``KEY_MAGNITUDE`` (0): ``v = X[j] >= 0``; the key is its fp32 bits without
  the sign (for ``v >= 0`` they order like the values).
* ``KEY_ABS_DEV`` (1): ``v = |X[j] - center|``, same key.
* ``KEY_DESC`` (2): ``v = X[j]``, *finite values only* (``-inf``, ``+inf`` and
  NaN are left out, as if past ``hi``); the key orders the values descending
  (the k-th smallest key is the (k+1)-th largest value): ``b ^ 0x7FFFFFFF`` for
  sign bit 0, ``b`` for sign bit 1, read as uint32 (the complement of the usual
  order-preserving map), ``-0`` taken as ``+0``.

Keys are carried as int32 bit patterns: digits and prefixes are masked, so
sign extension of the shifts never matters.
"""

from __future__ import annotations

import triton
import triton.language as tl

KEY_MAGNITUDE = tl.constexpr(0)
KEY_ABS_DEV = tl.constexpr(1)
KEY_DESC = tl.constexpr(2)


@triton.jit
def desc_key(v, ok):
    """KEY_DESC of fp32 values v: (key bits int32, ok narrowed to the finite values).
    Also what a producer of scores counts for ``topk_range``'s ``h_top``
    (``token_scores``' HIST): one definition, so its digits are the select's."""
    bits = v.to(tl.int32, bitcast=True)
    ok = ok & (tl.abs(v) < float("inf"))  # NaN compares false: left out too
    return tl.where(v == 0.0, 0x7FFFFFFF, tl.where(bits >= 0, bits ^ 0x7FFFFFFF, bits)), ok


@triton.jit
def load_key(X, offs, ok, center, KEY: tl.constexpr):
    """(v, key bits int32, ok): v = X[offs] (or |X[offs] - center|); ok narrowed to
    the values the select counts (KEY_DESC: finite ones)."""
    v = tl.load(X + offs, mask=ok, other=0.0)
    if KEY == 1:
        v = tl.abs(v - center)
    if KEY == 2:
        bits, ok = desc_key(v, ok)
    else:
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return v, bits, ok


@triton.jit
def digit_hist(X, lo, hi, center, prefix, SHIFT: tl.constexpr, DBITS: tl.constexpr, KEY: tl.constexpr,
               FILTER: tl.constexpr, BLOCK_N: tl.constexpr):
    """2^DBITS-bin histogram of the digit (key >> SHIFT) & (2^DBITS - 1) of v_j, j in
    [lo, hi), among the values whose key bits above the digit (32 - SHIFT - DBITS of
    them) equal `prefix` (all of them unless FILTER) and that the key counts.
    (Triton's histogram costs a ballot per digit bit per value, and its bins are
    spread over the warps' lanes: with 8-bit digits each pass over a row is the
    select's main cost.)"""
    NBINS: tl.constexpr = 1 << DBITS
    hist = tl.zeros([NBINS], dtype=tl.int32)
    outside = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        _, bits, ok = load_key(X, offs, offs < hi, center, KEY)
        if FILTER:
            ok = ok & (((bits >> (SHIFT + DBITS)) & ((1 << (32 - SHIFT - DBITS)) - 1)) == prefix)
        # Values outside the prefix (or past hi, or not counted) land in bin 0 and are taken out below.
        hist += tl.histogram(tl.where(ok, (bits >> SHIFT) & (NBINS - 1), 0), NBINS)
        outside += (~ok).to(tl.int32)
    return tl.where(tl.arange(0, NBINS) == 0, hist - tl.sum(outside, 0), hist)


@triton.jit
def pick_digit(h, k, prefix, DBITS: tl.constexpr):
    """The bin of the 2^DBITS-bin histogram h holding the k-th smallest (0-based):
    (k within it, prefix with its digit appended). k must be below the sum of h
    (else the digit is 2^DBITS, past the bins; callers with nothing to select
    only ever read empty ranges with it)."""
    c = tl.cumsum(h, 0)
    digit = tl.sum((c <= k).to(tl.int32), 0)
    k -= tl.sum(tl.where(tl.arange(0, 1 << DBITS) < digit, h, 0), 0)
    return k, (prefix << DBITS) | digit


@triton.jit
def gather_prefix(X, lo, hi, center, prefix, SHIFT: tl.constexpr, SCR, cnt, KEY: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Copies v_j, j in [lo, hi), whose key's top 32 - SHIFT bits equal `prefix`, to
    SCR[cnt:] in position order; returns cnt plus their number. SCR gets v itself
    (|X - center| already taken for KEY_ABS_DEV: read back as KEY_MAGNITUDE)."""
    cnt = cnt + tl.zeros([], dtype=tl.int32)  # a literal 0 arrives as a constexpr: the loop carries a tensor
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        v, bits, ok = load_key(X, offs, offs < hi, center, KEY)
        keep = (ok & (((bits >> SHIFT) & ((1 << (32 - SHIFT)) - 1)) == prefix)).to(tl.int32)
        tl.store(SCR + cnt + tl.cumsum(keep, 0) - keep, v, mask=keep != 0)
        cnt += tl.sum(keep, 0)
    return cnt


@triton.jit
def digit_histogram(X, lo, hi, center, prefix, shift, KEY: tl.constexpr, FILTER: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """:func:`digit_hist` with 8-bit digits (256 bins); `shift` a literal."""
    return digit_hist(X, lo, hi, center, prefix, shift, 8, KEY, FILTER, BLOCK_N)


@triton.jit
def _pick_digit(h, k, prefix):
    """:func:`pick_digit` of a 256-bin histogram."""
    return pick_digit(h, k, prefix, 8)


@triton.jit
def radix_select(X, lo, hi, h_top, k, center, SCR, KEY: tl.constexpr, GATHER: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The k-th smallest key (0-based, 0 <= k < the values counted) of v_j, j in [lo, hi).

    ``h_top``: ``digit_histogram(X, lo, hi, center, 0, 24, KEY, False, BLOCK_N)``
    (callers read the count of values off it first). Returns (key bits, rank):
    ``rank`` values with that key come before the k-th (so ``k - rank`` keys are
    strictly smaller). With GATHER, once the top 16 bits are known the values
    sharing them -- a narrow value range (1/128 of an octave), typically ~1% of
    [lo, hi) -- are copied to SCR (this program's scratch row, >= hi - lo long),
    and the last two passes read those alone instead of all of [lo, hi). Exact
    whatever the data: if they are many, the passes read many.
    """
    k, prefix = _pick_digit(h_top, k, 0)
    h = digit_histogram(X, lo, hi, center, prefix, 16, KEY, True, BLOCK_N)
    k, prefix = _pick_digit(h, k, prefix)
    if GATHER:
        # Every thread is done reading SCR (a previous select) before it is rewritten.
        tl.debug_barrier()
        cnt = gather_prefix16(X, lo, hi, center, prefix, SCR, 0, KEY, BLOCK_N)
        # bar.sync: the CTA's global stores above are visible to all its threads.
        tl.debug_barrier()
        prefix, k = select_low16(SCR, cnt, k, prefix, KEY, BLOCK_N)
    else:
        h = digit_histogram(X, lo, hi, center, prefix, 8, KEY, True, BLOCK_N)
        k, prefix = _pick_digit(h, k, prefix)
        h = digit_histogram(X, lo, hi, center, prefix, 0, KEY, True, BLOCK_N)
        k, prefix = _pick_digit(h, k, prefix)
    return prefix, k


@triton.jit
def radix_select_small(X, lo, hi, h_top, k, center, SCR, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`radix_select` with GATHER, its passes over [lo, hi) on 6-bit digits.

    ``h_top``: ``digit_hist(X, lo, hi, center, 0, 26, 6, KEY, False, BLOCK_N)`` (the
    top 6 bits). Then the 64-bin histogram of bits 25..20 among the values with
    that top digit, the values whose top 12 bits match gathered to SCR (1/8 of an
    octave: ~16x more than :func:`radix_select` gathers after 16 bits, still a
    small share of the row), and the last 20 bits over those alone: 7 + 7 + 6
    bits, a 128-, 128- and 64-bin histogram (three passes, as 8 + 8 + 4 would
    take, in ~6% fewer instructions: a 16-bin histogram still takes 5 ballots a
    value). Same (key bits, rank) as :func:`radix_select`: exact integer counts
    over the same keys, cut elsewhere.
    """
    k, prefix = pick_digit(h_top, k, 0, 6)
    h = digit_hist(X, lo, hi, center, prefix, 20, 6, KEY, True, BLOCK_N)
    k, prefix = pick_digit(h, k, prefix, 6)
    # Every thread is done reading SCR (a previous select) before it is rewritten.
    tl.debug_barrier()
    cnt = gather_prefix(X, lo, hi, center, prefix, 20, SCR, 0, KEY, BLOCK_N)
    # bar.sync: the CTA's global stores above are visible to all its threads.
    tl.debug_barrier()
    SRC_KEY: tl.constexpr = 0 if KEY == 1 else KEY  # SCR holds v: |X - center| is taken
    h = digit_hist(SCR, 0, cnt, 0.0, prefix, 13, 7, SRC_KEY, True, BLOCK_N)
    k, prefix = pick_digit(h, k, prefix, 7)
    h = digit_hist(SCR, 0, cnt, 0.0, prefix, 6, 7, SRC_KEY, True, BLOCK_N)
    k, prefix = pick_digit(h, k, prefix, 7)
    h = digit_hist(SCR, 0, cnt, 0.0, prefix, 0, 6, SRC_KEY, True, BLOCK_N)
    k, prefix = pick_digit(h, k, prefix, 6)
    return prefix, k


@triton.jit
def gather_prefix16(X, lo, hi, center, prefix, SCR, cnt, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`gather_prefix` of the values whose key's top 16 bits equal `prefix`,
    read back by :func:`select_low16`."""
    return gather_prefix(X, lo, hi, center, prefix, 16, SCR, cnt, KEY, BLOCK_N)


@triton.jit
def select_low16(SCR, cnt, k, prefix, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """The select's last two passes over the values :func:`gather_prefix16` left in
    SCR[0, cnt) (their key's top 16 bits are `prefix`): (key bits, rank) as
    :func:`radix_select` returns them."""
    SRC_KEY: tl.constexpr = 0 if KEY == 1 else KEY  # SCR holds v: |X - center| is taken
    h = digit_histogram(SCR, 0, cnt, 0.0, prefix, 8, SRC_KEY, True, BLOCK_N)
    k, prefix = _pick_digit(h, k, prefix)
    h = digit_histogram(SCR, 0, cnt, 0.0, prefix, 0, SRC_KEY, True, BLOCK_N)
    k, prefix = _pick_digit(h, k, prefix)
    return prefix, k


@triton.jit
def place_kept(row, a, b, t, ties, out, written, seen, BLOCK_N: tl.constexpr, cap=0, CAPPED: tl.constexpr = False):
    """Write the positions in [a, b) whose key is below the k-th's key ``t``, or equal
    to it among its first ``ties`` (counting ``seen`` earlier equal keys), to
    ``out[written:]`` in ascending order (a running offset plus a block prefix sum).
    CAPPED: none at ``out[cap:]`` (where ``t`` comes from a histogram the kernel did
    not count itself; a right ``t`` keeps exactly ``cap`` and the cap never bites)."""
    written = written + tl.zeros([], dtype=tl.int32)  # literal 0s arrive as constexprs: the loop carries tensors
    seen = seen + tl.zeros([], dtype=tl.int32)
    for n0 in range(a, b, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        # Keys, not floats, are compared: the select's exact order (no flush of denormals).
        _, bits, ok = load_key(row, offs, offs < b, 0.0, 2)
        u = bits.to(tl.uint32, bitcast=True)
        eq = (ok & (u == t)).to(tl.int32)
        keep = (ok & (u < t)) | ((eq != 0) & (seen + tl.cumsum(eq, 0) - eq < ties))
        keep_i = keep.to(tl.int32)
        at = written + tl.cumsum(keep_i, 0) - keep_i
        if CAPPED:
            keep = keep & (at < cap)
        tl.store(out + at, offs, mask=keep)
        written += tl.sum(keep_i, 0)
        seen += tl.sum(eq, 0)


@triton.jit
def count_keys(X, a, b, t, BLOCK_N: tl.constexpr):
    """(entries of X[a:b] whose KEY_DESC key is below t, entries equal to it): what a
    slice before this one keeps of those, for the top-k's write offsets."""
    less = tl.zeros([BLOCK_N], dtype=tl.int32)
    eq = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(a, b, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        _, bits, ok = load_key(X, offs, offs < b, 0.0, 2)
        u = bits.to(tl.uint32, bitcast=True)
        less += (ok & (u < t)).to(tl.int32)
        eq += (ok & (u == t)).to(tl.int32)
    return tl.sum(less, 0), tl.sum(eq, 0)


@triton.jit
def topk_bounds(LO, HI, BUDGET, N, K_MAX, cur_r):
    """Row cur_r's top-k range and size: [lo, hi) clipped to [0, N), k = min(budget,
    hi - lo, K_MAX); hi = lo when nothing is selected, so every loop over it is empty."""
    lo = tl.maximum(tl.load(LO + cur_r), 0)
    hi = tl.minimum(tl.load(HI + cur_r), N)
    k = tl.minimum(tl.minimum(tl.load(BUDGET + cur_r), hi - lo), K_MAX)
    return lo, tl.where(k > 0, hi, lo), k
