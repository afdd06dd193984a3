"""kernels/topk_range.py (top-k over a ragged range per row, ascending positions)
against torch.topk + sort: ragged ranges, lo > 0, empty ranges, budgets of 0 and
above the live length, k_max below and above it, -inf / NaN / +inf inside the
range, forced ties (integer-valued scores), N not a multiple of the block. Any
tie choice passes if the kept values (as a multiset) and the count are right and
the positions are distinct, in range, finite and ascending."""

from __future__ import annotations

import re
from typing import List, Tuple

import pytest
import torch

import triton
import triton.language as tl

from sgl_sparse.kernels._radix import digit_hist
from sgl_sparse.kernels.topk_range import top_digit_hist_ref, topk_range, topk_range_ref


def _check(scores, lo, hi, budget, k_max, pos, cnt):
    ref_pos, ref_cnt = topk_range_ref(scores, lo, hi, budget, k_max)
    assert torch.equal(cnt, ref_cnt)
    r, h, _ = scores.shape
    for i in range(r):
        for j in range(h):
            c = int(cnt[i, j])
            p = pos[i, j, :c].long()
            if c:
                assert bool((p >= lo[i]).all()) and bool((p < hi[i]).all()), (i, j)
                assert bool((p[1:] > p[:-1]).all()), (i, j, p)  # ascending, hence distinct
            got = scores[i, j, p]
            assert bool(torch.isfinite(got).all())
            want = scores[i, j, ref_pos[i, j, :c].long()]
            assert torch.equal(got.sort().values, want.sort().values), (i, j)
            assert bool((pos[i, j, c:] == 0).all())  # the launcher's output is zero-filled


def _case(gen, r, h, n, ints=False, holes=0.0):
    if ints:  # few distinct values: many ties at the cutoff
        s = torch.randint(-3, 4, (r, h, n), generator=gen).float()
    else:
        s = torch.randn(r, h, n, generator=gen) * 10.0
    if holes:
        u = torch.rand(r, h, n, generator=gen)
        s = torch.where(u < holes, float("-inf"), s)
        s = torch.where((u >= holes) & (u < 1.3 * holes), float("nan"), s)
        s = torch.where((u >= 1.3 * holes) & (u < 1.4 * holes), float("inf"), s)
    return s


