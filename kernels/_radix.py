"""
Exact radix select over fp32 keys, shared by the Selector's medians
(``selector_scores._lower_median``) and the ragged top-k (``topk_range``)
=========================================================================

One Triton program selects the k-th smallest *key* (0-based) of
``v_j, j in [lo, hi)``, 8 bits per pass from the top: a 256-bin histogram of
the digit among the values whose higher bits equal the prefix found so far,
then the bin holding the k-th. Exact whatever the data (ties included).

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
def load_key(X, offs, ok, center, KEY: tl.constexpr):
    """(v, key bits int32, ok): v = X[offs] (or |X[offs] - center|); ok narrowed to
    the values the select counts (KEY_DESC: finite ones)."""
    v = tl.load(X + offs, mask=ok, other=0.0)
    if KEY == 1:
        v = tl.abs(v - center)
    bits = v.to(tl.int32, bitcast=True)
    if KEY == 2:
        ok = ok & (tl.abs(v) < float("inf"))  # NaN compares false: left out too
        bits = tl.where(v == 0.0, 0x7FFFFFFF, tl.where(bits >= 0, bits ^ 0x7FFFFFFF, bits))
    else:
        bits = bits & 0x7FFFFFFF
    return v, bits, ok


@triton.jit
def digit_histogram(X, lo, hi, center, prefix, shift, KEY: tl.constexpr, FILTER: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """256-bin histogram of the digit (key >> shift) & 255 of v_j, j in [lo, hi), among
    the values whose key bits above the digit equal `prefix` (all of them unless
    FILTER) and that the key counts. (Triton's histogram costs a ballot per digit bit
    per value: with 8-bit digits, each pass is the select's main cost.)"""
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], dtype=tl.int32)
    outside = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        _, bits, ok = load_key(X, offs, offs < hi, center, KEY)
        if FILTER:
            ok = ok & (((bits >> (shift + 8)) & ((1 << (24 - shift)) - 1)) == prefix)
        # Values outside the prefix (or past hi, or not counted) land in bin 0 and are taken out below.
        hist += tl.histogram(tl.where(ok, (bits >> shift) & 255, 0), 256)
        outside += (~ok).to(tl.int32)
    return tl.where(bins == 0, hist - tl.sum(outside, 0), hist)


@triton.jit
def _pick_digit(h, k, prefix):
    """The bin of h holding the k-th smallest (0-based): (k within it, prefix with its digit)."""
    bins = tl.arange(0, 256)
    c = tl.cumsum(h, 0)
    digit = tl.sum((c <= k).to(tl.int32), 0)
    k -= tl.sum(tl.where(bins < digit, h, 0), 0)
    return k, (prefix << 8) | digit


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
def gather_prefix16(X, lo, hi, center, prefix, SCR, cnt, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copies v_j, j in [lo, hi), whose key's top 16 bits equal `prefix`, to SCR[cnt:]
    in position order; returns cnt plus their number. SCR gets v itself (|X - center|
    already taken for KEY_ABS_DEV), read back by :func:`select_low16`."""
    cnt = cnt + tl.zeros([], dtype=tl.int32)  # a literal 0 arrives as a constexpr: the loop carries a tensor
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        v, bits, ok = load_key(X, offs, offs < hi, center, KEY)
        keep = (ok & (((bits >> 16) & 0xFFFF) == prefix)).to(tl.int32)
        tl.store(SCR + cnt + tl.cumsum(keep, 0) - keep, v, mask=keep != 0)
        cnt += tl.sum(keep, 0)
    return cnt


@triton.jit
def select_low16(SCR, cnt, k, prefix, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """The select's last two passes over the values :func:`gather_prefix16` left in
    SCR[0, cnt) (their key's top 16 bits are `prefix`): (key bits, rank) as
    :func:`radix_select` returns them."""
    SRC_KEY: tl.constexpr = 0 if KEY == 1 else KEY
    h = digit_histogram(SCR, 0, cnt, 0.0, prefix, 8, SRC_KEY, True, BLOCK_N)
    k, prefix = _pick_digit(h, k, prefix)
    h = digit_histogram(SCR, 0, cnt, 0.0, prefix, 0, SRC_KEY, True, BLOCK_N)
    k, prefix = _pick_digit(h, k, prefix)
    return prefix, k


@triton.jit
def place_kept(row, a, b, t, ties, out, written, seen, BLOCK_N: tl.constexpr):
    """Write the positions in [a, b) whose key is below the k-th's key ``t``, or equal
    to it among its first ``ties`` (counting ``seen`` earlier equal keys), to
    ``out[written:]`` in ascending order (a running offset plus a block prefix sum)."""
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
        tl.store(out + written + tl.cumsum(keep_i, 0) - keep_i, offs, mask=keep)
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
