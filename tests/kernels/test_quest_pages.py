"""Tests for kernels.quest_pages against float64 / plain-PyTorch references.

Under the Triton interpreter at small shapes (pages of 16 positions, a few
dozen pages). Bounds are min/max of values of the KV dtype, so they must match
the reference *exactly*; page scores are sums of exact products in fp32 and
must match the float64 formula to fp32 rounding. Every test draws fresh random
data and pre-fills outputs with garbage that a correct kernel overwrites or
(outside the documented range) leaves alone.
"""

import random

import pytest
import torch

from sgl_sparse import kernels as K
from sgl_sparse.kernels import testing as T

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = K.QUEST_PAGE_SIZE


def _pool_case(seq_lens, *, num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16, seed=0):
    """k_pool / req_to_token / req_pool_idx (and q) of random requests of these lengths."""
    n = len(seq_lens)
    return T.make_decode_case(
        seq_lens, [0] * n, [(0, s) for s in seq_lens], num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, cap=1, dtype=dtype, device=DEVICE, seed=seed,
    )


def _garbage_store(slots, num_kv_heads, max_pages, head_dim, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kmin = torch.randn(slots, num_kv_heads, max_pages, head_dim, generator=g, device=DEVICE).to(dtype)
    kmax = torch.randn(slots, num_kv_heads, max_pages, head_dim, generator=g, device=DEVICE).to(dtype)
    return kmin, kmax


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bounds_update_exact(dtype):
    """Whole pages covering [lo, hi): a prefix from 0, a chunk starting mid-page
    and ending mid-page, an empty range, a slot < 0 row, and a range running past
    max_pages (capped)."""
    seq_lens = [75, 130, 40, 60, 200]
    case = _pool_case(seq_lens, dtype=dtype, seed=1)
    max_pages = 10  # row 4 (200 positions = 13 pages) is capped at 10
    kmin, kmax = _garbage_store(6, 2, max_pages, 64, dtype, seed=2)
    slot = torch.tensor([3, 0, 5, -1, 1], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([0, 37, 20, 0, 0], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([75, 101, 20, 60, 200], dtype=torch.int32, device=DEVICE)
    args = (case.k_pool, case.req_to_token, case.req_pool_idx, slot, lo, hi)
    ref_min, ref_max = kmin.clone(), kmax.clone()
    K.quest_bounds_ref(*args, ref_min, ref_max)
    K.quest_bounds_update(*args, kmin, kmax, num_programs=2, block_p=2)
    assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max)
    # The reference itself: page 2 of row 1 (positions 32..47, lo = 37) is the
    # min over all 16 keys, including those before lo.
    toks = case.req_to_token[int(case.req_pool_idx[1]), 32:48].long()
    assert torch.equal(kmin[0, :, 2], case.k_pool[toks].amin(0))


def test_bounds_decode_steps():
    """Decode steps crossing page boundaries == bounds rebuilt from scratch.

    The page a step opens holds garbage of an earlier request: it must be reset,
    not min/max-ed with it. A slot < 0 row is never touched."""
    n0, steps = 29, 22  # positions 29..50: finishes page 1, fills page 2, opens page 3
    case = _pool_case([n0 + steps, n0 + steps + 7], dtype=torch.bfloat16, seed=3)
    kmin, kmax = _garbage_store(3, 2, 5, 64, torch.bfloat16, seed=4)
    slot = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    untouched = (kmin[1].clone(), kmax[1].clone(), kmin[0].clone())
    pool = (case.k_pool, case.req_to_token, case.req_pool_idx, slot)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    K.quest_bounds_update(*pool, zero, torch.full_like(zero, n0), kmin, kmax)
    for n in range(n0 + 1, n0 + steps + 1):
        K.quest_bounds_decode(*pool, torch.tensor([n, n + 7], dtype=torch.int32, device=DEVICE), kmin, kmax)
        if n in (n0 + 3, n0 + steps):
            ref_min, ref_max = kmin.clone(), kmax.clone()
            ref_min[2], ref_max[2] = kmin[2].neg(), kmax[2].neg()  # the reference must rebuild every page
            K.quest_bounds_ref(*pool, zero, torch.full_like(zero, n), ref_min, ref_max)
            used = -(-n // PAGE)
            assert torch.equal(kmin[2, :, :used], ref_min[2, :, :used])
            assert torch.equal(kmax[2, :, :used], ref_max[2, :, :used])
    assert torch.equal(kmin[1], untouched[0]) and torch.equal(kmax[1], untouched[1])
    assert torch.equal(kmin[0], untouched[2])


SCORE_CONFIGS = [(dtype, group) for dtype in (torch.bfloat16, torch.float16) for group in (1, 4, 8)]


@pytest.mark.parametrize("idx", range(len(SCORE_CONFIGS)))
def test_page_scores_vs_float64(idx):
    dtype, group = SCORE_CONFIGS[idx]
    bs, num_kv_heads, max_pages, d = 4, 2, 70, 64  # 70: not a multiple of the 16/64 page blocks
    g = torch.Generator(device=DEVICE).manual_seed(100 + idx)
    q = torch.randn(bs, num_kv_heads * group, d, generator=g, device=DEVICE).to(dtype)
    a = torch.randn(5, num_kv_heads, max_pages, d, generator=g, device=DEVICE)
    b = torch.randn(5, num_kv_heads, max_pages, d, generator=g, device=DEVICE)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    slot = torch.tensor([4, 0, -1, 2], dtype=torch.int32, device=DEVICE)
    first = torch.tensor([1, 0, 0, 30], dtype=torch.int32, device=DEVICE)
    last = torch.tensor([69, 70, 50, 30], dtype=torch.int32, device=DEVICE)  # row 3: empty range
    out = torch.full((bs, num_kv_heads, max_pages), float("nan"), device=DEVICE)
    s = K.quest_page_scores(q, kmin, kmax, slot, first, last, out=out, block_p=16)
    ref = K.quest_page_scores_ref(q, kmin, kmax, slot, first, last)
    assert not torch.isnan(s).any()
    assert torch.equal(torch.isneginf(s), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert fin.sum() == 2 * (68 + 70)
    torch.testing.assert_close(s[fin], ref[fin], rtol=1e-5, atol=1e-4)
    if idx == 0:  # fill=False: [first, last) of the live rows only, the same values there
        out.fill_(float("nan"))
        s2 = K.quest_page_scores(q, kmin, kmax, slot, first, last, out=out, block_p=16, fill=False)
        pos = torch.arange(max_pages, device=DEVICE)
        live = ((pos >= first[:, None]) & (pos < last[:, None]) & (slot[:, None] >= 0))[:, None, :].expand_as(s2)
        assert torch.equal(s2[live], s[live])  # outside: -inf in the page blocks overlapping the range, or unwritten
        assert (torch.isnan(s2[~live]) | torch.isneginf(s2[~live])).all()
        assert torch.isnan(s2[2]).all() and torch.isnan(s2[3]).all()  # no slot; an empty range


def test_page_scores_bound_real_logits():
    """On bounds built from real keys, every page score >= every logit of the group
    on that page (Quest's guarantee), with the default tiling."""
    n = 90
    case = _pool_case([n, 57], group=4, dtype=torch.float16, seed=7)
    kmin, kmax = _garbage_store(2, 2, 8, 64, torch.float16, seed=8)
    slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    K.quest_bounds_update(case.k_pool, case.req_to_token, case.req_pool_idx, slot, zero, case.seq_lens, kmin, kmax)
    last = torch.tensor([5, 3], dtype=torch.int32, device=DEVICE)  # whole pages only (90, 57 keys)
    s = K.quest_page_scores(case.q, kmin, kmax, slot, zero, last)
    for b, npages in enumerate(last.tolist()):
        toks = case.req_to_token[int(case.req_pool_idx[b]), : npages * PAGE].long()
        k = case.k_pool[toks].double().view(npages, PAGE, 2, 64)  # [P, 16, Hkv, D]
        qb = case.q[b].double().view(2, 4, 64)
        logits = torch.einsum("hgd,pjhd->hpgj", qb, k).amax(dim=(2, 3))  # [Hkv, P]
        assert (s[b, :, :npages].double() >= logits - 1e-3).all()
        assert torch.isneginf(s[b, :, npages:]).all()


def _select_expected(scores, budget, b_start, k, n_sink):
    bs, hkv, _ = scores.shape
    out = {}
    for b in range(bs):
        for h in range(hkv):
            order = sorted(range(scores.shape[2]), key=lambda p: -float(scores[b, h, p]))[:k]
            pages = [p for p in order[: budget[b]] if scores[b, h, p] != float("-inf")]
            s = int(b_start[b])
            pos = list(range(min(n_sink, s)))
            pos += [p * PAGE + j for p in pages for j in range(PAGE) if n_sink <= p * PAGE + j < s]
            out[b, h] = sorted(pos)
    return out


def test_select_positions_and_decode():
    """Top-k pages -> sorted distinct positions below b_start (sinks first, per-row
    budgets, -inf pages skipped), then two_segment_decode over them == reference."""
    rng = random.Random(5)
    seq_lens = [120, 77, 100]
    case = _pool_case(seq_lens, group=4, dtype=torch.bfloat16, seed=9)
    max_pages, k, n_sink = 8, 3, 4
    scores = torch.randn(3, 2, max_pages, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    scores[0, 1, :] = float("-inf")  # nothing selectable for this head
    scores[0, 1, 2] = 0.5  # ... but one page
    scores[1, :, 4:] = float("-inf")  # row 1: b_start 77 -> pages >= 4 are recent
    b_start = torch.tensor([100, 64, 40], dtype=torch.int32, device=DEVICE)  # row 2 clips page 2 mid-page
    budget = torch.tensor([3, 2, 3], dtype=torch.int32, device=DEVICE)
    a_pos, a_len = K.quest_select_positions(scores, budget, b_start, max_select_pages=k, n_sink=n_sink)
    assert a_pos.shape == (3, 2, n_sink + PAGE * k) and a_pos.dtype == torch.int32
    exp = _select_expected(scores.cpu(), budget.tolist(), b_start.tolist(), k, n_sink)
    for (b, h), pos in exp.items():
        assert int(a_len[b, h]) == len(pos)
        got = a_pos[b, h, : len(pos)].tolist()
        assert got[: min(n_sink, int(b_start[b]))] == list(range(min(n_sink, int(b_start[b]))))  # sinks first
        assert sorted(got) == pos  # distinct, exactly the expected set
    # An int budget == the same budget as a tensor.
    p2, l2 = K.quest_select_positions(scores, 2, b_start, max_select_pages=k, n_sink=n_sink)
    p3, l3 = K.quest_select_positions(scores, torch.full_like(budget, 2), b_start, max_select_pages=k, n_sink=n_sink)
    assert torch.equal(l2, l3) and all(
        torch.equal(p2[b, h, : l2[b, h]], p3[b, h, : l3[b, h]]) for b in range(3) for h in range(2))
    exp2 = _select_expected(scores.cpu(), [2, 2, 2], b_start.tolist(), k, n_sink)
    assert all(sorted(p2[b, h, : l2[b, h]].tolist()) == pos for (b, h), pos in exp2.items())
    # b_start below n_sink: only the sinks that exist, no page position.
    p4, l4 = K.quest_select_positions(scores, budget, torch.full_like(b_start, 2), max_select_pages=k, n_sink=n_sink)
    assert (l4 == 2).all() and (p4[:, :, :2] == torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)).all()
    # Feed it to the decode kernel: A = listed positions, B = [b_start, n).
    case.a_slot = torch.full((3,), -2, dtype=torch.int32, device=DEVICE)
    case.a_len, case.a_pos = a_len, a_pos
    case.b_start = b_start
    out = torch.full_like(case.q, float("nan"))
    o = K.two_segment_decode(*case.args(), out=out, a_pos=a_pos, num_splits=rng.choice([1, 2]),
                             block_n=16, min_split_len=16)
    ref = K.two_segment_decode_ref(*case.args(), a_pos=a_pos)
    assert T.rel_error(o.float(), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quest_pipeline_32k():
    """Real sizes: bounds over a 32K prefix (default tiling), 40 decode steps,
    page scores vs float64, top-k pages -> indexed decode vs the reference."""
    seq = [32768 + 40, 20000 + 40]
    case = _pool_case(seq, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, seed=40)
    max_pages = 32768 // PAGE + 8
    kmin, kmax = _garbage_store(3, 8, max_pages, 128, torch.bfloat16, seed=41)
    slot = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    pool = (case.k_pool, case.req_to_token, case.req_pool_idx, slot)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    n0 = torch.tensor([seq[0] - 40, seq[1] - 40], dtype=torch.int32, device=DEVICE)
    K.quest_bounds_update(*pool, zero, n0, kmin, kmax)
    for i in range(1, 41):
        K.quest_bounds_decode(*pool, n0 + i, kmin, kmax)
    ref_min, ref_max = kmin.clone(), kmax.clone()
    K.quest_bounds_ref(*pool, zero, case.seq_lens, ref_min, ref_max)
    assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max)
    first = torch.ones(2, dtype=torch.int32, device=DEVICE)
    last = (case.seq_lens - 256) // PAGE
    s = K.quest_page_scores(case.q, kmin, kmax, slot, first, last)
    ref = K.quest_page_scores_ref(case.q, kmin, kmax, slot, first, last)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(s), ~fin)
    torch.testing.assert_close(s[fin], ref[fin], rtol=1e-5, atol=1e-3)
    b_start = last * PAGE
    a_pos, a_len = K.quest_select_positions(s, 128, b_start, max_select_pages=128, n_sink=4)
    case.a_slot = torch.full((2,), -2, dtype=torch.int32, device=DEVICE)
    case.a_len, case.a_pos, case.b_start = a_len, a_pos, b_start
    assert (a_len == 4 + 128 * PAGE).all()
    o = K.two_segment_decode(*case.args(), a_pos=a_pos)
    ref_o = K.two_segment_decode_ref(*case.args(), a_pos=a_pos)
    assert T.rel_error(o.float(), ref_o) < 1e-2


def test_decode_kernel_folds_bounds():
    """two_segment_decode(quest_bounds=...) == quest_bounds_decode, step after step
    across a page boundary, for rows served (row_mask 1 and 2), not for row_mask 0
    rows or slot < 0 rows; the attention output is unaffected."""
    n0, steps = 30, 4  # positions 30..33: position 32 opens page 2
    seq_lens = [n0 + steps, n0 + steps + 5, n0 + steps + 9, n0 + steps + 2]
    case = _pool_case(seq_lens, group=4, dtype=torch.bfloat16, seed=70)
    kmin, kmax = _garbage_store(5, 2, 4, 64, torch.bfloat16, seed=71)
    slot = torch.tensor([4, 1, -1, 2], dtype=torch.int32, device=DEVICE)
    row_mask = torch.tensor([1, 2, 1, 0], dtype=torch.int32, device=DEVICE)
    ref_min, ref_max = kmin.clone(), kmax.clone()
    served_slot = torch.where(row_mask > 0, slot, torch.full_like(slot, -1))
    for i in range(1, steps + 1):
        n = torch.tensor([n0 + i, n0 + i + 5, n0 + i + 9, n0 + i + 2], dtype=torch.int32, device=DEVICE)
        case.b_start, case.b_end = n - 20, n
        out = torch.full_like(case.q, float("nan"))
        K.two_segment_decode(*case.args(), out=out, row_mask=row_mask, quest_bounds=(kmin, kmax, slot),
                             num_splits=2, block_n=16, min_split_len=16)
        K.quest_bounds_decode(case.k_pool, case.req_to_token, case.req_pool_idx, served_slot, n, ref_min, ref_max)
        assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max), f"step {i}"
    ref = K.two_segment_decode_ref(*case.args(), row_mask=row_mask)
    on = row_mask == 1
    assert T.rel_error(out[on].float(), ref[on]) < 1e-2


@pytest.mark.parametrize("page", [1, 16])
def test_expand_selection_out_rows(page):
    """out_rows: each row's listing lands in row out_rows[b] of the outputs (another
    height), bit for bit what the plain launch writes in row b; rows with
    out_rows[b] < 0 write nothing (the CUDA-graph path's slots without a row)."""
    from sgl_sparse.kernels.quest_pages import expand_selection
    from sgl_sparse.kernels.topk_range import topk_range

    gen = torch.Generator().manual_seed(page)
    r, h, n, k, width = 5, 2, 40, 8, 48 if page == 1 else 160
    scores = torch.randn(r, h, n, generator=gen).to(DEVICE)
    lo = torch.tensor([0, 3, 1, 0, 5], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([40, 30, 1, 17, 40], dtype=torch.int32, device=DEVICE)  # row 2: empty
    budget = torch.tensor([8, 5, 8, 3, 6], dtype=torch.int32, device=DEVICE)
    idx, count = topk_range(scores, lo, hi, budget, k)
    sink = torch.tensor([4, 0, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    b_start = torch.tensor([600, 300, 20, 9, 500], dtype=torch.int32, device=DEVICE) // (16 // page)
    ref_pos = torch.full((r, h, width), -7, dtype=torch.int32, device=DEVICE)
    ref_len = torch.full((r, h), -7, dtype=torch.int32, device=DEVICE)
    expand_selection(None, idx, k, b_start, ref_pos, ref_len, page=page, n_sink=sink, count=count)
    rows = torch.tensor([6, -1, 0, 3, -1], device=DEVICE)
    pos = torch.full((7, h, width), -7, dtype=torch.int32, device=DEVICE)
    length = torch.full((7, h), -7, dtype=torch.int32, device=DEVICE)
    expand_selection(None, idx, k, b_start, pos, length, page=page, n_sink=sink, count=count, out_rows=rows)
    for b, o in enumerate(rows.tolist()):
        if o >= 0:
            assert torch.equal(pos[o], ref_pos[b]) and torch.equal(length[o], ref_len[b]), b
    untouched = [o for o in range(7) if o not in rows.tolist()]
    assert (pos[untouched] == -7).all() and (length[untouched] == -7).all()
    assert int((ref_len > 0).sum()) >= 4  # rows list something


@pytest.mark.parametrize("page", [1, 16])
def test_expand_selection_slots(page):
    """slots: every listed entry (sinks included) also as its pool slot,
    req_to_token[req_pool_idx[b], pos] with the request of the INPUT row b (a store
    slot on the serving path), at the same place of the out_rows row; positions and
    lengths as without; nothing else of the slot buffer written."""
    from sgl_sparse.kernels.quest_pages import expand_selection
    from sgl_sparse.kernels.topk_range import topk_range

    gen = torch.Generator().manual_seed(10 + page)
    r, h, n, k, width, ctx = 5, 2, 40, 8, 48 if page == 1 else 160, 700
    scores = torch.randn(r, h, n, generator=gen).to(DEVICE)
    lo = torch.tensor([0, 3, 1, 0, 5], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([40, 30, 1, 17, 40], dtype=torch.int32, device=DEVICE)  # row 2: empty
    budget = torch.tensor([8, 5, 8, 3, 6], dtype=torch.int32, device=DEVICE)
    idx, count = topk_range(scores, lo, hi, budget, k)
    sink = torch.tensor([4, 0, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    b_start = torch.tensor([600, 300, 20, 9, 500], dtype=torch.int32, device=DEVICE) // (16 // page)
    rows = torch.tensor([6, -1, 0, 3, 2], device=DEVICE)
    rpi = torch.tensor([1, 0, 3, 2, 0], device=DEVICE)  # per input row
    r2t = torch.randint(0, 1 << 20, (4, ctx), generator=gen, dtype=torch.int32).to(DEVICE)
    ref_pos = torch.full((7, h, width), -7, dtype=torch.int32, device=DEVICE)
    ref_len = torch.full((7, h), -7, dtype=torch.int32, device=DEVICE)
    expand_selection(None, idx, k, b_start, ref_pos, ref_len, page=page, n_sink=sink, count=count, out_rows=rows)
    pos = torch.full((7, h, width), -7, dtype=torch.int32, device=DEVICE)
    length = torch.full((7, h), -7, dtype=torch.int32, device=DEVICE)
    a_slots = torch.full((7, h, width), -9, dtype=torch.int32, device=DEVICE)
    expand_selection(None, idx, k, b_start, pos, length, page=page, n_sink=sink, count=count, out_rows=rows,
                     slots=(r2t, rpi, a_slots))
    assert torch.equal(pos, ref_pos) and torch.equal(length, ref_len)
    for b, o in enumerate(rows.tolist()):
        if o < 0:
            continue
        for hh in range(h):
            m = int(length[o, hh])
            want = r2t[int(rpi[b])][pos[o, hh, :m].long()]
            assert torch.equal(a_slots[o, hh, :m], want), (b, hh)
            assert (a_slots[o, hh, m:] == -9).all()
    untouched = [o for o in range(7) if o not in rows.tolist()]
    assert (a_slots[untouched] == -9).all()
    assert int(length[6, 0]) > 4 and int((length[rows[rows >= 0]] > 0).sum()) >= 4  # sinks and pages listed


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_bounds_over_an_fp8_pool(fp8):
    """Over an fp8 pool the bounds are kept in the model's dtype (bf16 holds every fp8
    value): at extend, at decode steps, and folded by the decode kernel, each exactly
    the fp8 keys' min / max; the attention reads the fp8 pool beside them."""
    n0, steps = 30, 4
    seq_lens = [n0 + steps, n0 + steps + 21]
    case = _pool_case(seq_lens, group=4, dtype=torch.bfloat16, seed=80)
    case.k_pool, case.v_pool = case.k_pool.to(fp8), case.v_pool.to(fp8)
    case.a_k, case.a_v = case.a_k.to(fp8), case.a_v.to(fp8)
    kmin, kmax = _garbage_store(3, 2, 5, 64, torch.bfloat16, seed=81)
    slot = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    pool = (case.k_pool, case.req_to_token, case.req_pool_idx, slot)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    first = torch.tensor([n0, n0 + 21], dtype=torch.int32, device=DEVICE)
    K.quest_bounds_update(*pool, zero, first, kmin, kmax, num_programs=2, block_p=2)
    ref_min, ref_max = kmin.clone(), kmax.clone()
    K.quest_bounds_ref(*pool, zero, first, ref_min, ref_max)
    assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max)
    toks = case.req_to_token[int(case.req_pool_idx[0]), :16].long()
    assert torch.equal(kmin[2, :, 0], case.k_pool[toks].float().amin(0).to(torch.bfloat16))
    for i in range(1, steps + 1):  # odd steps: the decode kernel folds the key; even: quest_bounds_decode
        n = first + i
        if i % 2:
            case.b_start, case.b_end = n - 20, n
            out = torch.full_like(case.q, float("nan"))
            K.two_segment_decode(*case.args(), out=out, quest_bounds=(kmin, kmax, slot), num_splits=2,
                                 block_n=16, min_split_len=16)
            assert T.rel_error(out.float(), K.two_segment_decode_ref(*case.args())) < 1e-2
        else:
            K.quest_bounds_decode(*pool, n, kmin, kmax)
        ref_min, ref_max = kmin.neg(), kmax.neg()  # rebuilt from scratch
        K.quest_bounds_ref(*pool, zero, n, ref_min, ref_max)
        for r, s in enumerate(slot.tolist()):
            used = -(-int(n[r]) // PAGE)
            assert torch.equal(kmin[s, :, :used], ref_min[s, :, :used]), f"step {i} row {r}"
            assert torch.equal(kmax[s, :, :used], ref_max[s, :, :used]), f"step {i} row {r}"