def _ragged_ranges(gen, r, n, k_max):
    """Per-row ranges and budgets: random, and with r > 2 an empty range (row 1),
    hi < lo (row 2) and a budget of 0 (row 0)."""
    lo = torch.randint(0, n // 3, (r,), generator=gen, dtype=torch.int32)
    hi = torch.randint(n // 2, n + 1, (r,), generator=gen, dtype=torch.int32)
    budget = torch.randint(0, k_max + 20, (r,), generator=gen, dtype=torch.int32)
    if r > 2:
        hi[1] = lo[1]  # empty
        hi[2] = max(int(lo[2]) - 5, 0)  # hi < lo
        budget[0] = 0
    return lo, hi, budget


@pytest.mark.parametrize("r,h,n,k_max,ints,holes", [
    (1, 1, 37, 8, False, 0.0),
    (1, 1, 300, 64, True, 0.0),
    (3, 8, 150, 40, False, 0.2),
    (4, 8, 150, 200, True, 0.1),  # k_max above the live length
    (2, 3, 2100, 700, False, 0.05),  # several blocks, N not a multiple of the block
])
def test_topk_range_matches_torch(r, h, n, k_max, ints, holes):
    gen = torch.Generator().manual_seed(r * 1000 + n + k_max)
    s = _case(gen, r, h, n, ints, holes)
    lo, hi, budget = _ragged_ranges(gen, r, n, k_max)
    if r > 2:
        lo[3 % r] = 0
        hi[3 % r] = n
        budget[3 % r] = 10 ** 6  # above the live length
    for gather in (True, False):
        pos, cnt = topk_range(s, lo, hi, budget, k_max, gather=gather, block_n=256)
        _check(s, lo, hi, budget, k_max, pos, cnt)
    # the default: rows that fit one block (all of these) in registers (_topk_row_kernel)
    pos, cnt = topk_range(s, lo, hi, budget, k_max)
    _check(s, lo, hi, budget, k_max, pos, cnt)


@pytest.mark.parametrize("r,h,n,k_max,ints,holes", [
    (5, 2, 256, 33, True, 0.1),  # N exactly a power of two, many ties
    (4, 3, 2049, 129, False, 0.0),  # quest's pages at 32K + 16: a 4096-wide register block
    (3, 2, 70, 100, False, 0.9),  # mostly non-finite: fewer finite scores than the budget
])
def test_topk_row_kernel_is_bit_identical(r, h, n, k_max, ints, holes):
    """_topk_row_kernel (the row in registers) against the block-walking kernel: the
    same positions, order and counts (the same select and tie rule), on ragged
    ranges, an empty one, a budget of 0 and one above the live length, rows with no
    finite score."""
    gen = torch.Generator().manual_seed(7 * n + r)
    s = _case(gen, r, h, n, ints, holes)
    s[-1, 0] = float("-inf")  # a (row, head) without a finite score
    lo = torch.randint(0, n // 4, (r,), generator=gen, dtype=torch.int32)
    hi = torch.randint(n // 2, n + 1, (r,), generator=gen, dtype=torch.int32)
    budget = torch.randint(1, k_max + 20, (r,), generator=gen, dtype=torch.int32)
    hi[1] = lo[1]  # empty
    budget[2] = 0
    budget[0] = 10 ** 6
    row = topk_range(s, lo, hi, budget, k_max, one_block=True)
    walk = topk_range(s, lo, hi, budget, k_max, one_block=False, splits=1)
    assert torch.equal(row[0], walk[0]) and torch.equal(row[1], walk[1])
    _check(s, lo, hi, budget, k_max, *row)
    assert int(row[1][-1, 0]) == 0 and int(row[1][1].max()) == 0 and int(row[1][2].max()) == 0


def test_topk_row_kernel_only_for_rows_that_fit():
    from sgl_sparse.kernels.topk_range import ROW_BLOCK_MAX, row_block_fits, row_launch_shape

    assert row_launch_shape(2049) == (4096, 16) and row_launch_shape(129) == (256, 1)
    assert row_launch_shape(ROW_BLOCK_MAX) == (ROW_BLOCK_MAX, 16)
    # by default only where its block is mostly live (or small): the H100's A/B
    assert [row_block_fits(n) for n in (136, 1024, 2064, 2560, 8126)] == [True, True, False, True, True]
    s = torch.zeros(1, 1, ROW_BLOCK_MAX + 1)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="one_block"):
        topk_range(s, 0 * one, one, one, 1, one_block=True)


@pytest.mark.parametrize("rows,splits,block_n,ints,holes", [
    (5, 3, 32, True, 0.1),  # ties at the cutoff spread over slices, non-finite holes
    (3, 6, 16, False, 0.0),  # row 0: its last slice empty (slices are whole blocks)
])
def test_topk_range_split_is_bit_identical(rows, splits, block_n, ints, holes):
    """Each (row, head) split over several programs: the same positions, order and
    counts as the single-program kernel (ties kept by position across slices), on
    ragged ranges, empty ones (hi <= lo), budgets of 0 and above the live length,
    lengths not a multiple of the block."""
    gen = torch.Generator().manual_seed(splits * 100 + block_n)
    r, h, n, k_max = 5, 2, 203, 48  # rows 0-4, the first `rows` of them
    s = _case(gen, r, h, n, ints, holes)
    lo = torch.tensor([0, 9, 30, 3, 0], dtype=torch.int32)
    hi = torch.tensor([n, 190, 30, 1, 57], dtype=torch.int32)  # rows 2, 3: empty
    budget = torch.tensor([48, 10 ** 6, 5, 7, 0], dtype=torch.int32)
    if ints:
        budget[4] = 60  # above the live length 57
    s, lo, hi, budget = s[:rows], lo[:rows], hi[:rows], budget[:rows]
    one = topk_range(s, lo, hi, budget, k_max, block_n=block_n, splits=1)
    got = topk_range(s, lo, hi, budget, k_max, block_n=block_n, splits=splits)
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
    _check(s, lo, hi, budget, k_max, *got)


def _digits_case(gen, kind: str, r: int, h: int, n: int) -> torch.Tensor:
    """Scores for the small/8-bit digit A/B: ``kind`` picks what the cutoff meets."""
    if kind in ("normal", "ints", "holes"):
        return _case(gen, r, h, n, ints=kind == "ints", holes=0.3 if kind == "holes" else 0.0)
    if kind == "equal":  # every score tied, in every row
        return torch.full((r, h, n), 1.5)
    if kind == "zeros":  # mostly -0.0 and +0.0 (they tie), a few +-1
        vals = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 1.0, -1.0])
        return vals[torch.randint(0, len(vals), (r, h, n), generator=gen)]
    assert kind == "extremes"  # 2^e for e in [-149, 127] (denormals to near fp32 max), both signs
    e = torch.randint(-149, 128, (r, h, n), generator=gen).double()
    m = 1.0 + torch.rand(r, h, n, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(r, h, n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * m * torch.exp2(e)).clamp(-3.4e38, 3.4e38).float()


@pytest.mark.parametrize("kind", ["normal", "ints", "holes", "equal", "zeros", "extremes"])
@pytest.mark.parametrize("launch", [dict(one_block=True), dict(one_block=False, splits=1, block_n=16),
                                    dict(one_block=False, splits=1, block_n=32),
                                    dict(one_block=False, splits=1, block_n=256)])
def test_topk_small_digits_are_bit_identical(kind, launch):
    """The select on 6-bit digits over the row (small_digits=True) against
    the 8-bit one (small_digits=False, the kernels before): the same positions, order
    and counts, on both kernels; N = 150 is no multiple of the block. Rows: the whole
    range, a budget above the live length, an empty range, hi < lo, a budget of 0, and
    a live length (40) below both the budget and k_max."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)) + launch.get("block_n", 0))
    r, h, n, k_max = 6, 2, 150, 48
    s = _digits_case(gen, kind, r, h, n)
    lo = torch.tensor([0, 9, 30, 50, 0, 100], dtype=torch.int32)
    hi = torch.tensor([n, 131, 30, 3, n, 140], dtype=torch.int32)
    budget = torch.tensor([k_max, 10 ** 6, 5, 7, 0, 60], dtype=torch.int32)
    small = topk_range(s, lo, hi, budget, k_max, small_digits=True, **launch)
    wide = topk_range(s, lo, hi, budget, k_max, small_digits=False, **launch)
    assert torch.equal(small[0], wide[0]) and torch.equal(small[1], wide[1])
    _check(s, lo, hi, budget, k_max, *small)
    assert not small[1][2:5].any()  # empty ranges, budget 0: nothing selected


@triton.jit
def _top_digit_hist_kernel(S, LO, HI, H, N, stride_r, stride_h, BLOCK_N: tl.constexpr):
    """The select's first pass as _topk_range_kernel runs it (the range clipped as
    topk_bounds clips it), its 64 bins stored: what h_top must hold."""
    cur_r = tl.program_id(0)
    cur_h = tl.program_id(1)
    lo = tl.maximum(tl.load(LO + cur_r), 0)
    hi = tl.minimum(tl.load(HI + cur_r), N)
    row = S + cur_r * stride_r + cur_h * stride_h
    h = digit_hist(row, lo, hi, 0.0, 0, 26, 6, 2, False, BLOCK_N)
    tl.store(H + (cur_r * tl.num_programs(1) + cur_h) * 64 + tl.arange(0, 64), h)


@pytest.mark.parametrize("kind", ["normal", "ints", "holes", "equal", "zeros", "extremes"])
def test_top_digit_hist_ref_matches_digit_hist(kind):
    """top_digit_hist_ref (torch) against the kernel's own first pass (digit_hist with
    6-bit digits at bit 26, KEY_DESC): the same 64 counts, on ragged ranges, lo < 0,
    hi > N, empty ranges, and non-finite scores (never counted)."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    r, h, n = 6, 3, 150
    s = _digits_case(gen, kind, r, h, n)
    s[0, 0, 3:9] = torch.tensor([float("nan"), float("inf"), float("-inf"), -float("nan"), 0.0, -0.0])
    lo = torch.tensor([0, -5, 30, 50, 149, 7], dtype=torch.int32)
    hi = torch.tensor([n, 131, 30, 3, n + 9, 8], dtype=torch.int32)
    got = torch.zeros(r, h, 64, dtype=torch.int32)
    _top_digit_hist_kernel[(r, h)](s, lo, hi, got, n, s.stride(0), s.stride(1), BLOCK_N=32)
    want = top_digit_hist_ref(s, lo, hi)
    assert torch.equal(got, want)
    finite = torch.isfinite(s)
    assert int(want[0].sum()) == int(finite[0].sum())  # every finite score counted once, no other
    assert not want[2:4].any()  # empty ranges


