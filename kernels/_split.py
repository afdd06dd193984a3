"""
A radix select split over several programs per row (``topk_range``, the Selector's medians)
==========================================================================================

The single-program select (``_radix.py``) walks a whole row serially: with rows
of 32K-128K and only hundreds of (row, head) programs it is latency-bound, far
under the memory bandwidth. Here each row is cut into ``S`` slices of whole
blocks, one program per (row, head, slice), and every pass is its own launch:

1. each slice's 256-bin histogram of the top key digit -> ``H0[s]``;
2. every program sums ``H0`` over the slices and picks the top digit (all of them
   the same, integer sums), then the histogram of the second digit among the
   values with that top digit -> ``H1[s]``;
3. the same picks from ``H0``, ``H1`` (the top 16 bits); a slice's survivors
   (the values with those 16 bits) are copied to the row's scratch at the
   number of survivors of the slices before it (``H1[s' < s]`` at the picked
   digit): the row's survivors, in position order, fill ``SCR[0, count)``;
4. the consumer (the next launch, whatever it does with the result) redoes the
   picks and reads the survivors for the last two digits (:func:`finish`).

Per-slice histograms, not atomics: no buffer to zero, and the counts of the
slices *before* a slice (what the top-k's compaction needs to place its kept
positions) come with them. Everything is integer counting: the result is the
same element the single-program select finds. Each program re-reads ``S``
histograms per pass (``S x 1 KiB``) and, in step 4, all the row's survivors
(typically ~1% of the row); if very many values share the top 16 bits (e.g. all
equal) every program reads them all -- as slow as the single-program select,
never wrong.

The split count depends only on host-known sizes (the rows' bound and the
number of rows), so the grids are static: CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._radix import _pick_digit, digit_histogram, gather_prefix16, select_low16
from ._utils import device_num_sms

# A split launch should fill every SM with about this many resident 4-warp programs
# (H100: 16 x 4 warps = its 64 warp slots); fewer (row, head) programs than that
# are split.
TARGET_PROGRAMS_PER_SM = 16
# A slice shorter than this is not worth its re-read histograms and survivors.
MIN_SLICE = 4096
MAX_SPLITS = 32
# Whether a call without an explicit ``splits`` splits long rows at all. Off until the
# split path is timed on a GPU against the single-program kernels (bench_selector
# --stats-ab, bench_topk: written, not yet run on a GPU); SGL_SPARSE_SPLIT_ROWS=1 turns
# the automatic count on for an A/B of the whole server. An explicit ``splits``
# always applies (tests, benchmarks).
AUTO_SPLIT = os.environ.get("SGL_SPARSE_SPLIT_ROWS", "0") == "1"
# Histograms summed BLOCK_S slices at a time.
BLOCK_S = tl.constexpr(8)


def split_count(n: int, programs: int, device: torch.device, *, min_slice: int = MIN_SLICE) -> int:
    """Slices per row for ``programs`` (row, head) programs over rows of at most
    ``n`` values: 1 (the single-program kernel) when the rows are short or many."""
    want = -(-TARGET_PROGRAMS_PER_SM * device_num_sms(device) // max(programs, 1))
    return int(max(1, min(want, n // max(min_slice, 1), MAX_SPLITS)))


def resolve_splits(splits: int | None, n: int, programs: int, device: torch.device) -> int:
    """The split count a kernel call runs with: ``splits`` when given, else
    :func:`split_count` if ``AUTO_SPLIT``, else 1 (the single-program kernel)."""
    if splits:
        return int(splits)
    return split_count(n, programs, device) if AUTO_SPLIT else 1


@triton.jit
def slice_bounds(lo, hi, s, S, BLOCK_N: tl.constexpr):
    """Slice s of [lo, hi) (hi >= lo) among S: whole blocks, the last slices possibly empty."""
    per = tl.cdiv(tl.cdiv(hi - lo, S), BLOCK_N) * BLOCK_N
    a = tl.minimum(lo + s * per, hi)
    return a, tl.minimum(a + per, hi)


@triton.jit
def hist_totals(H, S, s):
    """H [S, 256] int32 per-slice histograms: (their sum, the sum over the slices before s)."""
    bins = tl.arange(0, 256)
    tot = tl.zeros([256], dtype=tl.int32)
    before = tl.zeros([256], dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        h = tl.load(H + sl[:, None] * 256 + bins[None, :], mask=(sl < S)[:, None], other=0)
        tot += tl.sum(h, 0)
        before += tl.sum(tl.where((sl < s)[:, None], h, 0), 0)
    return tot, before


@triton.jit
def prefix16(tot0, H1, S, s, k):
    """The picks of steps 2-3 for the k-th smallest key: (k within the survivors, the
    top 16 bits, survivors of the slices before s, survivors of the row, values of the
    slices before s whose second digit is below the picked one)."""
    k, prefix = _pick_digit(tot0, k, 0)
    tot1, before1 = hist_totals(H1, S, s)
    k, prefix = _pick_digit(tot1, k, prefix)
    bins = tl.arange(0, 256)
    at = bins == (prefix & 255)
    below = tl.sum(tl.where(bins < (prefix & 255), before1, 0), 0)
    return k, prefix, tl.sum(tl.where(at, before1, 0), 0), tl.sum(tl.where(at, tot1, 0), 0), below


@triton.jit
def select_pass(X, a, b, center, k, tot0, H0, H1, S, s, SCR, KEY: tl.constexpr, STEP: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Step STEP (0, 1, 2 of the module doc) of the select of the k-th smallest key of
    the row, for its slice [a, b). H0, H1: the row's [S, 256] histograms; tot0: the
    sum of H0 (:func:`hist_totals`; steps 1, 2)."""
    bins = tl.arange(0, 256)
    if STEP == 0:
        tl.store(H0 + s * 256 + bins, digit_histogram(X, a, b, center, 0, 24, KEY, False, BLOCK_N))
    elif STEP == 1:
        _, top = _pick_digit(tot0, k, 0)
        tl.store(H1 + s * 256 + bins, digit_histogram(X, a, b, center, top, 16, KEY, True, BLOCK_N))
    else:
        _, prefix, off, _, _ = prefix16(tot0, H1, S, s, k)
        gather_prefix16(X, a, b, center, prefix, SCR, off, KEY, BLOCK_N)


@triton.jit
def finish(tot0, H1, S, s, k, SCR, KEY: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step 4: (key bits, rank) of the k-th smallest key as ``radix_select`` returns
    them, then the survivors of the slices before s (SCR[0, off)) and ``below`` of
    :func:`prefix16`."""
    k, prefix, off, cnt, below = prefix16(tot0, H1, S, s, k)
    bits, rank = select_low16(SCR, cnt, k, prefix, KEY, BLOCK_N)
    return bits, rank, off, below
