"""
``topk_range`` with each (row, head) split over several programs
================================================================

The same output as ``topk_range._topk_range_kernel`` (bit for bit: positions,
order, which cutoff ties are kept, counts) from four launches over a grid
``(R, H, S)``, slice ``s`` of a row covering ``[a, b)`` (``_split.py``):

* phases 0-2: the radix select's split steps (top digit histograms, which also
  count the finite entries ``F``, so every program knows ``k = min(budget, F,
  k_max)``; second digit; survivors gathered);
* phase 3: every program finishes the select (the k-th largest key ``t`` and how
  many entries equal to it are kept), then places its slice's kept positions.
  Kept entries of the slices before it -- keys below ``t`` (the histograms'
  bins below ``t``'s two top digits, plus the survivors of those slices below
  ``t``) and the first ties by position (the survivors equal to ``t``) -- give
  its write offset and its count of ties seen, exactly what the single program
  had when its serial walk reached ``a``.

Rows with nothing to select (``k = 0``: an empty range or budget, the slots
without a live request under a captured graph) return at once in every phase.
Slice 0 stores the count. Graph capturable: the grid and buffers depend on
shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._radix import count_keys, place_kept, topk_bounds
from ._split import finish, hist_totals, select_pass, slice_bounds

__all__ = ["topk_range_split"]


@triton.jit(do_not_specialize=["N", "K_MAX", "NSPLIT", "stride_r", "stride_h", "stride_cr", "stride_ch",
                               "stride_or", "stride_oh", "stride_lr", "stride_kr"])
def _topk_split_kernel(
    S,  # [R, H, N] fp32 scores, stride 1 along N
    LO,  # [R] int32
    HI,  # [R] int32
    BUDGET,  # [R] int32
    SCR,  # [R, H, N] fp32 scratch: the survivors of the row
    HIST,  # [R, H, 2, NSPLIT, 256] int32 per-slice histograms
    OUT,  # [R, H, K_MAX] int32
    OUT_LEN,  # [R, H] int32
    SKIP,  # [R, H] int32 (HAS_SKIP only): != 0, the row is left alone in every phase
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
    stride_kr,
    PHASE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SKIP: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_s = tl.program_id(2)
    if HAS_SKIP:
        if tl.load(SKIP + cur_r * stride_kr + cur_h) != 0:
            return
    lo, hi, k = topk_bounds(LO, HI, BUDGET, N, K_MAX, cur_r)
    if k <= 0:
        # Nothing to select (a slot without a live request under a captured graph):
        # every phase returns at once, before the histogram reads that cost O(S x 256)
        # per program; the count is 0, as the passes would have found.
        if PHASE == 3:
            if cur_s == 0:
                tl.store(OUT_LEN + cur_r * stride_lr + cur_h, 0)
        return
    row = S + cur_r.to(tl.int64) * stride_r + cur_h.to(tl.int64) * stride_h
    scr = SCR + cur_r.to(tl.int64) * stride_cr + cur_h.to(tl.int64) * stride_ch
    h0 = HIST + (cur_r * tl.num_programs(1) + cur_h).to(tl.int64) * (2 * NSPLIT * 256)
    h1 = h0 + NSPLIT * 256
    if PHASE == 0:
        a, b = slice_bounds(lo, hi, cur_s, NSPLIT, BLOCK_N)
        # KEY_DESC (2): finite scores only, the k-th smallest key is the (k+1)-th largest score.
        select_pass(row, a, b, 0.0, 0, 0, h0, h1, NSPLIT, cur_s, scr, 2, 0, BLOCK_N)
    else:
        tot0, before0 = hist_totals(h0, NSPLIT, cur_s)
        f = tl.sum(tot0, 0)
        k = tl.maximum(tl.minimum(k, f), 0)
        hi = tl.where(k > 0, hi, lo)
        a, b = slice_bounds(lo, hi, cur_s, NSPLIT, BLOCK_N)
        if PHASE < 3:
            # k = F (the budget keeps every finite entry): no select, phase 3 keeps them all
            if k < f:
                select_pass(row, a, b, 0.0, k - 1, tot0, h0, h1, NSPLIT, cur_s, scr, 2, PHASE, BLOCK_N)
        else:
            out = OUT + cur_r.to(tl.int64) * stride_or + cur_h * stride_oh
            if k < f:
                key, rank, off, below1 = finish(tot0, h1, NSPLIT, cur_s, k - 1, scr, 2, BLOCK_N)
                ties = rank + 1  # entries with that key that are kept (the others kept rank above it)
                t = key.to(tl.uint32, bitcast=True)
                # What the slices before this one keep: keys below t by their top digit,
                # by their second digit (top digit t's), and among the survivors (top 16
                # bits t's) below t or tied with it, in position order.
                below0 = tl.sum(tl.where(tl.arange(0, 256) < ((key >> 24) & 255), before0, 0), 0)
                less, seen = count_keys(scr, 0, off, t, BLOCK_N)
                written = below0 + below1 + less + tl.minimum(seen, ties)
                place_kept(row, a, b, t, ties, out, written, seen, BLOCK_N)
            else:
                # every finite entry: the slices before this one hold sum(before0) of them;
                # t above every finite key (no finite key is 0xFFFFFFFF)
                t_all = tl.full([], -1, dtype=tl.int32).to(tl.uint32, bitcast=True)
                place_kept(row, a, b, t_all, 0, out, tl.sum(before0, 0), 0, BLOCK_N)
            if cur_s == 0:
                tl.store(OUT_LEN + cur_r * stride_lr + cur_h, k)


#: The launches, in order.
PHASES = (0, 1, 2, 3)


def topk_range_split(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: torch.Tensor, k_max: int,
                     out: torch.Tensor, out_len: torch.Tensor, splits: int, block_n: int, num_warps: int,
                     skip: torch.Tensor | None = None) -> None:
    """``topk_range``'s work with ``splits`` programs per (row, head) (arguments
    checked by ``topk_range``; ``scores`` non-empty)."""
    r, h, n = scores.shape
    scratch = torch.empty_like(scores)
    hist = torch.empty((r, h, 2, splits, 256), dtype=torch.int32, device=scores.device)
    skip_t = out_len if skip is None else skip  # not touched without HAS_SKIP
    for phase in PHASES:
        _topk_split_kernel[(r, h, splits)](
            scores, lo, hi, budget, scratch, hist, out, out_len, skip_t,
            n, k_max, splits,
            scores.stride(0), scores.stride(1), scratch.stride(0), scratch.stride(1),
            out.stride(0), out.stride(1), out_len.stride(0), skip_t.stride(0),
            PHASE=phase, BLOCK_N=block_n, HAS_SKIP=skip is not None, num_warps=num_warps,
        )