@pytest.mark.parametrize("launch", [dict(one_block=True), dict(one_block=True, small_digits=False),
                                    dict(one_block=False, splits=1, block_n=16),
                                    dict(one_block=False, splits=1, block_n=32, small_digits=False),
                                    dict(one_block=False, splits=1, block_n=16, gather=False),
                                    dict(one_block=False, splits=3, block_n=16), "htop"])
def test_topk_budget_keeping_every_finite_score(launch):
    """Rows mostly -inf (lfps's priorities: its C1 is a few % of the context) whose
    budget keeps every finite score (k = F: no select, the compaction keeps them all),
    beside rows where it does not (F one above the budget, far above it) and rows with
    no finite score: on every launch path, every finite position in range, ascending,
    and the reference's counts; the others as the reference."""
    gen = torch.Generator().manual_seed(7)
    r, h, n, k_max = 6, 3, 300, 64
    s = torch.randn(r, h, n, generator=gen) * 10.0
    live = torch.rand(r, h, n, generator=gen)
    finite = torch.tensor([[5, 40, 0], [64, 63, 1], [65, 200, 12], [30, 30, 30], [0, 0, 0], [64, 64, 64]])
    for i in range(r):
        for j in range(h):
            keep = torch.zeros(n, dtype=torch.bool)
            keep[torch.argsort(live[i, j])[: int(finite[i, j])]] = True
            s[i, j] = torch.where(keep, s[i, j], float("-inf"))
    s[3, 1, 7] = float("nan")  # non-finite holes besides -inf stay out
    s[3, 2, 9] = float("inf")
    lo = torch.zeros(r, dtype=torch.int32)
    hi = torch.full((r,), n, dtype=torch.int32)
    budget = torch.tensor([64, 64, 64, 10 ** 6, 64, 64], dtype=torch.int32)
    if launch == "htop":
        h_top, _ = _htop_strided(top_digit_hist_ref(s, lo, hi))
        pos, cnt = topk_range(s, lo, hi, budget, k_max, h_top=h_top, block_n=16)
    else:
        pos, cnt = topk_range(s, lo, hi, budget, k_max, **launch)
    _check(s, lo, hi, budget, k_max, pos, cnt)
    for i in range(r):
        for j in range(h):
            f = torch.isfinite(s[i, j]).nonzero().flatten()
            if len(f) <= min(int(budget[i]), k_max):  # every finite score kept, in order
                assert int(cnt[i, j]) == len(f) and torch.equal(pos[i, j, : len(f)].long(), f), (i, j)
    assert int(cnt[2, 0]) == 64 and int(cnt[2, 1]) == 64  # F above the budget: the select's 64


