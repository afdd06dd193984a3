"""
Top-k over a ragged range per row, ascending positions out
==========================================================

``topk_range(scores, lo, hi, budget, k_max)``: for every (row, head) of
``scores [R, H, N]`` fp32, the positions of the ``k = min(budget[row], F,
k_max)`` largest scores among the *finite* entries of ``scores[row, head,
lo[row]:hi[row]]`` (``F`` of them), listed in ascending position order, and
``k`` itself. It replaces ``torch.topk`` (+ ``torch.sort`` of the kept indices)
where the live part of a fixed-width score row is a per-row range: the quest
pages and asyncspade tokens of ``query_device`` (``[slots, Hkv, max_context]``,
slots without a request have an empty range) and the Selector's step 6
(``selector.core.top_k_positions``). ``torch.topk`` pays for the full width
``N`` and a large ``k`` on every row, empty or not; here the work of a row is
bounded by ``hi - lo``, and a row with nothing to select (``hi <= lo``,
``budget <= 0``) stores its count 0 and exits after O(1) work.

One program per (row, head), grid ``(R, H)``, CUDA-graph capturable (no host
sync, shapes static: ``k_max`` is the output width):

1. The exact k-th largest finite score ``t``, by radix select over an
   order-reversing uint32 key of the fp32 bits (``_radix.py``, shared with the
   Selector's medians): the top digit's histogram also counts ``F``, so ``k`` is
   known before the select. With ``small_digits`` (the default) two 64-bin
   histograms walk ``[lo, hi)`` (bits 31..26, then 25..20 among
   the values with that top digit), the values sharing those top 12 bits are
   gathered to a scratch row (``gather=True``) and three passes over those alone
   finish the key (7 + 7 + 6 bits). When the budget keeps every finite score
   (``k = F``: lfps's priority rows, -inf outside its C1 of a few % of the
   context, against 8192 candidates), there is no select: the compaction keeps
   every finite entry, after the one histogram pass that counted them (the
   same output; every path, the split one included). ``small_digits=False``: two
   256-bin histograms over the row, the values sharing the top 16 bits gathered,
   two 256-bin passes over those. Why 64 bins: Triton's histogram costs, per
   value, a ballot per bin-index bit plus an AND per bit for every bin a lane owns
   (bins / 32), so a pass over the row compiles to ~30% fewer instructions on 64
   bins than on 256 (``_radix.py``); the histogram passes are the Top-K's main
   cost on the GPU: 0.83x the time of 8-bit digits over asyncspade's rows on an
   H200 (``bench/kernels/bench_topk.py``, ``topk_range 6bit``). The select also says
   how many entries equal to ``t`` are kept (``k`` minus those strictly above).
2. One compaction pass over ``[lo, hi)``: an entry is kept if ``s > t``, or
   ``s == t`` and it is among the first ties by position, up to ``k`` in all
   (compared as keys: the select's exact order, ``-0 == +0``, no denormal flush);
   kept positions are written at a running offset plus a block prefix sum
   (``tl.cumsum``), so they come out ascending.

The top digit's histogram from the producer (``h_top=``): the first of those
serial passes over the whole row (bits 31..26), a large share of a Top-K that is
ALU/latency bound on the GPU, not bandwidth bound (``bench/kernels/bench_topk.py``'s
``topk_range htop`` rows time the kernel without it). The kernel that writes the scores can count
the same 64 bins with atomics as it writes them; given them, the block-walking
kernel loads them instead of that pass, and zeroes them for the producer's next
step (``topk_range``'s docstring has the exact contract).

Rows that fit one block (``N <= ROW_BLOCK_MAX``: quest's pages up to 128K tokens,
lfps's ranks, the covered Selector rows) take ``_topk_row_kernel`` instead: the row
is loaded into registers once and the digit histograms (six: bits 31..26,
25..20, then four 5-bit digits; ``small_digits=False``: four 8-bit ones) and the
compaction read those, one pass over memory instead of seven serial ones (two
histograms, the gather, the gathered values' three -- two with 8-bit digits --,
the compaction), each with its load latency, and no scratch row. Same output bit
for bit (same select, same tie rule). On the H100 at 32768 x 1 quest's radix
Top-K was the largest kernel of its
step (20 us a layer for 8 rows x 2049 pages, 2048-wide blocks, bench/README
"Session 18"), a latency chain, not a bandwidth one.

Long rows with few (row, head) programs (the Selector's 32K-128K rows, a few
hundred programs) leave that serial walk latency-bound: there each row is split
over several programs (``topk_split.py``, grid ``(R, H, S)``, four launches), with
the same output bit for bit; it keeps 8-bit digits (its per-slice histograms are
256 wide, shared with the Selector's medians): ``small_digits`` does not apply.

Non-finite scores: ``-inf`` is how the callers mark positions that are not
candidates, ``NaN`` is never a valid score, and ``+inf`` is left out with them
(the torch references count finite entries only): none is ever selected.
Ties at the cutoff keep the lowest positions (``torch.topk`` keeps an
unspecified subset; the kept *values* are the same). Output entries past ``k``
are not written: the launcher's own output is zero-filled, a given ``out``
keeps what it held.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._radix import (_pick_digit, digit_hist, digit_histogram, load_key, pick_digit, place_kept, radix_select,
                     radix_select_small, topk_bounds)
from ._split import TOPK_RULE, resolve_splits
from ._utils import device_num_sms, env_switch

__all__ = ["topk_range", "topk_range_ref", "top_digit_hist_ref", "takes_htop", "launch_shape", "LAUNCH_SHAPES"]


@triton.jit
def _take_top_hist(HTOP, cur_r, cur_h, stride_tr, stride_th):
    """This (row, head)'s 64 bins of h_top, left zeroed for the producer's next
    accumulation (the program owns them: no other program reads or writes them)."""
    bins = HTOP + cur_r.to(tl.int64) * stride_tr + cur_h.to(tl.int64) * stride_th + tl.arange(0, 64)
    h = tl.load(bins)
    tl.store(bins, tl.zeros([64], dtype=tl.int32))  # same layout as the load: each thread after its own read
    return h


@triton.jit(do_not_specialize=["N", "K_MAX", "stride_r", "stride_h", "stride_cr", "stride_ch", "stride_or",
                               "stride_oh", "stride_lr", "stride_tr", "stride_th", "stride_kr"])
def _topk_range_kernel(
    S,  # [R, H, N] fp32 scores, stride 1 along N
    LO,  # [R] int32
    HI,  # [R] int32
    BUDGET,  # [R] int32
    SCR,  # [R, H, N] fp32 scratch (GATHER only)
    OUT,  # [R, H, K_MAX] int32 positions, ascending in the first OUT_LEN entries
    OUT_LEN,  # [R, H] int32
    HTOP,  # [R, H, 64] int32 top-digit histograms (HAS_HTOP only), zeroed here
    SKIP,  # [R, H] int32 (HAS_SKIP only): != 0, the row is someone else's (nothing read or written)
    N,
    K_MAX,
    stride_r,
    stride_h,
    stride_cr,
    stride_ch,
    stride_or,
    stride_oh,
    stride_lr,
    stride_tr,
    stride_th,
    stride_kr,
    BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr,
    SMALL_DIGITS: tl.constexpr,  # with GATHER: 6-bit digits over [lo, hi) (radix_select_small)
    HAS_HTOP: tl.constexpr,  # with GATHER and SMALL_DIGITS: the top digit's histogram given, not computed
    HAS_SKIP: tl.constexpr,
):
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    if HAS_SKIP:
        if tl.load(SKIP + cur_r * stride_kr + cur_h) != 0:
            return
    lo, hi, k = topk_bounds(LO, HI, BUDGET, N, K_MAX, cur_r)  # nothing to select: hi = lo
    if HAS_HTOP:  # taken (and zeroed) before the early exit: every program leaves its bins at 0
        h_given = _take_top_hist(HTOP, cur_r, cur_h, stride_tr, stride_th)
    if k <= 0:  # an empty range or budget (a slot without a live request): no pass over the row
        tl.store(OUT_LEN + cur_r * stride_lr + cur_h, 0)
        return
    row = S + cur_r.to(tl.int64) * stride_r + cur_h.to(tl.int64) * stride_h
    scr = SCR + cur_r.to(tl.int64) * stride_cr + cur_h.to(tl.int64) * stride_ch
    # KEY_DESC (2): finite scores only, the k-th smallest key is the (k+1)-th largest score.
    # The top digit's histogram also counts them (F): k = min(k, F) before the select.
    # k = F (the budget keeps every finite score, as lfps's sparse priority rows mostly
    # do): no select, the compaction keeps every finite entry (t above every finite key).
    key = tl.full([], -1, dtype=tl.int32)
    rank = tl.full([], -1, dtype=tl.int32)
    if SMALL_DIGITS and GATHER:
        if HAS_HTOP:  # the scores' producer counted it: one serial pass over the row less
            h = h_given
        else:
            h = digit_hist(row, lo, hi, 0.0, 0, 26, 6, 2, False, BLOCK_N)
        f = tl.sum(h, 0)
        k = tl.maximum(tl.minimum(k, f), 0)
        hi = tl.where(k > 0, hi, lo)
        if k < f:
            key, rank = radix_select_small(row, lo, hi, h, k - 1, 0.0, scr, 2, BLOCK_N)  # the k-th largest's key
    else:
        h = digit_histogram(row, lo, hi, 0.0, 0, 24, 2, False, BLOCK_N)
        f = tl.sum(h, 0)
        k = tl.maximum(tl.minimum(k, f), 0)
        hi = tl.where(k > 0, hi, lo)
        if k < f:
            key, rank = radix_select(row, lo, hi, h, k - 1, 0.0, scr, 2, GATHER, BLOCK_N)
    ties = rank + 1  # entries with that key that are kept (the others kept rank above it)
    t = key.to(tl.uint32, bitcast=True)
    out = OUT + cur_r.to(tl.int64) * stride_or + cur_h * stride_oh
    # A given h_top that does not match the scores would misplace t: the writes stay under k
    # (the output is then wrong, not memory past the row's k_max).
    place_kept(row, lo, hi, t, ties, out, 0, 0, BLOCK_N, k, HAS_HTOP)
    tl.store(OUT_LEN + cur_r * stride_lr + cur_h, k)


@triton.jit
def _row_histogram(bits, sel, SHIFT: tl.constexpr, DBITS: tl.constexpr):
    """2^DBITS-bin histogram of the digit (key >> SHIFT) & (2^DBITS - 1) of the keys
    held in registers where `sel`: the others land in bin 0 and are taken out."""
    NBINS: tl.constexpr = 1 << DBITS
    h = tl.histogram(tl.where(sel, (bits >> SHIFT) & (NBINS - 1), 0), NBINS)
    return tl.where(tl.arange(0, NBINS) == 0, h - tl.sum((~sel).to(tl.int32), 0), h)


@triton.jit
def _row_digit(bits, ok, rank, prefix, SHIFT: tl.constexpr, DBITS: tl.constexpr):
    """One radix pass over keys held in registers: the DBITS-bit digit at SHIFT of the
    keys whose higher bits equal `prefix`, and the bin holding the rank-th."""
    sel = ok & (((bits >> (SHIFT + DBITS)) & ((1 << (32 - SHIFT - DBITS)) - 1)) == prefix)
    return pick_digit(_row_histogram(bits, sel, SHIFT, DBITS), rank, prefix, DBITS)


@triton.jit(do_not_specialize=["N", "K_MAX", "stride_r", "stride_h", "stride_or", "stride_oh", "stride_lr",
                               "stride_kr"])
def _topk_row_kernel(
    S,  # [R, H, N] fp32 scores, stride 1 along N, N <= BLOCK_N
    LO,  # [R] int32
    HI,  # [R] int32
    BUDGET,  # [R] int32
    OUT,  # [R, H, K_MAX] int32 positions, ascending in the first OUT_LEN entries
    OUT_LEN,  # [R, H] int32
    SKIP,  # [R, H] int32 (HAS_SKIP only), as _topk_range_kernel's
    N,
    K_MAX,
    stride_r,
    stride_h,
    stride_or,
    stride_oh,
    stride_lr,
    stride_kr,
    BLOCK_N: tl.constexpr,
    SMALL_DIGITS: tl.constexpr,  # 6- and 5-bit digits: 64- and 32-bin histograms
    HAS_SKIP: tl.constexpr,
):
    """_topk_range_kernel for a row held in registers: the same radix select (the
    k-th largest finite score's key, from the top: 8 bits a pass, or 6, 6, 5, 5, 5, 5
    with SMALL_DIGITS) and the same compaction, over one load of the row."""
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    if HAS_SKIP:
        if tl.load(SKIP + cur_r * stride_kr + cur_h) != 0:
            return
    lo, hi, k = topk_bounds(LO, HI, BUDGET, N, K_MAX, cur_r)
    if k <= 0:
        tl.store(OUT_LEN + cur_r * stride_lr + cur_h, 0)
        return
    row = S + cur_r.to(tl.int64) * stride_r + cur_h.to(tl.int64) * stride_h
    offs = tl.arange(0, BLOCK_N)
    _, bits, ok = load_key(row, offs, (offs >= lo) & (offs < hi), 0.0, 2)  # KEY_DESC: finite scores only
    # SMALL_DIGITS: bits 31..26, 25..20, then four 5-bit digits, not 6 + 6 + 6 + 2: under
    # 32 bins a histogram still takes 5 ballots a value, and 32 bins are one per lane.
    # k = F (every finite score kept): no digit passes, t above every finite key
    rank = tl.full([], -1, dtype=tl.int32)
    prefix = tl.full([], -1, dtype=tl.int32)
    if SMALL_DIGITS:
        h = _row_histogram(bits, ok, 26, 6)  # the top digit's also counts the finite scores
        f = tl.sum(h, 0)
        k = tl.minimum(k, f)
        if k < f:
            rank, prefix = pick_digit(h, tl.maximum(k - 1, 0), 0, 6)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 20, 6)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 15, 5)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 10, 5)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 5, 5)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 0, 5)
    else:  # bits 31..24, 23..16, 15..8, 7..0
        h = _row_histogram(bits, ok, 24, 8)
        f = tl.sum(h, 0)
        k = tl.minimum(k, f)
        if k < f:
            rank, prefix = _pick_digit(h, tl.maximum(k - 1, 0), 0)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 16, 8)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 8, 8)
            rank, prefix = _row_digit(bits, ok, rank, prefix, 0, 8)
    # keep keys below the k-th's, and the first rank + 1 equal to it by position (k = 0:
    # no finite score, nothing is ok)
    t = prefix.to(tl.uint32, bitcast=True)
    u = bits.to(tl.uint32, bitcast=True)
    eq = (ok & (u == t)).to(tl.int32)
    keep = (ok & (u < t)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq <= rank))
    keep_i = keep.to(tl.int32)
    out = OUT + cur_r.to(tl.int64) * stride_or + cur_h * stride_oh
    tl.store(out + tl.cumsum(keep_i, 0) - keep_i, offs, mask=keep)
    tl.store(OUT_LEN + cur_r * stride_lr + cur_h, k)


#: Rows up to this wide take _topk_row_kernel (one load into registers); wider ones
#: the block-walking kernels. 8192 fp32 over 16 warps: 16 values a thread.
ROW_BLOCK_MAX = 8192
ONE_BLOCK_ENABLED = env_switch("TOPK_ONE_BLOCK", True)
#: The select's passes over a whole row on 6-bit digits (64-bin histograms: fewer
#: instructions than 256-bin ones, the module doc); ``SGLANG_SPARSE_TOPK_SMALL_DIGITS=0``
#: keeps 8-bit ones. H200, graph replay (bench/README "Session 23", ``bench_topk.py``):
#: asyncspade's 14 layers x 64 rows of 32768 575.8 -> 478.9 us, quest's 4 x 8 rows of
#: 8126 pages 32.1 -> 26.5 us and 8 x 8 of 2049 15.0 -> 13.6 us; the split rows as before.
SMALL_DIGITS = env_switch("TOPK_SMALL_DIGITS", True)


def row_block_fits(n: int) -> bool:
    """Whether _topk_row_kernel's block suits rows of ``n``: masked lanes cost its
    histograms as much as live ones, so a block more than 40% empty over 1024 lanes
    goes to the block-walking kernel. H100, graph replay (bench/README "Session 18"):
    quest's 8126 pages (8192-block) 32 vs 52 us, 136 pages (256) 11 vs 20 us, 2560
    (4096) 18.5 vs 22.0; 2064 pages (4096) at 64 programs 18.6 vs 15.2."""
    block = row_launch_shape(n)[0]
    return block <= 1024 or 5 * n >= 3 * block


def row_launch_shape(n: int) -> Tuple[int, int]:
    """(block_n, num_warps) of _topk_row_kernel for rows of ``n`` scores: the next
    power of two, 1-16 values a thread."""
    block = max(16, triton.next_power_of_2(max(n, 1)))
    return block, max(1, min(16, block // 256))


#: (block_n, num_warps) that :func:`launch_shape` picks from, widest first (start-up
#: compiles each: ``selector.refresh.warm_up_kernels``).
LAUNCH_SHAPES = ((4096, 16), (2048, 8), (1024, 4))


def launch_shape(programs: int, device: torch.device, n: Optional[int] = None) -> Tuple[int, int]:
    """(block_n, num_warps) for ``programs`` (row, head[, slice]) programs over rows of
    ``n`` scores. Each program walks its range serially, so when there are fewer
    programs than SMs (the serving shapes: a few live slots x KV heads) a program
    gets an SM to itself and more warps per program shorten the walk; with many
    programs 4 warps keep several CTAs resident per SM. A block is never wider than
    the row: masked lanes cost the histograms and prefix sums as much as live ones
    (quest's 64 rows of 2064 pages, graph replay: 23 -> 14 us in 2048-blocks;
    end to end +5% at 32768 x 1, bench/README.md, session 9)."""
    sms = device_num_sms(device)
    i = 0 if programs <= sms else 1 if programs <= 4 * sms else 2
    while n is not None and i < len(LAUNCH_SHAPES) - 1 and LAUNCH_SHAPES[i][0] > n:
        i += 1
    return LAUNCH_SHAPES[i]


def topk_range(
    scores: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    budget: torch.Tensor,
    k_max: int,
    *,
    out: Optional[torch.Tensor] = None,
    out_len: Optional[torch.Tensor] = None,
    gather: bool = True,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    splits: Optional[int] = None,
    one_block: Optional[bool] = None,
    small_digits: Optional[bool] = None,
    h_top: Optional[torch.Tensor] = None,
    skip: Optional[torch.Tensor] = None,
    scratch: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` positions per (row, head) of the finite scores in ``[lo, hi)``, ascending.

    Args:
        scores: ``[R, H, N]`` fp32, stride 1 along ``N`` (rows and heads may be strided).
        lo, hi: ``[R]`` int32: the range per row (clipped to ``[0, N]``; ``hi <= lo``: empty).
        budget: ``[R]`` int32: entries to keep per row (``<= 0``: none).
        k_max: static output width; ``k = min(budget, finite entries in range, k_max)``.
        out, out_len: optional preallocated ``[R, H, k_max]`` / ``[R, H]`` int32
            (stride 1 along the last dim); entries of ``out`` past ``k`` are left as
            they are (the launcher's own ``out`` is zeros).
        gather: the select's last two passes read the scores left after its top
            16 bits only (a scratch the size of ``scores``); ``False``: all passes
            read the whole range.
        block_n, num_warps: default :func:`launch_shape` (wide programs when few;
            of all the split programs when split).
        splits: programs per (row, head) (``topk_split.py``: the same output);
            default ``_split.resolve_splits``: ``split_count`` of ``N`` and ``R x H``
            under ``_split.TOPK_RULE`` (1 unless the rows are long and few; always 1
            with ``SGL_SPARSE_SPLIT_ROWS=0``); ``gather=False`` runs unsplit.
        one_block: the row held in registers (``_topk_row_kernel``); default: when
            ``N <= ROW_BLOCK_MAX`` and none of ``block_n``, ``num_warps``, ``splits``,
            ``gather=False`` is asked for (``SGL_SPARSE_TOPK_ONE_BLOCK=0``: never).
        small_digits: the select's passes over the row on 6-bit digits (64-bin
            histograms; the register row: 6- and 5-bit ones) instead of 8-bit ones
            (256 bins); the same output bit for bit. Default
            :data:`SMALL_DIGITS` (``SGLANG_SPARSE_TOPK_SMALL_DIGITS``, on). No effect
            with ``gather=False`` (four 8-bit passes over the row, as before) nor on
            the split kernel (``splits > 1``: its per-slice histograms are 256 wide,
            shared with the Selector's medians).
        h_top: optional ``[R, H, 64]`` int32 (stride 1 along the bins; rows and
            heads may be strided): per (row, head) the 64-bin histogram of the top
            6 bits (``(key >> 26) & 63``) of the ``KEY_DESC`` keys (``_radix.load_key``)
            of the *finite* scores in the kernel's range ``[max(lo, 0), min(hi, N))``
            -- exactly ``digit_hist(row, lo, hi, 0.0, 0, 26, 6, 2, False, BLOCK_N)``,
            the select's first pass over the row, which the kernel then skips
            (:func:`top_digit_hist_ref` is its torch reference). Accumulated by the
            producer of the scores while it writes them (atomics), scoring ``[lo, hi)``
            from the same ``lo``/``hi`` arrays; a (row, head) with ``budget <= 0`` or an
            empty range is not read. Every program leaves its 64 bins zeroed (read
            ones or not), so the producer accumulates into the same tensor at the next
            step without a memset; the call consumes it (a second call on the same
            scores needs the histogram again). Only for the block-walking kernel on
            6-bit digits with ``gather`` and no split: ``one_block`` and ``splits`` default
            to ``False`` and 1 with it, ``small_digits`` to ``True`` (whatever
            :data:`SMALL_DIGITS` says), and asking otherwise asserts. A histogram that
            does not match the scores gives a wrong output (no write past ``k``).
        skip: optional ``[R, H]`` int32 (stride 1 along heads): a (row, head) with a
            non-zero entry is left alone, its ``out`` and ``out_len`` as they are
            (a producer that already listed the row: lfps's priorities, whose C1
            usually fits the budget, ``lfps_tables.lfps_priority``). Every path
            takes it (the split one in each phase); not with ``h_top``.
        scratch: optional fp32 ``[R, H, N]`` (stride 1 along ``N``) on the scores' device for
            the block-walking kernel's gathered scores (``gather``); allocated per call
            when not given. A caller capturing the call into a CUDA graph on a device
            other than the capture's (asyncspade's cache device) passes its own: the
            graph's private pool serves the capturing device's allocations only.

    Returns:
        ``(positions [R, H, k_max] int32, count [R, H] int32)``: positions of the
        kept scores ascending in the first ``count`` entries.
    """
    r, h, n = scores.shape
    k_max = int(k_max)
    assert scores.dtype == torch.float32 and scores.stride(2) == 1, "scores: fp32, stride 1 along N"
    for name, t in (("lo", lo), ("hi", hi), ("budget", budget)):
        assert t.shape == (r,) and t.dtype == torch.int32 and t.is_contiguous(), f"{name}: int32 [R]"
    dev = scores.device
    if h_top is not None:
        assert skip is None, "skip: not with h_top (a skipped program would leave its bins as they are)"
        small_digits, one_block, splits = _htop_launch(h_top, scores, gather, small_digits, one_block, splits)
    if skip is not None:
        assert skip.shape == (r, h) and skip.dtype == torch.int32 and skip.stride(1) == 1, "skip: int32 [R, H]"
        assert skip.device == dev, "skip: on the scores' device"
    small_digits = SMALL_DIGITS if small_digits is None else bool(small_digits)
    if one_block is None:
        one_block = (ONE_BLOCK_ENABLED and n <= ROW_BLOCK_MAX and gather and block_n is None and num_warps is None
                     and splits is None and row_block_fits(n))
    assert not one_block or n <= ROW_BLOCK_MAX, f"one_block: rows up to {ROW_BLOCK_MAX} scores, not {n}"
    if one_block:
        block_n, num_warps = row_launch_shape(n)
    else:
        splits = 1 if not gather or n == 0 else resolve_splits(splits, n, r * h, dev, TOPK_RULE)
        auto_block, auto_warps = launch_shape(r * h * splits, dev, n)
        block_n = int(block_n or auto_block)
        num_warps = int(num_warps or auto_warps)
    assert k_max >= 1 and block_n >= 16 and block_n & (block_n - 1) == 0
    if out is None:
        out = torch.zeros((r, h, k_max), dtype=torch.int32, device=dev)
    if out_len is None:
        out_len = torch.empty((r, h), dtype=torch.int32, device=dev)
    assert out.shape == (r, h, k_max) and out.dtype == torch.int32 and out.stride(2) == 1
    assert out_len.shape == (r, h) and out_len.dtype == torch.int32 and out_len.stride(1) == 1
    if r == 0 or h == 0:
        return out, out_len
    skip_t = out_len if skip is None else skip  # an int32 pointer the kernels do not touch without HAS_SKIP
    if one_block:
        _topk_row_kernel[(r, h)](
            scores, lo, hi, budget, out, out_len, skip_t, n, k_max,
            scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), out_len.stride(0), skip_t.stride(0),
            BLOCK_N=block_n, SMALL_DIGITS=small_digits, HAS_SKIP=skip is not None, num_warps=num_warps,
        )
        return out, out_len
    if splits > 1:
        from .topk_split import topk_range_split

        topk_range_split(scores, lo, hi, budget, k_max, out, out_len, splits, block_n, num_warps, skip=skip)
        return out, out_len
    if not (gather and n > 0):
        scratch = scores
    elif scratch is None:
        scratch = torch.empty_like(scores)
    else:
        assert scratch.shape == scores.shape and scratch.stride(2) == 1, "scratch: scores' shape, stride 1 along N"
        assert scratch.dtype == torch.float32 and scratch.device == dev, "scratch: fp32 on the scores' device"
    htop = out_len if h_top is None else h_top  # an int32 pointer the kernel does not touch without HAS_HTOP
    _topk_range_kernel[(r, h)](
        scores, lo, hi, budget, scratch, out, out_len, htop, skip_t,
        n, k_max,
        scores.stride(0), scores.stride(1), scratch.stride(0), scratch.stride(1),
        out.stride(0), out.stride(1), out_len.stride(0), htop.stride(0), htop.stride(1), skip_t.stride(0),
        BLOCK_N=block_n, GATHER=bool(gather), SMALL_DIGITS=small_digits, HAS_HTOP=h_top is not None,
        HAS_SKIP=skip is not None, num_warps=num_warps,
    )
    return out, out_len


