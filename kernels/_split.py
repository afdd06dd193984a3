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
   picks and reads the survivors for the last two digits (:func:`finish`); or, where
   the survivors may be most of the row, two more launches cut them into ``S``
   slices as well (:func:`low_pass`, the third digit then the fourth) and the
   consumer picks from the histograms alone (:func:`split_select_done`).

Per-slice histograms, not atomics: no buffer to zero, and the counts of the
slices *before* a slice (what the top-k's compaction needs to place its kept
positions) come with them. Everything is integer counting: the result is the
same element the single-program select finds. Each program re-reads ``S``
histograms per pass (``S x 1 KiB``) and, in step 4, all the row's survivors
(typically ~1% of the row); if very many values share the top 16 bits (e.g. all
equal) every program reads them all -- as slow as the single-program select,
never wrong. Key norms are such rows: Qwen3's per-head RMSNorm on keys leaves
every norm within a few % of the others: at 130000 x 4 over fp8 (session 33's
profile) the launch finishing the Selector's median took 1.45 ms, 10x a pass over
the row (so most of each row shared the median's top 16 bits). The medians take
:func:`low_pass` since.

The split count depends only on host-known sizes (the rows' bound and the
number of rows), so the grids are static: CUDA-graph capturable. Each kernel has
its own measured rule (:data:`STATS_RULE`, :data:`TOPK_RULE`). The cost of a split:
rows that are all empty still take its launches (graph replay, 64 programs of 40K:
5.9 us unsplit, 23 us in 4 slices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._radix import _pick_digit, digit_histogram, gather_prefix16, select_low16
from ._utils import device_num_sms, env_switch

@dataclass(frozen=True)
class SplitRule:
    """How many slices a kernel cuts its rows into, from the H100 A/B (kernel run 4,
    ``bench/results/{topk,selector}_h100_run*``): about ``per_sm`` (row, head, slice)
    programs per SM, no fewer than ``min_splits`` slices (a smaller split is not
    worth its extra passes: then 1) and at most ``max_splits``."""

    per_sm: int
    min_splits: int
    max_splits: int


# The medians (selector_stats): 256 (row, head) programs of 128K keys ran 1.56x
# faster in 8 slices (2.30 -> 1.47 ms), 1024 programs of 32K ran 3-12% slower in 2
# or 4 slices (H100, session 9). H200, session 33 (bench_selector --stats-ab, the
# survivors split too): 1024 programs of 32K (the 32768 x 8 refresh's chunk) take
# 1.93 -> 1.57 ms in 2 slices over Qwen3-like key norms (43% of a row sharing the
# median's top 16 bits), 1.44 -> 1.46 over log-normal ones: 2 slices from there on.
STATS_RULE = SplitRule(per_sm=16, min_splits=2, max_splits=32)
# The Top-K (topk_range; four launches when split): 64 programs of 32K-40K scores
# (asyncspade's per-step token select, graph replay) 114 -> 74 and 140 -> 85 us in 4
# slices, 8-16 no better; 512 programs of 32K (the Selector's) 397 -> 360 us in 2-4.
# (8 slices in 1024-blocks / 4 warps: 66 us with 32K live, but the split follows the
# rows' static width, and end to end at 8192 x 8 -- 8K live in rows of 33K -- it cost
# asyncspade 8% and lfps's 2-slice candidate select 35%: bench/README.md, session 9.)
TOPK_RULE = SplitRule(per_sm=8, min_splits=2, max_splits=4)
# A slice shorter than this is not worth its re-read histograms and survivors.
MIN_SLICE = 4096
# Whether a call without an explicit ``splits`` splits long rows at all (on since the
# H100 A/B above; SGLANG_SPARSE_SPLIT_ROWS=0 turns it off for an A/B of a whole server).
# An explicit ``splits`` always applies (tests, benchmarks).
AUTO_SPLIT = env_switch("SPLIT_ROWS", True)
# Histograms summed BLOCK_S slices at a time.
BLOCK_S = tl.constexpr(8)


def split_count(n: int, programs: int, device: torch.device, rule: SplitRule, *,
                min_slice: int = MIN_SLICE) -> int:
    """Slices per row for ``programs`` (row, head) programs over rows of at most
    ``n`` values: 1 (the single-program kernel) when the rows are short or many."""
    want = rule.per_sm * device_num_sms(device) // max(programs, 1)
    s = min(want, n // max(min_slice, 1), rule.max_splits)
    return int(s) if s >= rule.min_splits else 1


def resolve_splits(splits: int | None, n: int, programs: int, device: torch.device, rule: SplitRule) -> int:
    """The split count a kernel call runs with: ``splits`` when given, else
    :func:`split_count` if ``AUTO_SPLIT``, else 1 (the single-program kernel)."""
    if splits:
        return int(splits)
    return split_count(n, programs, device, rule) if AUTO_SPLIT else 1


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


@triton.jit
def low_pass(tot0, H, S, s, k, SCR, KEY: tl.constexpr, STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step 4 split like the others: the histogram of the third digit (STEP 0) or,
    with the third picked, the fourth (STEP 1) over this program's slice of the
    row's survivors SCR[0, count) (:func:`select_pass` step 2) -> ``H[2, s]`` /
    ``H[3, s]`` (H: [4, S, 256], a digit's histograms each; tot0: the sum of
    ``H[0]``). Each program reads count / S values instead of all of them."""
    SRC_KEY: tl.constexpr = 0 if KEY == 1 else KEY  # SCR holds v: |X - center| is taken
    k, prefix, _, cnt, _ = prefix16(tot0, H + S * 256, S, s, k)
    a, b = slice_bounds(0, cnt, s, S, BLOCK_N)
    bins = tl.arange(0, 256)
    if STEP == 0:
        tl.store(H + 2 * S * 256 + s * 256 + bins, digit_histogram(SCR, a, b, 0.0, prefix, 8, SRC_KEY, True, BLOCK_N))
    else:
        tot2, _ = hist_totals(H + 2 * S * 256, S, s)
        k, prefix = _pick_digit(tot2, k, prefix)
        tl.store(H + 3 * S * 256 + s * 256 + bins, digit_histogram(SCR, a, b, 0.0, prefix, 0, SRC_KEY, True, BLOCK_N))


@triton.jit
def split_select_step(X, a, b, center, k, H, S, s, SCR, KEY: tl.constexpr, STEP: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Launch STEP (0-4) of the whole split select of the k-th smallest key, for the
    slice [a, b): :func:`select_pass` steps 0-2, then both :func:`low_pass` steps.
    H: the row's [4, S, 256] histograms, one [S, 256] per digit."""
    if STEP == 0:
        select_pass(X, a, b, center, k, 0, H, H + S * 256, S, s, SCR, KEY, 0, BLOCK_N)
    else:
        tot0, _ = hist_totals(H, S, s)
        if STEP < 3:
            select_pass(X, a, b, center, k, tot0, H, H + S * 256, S, s, SCR, KEY, STEP, BLOCK_N)
        else:
            low_pass(tot0, H, S, s, k, SCR, KEY, STEP - 3, BLOCK_N)


@triton.jit
def split_select_done(H, S, s, k):
    """After :func:`split_select_step`'s five launches: the k-th smallest key's
    (bits, rank) as :func:`finish` returns them, from the four digits' histograms
    alone (no survivor read), the same in every program."""
    tot0, _ = hist_totals(H, S, s)
    k, prefix, _, _, _ = prefix16(tot0, H + S * 256, S, s, k)
    for d in tl.static_range(2, 4):
        tot, _ = hist_totals(H + d * S * 256, S, s)
        k, prefix = _pick_digit(tot, k, prefix)
    return prefix, k