@pytest.mark.parametrize("launch", [dict(one_block=True), dict(one_block=False, splits=1, block_n=16),
                                    dict(one_block=False, splits=3, block_n=16)])
def test_topk_skip_leaves_rows_alone(launch):
    """skip (lfps's priorities list the rows whose C1 fits the budget themselves): a
    skipped (row, head) keeps its out and out_len as they were, on every path (the
    split one in all four phases); the others are as without skip, empty rows and
    budgets included."""
    gen = torch.Generator().manual_seed(11)
    r, h, n, k_max = 5, 3, 200, 32
    s = torch.randn(r, h, n, generator=gen)
    s[:, 1] = torch.where(torch.rand(r, n, generator=gen) < 0.1, s[:, 1], float("-inf"))
    lo = torch.tensor([0, 3, 50, 0, 7], dtype=torch.int32)
    hi = torch.tensor([200, 150, 50, 190, 180], dtype=torch.int32)  # row 2: empty
    budget = torch.tensor([32, 10, 32, 0, 500], dtype=torch.int32)  # row 3: none
    skip = torch.zeros(r, h, dtype=torch.int32)
    skip[0, 0] = skip[1, 2] = skip[2, 1] = skip[3, 0] = skip[4, 1] = 1
    want_pos, want_cnt = topk_range(s, lo, hi, budget, k_max, **launch)
    pos = torch.full((r, h, k_max), -5, dtype=torch.int32)
    cnt = torch.full((r, h), -6, dtype=torch.int32)
    pos, cnt = topk_range(s, lo, hi, budget, k_max, out=pos, out_len=cnt, skip=skip, **launch)
    on = skip == 0
    assert (pos[~on] == -5).all() and (cnt[~on] == -6).all()
    assert torch.equal(cnt[on], want_cnt[on])
    for i, j in on.nonzero().tolist():
        c = int(want_cnt[i, j])
        assert torch.equal(pos[i, j, :c], want_pos[i, j, :c]) and (pos[i, j, c:] == -5).all(), (i, j)
    with pytest.raises(AssertionError, match="skip"):
        topk_range(s, lo, hi, budget, k_max, skip=skip[:, :2].contiguous(), **launch)


def test_topk_scratch_given_is_the_same_select():
    """scratch (asyncspade's cache device preallocates it: a graph captured on another
    device allocates from that device's pool only): a caller's scratch, strided and
    dirty, gives the block-walking kernel's output bit for bit; a wrong one asserts."""
    gen = torch.Generator().manual_seed(5)
    r, h, n, k_max = 4, 3, 300, 24
    s = _case(gen, r, h, n, ints=True, holes=0.1)
    lo, hi, budget = _ragged_ranges(gen, r, n, k_max)
    launch = dict(block_n=32)  # the block-walking kernel, gather: the path that takes a scratch
    want_pos, want_cnt = topk_range(s, lo, hi, budget, k_max, **launch)
    scratch = torch.full((h, r, n + 7), float("nan")).transpose(0, 1)[..., :n]  # strided rows and heads
    pos, cnt = topk_range(s, lo, hi, budget, k_max, scratch=scratch, **launch)
    assert torch.equal(pos, want_pos) and torch.equal(cnt, want_cnt)
    _check(s, lo, hi, budget, k_max, pos, cnt)
    with pytest.raises(AssertionError, match="scratch"):
        topk_range(s, lo, hi, budget, k_max, scratch=torch.empty(r, h, n - 1), **launch)
    with pytest.raises(AssertionError, match="scratch"):
        topk_range(s, lo, hi, budget, k_max, scratch=torch.empty(r, h, n, dtype=torch.float64), **launch)