def takes_htop(n: int, programs: int, device: torch.device, *, one_block: Optional[bool] = None) -> bool:
    """Whether a call over ``programs`` (row, head) rows of ``n`` scores, left to its
    defaults, runs the kernel ``h_top`` feeds (block-walking, 6-bit digits, gather, no
    split), so that a producer's ``h_top`` only saves that kernel its first pass. Where
    the defaults take another (a register row, a split: 4 slices of asyncspade's 64
    rows of 32K ran 114 -> 74 us; 8-bit digits by the operator's choice), ``h_top``
    would force this one instead: a producer should not count it there. Host sizes
    only (static per CUDA graph). ``one_block``: as :func:`topk_range`'s."""
    if one_block is None:
        one_block = ONE_BLOCK_ENABLED and n <= ROW_BLOCK_MAX and row_block_fits(n)
    return bool(SMALL_DIGITS and not one_block and n > 0
                and resolve_splits(None, n, programs, device, TOPK_RULE) == 1)


def _htop_launch(h_top: torch.Tensor, scores: torch.Tensor, gather: bool, small_digits: Optional[bool],
                 one_block: Optional[bool], splits: Optional[int]) -> Tuple[bool, bool, int]:
    """(small_digits, one_block, splits) of a call given ``h_top``: the one path that
    starts from the top 6-bit digit's histogram (the block-walking kernel, gather, no
    split); a caller asking for another asserts rather than have its h_top ignored."""
    r, h, _ = scores.shape
    assert h_top.shape == (r, h, 64) and h_top.dtype == torch.int32 and h_top.stride(2) == 1, \
        "h_top: int32 [R, H, 64], stride 1 along the bins"
    assert h_top.device == scores.device, "h_top: on the scores' device"
    assert gather, "h_top: only with gather=True"
    assert small_digits is None or small_digits, "h_top: a 6-bit histogram, only with small_digits"
    assert not one_block, "h_top: not with one_block (the register row counts its own digits)"
    assert splits is None or splits == 1, "h_top: not with splits > 1 (the split kernel has 8-bit digits)"
    return True, False, 1