def _htop_strided(want: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h_top, its buffer): strided rows and heads, a [H, R, 80] buffer seen as [R, H, 64]."""
    r, h, _ = want.shape
    buf = torch.full((h, r, 80), -1, dtype=torch.int32)
    t = buf.transpose(0, 1)[..., :64]
    t.copy_(want)
    return t, buf


@pytest.mark.parametrize("kind", ["normal", "ints", "holes", "equal", "zeros", "extremes"])
@pytest.mark.parametrize("launch", [dict(block_n=16), dict(block_n=32), dict(block_n=256), dict()])
def test_topk_htop_is_bit_identical(kind, launch):
    """h_top from the producer (here its torch reference) instead of the kernel's first
    pass: the same positions, order and counts as without it, the reference's counts
    and kept values, and h_top all zeros after the call -- the bins of the (row, head)s
    the kernel does not read (empty ranges, budget 0) too. Rows as in
    test_topk_small_digits_are_bit_identical (N = 150: no multiple of the block);
    ``launch={}``: N fits one block, but h_top takes the block-walking kernel."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)) + launch.get("block_n", 0))
    r, h, n, k_max = 6, 2, 150, 48
    s = _digits_case(gen, kind, r, h, n)
    lo = torch.tensor([0, 9, 30, 50, 0, 100], dtype=torch.int32)
    hi = torch.tensor([n, 131, 30, 3, n, 140], dtype=torch.int32)
    budget = torch.tensor([k_max, 10 ** 6, 5, 7, 0, 60], dtype=torch.int32)
    want = topk_range(s, lo, hi, budget, k_max, small_digits=True, one_block=False, splits=1,
                      block_n=launch.get("block_n"))
    h_top, buf = _htop_strided(top_digit_hist_ref(s, lo, hi))
    h_top[2:5] = 7  # not read: an empty range, hi < lo, budget 0 (a producer may count them anyway)
    got = topk_range(s, lo, hi, budget, k_max, h_top=h_top, **launch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check(s, lo, hi, budget, k_max, *got)
    assert not h_top.any()  # zeroed for the producer's next step
    assert bool((buf[..., 64:] == -1).all())  # nothing past the 64 bins


@pytest.mark.parametrize("r,h,n,k_max,ints,holes", [
    (3, 8, 150, 40, False, 0.2),
    (4, 8, 150, 200, True, 0.1),  # k_max above the live length
    (2, 3, 2100, 700, False, 0.05),  # several blocks, N not a multiple of the block
    (3, 2, 70, 100, False, 0.9),  # mostly non-finite: fewer finite scores than the budget
])
def test_topk_htop_matches_torch(r, h, n, k_max, ints, holes):
    """As test_topk_range_matches_torch, with h_top: ragged ranges, an empty one, hi < lo,
    budget 0 and above the live length, -inf / NaN / +inf inside the range, ties; the
    same output as the kernel without h_top, h_top zeroed, and a second step with the
    producer's histogram of new scores accumulated into the zeroed h_top."""
    gen = torch.Generator().manual_seed(r * 1000 + n + k_max)
    lo, hi, budget = _ragged_ranges(gen, r, n, k_max)
    h_top = torch.zeros(r, h, 64, dtype=torch.int32)
    for step in range(2):
        s = _case(gen, r, h, n, ints, holes)
        s[-1, 0] = float("-inf")  # a (row, head) without a finite score
        h_top += top_digit_hist_ref(s, lo, hi)  # the producer accumulates into the bins the last call zeroed
        want = topk_range(s, lo, hi, budget, k_max, block_n=256, splits=1, one_block=False, small_digits=True)
        got = topk_range(s, lo, hi, budget, k_max, block_n=256, h_top=h_top)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        _check(s, lo, hi, budget, k_max, *got)
        assert not h_top.any() and int(got[1][-1, 0]) == 0


def test_topk_htop_wrong_histogram_stays_in_bounds():
    """A histogram that does not match the scores (a producer's bug) gives a wrong
    output, but never more than k_max positions, in range: the writes are capped at k."""
    gen = torch.Generator().manual_seed(11)
    r, h, n, k_max = 3, 2, 150, 20
    s = _case(gen, r, h, n, ints=True)
    lo = torch.tensor([0, 10, 40], dtype=torch.int32)
    hi = torch.tensor([n, 140, 100], dtype=torch.int32)
    budget = torch.tensor([20, 15, 1000], dtype=torch.int32)
    right = top_digit_hist_ref(s, lo, hi)
    for wrong in (right.roll(1, -1), right.roll(-3, -1), 2 * right, right * 0, right + 100):
        buf = torch.full((r, h, k_max + 64), -7, dtype=torch.int32)
        pos, cnt = topk_range(s, lo, hi, budget, k_max, block_n=32, out=buf[..., :k_max], h_top=wrong.clone())
        assert bool((buf[..., k_max:] == -7).all())
        assert bool((cnt >= 0).all() and (cnt <= k_max).all())
        assert bool(((pos == -7) | ((pos >= 0) & (pos < n))).all())


def test_topk_htop_only_on_its_path(monkeypatch):
    """h_top applies to the block-walking kernel on 6-bit digits with gather, unsplit: a
    call asking for another path asserts instead of ignoring it; a bad h_top asserts;
    small_digits=None takes 6-bit digits with it even where SMALL_DIGITS is off."""
    import importlib

    T = importlib.import_module("sgl_sparse.kernels.topk_range")
    s = torch.randn(2, 2, 50)
    lo, hi = torch.zeros(2, dtype=torch.int32), torch.full((2,), 50, dtype=torch.int32)
    budget = torch.full((2,), 5, dtype=torch.int32)
    h_top = top_digit_hist_ref(s, lo, hi)
    for kw, msg in ((dict(one_block=True), "one_block"), (dict(splits=2), "splits"), (dict(gather=False), "gather"),
                    (dict(small_digits=False), "small_digits")):
        with pytest.raises(AssertionError, match=msg):
            topk_range(s, lo, hi, budget, 8, h_top=h_top.clone(), **kw)
    for bad in (h_top[:1], h_top.long(), h_top[..., :32], h_top.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(AssertionError, match="h_top"):
            topk_range(s, lo, hi, budget, 8, h_top=bad)
    want = topk_range(s, lo, hi, budget, 8, one_block=False, splits=1, small_digits=True)
    got = topk_range(s, lo, hi, budget, 8, h_top=h_top, one_block=False, splits=1, small_digits=True, gather=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not h_top.any()
    monkeypatch.setattr(T, "SMALL_DIGITS", False)
    got = topk_range(s, lo, hi, budget, 8, h_top=top_digit_hist_ref(s, lo, hi))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_topk_small_digits_default_and_switch(monkeypatch):
    """small_digits=None takes the module's SMALL_DIGITS (SGLANG_SPARSE_TOPK_SMALL_DIGITS,
    on by default since an H200 timed it), in both kernels."""
    import importlib

    from sgl_sparse.kernels._utils import env_switch

    T = importlib.import_module("sgl_sparse.kernels.topk_range")  # the package exports the function
    assert T.SMALL_DIGITS is env_switch("TOPK_SMALL_DIGITS", True)  # on unless the operator says 0
    gen = torch.Generator().manual_seed(5)
    s = _case(gen, 2, 2, 150, ints=True)
    lo, hi = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([150, 101], dtype=torch.int32)
    budget = torch.tensor([30, 70], dtype=torch.int32)
    want = topk_range(s, lo, hi, budget, 64, block_n=32, splits=1, small_digits=False)
    for default in (True, False):
        monkeypatch.setattr(T, "SMALL_DIGITS", default)
        for launch in (dict(block_n=32, splits=1), dict()):  # the block-walking kernel, the register row
            got = topk_range(s, lo, hi, budget, 64, **launch)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (default, launch)


def test_topk_range_split_count():
    from sgl_sparse.kernels._split import STATS_RULE, TOPK_RULE, split_count

    cpu = torch.device("cpu")  # 4 pretend SMs: 32 top-k programs, 64 stats programs
    assert split_count(300, 8, cpu, TOPK_RULE) == 1  # short rows
    assert split_count(1 << 15, 8, cpu, TOPK_RULE) == 4  # capped at the rule's max
    assert split_count(1 << 15, 16, cpu, TOPK_RULE) == 2
    assert split_count(1 << 15, 17, cpu, TOPK_RULE) == 1  # fewer than min_splits slices: not worth it
    assert split_count(1 << 15, 4096, cpu, TOPK_RULE) == 1  # many rows
    assert split_count(1 << 15, 16, cpu, STATS_RULE) == 4
    assert split_count(1 << 15, 32, cpu, STATS_RULE) == 2  # the 32768 x 8 refresh's chunk (1024 programs / 132 SMs)
    assert split_count(1 << 15, 33, cpu, STATS_RULE) == 1  # 1 < STATS_RULE.min_splits
    assert split_count(1 << 20, 1, cpu, STATS_RULE) == 32  # capped
    assert split_count(1 << 15, 1, cpu, STATS_RULE) == 8  # slices of at least MIN_SLICE


def test_topk_range_launch_shape():
    """By the programs per SM, and blocks no wider than the row."""
    from sgl_sparse.kernels.topk_range import LAUNCH_SHAPES, launch_shape

    cpu = torch.device("cpu")  # 4 pretend SMs
    assert launch_shape(2, cpu, 1 << 15) == LAUNCH_SHAPES[0]  # few programs over long rows: the widest
    assert launch_shape(2, cpu, 2064) == (2048, 8)  # quest's pages: not a half-masked 4096-block
    assert launch_shape(2, cpu, 300) == LAUNCH_SHAPES[-1]
    assert launch_shape(12, cpu, 1 << 15) == LAUNCH_SHAPES[1]
    assert launch_shape(64, cpu, 1 << 15) == LAUNCH_SHAPES[2]


def test_topk_range_edge_values():
    """-0 and +0 tie, very large / tiny magnitudes of both signs, all-non-finite rows,
    strided rows, and a given `out` keeping its entries past the count."""
    vals = torch.tensor([0.0, -0.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 1.0, -1.0, 0.0, -0.0, 2.0, float("-inf"),
                         float("nan"), float("inf"), -2.0, 1e-30])
    n = vals.numel()
    big = torch.stack([vals, vals.flip(0), torch.full((n,), float("-inf")), vals.roll(5)]).view(4, 1, n)
    s = torch.cat([big, big * 0.5], dim=1)[:, :, :]  # [4, 2, n]
    s = torch.cat([s, torch.zeros(4, 2, 3)], dim=2)[:, :, :n]  # strided rows (stride n + 3)
    assert s.stride(1) == n + 3
    lo = torch.tensor([0, 2, 0, 1], dtype=torch.int32)
    hi = torch.full((4,), n, dtype=torch.int32)
    for budget_v in (1, 5, 9, 13, 16):
        budget = torch.full((4,), budget_v, dtype=torch.int32)
        pos, cnt = topk_range(s, lo, hi, budget, 12)
        _check(s, lo, hi, budget, 12, pos, cnt)
    out = torch.full((4, 2, 12), -7, dtype=torch.int32)
    pos, cnt = topk_range(s, lo, hi, torch.full((4,), 3, dtype=torch.int32), 12, out=out)
    assert pos is out and bool((out[..., 3:] == -7).all()) and bool((cnt[2] == 0).all())


def test_topk_range_matches_asyncspade_select_topk():
    """asyncspade.select_topk (the torch path's token Top-K) on scores finite exactly on
    [sink, hi): the same positions and counts (random scores: no ties)."""
    from sgl_sparse.queryaware.asyncspade import select_topk

    gen = torch.Generator().manual_seed(3)
    r, h, n, k_max = 4, 2, 90, 24
    lo = torch.tensor([2, 0, 5, 3], dtype=torch.int32)
    hi = torch.tensor([80, 0, 30, 90], dtype=torch.int32)
    live = (torch.arange(n) >= lo[:, None]) & (torch.arange(n) < hi[:, None])
    s = torch.randn(r, h, n, generator=gen).masked_fill(~live[:, None, :], float("-inf"))
    budget = torch.tensor([24, 10, 40, 7], dtype=torch.int32)
    ref_pos, ref_cnt = select_topk(s, budget, k_max)
    pos, cnt = topk_range(s, lo, hi, budget, k_max)
    assert torch.equal(cnt, ref_cnt) and torch.equal(pos, ref_pos)


def test_topk_range_empty_rows_and_shapes():
    s = torch.randn(3, 2, 50)
    z = torch.zeros(3, dtype=torch.int32)
    pos, cnt = topk_range(s, z, z, torch.full((3,), 9, dtype=torch.int32), 4)
    assert not cnt.any() and not pos.any()
    with pytest.raises(AssertionError):
        topk_range(s.double(), z, z, z, 4)
    with pytest.raises(AssertionError):
        topk_range(s, z.long(), z, z, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k_max", [(40960, 2048), (32768, 2048), (4096, 257)])
def test_topk_range_gpu(n, k_max):
    """Serving sizes: 8 slots x 8 KV heads, half of them empty, ragged live lengths."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    r, h = 8, 8
    s = torch.randn(r, h, n, generator=gen, device=dev)
    lo = torch.tensor([4, 0, 4, 0, 2, 0, 0, 4], dtype=torch.int32, device=dev)
    hi = torch.tensor([n - 256, 0, n // 3, 0, 1000, 0, n, 0], dtype=torch.int32, device=dev)
    budget = torch.tensor([k_max, 5, k_max // 2, 0, 2 * k_max, k_max, 1, k_max], dtype=torch.int32, device=dev)
    s[:, :, :: 7] = torch.round(s[:, :, :: 7])  # some ties
    from sgl_sparse.kernels._split import TOPK_RULE, split_count

    for splits in (1, max(2, split_count(n, r * h, dev, TOPK_RULE))):  # the single-program and the split kernel
        pos, cnt = topk_range(s, lo, hi, budget, k_max, splits=splits)
        _check(s.cpu(), lo.cpu(), hi.cpu(), budget.cpu(), k_max, pos.cpu(), cnt.cpu())


def _compile_topk(kernel: str, const: dict, module: str = "sgl_sparse.kernels.topk_range", **kw) -> dict:
    """compile_sm90 of a topk_range (or topk_split) kernel (pointers 16-aligned, as launched)."""
    import importlib

    from sgl_sparse.kernels.testing import compile_sm90

    fn = getattr(importlib.import_module(module), kernel)  # the package exports the function
    const = {"HAS_SKIP": False, **const}
    ptrs = {"S": "*fp32", "SCR": "*fp32", "LO": "*i32", "HI": "*i32", "BUDGET": "*i32", "OUT": "*i32",
            "OUT_LEN": "*i32", "HTOP": "*i32", "HIST": "*i32", "SKIP": "*i32"}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    return compile_sm90(module, kernel, sig, const, [n for n in fn.arg_names if n in ptrs], **kw)


@pytest.mark.parametrize("small_digits", [True, False])
@pytest.mark.parametrize("kernel, const", [
    ("_topk_row_kernel", dict(BLOCK_N=8192)),  # quest's pages at 128K tokens
    ("_topk_row_kernel", dict(BLOCK_N=1024)),
    ("_topk_range_kernel", dict(BLOCK_N=2048, GATHER=True, HAS_HTOP=False)),
    ("_topk_range_kernel", dict(BLOCK_N=2048, GATHER=True, HAS_HTOP=False, HAS_SKIP=True)),  # lfps's C1
])
def test_topk_kernels_compile_for_sm90(kernel, const, small_digits):
    """Triton's compiler, not only the interpreter, takes the Top-K kernels (no GPU
    needed): a constexpr reassigned in a static_range loop ran in the interpreter and
    failed the H100's compile in session 18; the register-row kernel's histogram
    passes were refactored after its last GPU run."""
    counts = _compile_topk(kernel, dict(const, SMALL_DIGITS=small_digits))
    assert any(k.startswith("st.global") for k in counts), counts  # it stores positions


def test_topk_htop_kernel_compiles_for_sm90():
    """With h_top the compiled kernel has one histogram loop (a loop with ballots) fewer
    than without: the first pass over the row is gone, the rest as before; it loads the
    64 bins and stores them back zeroed (asyncspade's launch: 1024-blocks, 4 warps)."""
    const = dict(BLOCK_N=1024, GATHER=True, SMALL_DIGITS=True)
    got = {has: _compile_topk("_topk_range_kernel", dict(const, HAS_HTOP=has), options={"num_warps": 4},
                              keep_ptx=True) for has in (False, True)}
    hist_loops = {has: [b for b in _loop_bodies(got[has]["ptx"]) if b[1]] for has in (False, True)}
    assert len(hist_loops[True]) == len(hist_loops[False]) - 1, hist_loops
    assert hist_loops[True] == hist_loops[False][1:]  # the others unchanged
    st = lambda c: sum(v for k, v in c.items() if k.startswith("st.global"))  # noqa: E731
    assert st(got[True]) > st(got[False])


def _loop_bodies(ptx: str) -> List[Tuple[int, int]]:
    """(instructions, ballots) of each loop of the PTX in program order: the lines
    from a label to a branch back to it."""
    lines = [line.strip() for line in ptx.splitlines()]
    at, loops = {}, []
    for i, line in enumerate(lines):
        label = re.match(r"(\$L__BB\d+_\d+):", line)
        back = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if label:
            at[label[1]] = i
        elif back and back[1] in at:
            body = [x for x in lines[at[back[1]]:i + 1] if x.endswith(";")]
            loops.append((len(body), sum("vote.sync.ballot" in x for x in body)))
    return loops


def test_topk_small_digits_cost_fewer_instructions():
    """The premise of small_digits, on sm_90 PTX (asyncspade's launch: 1024-blocks, 4
    warps, gather on). tl.histogram takes a ballot per bin-index bit per value, then
    each lane ANDs those into the indicator of every bin it owns and popcounts it:
    per value ~log2(bins) ballots and (bins / 32) x log2(bins) ANDs. So each pass over
    the whole row (the top two digits' histograms) costs fewer ballots and fewer
    instructions on 64 bins than on 256, and the kernel's popcounts drop. (Summed over
    every pass the ballots do not drop: one per key bit per value either way.)"""
    const = dict(BLOCK_N=1024, GATHER=True, HAS_HTOP=False)
    ptx = {sd: _compile_topk("_topk_range_kernel", dict(const, SMALL_DIGITS=sd), options={"num_warps": 4},
                             patterns=[r"\bpopc\."], keep_ptx=True) for sd in (False, True)}
    # the first two histogram loops walk [lo, hi); then the gather, the survivors' passes, the compaction
    wide, small = ([b for b in _loop_bodies(ptx[sd]["ptx"]) if b[1]][:2] for sd in (False, True))
    assert len(wide) == len(small) == 2
    for (i_wide, b_wide), (i_small, b_small) in zip(wide, small):
        assert b_small < b_wide and i_small < 0.8 * i_wide, (wide, small)  # 64 -> 48 ballots, ~800 -> ~570
    assert ptx[True][r"\bpopc\."] < ptx[False][r"\bpopc\."]  # 259 -> 115 (triton 3.7)


def test_takes_htop_where_the_defaults_take_its_kernel(monkeypatch):
    """takes_htop: a producer counts h_top only for calls whose defaults run the
    block-walking kernel on 6-bit digits unsplit (where h_top would force that kernel
    on a call that takes another, it says no)."""
    import importlib

    T = importlib.import_module("sgl_sparse.kernels.topk_range")
    cpu = torch.device("cpu")  # 4 fake SMs
    assert T.takes_htop(32768, 64, cpu)  # many programs: unsplit, rows past the register row
    assert not T.takes_htop(32768, 2, cpu)  # few long rows: split
    assert not T.takes_htop(160, 64, cpu) and T.takes_htop(160, 64, cpu, one_block=False)  # a register row
    assert not T.takes_htop(0, 64, cpu)
    monkeypatch.setattr(T, "SMALL_DIGITS", False)
    assert not T.takes_htop(32768, 64, cpu)  # 8-bit digits asked for


@pytest.mark.parametrize("phase", [0, 3])
def test_topk_split_kernel_with_skip_compiles_for_sm90(phase):
    """The split kernel's phases with ``skip`` (lfps's C1 Top-K over 64 rows of 33792)
    compile for sm_90."""
    got = _compile_topk("_topk_split_kernel", dict(PHASE=phase, BLOCK_N=1024, HAS_SKIP=True),
                        module="sgl_sparse.kernels.topk_split", options={"num_warps": 4})
    assert got.get("ld.global.b32", 0) + got.get("ld.global.v4.b32", 0) > 0, got