def topk_range_ref(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: torch.Tensor,
                   k_max: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch ``torch.topk`` + ``torch.sort`` reference of :func:`topk_range`
    (same outputs up to which cutoff ties are kept)."""
    r, h, n = scores.shape
    pos = torch.arange(n, device=scores.device)
    live = (pos >= lo[:, None].long()) & (pos < hi[:, None].long())
    s = torch.where(live[:, None, :] & torch.isfinite(scores), scores, float("-inf"))
    count = torch.minimum(torch.isfinite(s).sum(-1), budget.long()[:, None]).clamp(0, k_max)
    k = max(1, min(k_max, n))
    idx = torch.topk(s, k, dim=-1).indices if n > 0 else torch.zeros(r, h, k, dtype=torch.long)
    keep = torch.arange(k, device=scores.device) < count[..., None]
    big = torch.iinfo(torch.int64).max
    out = torch.sort(torch.where(keep, idx, big), dim=-1).values
    out = torch.where(keep, out, 0)
    out = torch.nn.functional.pad(out, (0, k_max - k)) if k < k_max else out[..., :k_max]
    return out.to(torch.int32), count.to(torch.int32)


def top_digit_hist_ref(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch reference of :func:`topk_range`'s ``h_top``: ``[R, H, 64]`` int32,
    per (row, head) the histogram of ``(key >> 26) & 63`` over the finite scores in
    ``[lo, hi)`` (clipped to ``[0, N)``; empty when ``hi <= lo``), ``key`` the
    ``KEY_DESC`` key of ``_radix.load_key``: the fp32 bits ``b`` as int32,
    ``0x7FFFFFFF`` for ``+-0``, ``b ^ 0x7FFFFFFF`` for ``b >= 0``, ``b`` otherwise."""
    r, h, n = scores.shape
    pos = torch.arange(n, device=scores.device)
    live = (pos >= lo[:, None].long()) & (pos < hi[:, None].long())
    ok = live[:, None, :] & torch.isfinite(scores)  # NaN and +-inf are never counted
    b = scores.view(torch.int32)
    key = torch.where(scores == 0, 0x7FFFFFFF, torch.where(b >= 0, b ^ 0x7FFFFFFF, b))
    hist = torch.zeros(r, h, 64, dtype=torch.int64, device=scores.device)
    hist.scatter_add_(-1, ((key >> 26) & 63).long(), ok.long())
    return hist.to(torch.int32)
