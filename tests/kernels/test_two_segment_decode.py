"""Tests for kernels.two_segment_decode against the plain-PyTorch reference.

Without CUDA these run under the Triton interpreter (TRITON_INTERPRET=1, set
here and in conftest.py) at small shapes, with small BLOCK_N / min_split_len
so that short sequences still exercise several loop iterations and several
splits. ``@pytest.mark.gpu`` tests use real sizes (4K-128K) and need CUDA.

Every test draws fresh random inputs, poisons the output with NaN before the
launch (so an unwritten element fails), and checks the relative error
``||out - ref|| / ||ref||`` against a per-dtype tolerance.
"""

import contextlib
import dataclasses
import random

import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.kernels import testing as T

HAS_CUDA = torch.cuda.is_available()

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
# Interpreter-friendly tiling: 16-key blocks, splits as small as one block.
SMALL = dict(block_n=16, min_split_len=16)


def gpu_test(fn):
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(fn)
    return pytest.mark.gpu(fn)


def run_kernel(case, **kw):
    """Launch with a NaN-poisoned preallocated output; return (out, lse)."""
    out = torch.full_like(case.q, float("nan"))
    res = K.two_segment_decode(*case.args(), out=out, return_lse=True, **case.kwargs(), **kw)
    o, lse = res
    assert o.data_ptr() == out.data_ptr()
    return o, lse


def check(case, tol=None, **kw):
    o, lse = run_kernel(case, **kw)
    ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, **case.kwargs())
    assert not torch.isnan(o).any(), "NaN in output (unwritten element or bad softmax)"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    tol = tol if tol is not None else TOL[case.q.dtype]
    err = T.rel_error(o.float(), ref_o)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    # LSE: -inf exactly where the reference has no keys, close elsewhere.
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        torch.testing.assert_close(lse[finite], ref_lse[finite].to(lse.device), atol=2e-2, rtol=0)
    # Requests (and heads) without any key must output exactly zero.
    empty = ~finite
    if empty.any():
        assert (o.float()[empty] == 0).all()
    return o, lse, err


# -----------------------------------------------------------------------------
# Mixed-policy batches: every dtype x GQA ratio x head dim
# -----------------------------------------------------------------------------

POLICIES = ["dense", "sink_window", "select_recent", "a_only", "empty_b", "both_empty"]


def mixed_batch(bs, num_kv_heads, cap, rng):
    """Ragged per-request lengths under a rotating set of policies."""
    seq_lens, a_lens, b_ranges = [], [], []
    start = rng.randrange(len(POLICIES))
    for i in range(bs):
        policy = POLICIES[(start + i) % len(POLICIES)]
        n = rng.randint(20, 90)  # rarely a multiple of BLOCK_N = 16
        if policy == "dense":
            a, b = 0, (0, n)
        elif policy == "sink_window":
            w = rng.randint(5, min(40, n))
            a, b = min(4, cap), (n - w, n)
        elif policy == "select_recent":
            # a_len differs per KV head (head-wise selection budgets).
            a = [rng.randint(1, cap) for _ in range(num_kv_heads)]
            r = rng.randint(1, 20)
            b = (n - r, n)
        elif policy == "a_only":
            a, b = [rng.randint(0, cap) for _ in range(num_kv_heads)], (n, n)
        elif policy == "empty_b":  # B empty but in the middle of the sequence
            a, b = rng.randint(1, cap), (n // 2, n // 2)
        else:  # both_empty
            a, b = 0, (0, 0)
        seq_lens.append(n)
        a_lens.append(a)
        b_ranges.append(b)
    return seq_lens, a_lens, b_ranges


MIXED_CONFIGS = [
    (dtype, group, head_dim)
    for dtype in (torch.bfloat16, torch.float16)
    for group in (1, 4, 8)
    for head_dim in (64, 128)
]


@pytest.mark.parametrize("idx", range(len(MIXED_CONFIGS)))
def test_mixed_batch(idx):
    dtype, group, head_dim = MIXED_CONFIGS[idx]
    rng = random.Random(1000 + idx)
    bs = 1 + idx % 5  # batch sizes 1..5
    num_kv_heads = (2, 1, 3)[idx % 3]
    cap = 37
    seq_lens, a_lens, b_ranges = mixed_batch(bs, num_kv_heads, cap, rng)
    case = T.make_decode_case(
        seq_lens,
        a_lens,
        b_ranges,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        cap=cap,
        dtype=dtype,
        device=DEVICE,
        seed=idx,
        req_pool_idx_dtype=(torch.int64, torch.int32)[idx % 2],
    )
    check(case, num_splits=(1, 2, 3, 5)[idx % 4], **SMALL)


# -----------------------------------------------------------------------------
# Splits, empty segments, LSE, defaults
# -----------------------------------------------------------------------------


def _standard_case(dtype=torch.bfloat16, seed=0, group=4, head_dim=64, **kw):
    seq_lens = [150, 61, 97]
    a_lens = [[23, 5], [0, 0], [40, 17]]
    b_ranges = [(150 - 70, 150), (0, 61), (97 - 19, 97)]
    return T.make_decode_case(
        seq_lens,
        a_lens,
        b_ranges,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        cap=40,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
        **kw,
    )


def test_num_splits_agree():
    """1 split (direct store, no merge) up to more splits than there are blocks."""
    case = _standard_case(seed=1)
    outs = {}
    for ns in (1, 2, 4, 16):
        outs[ns], _, _ = check(case, num_splits=ns, **SMALL)
    for ns in (2, 4, 16):
        assert T.rel_error(outs[ns].float(), outs[1].float()) < 1e-2


@pytest.mark.parametrize("which", ["a_empty", "b_empty", "both_empty"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_segments(which, num_splits):
    n = [45, 70]
    if which == "a_empty":
        a_lens, b = [0, 0], [(3, 45), (0, 70)]
    elif which == "b_empty":
        a_lens, b = [[30, 9], [1, 33]], [(45, 45), (0, 0)]
    else:
        a_lens, b = [0, 0], [(45, 45), (10, 10)]
    case = T.make_decode_case(
        n, a_lens, b, num_kv_heads=2, group=4, head_dim=64, cap=33, dtype=torch.float16, device=DEVICE, seed=7
    )
    o, lse, _ = check(case, num_splits=num_splits, **SMALL)
    if which == "both_empty":
        assert (o == 0).all() and torch.isneginf(lse).all()


def test_a_slot_ignored_when_a_len_zero():
    """A garbage slot (-1 and out-of-range) must not be touched when a_len == 0."""
    case = _standard_case(seed=2)
    case.a_slot[1] = 1 << 20  # request 1 has a_len == 0 on every head
    check(case, num_splits=2, **SMALL)


def test_dense_matches_dense_reference():
    """Segment B over [0, n) only == full attention; also cross-checks the references."""
    seq_lens = [77, 33, 120]
    case = T.make_decode_case(
        seq_lens,
        [0] * 3,
        [(0, n) for n in seq_lens],
        num_kv_heads=2,
        group=8,
        head_dim=128,
        cap=16,
        dtype=torch.bfloat16,
        device=DEVICE,
        seed=3,
    )
    o, lse = run_kernel(case, num_splits=3, **SMALL)
    ref_o, ref_lse = K.dense_decode_ref(
        case.q, case.k_pool, case.v_pool, case.req_to_token, case.req_pool_idx, case.seq_lens, case.sm_scale, return_lse=True
    )
    ref2 = K.two_segment_decode_ref(*case.args())
    assert T.rel_error(ref2, ref_o) < 1e-6
    assert T.rel_error(o.float(), ref_o) < TOL[torch.bfloat16]
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)


def test_peaky_softmax():
    """Large logits (q scaled x8): exercises the running-max rescaling."""
    case = _standard_case(dtype=torch.float16, seed=4, q_scale=8.0)
    check(case, num_splits=3, **SMALL)


def test_default_tuning():
    """Default block_n (64) / heuristic split count, as used on the GPU."""
    case = _standard_case(seed=5, head_dim=128, group=2)  # Qwen3-1.7B: G=2, D=128
    check(case)  # no overrides
    check(case, num_splits=2)  # default block_n with a merge


def test_strided_views():
    """Non-contiguous q / pool / compact views (only the head dim is contiguous)."""
    case = _standard_case(seed=6)
    def widen(t, dim):  # same values, inside a bigger buffer
        shape = list(t.shape)
        shape[dim] *= 2
        big = torch.randn(shape, dtype=t.dtype, device=t.device)
        idx = [slice(None)] * t.dim()
        idx[dim] = slice(0, t.shape[dim])
        big[tuple(idx)] = t
        return big[tuple(idx)]
    case.q = widen(case.q, 1)
    case.k_pool = widen(case.k_pool, 1)
    case.v_pool = widen(case.v_pool, 0)
    case.a_k = widen(case.a_k, 2)
    case.a_v = widen(case.a_v, 1)
    assert not case.k_pool.is_contiguous() and not case.a_k.is_contiguous()
    check(case, num_splits=2, **SMALL)


def test_no_lse_and_fresh_output():
    """return_lse=False returns a new tensor of the right dtype."""
    case = _standard_case(seed=8, dtype=torch.float16)
    o = K.two_segment_decode(*case.args(), num_splits=2, **SMALL)
    assert o.dtype == torch.float16 and o.shape == case.q.shape
    ref = K.two_segment_decode_ref(*case.args())
    assert T.rel_error(o.float(), ref) < TOL[torch.float16]


@pytest.fixture
def fp8_doubles(monkeypatch):
    """SGLANG_SPARSE_FP8_SPLIT_FACTOR=2: twice the programs over fp8 (the kernel's best
    on dense rows; off by default since session 32, see FP8_SPLIT_FACTOR)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(K.two_segment_decode.__module__), "FP8_SPLIT_FACTOR", 2)


def test_choose_num_splits(fp8_doubles):
    f = K.choose_num_splits
    # Batch 1 at long context: enough programs to cover all SMs (132 on H100).
    assert 1 * 8 * f(1, 8, 131072, 132) >= 132
    assert f(8, 8, 131072, 132) == 4
    # Large batch: already enough programs, no splitting (and no merge).
    assert f(32, 8, 131072, 132) == 1
    assert f(128, 8, 131072, 132) == 1
    # Short contexts are never cut below min_split_len.
    assert f(1, 8, 300, 132, min_split_len=256) == 2
    assert f(1, 8, 1, 132) == 1
    # Bounded by max_splits.
    assert f(1, 1, 1 << 20, 1000) == 64
    # Depends only on its (static) arguments.
    assert f(3, 2, 4096, 132) == f(3, 2, 4096, 132)
    # fp8 caches: twice the programs (programs_per_sm), at most FP8_MAX_SPLITS, and
    # within the fused merge's 8 where bf16's choice is (batch 4 keeps its balancing).
    assert [f(bs, 8, 131072, 132, kv_fp8=True) for bs in (1, 2, 4, 8, 16, 32, 64)] == [32, 32, 8, 8, 4, 2, 1]
    assert [f(bs, 8, 131072, 132) for bs in (1, 2, 4, 8, 16, 32, 64)] == [33, 16, 8, 4, 2, 1, 1]
    assert f(1, 8, 300, 132, min_split_len=256, kv_fp8=True) == 2  # the length bound holds


def test_balances_over_fp8_counts_its_programs(fp8_doubles):
    """Every batch whose launch balances its splits over bf16 still does over fp8
    (twice the programs, the fused merge's range kept); the waves bound counts
    fp8's programs."""
    for bs in (2, 4, 8, 16, 32, 64, 128):
        assert K.balances(bs, 8, 131072, 132, kv_fp8=True) == K.balances(bs, 8, 131072, 132), bs
    assert K.balances(8, 8, 131072, 132, kv_fp8=True)
    assert K.programs_per_sm(True) == 2 * K.programs_per_sm(False)


def test_fused_merge_bound_lets_fp8_batch_4_double(monkeypatch, fp8_doubles):
    """SGLANG_SPARSE_FUSED_MERGE_MAX_SPLITS (the A/B knob): at 16, batch 4 over fp8
    takes 16 splits and still balances; the variable is read as a bounded count."""
    import importlib

    from sgl_sparse.kernels import _utils

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "FUSED_MERGE_MAX_SPLITS", 16)
    assert K.choose_num_splits(4, 8, 131072, 132, kv_fp8=True) == 16
    assert K.balances(4, 8, 131072, 132, kv_fp8=True)
    monkeypatch.setenv("SGLANG_SPARSE_FUSED_MERGE_MAX_SPLITS", "16")
    assert _utils.env_count("FUSED_MERGE_MAX_SPLITS", 8, 1, 64) == 16
    monkeypatch.setenv("SGLANG_SPARSE_FUSED_MERGE_MAX_SPLITS", "0")
    with pytest.raises(ValueError, match="SGLANG_SPARSE_FUSED_MERGE_MAX_SPLITS"):
        _utils.env_count("FUSED_MERGE_MAX_SPLITS", 8, 1, 64)


def test_fp8_split_factor_one_is_bf16s_heuristic(monkeypatch):
    """SGLANG_SPARSE_FP8_SPLIT_FACTOR=1, the default (session 31's served splits, the
    better end to end; 2 is the A/B knob): over fp8 the heuristic, its balancing and
    its program count are bf16's."""
    import importlib

    from sgl_sparse.kernels import _utils

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    assert tsd.FP8_SPLIT_FACTOR == 1
    for bs in (1, 2, 4, 8, 16, 32, 64):
        assert K.choose_num_splits(bs, 8, 33792, 132, kv_fp8=True) == K.choose_num_splits(bs, 8, 33792, 132), bs
        assert K.balances(bs, 8, 33792, 132, kv_fp8=True) == K.balances(bs, 8, 33792, 132), bs
    assert K.programs_per_sm(True) == K.programs_per_sm(False)
    monkeypatch.setenv("SGLANG_SPARSE_FP8_SPLIT_FACTOR", "5")
    with pytest.raises(ValueError, match="SGLANG_SPARSE_FP8_SPLIT_FACTOR"):
        _utils.env_count("FP8_SPLIT_FACTOR", 2, 1, 4)


# -----------------------------------------------------------------------------
# GPU-sized tests (CUDA only)
# -----------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("ctx", [4096, 32768, 131072])
@pytest.mark.parametrize("bs", [1, 4])
def test_gpu_long_context(ctx, bs):
    rng = random.Random(ctx + bs)
    seq_lens, a_lens, b_ranges = [], [], []
    policies = ["dense", "sink_window", "select_recent", "dense"]
    cap = ctx // 8
    for i in range(bs):
        n = ctx - rng.randint(0, 100)
        a, b = T.policy_segments(policies[i % 4], n, budget=min(cap, n // 8) + 256)
        if policies[i % 4] == "select_recent":
            a = [max(0, min(cap, a - 13 * h)) for h in range(8)]
        else:
            a = min(a, cap)
        seq_lens.append(n)
        a_lens.append(a)
        b_ranges.append(b)
    case = T.make_decode_case(
        seq_lens, a_lens, b_ranges, num_kv_heads=8, group=2, head_dim=128, cap=cap, dtype=torch.bfloat16, device="cuda", seed=bs
    )
    check(case)


@gpu_test
def test_gpu_cuda_graph_replay():
    """Capture once, then change only descriptor *values* and replay."""
    seq_lens = [5000, 3000, 7000]
    case = T.make_decode_case(
        seq_lens, [0, 100, [300, 20, 0, 7, 1, 2, 3, 4]], [(0, 5000), (2000, 3000), (6500, 7000)],
        num_kv_heads=8, group=2, head_dim=128, cap=512, dtype=torch.bfloat16, device="cuda", seed=11,
        empty_slot_value=None,  # a_len of request 0 becomes non-zero below
    )
    out = torch.empty_like(case.q)
    kw = dict(max_kv_len=8192, out=out)
    K.two_segment_decode(*case.args(), **kw)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.two_segment_decode(*case.args(), **kw)
    for step in range(3):
        case.a_len.copy_(torch.randint(0, 513, case.a_len.shape, device="cuda", dtype=torch.int32))
        starts = torch.tensor([step * 100, 1000 + step, 10], dtype=torch.int32, device="cuda")
        case.b_start.copy_(starts)
        case.b_end.copy_(torch.tensor([5000 - step, 3000, 6999], dtype=torch.int32, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        ref = K.two_segment_decode_ref(*case.args())
        assert T.rel_error(out.float(), ref) < TOL[torch.bfloat16]


# -----------------------------------------------------------------------------
# Segment A read in place (a_slot < 0): sink tokens of window policies
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_sink_mixed_with_compact(num_splits, dtype):
    """One launch: compact segment A, in-place sink, and dense rows side by side."""
    seq_lens = [150, 61, 97, 40]
    a_lens = [[23, 5], [4, 4], [40, 17], [6, 6]]  # row 3 asks for more sink than b_start allows
    b_ranges = [(80, 150), (61 - 20, 61), (78, 97), (3, 40)]
    case = T.make_decode_case(
        seq_lens, a_lens, b_ranges, num_kv_heads=2, group=4, head_dim=64, cap=40,
        dtype=dtype, device=DEVICE, seed=11,
    )
    case.a_slot[1] = -1
    case.a_slot[3] = -1  # clamped to b_start = 3 in place
    check(case, num_splits=num_splits, **SMALL)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_row_mask_skips_rows(num_splits):
    """Rows with mask 0 are not written at all (another kernel owns them)."""
    case = _standard_case(seed=5)
    mask = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    sentinel = 7.0
    out = torch.full_like(case.q, sentinel)
    K.two_segment_decode(*case.args(), out=out, row_mask=mask, num_splits=num_splits, **SMALL)
    ref = K.two_segment_decode_ref(*case.args())
    assert (out[1] == sentinel).all()
    keep = mask.bool()
    assert not torch.isnan(out).any()
    assert T.rel_error(out[keep].float(), ref[keep]) < TOL[case.q.dtype]


# -----------------------------------------------------------------------------
# Indexed segment A (a_slot == -2): per-head position lists read in place
# -----------------------------------------------------------------------------

INDEXED_CONFIGS = [(dtype, group) for dtype in (torch.bfloat16, torch.float16) for group in (1, 4, 8)]


@pytest.mark.parametrize("idx", range(len(INDEXED_CONFIGS)))
def test_indexed_a_mixed_modes(idx):
    """One launch: indexed, compact, in-place prefix and dense rows, with row_mask.

    Ragged lengths (rarely a multiple of BLOCK_N = 16), per-head position counts
    that differ and include 0, an indexed row with every count 0, and an
    indexed row the row mask switches off (it must stay unwritten).
    """
    dtype, group = INDEXED_CONFIGS[idx]
    rng = random.Random(4000 + idx)
    num_kv_heads, cap, cap_pos = 2, 24, 45
    n = [rng.randint(60, 110) for _ in range(6)]
    b_ranges = [
        (n[0] - 17, n[0]),  # 0: indexed, counts differ per head (one is 0)
        (n[1] - 9, n[1]),  # 1: compact buffer
        (n[2] - 30, n[2]),  # 2: in-place sink prefix
        (0, n[3]),  # 3: dense
        (n[4] - 5, n[4]),  # 4: indexed, all counts 0
        (n[5] - 20, n[5]),  # 5: indexed, masked off by row_mask
    ]
    a_lens = [0, [rng.randint(1, cap), rng.randint(0, cap)], [4, 4], 0, 0, 0]
    case = T.make_decode_case(
        n, a_lens, b_ranges, num_kv_heads=num_kv_heads, group=group, head_dim=64, cap=cap,
        dtype=dtype, device=DEVICE, seed=idx, empty_slot_value=None,
        req_pool_idx_dtype=(torch.int64, torch.int32)[idx % 2],
    )
    case.a_slot[2] = -1
    heads0 = [rng.randint(17, cap_pos), 0]
    rng.shuffle(heads0)
    T.set_indexed_rows(case, {0: heads0, 4: 0, 5: [rng.randint(1, 30), 3]}, cap_pos=cap_pos, seed=idx)
    row_mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    for num_splits in ((1, 3) if idx == 0 else ((1, 3)[idx % 2],)):
        out = torch.full_like(case.q, float("nan"))
        o, lse = K.two_segment_decode(*case.args(), out=out, return_lse=True, row_mask=row_mask,
                                      num_splits=num_splits, **case.kwargs(), **SMALL)
        ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, row_mask=row_mask, **case.kwargs())
        assert torch.isnan(o[5]).all(), "a row_mask == 0 row was written"
        on = row_mask.bool()
        assert not torch.isnan(o[on]).any() and not torch.isnan(lse[on]).any()
        err = T.rel_error(o[on].float(), ref_o[on])
        assert err < TOL[dtype], f"num_splits={num_splits}: relative error {err:.3g}"
        torch.testing.assert_close(lse[on], ref_lse[on], atol=2e-2, rtol=0)


@pytest.mark.parametrize("idx", [0, 4])
def test_indexed_a_as_pool_slots(idx):
    """``a_pos_slots``: the lists hold pool slots instead of positions. The same
    tokens in the same order: bit for bit the output of the position lists, in a
    launch that also holds compact, prefix, dense and masked-off rows."""
    dtype, group = INDEXED_CONFIGS[idx]
    n = [97, 81, 70, 66, 90]
    case = T.make_decode_case(
        n, [0, [5, 9], [4, 4], 0, 0], [(n[0] - 17, n[0]), (n[1] - 9, n[1]), (n[2] - 30, n[2]), (0, n[3]),
                                       (n[4] - 11, n[4])],
        num_kv_heads=2, group=group, head_dim=64, cap=24, dtype=dtype, device=DEVICE, seed=50 + idx,
        empty_slot_value=None,
    )
    case.a_slot[2] = -1
    T.set_indexed_rows(case, {0: [40, 0], 4: [7, 33]}, cap_pos=45, seed=idx)
    slots = T.pool_slots_of(case)
    row_mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        kw = dict(return_lse=True, row_mask=row_mask, num_splits=num_splits, **SMALL)
        o_pos, lse_pos = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")),
                                              a_pos=case.a_pos, **kw)
        o_sl, lse_sl = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")),
                                            a_pos=slots, a_pos_slots=True, **kw)
        on = row_mask.bool()
        assert not torch.isnan(o_sl[on]).any() and torch.isnan(o_sl[~on]).all()
        assert torch.equal(o_sl[on], o_pos[on]) and torch.equal(lse_sl[on], lse_pos[on])
        ref = K.two_segment_decode_ref(*case.args(), row_mask=row_mask, a_pos=slots, a_pos_slots=True)
        assert T.rel_error(o_sl[on].float(), ref[on]) < TOL[dtype]


@pytest.mark.parametrize("idx,as_slots", [(0, False), (4, True), (2, True)])
def test_indexed_lists_read_from_a_store_by_row(idx, as_slots):
    """``a_lists``: indexed rows whose list lives in a store (``rows[b]`` its row, a
    width of its own) read it there instead of from a_pos / a_len, whose entries for
    them are garbage here: bit for bit the launch with the store's rows copied into
    the step's (what gather_selection did each layer), and the reference; beside
    indexed rows reading their own list, compact, prefix and dense rows, an empty
    store list, a masked-off row, positions or pool slots, split, fused and balanced."""
    dtype, group = INDEXED_CONFIGS[idx]
    n = [97, 81, 70, 66, 90, 58]
    bs, hkv, width = len(n), 2, 40
    case = T.make_decode_case(
        n, [0, [5, 9], 0, 0, 0, 0], [(n[0] - 17, n[0]), (n[1] - 9, n[1]), (n[2] - 30, n[2]), (0, n[3]),
                                     (n[4] - 11, n[4]), (n[5] - 6, n[5])],
        num_kv_heads=hkv, group=group, head_dim=64, cap=24, dtype=dtype, device=DEVICE, seed=70 + idx,
        empty_slot_value=None,
    )
    # rows 0, 2, 4, 5 indexed: 0 and 4 from the store (4's lists empty on head 0), 2 and 5 their own
    T.set_indexed_rows(case, {0: [31, 7], 2: [12, 30], 4: [0, 40], 5: [9, 3]}, cap_pos=48, seed=idx)
    lists = T.pool_slots_of(case) if as_slots else case.a_pos
    store_rows = torch.tensor([3, -1, -1, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    store_pos = torch.randint(0, 1 << 30, (5, hkv, width), dtype=torch.int32, device=DEVICE)  # garbage elsewhere
    store_len = torch.randint(0, width, (5, hkv), dtype=torch.int32, device=DEVICE)
    step_pos, step_len = lists.clone(), case.a_len.clone()
    for b, r in ((0, 3), (4, 1)):
        store_pos[r, :, :width] = lists[b, :, :width]
        store_len[r] = case.a_len[b]
        step_pos[b] = torch.randint(0, 1 << 30, step_pos[b].shape, dtype=torch.int32, device=DEVICE)
        step_len[b] = torch.tensor([48, 1], dtype=torch.int32)  # what a stale copy would say
    row_mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    on = row_mask.bool()
    args = list(case.args())
    copied = dict(a_pos=lists, a_pos_slots=as_slots)
    stored = dict(a_pos=step_pos, a_pos_slots=as_slots, a_lists=(store_rows, store_pos, store_len))
    ref = K.two_segment_decode_ref(*args, row_mask=row_mask, **copied)
    counters = K.make_split_counters(bs, hkv, DEVICE)
    for launch in (dict(num_splits=1), dict(num_splits=3), dict(num_splits=3, split_counters=counters),
                   dict(num_sms=2, max_kv_len=400, split_counters=counters, balance=True)):
        kw = dict(return_lse=True, row_mask=row_mask, **launch, **SMALL)
        o_copy, lse_copy = K.two_segment_decode(*args, out=torch.full_like(case.q, float("nan")), **copied, **kw)
        args_st = list(args)
        args_st[4] = step_len  # a_len
        o_st, lse_st = K.two_segment_decode(*args_st, out=torch.full_like(case.q, float("nan")), **stored, **kw)
        assert not torch.isnan(o_st[on]).any() and torch.isnan(o_st[~on]).all(), launch
        assert torch.equal(o_st[on], o_copy[on]) and torch.equal(lse_st[on], lse_copy[on]), launch
        assert T.rel_error(o_st[on].float(), ref[on]) < TOL[dtype], launch
        ref_st = K.two_segment_decode_ref(*args_st, row_mask=row_mask, **stored)
        assert torch.equal(ref_st, ref)
    assert int(counters.abs().sum()) == 0
    with pytest.raises(AssertionError, match="a_lists"):
        K.two_segment_decode(*args, a_lists=(store_rows, store_pos, store_len), **SMALL)


def test_indexed_a_differs_from_prefix():
    """The same a_len read as a prefix gives a different answer: the list is used."""
    case = _standard_case(seed=21, empty_slot_value=None)
    T.set_indexed_rows(case, {0: [23, 5], 2: [40, 17]}, cap_pos=40, seed=3)
    o_idx, _, _ = check(case, num_splits=2, **SMALL)
    as_prefix = T.DecodeCase(**{**case.__dict__, "a_pos": None})
    o_pre, _, _ = check(as_prefix, num_splits=2, **SMALL)  # a_slot -2 without a_pos == prefix
    assert T.rel_error(o_idx[0].float(), o_pre[0].float()) > 0.05


@pytest.mark.parametrize("num_splits", [1, 4])
def test_indexed_a_only_and_clamps(num_splits):
    """Indexed A with B empty (A only), long lists over many splits, b_start == 0.

    Row 2 is indexed with b_start == 0 and a garbage list: a_len clamps to 0, so
    only its segment B counts.
    """
    n = [130, 97, 40]
    case = T.make_decode_case(
        n, [0, 0, 0], [(130, 130), (60, 97), (0, 40)], num_kv_heads=2, group=4, head_dim=64, cap=8,
        dtype=torch.float16, device=DEVICE, seed=33, empty_slot_value=None,
    )
    T.set_indexed_rows(case, {0: [130, 77], 1: [60, 1]}, cap_pos=130, seed=5)
    case.a_slot[2] = -2
    case.a_len[2] = torch.tensor([9, 3], dtype=torch.int32)
    check(case, num_splits=num_splits, **SMALL)


# -----------------------------------------------------------------------------
# Fused merge (fused_merge=True): the last split program merges, one launch
# -----------------------------------------------------------------------------


@contextlib.contextmanager
def split_order(perm, axis=2):
    """Run the interpreter's grid with program_id(axis), the split index, remapped
    through ``perm`` (axis 0 for a split-major balanced launch).

    The interpreter runs programs one after another, split index innermost, so
    the last split to arrive would always be the highest one. Remapping the
    split index lets a test choose which split arrives last (and merges).
    """
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    orig = builder.set_grid_idx

    def remapped(*idx):
        idx = list(idx)
        idx[axis] = perm[idx[axis]] if idx[axis] < len(perm) else idx[axis]
        orig(*idx)

    builder.set_grid_idx = remapped
    try:
        yield
    finally:
        builder.set_grid_idx = orig


def _check_served_rows(o, lse, ref_o, ref_lse, on, dtype):
    """The rows `on` (bool [bs]) against the reference: no NaN, relative error, LSE
    -inf exactly where the reference's is, close elsewhere."""
    assert not torch.isnan(o[on]).any() and not torch.isnan(lse[on]).any()
    assert T.rel_error(o[on].float(), ref_o[on]) < TOL[dtype]
    assert torch.equal(torch.isinf(lse[on]), torch.isinf(ref_lse[on]))
    fin = torch.isfinite(ref_lse) & on[:, None]
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-2, rtol=0)


@pytest.mark.skipif(HAS_CUDA, reason="drives the interpreter's program order")
def test_fused_merge_matches_reference():
    """fused_merge: the reference's answers over repeated calls on one counter buffer.

    The batch mixes rows spread over several splits, rows that fit one chunk
    (written directly), a row with no keys, an indexed row and a row_mask-0
    row; lengths change between calls (as between CUDA-graph replays) and the
    splits arrive in a different order each call (reversed, then shuffled), so
    the merging program is not always the highest split. The counters must be
    all zero after every call.
    """
    rng = random.Random(77)
    num_kv_heads, cap = 2, 30
    counters = K.make_split_counters(8, num_kv_heads, DEVICE)
    for call, (num_splits, dtype) in enumerate(((4, torch.bfloat16), (5, torch.float16))):
        n = [rng.randint(70, 100), rng.randint(5, 15), 50, rng.randint(60, 80), 90, rng.randint(40, 90)]
        b_ranges = [(0, n[0]), (0, n[1]), (20, 20), (n[3] - 21, n[3]), (0, 90), (n[5] - 33, n[5])]
        a_lens = [0, 0, 0, 0, 0, [rng.randint(0, cap), cap]]
        case = T.make_decode_case(
            n, a_lens, b_ranges, num_kv_heads=num_kv_heads, group=4, head_dim=64, cap=cap,
            dtype=dtype, device=DEVICE, seed=call, empty_slot_value=None,
        )
        T.set_indexed_rows(case, {3: [rng.randint(0, 40), 40]}, cap_pos=40, seed=call)
        row_mask = torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
        ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, row_mask=row_mask, **case.kwargs())
        on = row_mask.bool()
        perm = list(range(num_splits))[::-1]
        if call:
            rng.shuffle(perm)
        out = torch.full_like(case.q, float("nan"))
        with split_order(perm):
            o, lse = K.two_segment_decode(
                *case.args(), out=out, return_lse=True, row_mask=row_mask, num_splits=num_splits,
                fused_merge=True, split_counters=counters, **case.kwargs(), **SMALL,
            )
        assert torch.isnan(o[4]).all(), "a row_mask == 0 row was written"
        _check_served_rows(o, lse, ref_o, ref_lse, on, dtype)
        assert (o[2] == 0).all() and torch.isneginf(lse[2]).all()
        assert int(counters.abs().sum()) == 0, "a split counter was left non-zero"


def test_fused_merge_own_counters_and_defaults():
    """fused_merge without a counter buffer (allocated per call), default tiling."""
    case = _standard_case(seed=9, head_dim=128, group=2)
    check(case, num_splits=3, fused_merge=True)
    check(case, num_splits=4, fused_merge=True, **SMALL)


def test_fused_merge_default_follows_split_count(monkeypatch):
    """fused_merge=None: one launch up to FUSED_MERGE_MAX_SPLITS splits when
    counters are given, the merge kernel beyond (and without counters)."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    merges = []
    orig = tsd._merge_splits_kernel

    class Counting:
        def __getitem__(self, grid):
            merges.append(grid)
            return orig[grid]

    monkeypatch.setattr(tsd, "_merge_splits_kernel", Counting())
    case = _standard_case(seed=10, head_dim=64, group=2)
    counters = K.make_split_counters(case.q.shape[0], case.a_k.shape[1], DEVICE)
    few, many = 3, tsd.FUSED_MERGE_MAX_SPLITS + 1
    for num_splits, kw, launches in ((few, dict(split_counters=counters), 0),
                                     (many, dict(split_counters=counters), 1),
                                     (few, {}, 1)):
        merges.clear()
        check(case, num_splits=num_splits, **kw, **SMALL)
        assert len(merges) == launches, (num_splits, kw.keys(), merges)
    assert int(counters.abs().sum()) == 0


@pytest.mark.skipif(HAS_CUDA, reason="drives the interpreter's program order")
@pytest.mark.parametrize("split_major", [False, True])
@pytest.mark.parametrize("grid_splits", [2, 6])
def test_balanced_splits_match_reference(grid_splits, split_major, monkeypatch):
    """balance=True: dense rows far longer than the others (an SFI slow step among
    sparse rows) take more of the grid's splits, short rows fewer; the answers are
    the reference's, with row_mask 0 and 2 rows, an indexed row, rows with no key,
    lengths changing between calls on one counter buffer and the splits arriving
    in a shuffled order, in either grid order (BALANCE_SPLIT_MAJOR). The counters end
    all zero."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "BALANCE_SPLIT_MAJOR", split_major)
    rng = random.Random(5 + grid_splits)
    num_kv_heads, cap = 2, 24
    counters = K.make_split_counters(8, num_kv_heads, DEVICE)
    for call, dtype in enumerate((torch.bfloat16, torch.float16, torch.bfloat16)):
        dense = rng.randint(150, 260)
        n = [dense, rng.randint(30, 50), dense - 37, 45, rng.randint(20, 40), 60, 40, 0]
        b_ranges = [(0, n[0]), (n[1] - 8, n[1]), (0, n[2]), (n[3] - 5, n[3]), (n[4] - 9, n[4]), (0, 60),
                    (n[6] - 7, n[6]), (0, 0)]
        a_lens = [0, [cap, 7], 0, [rng.randint(0, cap), 3], cap, 0, [5, 9], 0]
        case = T.make_decode_case(
            n, a_lens, b_ranges, num_kv_heads=num_kv_heads, group=4, head_dim=64, cap=cap,
            dtype=dtype, device=DEVICE, seed=call, empty_slot_value=None,
        )
        T.set_indexed_rows(case, {6: [5, 9]}, cap_pos=20, seed=call)
        # row 5: FlashInfer's (0); row 4: side effects only (2)
        row_mask = torch.tensor([1, 1, 1, 1, 2, 0, 1, 1], dtype=torch.int32, device=DEVICE)
        ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, row_mask=row_mask, **case.kwargs())
        on = row_mask == 1
        perm = list(range(grid_splits))
        rng.shuffle(perm)
        out = torch.full_like(case.q, float("nan"))
        with split_order(perm, axis=0 if split_major else 2):
            o, lse = K.two_segment_decode(
                *case.args(), out=out, return_lse=True, row_mask=row_mask, num_splits=grid_splits,
                balance=True, fused_merge=True, split_counters=counters, num_sms=16, **case.kwargs(), **SMALL,
            )
        assert torch.isnan(o[~on]).all(), "a row_mask != 1 row was written"
        _check_served_rows(o, lse, ref_o, ref_lse, on, dtype)
        assert (o[7] == 0).all() and torch.isneginf(lse[7]).all()
        assert int(counters.abs().sum()) == 0, "a split counter was left non-zero"


def _record_grids(monkeypatch, *flags):
    """(the kernel module, a list every stage-1 launch appends (its grid, the named
    constexprs' values) to); the launches still run."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    launches = []
    orig = tsd._two_segment_decode_stage1

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((grid, *(kw[f] for f in flags)))
                return orig[grid](*args, **kw)
            return run

    monkeypatch.setattr(tsd, "_two_segment_decode_stage1", Recording())
    return tsd, launches


def test_gated_twins_run_one_launch_chosen_on_the_device(monkeypatch):
    """gate: the plain launch and the balanced one, gated on one flag with opposite
    ``when_set``, leave exactly one launch's answers (the reference's, with side
    effects: the key norms stored once, by whichever runs); the launch whose turn it
    is not writes nothing (its output stays NaN when launched alone). balance_gate
    says 1 only where a served row's share differs from the heuristic's splits, and
    None while BALANCE_GATE is off (on by default)."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    bs, hkv = 3, 2
    case = T.make_decode_case([300, 40, 35], [0, [20, 3], 12], [(0, 300), (32, 40), (30, 35)], num_kv_heads=hkv,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=12)
    ref_o, _ = K.two_segment_decode_ref(*case.args(), return_lse=True, **case.kwargs())
    counters = K.make_split_counters(bs, hkv, DEVICE)
    common = dict(num_sms=2, max_kv_len=400, split_counters=counters, **case.kwargs(), **SMALL)
    splits = K.step_row_splits(case.a_len, case.b_start, case.b_end, None, hkv, 400, 2)
    assert splits is not None
    assert tsd.BALANCE_GATE  # the default
    monkeypatch.setattr(tsd, "BALANCE_GATE", False)
    assert K.balance_gate(splits, None, hkv, 400, 2) is None
    monkeypatch.setattr(tsd, "BALANCE_GATE", True)
    for flag in (0, 1):
        gate = torch.tensor([flag], dtype=torch.int32, device=DEVICE)
        twins = (dict(balance=False, gate=(gate, False)), dict(balance=True, row_splits=splits, gate=(gate, True)))
        norms = torch.full((case.k_pool.shape[0], hkv), -1.0, device=DEVICE)
        out = torch.full_like(case.q, float("nan"))
        for kw in twins:
            K.two_segment_decode(*case.args(), out=out, key_norms=norms, **kw, **common)
        assert not torch.isnan(out).any() and T.rel_error(out.float(), ref_o) < TOL[torch.bfloat16], flag
        assert int((norms >= 0).sum()) == bs * hkv  # each row's new key's norm, stored by one launch
        alone = torch.full_like(case.q, float("nan"))
        K.two_segment_decode(*case.args(), out=alone, **twins[1 - flag], **common)  # not its turn
        assert torch.isnan(alone).all(), flag
    assert int(counters.abs().sum()) == 0
    # the heuristic's splits for every row: 0; a long row among short ones: 1
    base = K.choose_num_splits(bs, hkv, 400, 2)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    assert int(K.balance_gate(torch.full((bs,), base, **i32), None, hkv, 400, 2)) == 0
    assert int(K.balance_gate(splits, None, hkv, 400, 2)) == int((splits != base).any())
    uneven = torch.tensor([base + 2, 1, 1], **i32)
    assert int(K.balance_gate(uneven, None, hkv, 400, 2)) == 1
    # rows another kernel serves (row_mask != 1) do not count
    assert int(K.balance_gate(uneven, torch.tensor([0, 1, 1], **i32), hkv, 400, 2)) == int(base != 1)
    # a gated launch must not need the merge kernel
    with pytest.raises(AssertionError, match="merge kernel"):
        K.two_segment_decode(*case.args(), num_splits=3, fused_merge=False, gate=(gate, True), num_sms=2,
                             max_kv_len=400, **case.kwargs(), **SMALL)


@pytest.mark.parametrize("with_lse", [False, True])
def test_one_grid_holds_both_twins_and_answers_as_the_one_the_flag_picks(monkeypatch, with_lse):
    """gate=(flag, None): the plain partition's programs and the balanced one's in one
    launch. With the flag 0 it answers as the plain launch, with 1 as the balanced one,
    bit for bit (the same chunks, the same merges), the side effects stored once; the
    split counters are left at 0; where the launch is not balanced (here: asked
    without balance) it is the plain launch, ungated, whatever the flag."""
    bs, hkv = 3, 2
    case = T.make_decode_case([300, 40, 35], [0, [20, 3], 12], [(0, 300), (32, 40), (30, 35)], num_kv_heads=hkv,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=13)
    ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, **case.kwargs())
    counters = K.make_split_counters(bs, hkv, DEVICE)
    common = dict(num_sms=2, max_kv_len=400, split_counters=counters, return_lse=with_lse, **case.kwargs(), **SMALL)
    splits = K.step_row_splits(case.a_len, case.b_start, case.b_end, None, hkv, 400, 2)
    for flag in (0, 1):
        gate = torch.tensor([flag], dtype=torch.int32, device=DEVICE)
        twin = dict(balance=True, row_splits=splits) if flag else dict(balance=False)
        want = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")), **twin, **common)
        norms = torch.full((case.k_pool.shape[0], hkv), -1.0, device=DEVICE)
        tsd, launches = _record_grids(monkeypatch, "GATE_RUN", "BALANCE")
        got = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")), key_norms=norms,
                                   balance=True, row_splits=splits, gate=(gate, None), **common)
        monkeypatch.undo()
        base, grid_splits = K.balanced_grid_splits(bs, hkv, 400, 2, 16)
        assert launches == [((bs, hkv, base + grid_splits), 3, True)]  # the plain splits, then the balanced
        got, want = (got, want) if with_lse else ((got,), (want,))
        for g, w in zip(got, want):
            assert not torch.isnan(g).any() and torch.equal(g, w), flag
        assert T.rel_error(got[0].float(), ref_o) < TOL[torch.bfloat16]
        if with_lse:
            torch.testing.assert_close(got[1], ref_lse.to(got[1].device), atol=2e-2, rtol=0)
        assert int((norms >= 0).sum()) == bs * hkv  # each row's new key's norm, stored once
        assert int(counters.abs().sum()) == 0
    plain = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")), balance=False, **common)
    plain = plain if with_lse else (plain,)
    for flag in (0, 1):
        gate = torch.tensor([flag], dtype=torch.int32, device=DEVICE)
        tsd, launches = _record_grids(monkeypatch, "GATE_RUN", "BALANCE")
        got = K.two_segment_decode(*case.args(), out=torch.full_like(case.q, float("nan")), balance=False,
                                   gate=(gate, None), **common)
        monkeypatch.undo()
        assert [(g, run) for g, run, _ in launches] == [((bs, hkv, K.choose_num_splits(bs, hkv, 400, 2, min_split_len=16)), 0)]
        got = got if with_lse else (got,)
        assert all(torch.equal(g, w) for g, w in zip(got, plain)), flag


def test_one_grid_unset_is_chosen_over_fp8_where_the_plain_launch_splits_a_row_once(monkeypatch):
    """BALANCE_ONE_GRID unset: the gated pair as one grid over fp8 where the plain
    launch has one split a row (H200 Qwen3-1.7B shape: 8192 x 32 served faster with
    it), the pair where it has several (32768 x 8 slower) and over bf16 (untimed);
    set, it decides alone."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "BALANCE_ONE_GRID", None)
    sms, hkv, max_kv = 132, 8, 140000
    assert K.choose_num_splits(32, hkv, max_kv, sms, kv_fp8=True) == 1
    assert K.choose_num_splits(8, hkv, max_kv, sms, kv_fp8=True) > 1
    assert K.one_grid(32, hkv, max_kv, sms, kv_fp8=True)
    assert not K.one_grid(8, hkv, max_kv, sms, kv_fp8=True)
    assert not K.one_grid(32, hkv, max_kv, sms, kv_fp8=False)
    # rows under one split's keys (DEFAULT_MIN_SPLIT_LEN): one split whatever the batch
    assert K.one_grid(1, hkv, 100, sms, kv_fp8=True)
    for forced in (True, False):
        monkeypatch.setattr(tsd, "BALANCE_ONE_GRID", forced)
        assert {K.one_grid(bs, hkv, max_kv, sms, kv_fp8=f) for bs in (1, 8, 32) for f in (True, False)} == {forced}


@pytest.mark.parametrize("value, expected", [(None, None), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_one_grid_switch_reads_unset_as_the_shapes_choice(value, expected):
    """SGLANG_SPARSE_BALANCE_ONE_GRID: unset is None (one_grid decides by shape), a
    switch's on / off values force it; read as the module loads (a fresh process)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("SPARSE_BALANCE_ONE_GRID")}
    if value is not None:
        env["SGLANG_SPARSE_BALANCE_ONE_GRID"] = value
    code = "import importlib; print(importlib.import_module(%r).BALANCE_ONE_GRID)" % K.two_segment_decode.__module__
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


def test_balance_gate_keeps_short_rows_alike_on_the_plain_launch():
    """balance_gate given the step's segments: rows alike whose shares pass the
    heuristic's splits (fp8's 4 programs an SM) open the gate only where each balanced
    program reads BALANCE_MIN_PROGRAM_KEYS keys (8192 x 32's sparse rows: yes; 32768 x
    8's and 131072 x 4's: no; every row dense: yes); unequal shares (a dense row among
    sparse ones) always; shares equal to the heuristic's never; masked rows (another
    kernel's) count neither keys nor shares."""
    i32 = dict(dtype=torch.int32)

    def gate(bs, n, dense, mask=None, fp8=True):
        a = torch.full((bs, 8), 2052, **i32)
        b0, b1 = torch.full((bs,), n - 256, **i32), torch.full((bs,), n, **i32)
        for r in dense:
            a[r], b0[r] = 0, 0
        m = None if mask is None else torch.tensor(mask, **i32)
        splits = K.step_row_splits(a, b0, b1, m, 8, 140000, 132, kv_fp8=fp8)
        base = K.choose_num_splits(bs, 8, 140000, 132, kv_fp8=fp8)
        plain = K.balance_gate(splits, m, 8, 140000, 132, kv_fp8=fp8)  # shares against the heuristic's only
        got = K.balance_gate(splits, m, 8, 140000, 132, kv_fp8=fp8, segments=(a, b0, b1))
        assert int(plain) == int(((splits != base) & (torch.ones(bs, dtype=torch.bool) if m is None else m == 1)).any())
        assert int(got) <= int(plain)
        return int(got)

    assert gate(32, 8192, []) == 1  # 73856 keys over 64 programs: 1154 a program
    assert gate(8, 32768, []) == 0 and gate(4, 131072, []) == 0  # 288 and 144 a program
    assert gate(8, 32768, [0]) == 1 and gate(4, 131072, [2]) == 1 and gate(32, 8192, [5]) == 1
    assert gate(8, 32768, range(8)) == 1 and gate(32, 8192, range(32)) == 1
    assert gate(8, 32768, [], fp8=False) == 0 and gate(8, 32768, [0], fp8=False) == 1  # bf16: the heuristic's P
    # the dense row served by another kernel: the served rows are alike and short
    assert gate(8, 32768, [0], mask=[0] + [1] * 7) == 0


def test_balance_is_asked_for_and_widens_the_heuristic_s_grid(monkeypatch):
    """balance=True with the heuristic's splits: the grid has balance_factor() x them
    and the answers are the reference's; off by default, and where kernels.balances
    says no (one row) or without split counters (no fused merge)."""
    tsd, launches = _record_grids(monkeypatch, "BALANCE")
    case = T.make_decode_case([300, 40, 35], [0, [20, 3], 12], [(0, 300), (32, 40), (30, 35)], num_kv_heads=2,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=3)
    counters = K.make_split_counters(3, 2, DEVICE)
    base = tsd.choose_num_splits(3, 2, 400, 2, min_split_len=16)
    assert K.balances(3, 2, 400, 2, min_split_len=16)
    for kw, balanced in ((dict(split_counters=counters, balance=True), True),
                         (dict(split_counters=counters), False),
                         (dict(balance=True), False)):
        launches.clear()
        check(case, num_sms=2, max_kv_len=400, **kw, **SMALL)
        (grid, bal), = launches
        assert bal == balanced and grid[2] == (base * tsd.balance_factor() if balanced else base), kw.keys()
    one = T.make_decode_case([300], [0], [(0, 300)], num_kv_heads=2, group=2, head_dim=64, cap=20,
                             dtype=torch.bfloat16, device=DEVICE, seed=4)
    assert not K.balances(1, 2, 400, 2, min_split_len=16)
    launches.clear()
    check(one, num_sms=2, max_kv_len=400, split_counters=counters, balance=True, **SMALL)
    assert launches[0][1] is False
    assert int(counters.abs().sum()) == 0


def test_split_major_grid_is_the_balanced_launch_s_alone_and_changes_no_bit(monkeypatch):
    """BALANCE_SPLIT_MAJOR: a balanced launch's grid is (splits, Hkv, bs) and its
    answers are bit for bit the request-major grid's (the same partition, merged in
    split order whoever arrives last); a plain launch keeps (bs, Hkv, splits)."""
    tsd, grids = _record_grids(monkeypatch, "BALANCE", "SPLIT_MAJOR")
    case = T.make_decode_case([300, 40, 35], [0, [20, 3], 12], [(0, 300), (32, 40), (30, 35)], num_kv_heads=2,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=11)
    counters = K.make_split_counters(3, 2, DEVICE)
    outs = {}
    for major in (False, True):
        monkeypatch.setattr(tsd, "BALANCE_SPLIT_MAJOR", major)
        grids.clear()
        o, lse = K.two_segment_decode(*case.args(), return_lse=True, num_sms=2, max_kv_len=400,
                                      split_counters=counters, balance=True, **case.kwargs(), **SMALL)
        (grid, bal, got_major), = grids
        assert bal and got_major == major
        assert grid == ((grid[0], 2, 3) if major else (3, 2, grid[2]))
        outs[major] = (o, lse)
        grids.clear()
        K.two_segment_decode(*case.args(), num_sms=2, max_kv_len=400, split_counters=counters, **case.kwargs(),
                             **SMALL)
        (grid, bal, got_major), = grids
        assert not bal and not got_major and grid[:2] == (3, 2)
    base = outs[False]
    for key, (o, lse) in outs.items():
        assert torch.equal(o, base[0]) and torch.equal(lse, base[1]), key
    assert not torch.isnan(base[0]).any()
    assert int(counters.abs().sum()) == 0
    record = torch.zeros(3 * 2 * 64, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="compiled GPUs only"):  # %smid has no interpreter
        K.two_segment_decode(*case.args(), num_sms=2, max_kv_len=400, record=record, **case.kwargs(), **SMALL)


# -----------------------------------------------------------------------------
# GPU: indexed segment A and the fused merge at real sizes, under CUDA graphs
# -----------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ctx", [32768, 131072])
def test_gpu_indexed_long_context(ctx, fused):
    """Rows: indexed (2K listed positions per head, different counts), dense, compact."""
    hkv = 8
    seq_lens = [ctx - 7, ctx // 2, ctx - 100]
    b_ranges = [(seq_lens[0] - 256, seq_lens[0]), (0, seq_lens[1]), (seq_lens[2] - 256, seq_lens[2])]
    case = T.make_decode_case(
        seq_lens, [0, 0, 1500], b_ranges, num_kv_heads=hkv, group=2, head_dim=128, cap=2048,
        dtype=torch.bfloat16, device="cuda", seed=ctx, empty_slot_value=None,
    )
    T.set_indexed_rows(case, {0: [2048 - 37 * h for h in range(hkv)]}, cap_pos=2048, seed=1)
    check(case, fused_merge=fused, max_kv_len=ctx)


@gpu_test
def test_gpu_fused_merge_graph_replay():
    """fused_merge inside a CUDA graph: 64 splits at batch 1 (many concurrent
    arrivals per counter), lengths changed between replays, counters back at 0
    after every replay, output equal to the two-launch path."""
    seq_lens = [70000, 5000, 300]
    case = T.make_decode_case(
        seq_lens, [0, 100, 0], [(0, 70000), (3000, 5000), (0, 300)], num_kv_heads=8, group=2, head_dim=128,
        cap=512, dtype=torch.bfloat16, device="cuda", seed=12, empty_slot_value=None, max_ctx=131072,
    )
    T.set_indexed_rows(case, {2: 0}, cap_pos=512, seed=2)
    counters = K.make_split_counters(3, 8, "cuda")
    out = torch.empty_like(case.q)
    kw = dict(max_kv_len=131072, num_splits=64, out=out, a_pos=case.a_pos, fused_merge=True, split_counters=counters)
    K.two_segment_decode(*case.args(), **kw)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.two_segment_decode(*case.args(), **kw)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step in range(20):
        n0 = 1000 + step * 3400
        case.b_start.copy_(torch.tensor([0, 1000 + step, 290 - step], dtype=torch.int32))
        case.b_end.copy_(torch.tensor([n0, 5000 - step, 300], dtype=torch.int32))
        case.a_len.copy_(torch.randint(0, 513, case.a_len.shape, device="cuda", dtype=torch.int32, generator=gen))
        case.a_len[2].clamp_(max=290 - step)
        for h in range(8):
            m = int(case.a_len[2, h])
            case.a_pos[2, h, :m] = torch.randperm(290 - step, device="cuda", generator=gen)[:m].to(torch.int32)
        g.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0
        two = K.two_segment_decode(*case.args(), max_kv_len=131072, num_splits=64, a_pos=case.a_pos)
        assert T.rel_error(out.float(), two.float()) < 2e-3
        if step % 5 == 0:
            ref = K.two_segment_decode_ref(*case.args(), a_pos=case.a_pos)
            assert T.rel_error(out.float(), ref) < TOL[torch.bfloat16]


def test_balanced_splits_are_shares_of_the_programs_by_keys():
    """balanced_splits: a uniform batch gets the heuristic's splits back; a long row
    among short ones proportionally more, clamped to the grid; rows another path
    serves (row_mask != 1) count for nothing."""
    i32 = dict(dtype=torch.int32)
    for bs, per_head in ((8, 33), (32, 33), (4, 33), (64, 33)):
        a = torch.full((bs, 8), 2052, **i32)
        b0, b1 = torch.full((bs,), 8192 - 256, **i32), torch.full((bs,), 8192, **i32)
        want = K.choose_num_splits(bs, 8, 140000, 132)
        assert K.balanced_splits(a, b0, b1, None, per_head, 64).tolist() == [want] * bs
    # 31 sparse rows of 2308 keys and a dense row of 8192 at batch 32 (132 SMs: 33
    # programs per KV head): the dense row gets floor(8192 * 33 / 79740) = 3 splits.
    a = torch.full((32, 8), 2052, **i32)
    a[0] = 0
    b0 = torch.full((32,), 8192 - 256, **i32)
    b0[0] = 0
    b1 = torch.full((32,), 8192, **i32)
    got = K.balanced_splits(a, b0, b1, None, 33, 4)
    assert got[0] == 3 and (got[1:] == 1).all() and got.dtype == torch.int32
    assert K.balanced_splits(a, b0, b1, None, 33, 2)[0] == 2  # the grid's bound
    mask = torch.ones(32, **i32)
    mask[1:] = 0  # only the dense row served here: all the programs are its
    assert K.balanced_splits(a, b0, b1, mask, 33, 64)[0] == 33
    empty = torch.zeros(2, **i32)
    assert K.balanced_splits(torch.zeros(2, 8, **i32), empty, empty, None, 33, 4).tolist() == [1, 1]


def test_balanced_shares_never_pass_their_programs():
    """Floored shares: on random batches (dense, sparse and empty rows, a row mask, fp8's
    doubling) the shares sum to at most the programs a KV head plus one for each row
    whose share was raised to its one program, so a step sized to one wave stays in
    it; each share is proportional to its keys within one program."""
    from sgl_sparse.kernels.two_segment_decode import FP8_DENSE_SPLIT_KEYS

    g = torch.Generator().manual_seed(38)
    for trial in range(200):
        bs = int(torch.randint(2, 40, (1,), generator=g))
        n = torch.randint(0, 140000, (bs,), generator=g)
        dense = torch.rand(bs, generator=g) < 0.3
        a = torch.where(dense, 0, torch.randint(0, 2053, (bs,), generator=g))[:, None].repeat(1, 8).to(torch.int32)
        b1 = n.to(torch.int32)
        b0 = torch.where(dense, 0, (n - 256).clamp(min=0)).to(torch.int32)
        mask = (torch.rand(bs, generator=g) < 0.8).to(torch.int32) if trial % 2 else None
        per_head, grid = 33, int(torch.randint(1, 65, (1,), generator=g))
        fp8 = bool(trial % 3)
        got = K.balanced_splits(a, b0, b1, mask, per_head, grid, kv_fp8=fp8)
        keys = (a[:, 0].long() + (b1 - b0).long()) * (1 if mask is None else mask.long())
        total = int(keys.sum().clamp(min=1))
        programs = 2 * per_head if fp8 and total >= per_head * FP8_DENSE_SPLIT_KEYS else per_head
        raised = int(((keys * programs) // total == 0).sum())
        assert got.dtype == torch.int32 and int(got.min()) >= 1 and int(got.max()) <= grid
        assert int(got.sum()) <= programs + raised, (trial, got.tolist(), programs)
        ideal = keys.double() * programs / total
        assert bool(((got.double() <= ideal.clamp(min=1)) | (got == 1)).all())
        assert bool(((got.double() > ideal - 1) | (got == grid)).all())


def test_step_row_splits_and_the_balanced_grid_as_the_wrapper_sizes_them():
    """step_row_splits: None where the batch does not balance (batch 1), else the
    shares of the balanced program target (what the backend passes every layer): the
    heuristic's over bf16, 4 an SM over fp8; balanced_grid_splits: the heuristic's splits
    and balance_factor() x them (4 over bf16, 16 over fp8), bounded by MAX_SPLITS and by
    the keys."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    i32 = dict(dtype=torch.int32)
    a = torch.zeros(4, 8, **i32)
    b0, b1 = torch.zeros(4, **i32), torch.tensor([130512, 2308, 2308, 2308], **i32)
    got = K.step_row_splits(a, b0, b1, None, 8, 140000, 132)
    want = K.balanced_splits(a, b0, b1, None, 132 * tsd.programs_per_sm(False) // 8, tsd.MAX_SPLITS)
    assert torch.equal(got, want) and int(got[0]) > int(got[1])
    assert K.step_row_splits(a[:1], b0[:1], b1[:1], None, 8, 140000, 132) is None  # batch 1
    base = K.choose_num_splits(4, 8, 140000, 132)
    assert K.balanced_grid_splits(4, 8, 140000, 132) == (base, min(tsd.MAX_SPLITS, base * 4))
    fp8 = K.step_row_splits(a, b0, b1, None, 8, 140000, 132, kv_fp8=True)
    assert torch.equal(fp8, K.balanced_splits(a, b0, b1, None, 132 * 4 // 8, tsd.MAX_SPLITS, kv_fp8=True))
    base8 = K.choose_num_splits(4, 8, 140000, 132, kv_fp8=True)
    assert K.balanced_grid_splits(4, 8, 140000, 132, kv_fp8=True) == (base8, min(tsd.MAX_SPLITS, base8 * 16))
    assert K.balanced_grid_splits(4, 8, 300, 132)[1] == 3  # the keys bound it: one split per 128


def test_a_balanced_launch_filling_the_gpu_shares_more_and_answers_the_same(monkeypatch):
    """BALANCE_PROGRAMS_PER_SM and BALANCE_FACTOR (the A/B knobs of a balanced launch
    that fills the GPU): the shares divide P = SMs x that / Hkv, so a dense row among
    sparse ones takes more splits, in a grid of factor x the heuristic's; the answers
    stay the reference's; the counters end zero."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    n = [320, 40, 36, 44]
    case = T.make_decode_case(n, [0, [9, 4], 12, 0], [(0, 320), (32, 40), (30, 36), (40, 44)], num_kv_heads=2,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=41)
    ref_o, _ = K.two_segment_decode_ref(*case.args(), return_lse=True, **case.kwargs())
    counters = K.make_split_counters(4, 2, DEVICE)
    shares, outs = {}, {}
    for pps, factor in ((0, 4), (8, 16)):
        monkeypatch.setattr(tsd, "BALANCE_PROGRAMS_PER_SM", pps)
        monkeypatch.setattr(tsd, "BALANCE_FACTOR", factor)
        splits = K.step_row_splits(case.a_len, case.b_start, case.b_end, None, 2, 400, 4)
        shares[pps] = splits.tolist()
        out = torch.full_like(case.q, float("nan"))
        outs[pps] = K.two_segment_decode(*case.args(), out=out, num_sms=4, max_kv_len=400, split_counters=counters,
                                         balance=True, row_splits=splits, **case.kwargs(), **SMALL)
        assert not torch.isnan(out).any() and T.rel_error(out.float(), ref_o) < TOL[torch.bfloat16], pps
    assert shares[8][0] > shares[0][0] and sum(shares[8]) > sum(shares[0]), shares
    assert int(counters.abs().sum()) == 0
    assert int(counters.abs().sum()) == 0


def test_balanced_splits_double_over_fp8_for_dense_steps():
    """Over fp8 a step whose programs would each read >= FP8_DENSE_SPLIT_KEYS keys
    (an SFI slow step at 131072 x 4: every row dense) takes twice the programs; the
    same batch's fast steps (rows of ~2.3K keys), 32768 x 8's dense step (~8K keys a
    program) and bf16 pools keep the heuristic's."""
    from sgl_sparse.kernels.two_segment_decode import FP8_DENSE_SPLIT_KEYS

    i32 = dict(dtype=torch.int32)

    def rows(bs, n, dense):
        a = torch.full((bs, 8), 0 if dense else 2052, **i32)
        b0 = torch.full((bs,), 0 if dense else n - 256, **i32)
        return a, b0, torch.full((bs,), n, **i32)

    assert FP8_DENSE_SPLIT_KEYS == 12288
    dense130 = rows(4, 130512, True)
    assert K.balanced_splits(*dense130[:3], None, 33, 32).tolist() == [8] * 4  # bf16: the heuristic's
    # 66 programs a KV head over 4 rows: 16 each (floored: 17 would be 68, past the one
    # wave of 4 resident an SM on 132 SMs)
    assert K.balanced_splits(*dense130[:3], None, 33, 32, kv_fp8=True).tolist() == [16] * 4
    assert K.balanced_splits(*dense130[:3], None, 33, 12, kv_fp8=True).tolist() == [12] * 4  # the grid's bound
    assert K.balanced_splits(*rows(4, 130512, False), None, 33, 32, kv_fp8=True).tolist() == [8] * 4
    assert K.balanced_splits(*rows(8, 33280, True), None, 33, 16, kv_fp8=True).tolist() == [4] * 8
    # one dense row among sparse ones: 137436 keys, 4165 a program, below the bound;
    # the dense row gets floor(130512 * 33 / 137436) = 31 as before
    a, b0, b1 = rows(4, 130512, False)
    a[0], b0[0] = 0, 0
    assert K.balanced_splits(a, b0, b1, None, 33, 32, kv_fp8=True).tolist() == [31, 1, 1, 1]


def test_an_all_dense_step_balances_where_its_shares_pass_the_heuristic(monkeypatch):
    """dense_step_balances (host): a step of dense rows only (every request an SFI
    slow step) balances exactly where the device's shares would give a request more
    programs than the heuristic's splits and each program still reads
    BALANCE_MIN_PROGRAM_KEYS keys: over fp8 at 4 programs an SM 131072 x 4, 32768 x 8 and
    8192 x 32 (all faster balanced, session 41), not over bf16 (slower), nor short rows,
    nor where the batch does not balance; at the heuristic's 2 an SM only where
    balanced_splits doubles its programs (131072 x 4), and never without that doubling."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    i32 = dict(dtype=torch.int32)

    def more_programs(bs, n, fp8):  # what the device's shares of such a step give
        if not K.balances(bs, 8, 140000, 132, kv_fp8=fp8):
            return False
        shares = K.step_row_splits(torch.zeros(bs, 8, **i32), torch.zeros(bs, **i32), torch.full((bs,), n, **i32),
                                   None, 8, 140000, 132, kv_fp8=fp8)
        return bool((shares > K.choose_num_splits(bs, 8, 140000, 132, kv_fp8=fp8)).all())

    cases = ((4, 130000, True, True), (4, 131072, True, True), (8, 32768, True, True), (32, 8192, True, True),
             (8, 256, True, False), (4, 130000, False, False), (1, 130000, True, False), (2, 130000, True, False))
    for bs, n, fp8, want in cases:
        assert K.dense_step_balances(bs, bs * n, 8, 140000, 132, kv_fp8=fp8) == want, (bs, n, fp8)
        if n >= 8192:
            assert more_programs(bs, n, fp8) == want, (bs, n, fp8)
    monkeypatch.setattr(tsd, "BALANCE_PROGRAMS_PER_SM", 2)
    for bs, n, want in ((4, 131072, True), (8, 32768, False), (32, 8192, False)):
        assert K.dense_step_balances(bs, bs * n, 8, 140000, 132, kv_fp8=True) == want, (bs, n)
        assert more_programs(bs, n, True) == want, (bs, n)
    monkeypatch.setattr(tsd, "FP8_DENSE_SPLIT_KEYS", 0)
    assert not K.dense_step_balances(4, 4 * 131072, 8, 140000, 132, kv_fp8=True)


# -----------------------------------------------------------------------------
# fp8 KV caches (SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2)
# -----------------------------------------------------------------------------

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_fp8_cache(case, fp8, k_scale, v_scale):
    """The case's pool and compact buffers stored as SGLang stores an fp8 cache."""
    return case.stored_as(fp8, k_scale, v_scale)


def _check_fp8(case, k_scale, v_scale, **kw):
    """Kernel against the reference of the dequantized cache (k * k_scale, v * v_scale)."""
    out = torch.full_like(case.q, float("nan"))
    o, lse = K.two_segment_decode(*case.args(), out=out, return_lse=True, k_scale=k_scale, v_scale=v_scale,
                                  **case.kwargs(), **kw)
    ref_o, ref_lse = K.two_segment_decode_ref(*case.args(), return_lse=True, k_scale=k_scale, v_scale=v_scale,
                                              **case.kwargs())
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    # fp8 values widen to bf16 exactly: the kernel's error is the bf16 path's.
    assert T.rel_error(o.float(), ref_o) < TOL[case.q.dtype]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].to(lse.device), atol=2e-2, rtol=0)
    return o


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("f16_dots,v_asm", [(True, True), (True, False), (False, False)])
def test_fp8_kv_cache_mixed_batch(monkeypatch, fp8, num_splits, f16_dots, v_asm):
    """Compact segment A, in-place sinks, windows and dense rows over an fp8 cache
    with scales, GQA 4, lengths off the block size; one launch; the dots in fp16
    (values widened by the compiler or by inline PTX; the interpreter runs the
    former) and in the query's dtype."""
    import importlib

    mod = importlib.import_module("sgl_sparse.kernels.two_segment_decode")
    monkeypatch.setattr(mod, "FP8_F16_DOTS", f16_dots)
    monkeypatch.setattr(mod, "FP8_V_ASM", v_asm)
    rng = random.Random(77 + num_splits)
    seq_lens, a_lens, b_ranges = mixed_batch(5, 2, 37, rng)
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=2, group=4, head_dim=64, cap=37,
                              dtype=torch.bfloat16, device=DEVICE, seed=5 + num_splits)
    case.a_slot[0] = -1  # its A read in place from the pool (sink tokens)
    k_scale, v_scale = 0.5, 2.0
    o = _check_fp8(_as_fp8_cache(case, fp8, k_scale, v_scale), k_scale, v_scale, num_splits=num_splits, **SMALL)
    # Unit scales read the stored values as they are: a different answer.
    o1 = K.two_segment_decode(*_as_fp8_cache(case, fp8, k_scale, v_scale).args(), num_splits=num_splits, **SMALL)
    assert T.rel_error(o1.float(), o.float()) > 0.1


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_kv_cache_indexed_rows(fp8):
    """quest/asyncspade-style rows (per-KV-head position lists) over an fp8 cache."""
    n = [97, 70, 83]
    case = T.make_decode_case(n, [0, [9, 24], 0], [(97 - 17, 97), (70 - 9, 70), (0, 83)], num_kv_heads=2,
                              group=4, head_dim=64, cap=24, dtype=torch.bfloat16, device=DEVICE, seed=9,
                              empty_slot_value=None)
    T.set_indexed_rows(case, {0: [31, 5]}, cap_pos=45, seed=9)
    _check_fp8(_as_fp8_cache(case, fp8, 1.0, 1.0), None, None, num_splits=2, **SMALL)


def test_plain_fp8_splits_doubles_one_split_where_the_warps_fit(monkeypatch):
    """The plain launch over fp8 splits twice where the heuristic splits once and
    twice the 2-warp programs fit FP8_PLAIN_WARPS_PER_SM (8) warps an SM: the H200
    Qwen3-1.7B shape at 8192 x 32 (256 programs on 132 SMs) doubles, 2048 x 64 (512)
    and 32768 x 8 (4 splits) do not; the balanced grid, the gate and one_grid keep the
    heuristic's; 0 turns it off."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "FP8_NUM_WARPS", 2)
    f, sms, hkv, max_kv = K.plain_fp8_splits, 132, 8, 140000
    base = {bs: K.choose_num_splits(bs, hkv, max_kv, sms, kv_fp8=True) for bs in (8, 20, 32, 33, 34, 64)}
    assert base == {8: 4, 20: 1, 32: 1, 33: 1, 34: 1, 64: 1}
    assert {bs: f(b, bs, hkv, max_kv, sms) for bs, b in base.items()} == {8: 4, 20: 2, 32: 2, 33: 2, 34: 1, 64: 1}
    assert f(1, 32, hkv, 100, sms) == 1  # one split's keys (DEFAULT_MIN_SPLIT_LEN): no second
    assert K.one_grid(32, hkv, max_kv, sms, kv_fp8=True) and K.balanced_grid_splits(32, hkv, max_kv, sms,
                                                                                    kv_fp8=True)[0] == 1
    monkeypatch.setattr(tsd, "FP8_NUM_WARPS", 4)  # 4-warp programs: the heuristic's target already
    assert f(1, 32, hkv, max_kv, sms) == 1
    monkeypatch.setattr(tsd, "FP8_NUM_WARPS", 2)
    monkeypatch.setattr(tsd, "FP8_PLAIN_WARPS_PER_SM", 0)
    assert f(1, 32, hkv, max_kv, sms) == 1


def test_gate_compares_shares_with_the_plain_partition_it_would_run(monkeypatch):
    """balance_gate's premise (shares equal to the plain partition's splits: the same
    work) against the partition that actually runs: the one grid's is the heuristic's,
    the pair's plain twin over fp8 plain_fp8_splits' (at 8192 x 32 on 132 SMs: 2 where
    the heuristic gives 1), so with the pair forced (BALANCE_ONE_GRID=0) rows alike whose
    shares are 2 keep the plain launch, and with the one grid they open the balanced
    partition. bf16 keeps the heuristic's either way."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "FP8_NUM_WARPS", 2)
    monkeypatch.setattr(tsd, "FP8_PLAIN_WARPS_PER_SM", 8)
    monkeypatch.setattr(tsd, "BALANCE_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(tsd, "FP8_DENSE_SPLIT_KEYS", 0)  # shares of P = 4 an SM, not doubled
    sms, hkv, max_kv, bs = 132, 8, 140000, 32
    i32 = dict(dtype=torch.int32)
    shares = torch.full((bs,), sms * 4 // hkv // bs, **i32)
    assert int(shares[0]) == 2
    for forced, want_plain, want_gate in ((None, 1, 1), (True, 1, 1), (False, 2, 0)):
        monkeypatch.setattr(tsd, "BALANCE_ONE_GRID", forced)
        assert K.plain_partition_splits(bs, hkv, max_kv, sms, kv_fp8=True) == want_plain, forced
        assert int(K.balance_gate(shares, None, hkv, max_kv, sms, kv_fp8=True)) == want_gate, forced
        assert K.plain_partition_splits(bs, hkv, max_kv, sms, kv_fp8=False) == K.choose_num_splits(bs, hkv, max_kv,
                                                                                                  sms)
    # the pair forced, a dense row among the sparse ones still opens it
    uneven = shares.clone()
    uneven[3] = 30
    assert int(K.balance_gate(uneven, None, hkv, max_kv, sms, kv_fp8=True)) == 1
    # where the heuristic splits several times (32768 x 8) the plain twin keeps them
    assert K.plain_partition_splits(8, hkv, max_kv, sms, kv_fp8=True) == K.choose_num_splits(8, hkv, max_kv, sms,
                                                                                              kv_fp8=True)


@pytest.mark.parametrize("fp8", FP8)
def test_plain_launch_over_fp8_takes_the_doubled_splits_and_answers_the_same(monkeypatch, fp8):
    """A plain launch over fp8 at a shape the heuristic gives one split (3 requests x 2
    KV heads on 3 SMs) runs 2 splits, merged in the launch (split counters given),
    against the reference; the same launch over bf16 stays at one."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "FP8_NUM_WARPS", 2)
    rng = random.Random(48)
    seq_lens, a_lens, b_ranges = mixed_batch(3, 2, 29, rng)
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=2, group=4, head_dim=64, cap=29,
                              dtype=torch.bfloat16, device=DEVICE, seed=48)
    sms, max_kv = 3, 400
    assert K.choose_num_splits(3, 2, max_kv, sms, kv_fp8=True) == 1
    counters = K.make_split_counters(3, 2, DEVICE)
    common = dict(num_sms=sms, max_kv_len=max_kv, min_split_len=16, split_counters=counters, block_n=16)
    _, launches = _record_grids(monkeypatch, "FUSED_MERGE")
    _check_fp8(_as_fp8_cache(case, fp8, 0.5, 2.0), 0.5, 2.0, **common)
    K.two_segment_decode(*case.args(), **case.kwargs(), **common)
    assert launches == [((3, 2, 2), True), ((3, 2, 1), False)]
    assert int(counters.abs().sum()) == 0


def test_fp8_kv_cache_refuses_a_mixed_pair():
    case = _standard_case()
    mixed = dataclasses.replace(case, k_pool=case.k_pool.to(FP8[0]), v_pool=case.v_pool.to(FP8[0]))
    with pytest.raises(AssertionError, match="compact buffers the pool's"):
        K.two_segment_decode(*mixed.args())  # fp8 pool, bf16 compact buffers


@gpu_test
@pytest.mark.parametrize("fp8", FP8)
def test_gpu_fp8_long_context(fp8):
    rng = random.Random(5)
    seq_lens, a_lens, b_ranges = [], [], []
    for i, policy in enumerate(["dense", "sink_window", "select_recent", "dense"]):
        n = 32768 - rng.randint(0, 100)
        a, b = T.policy_segments(policy, n, budget=2048 + 256)
        seq_lens.append(n)
        a_lens.append(min(a, 4096))
        b_ranges.append(b)
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=8, group=2, head_dim=128, cap=4096,
                              dtype=torch.bfloat16, device="cuda", seed=3)
    _check_fp8(_as_fp8_cache(case, fp8, 0.75, 1.5), 0.75, 1.5)


def test_fp8_balanced_launch_takes_fp8_s_programs(monkeypatch, fp8_doubles):
    """Over fp8 the balanced launch's grid is balance_factor(True) x the fp8 heuristic's
    splits (twice bf16's here), bounded by the keys, and its answers are the reference's."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    grids, orig = [], tsd._two_segment_decode_stage1

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return orig[grid]

    monkeypatch.setattr(tsd, "_two_segment_decode_stage1", Recording())
    case = T.make_decode_case([300, 40, 35], [0, [20, 3], 12], [(0, 300), (32, 40), (30, 35)], num_kv_heads=2,
                              group=2, head_dim=64, cap=20, dtype=torch.bfloat16, device=DEVICE, seed=3)
    base = tsd.choose_num_splits(3, 2, 400, 4, min_split_len=16, kv_fp8=True)
    assert base == 2 * tsd.choose_num_splits(3, 2, 400, 4, min_split_len=16)
    assert K.balances(3, 2, 400, 4, min_split_len=16, kv_fp8=True)
    _check_fp8(_as_fp8_cache(case, FP8[0], 0.5, 2.0), 0.5, 2.0, num_sms=4, max_kv_len=400, balance=True,
               split_counters=K.make_split_counters(3, 2, DEVICE), min_split_len=16, block_n=16)
    assert grids == [(3, 2, min(tsd.MAX_SPLITS, 400 // 16, base * tsd.balance_factor(True)))]


def test_fp8_dense_step_doubles_its_balanced_programs(monkeypatch):
    """FP8_DENSE_SPLIT_KEYS lowered to this test's sizes: a balanced launch over fp8
    whose rows are all dense gives each row about twice its share of programs
    (within the grid), and its answers are still the reference's; the row splits it
    used are recorded from the launch. At 2 programs an SM (fp8's default 4 would
    leave the doubled shares past this test's grid)."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "FP8_DENSE_SPLIT_KEYS", 16)
    monkeypatch.setattr(tsd, "BALANCE_PROGRAMS_PER_SM", 2)
    seen, orig = [], tsd.balanced_splits

    def recording(*args, **kw):
        seen.append(orig(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(tsd, "balanced_splits", recording)
    lens = [300, 290, 280]
    case = T.make_decode_case(lens, [0, 0, 0], [(0, n) for n in lens], num_kv_heads=2, group=2, head_dim=64, cap=20,
                              dtype=torch.bfloat16, device=DEVICE, seed=4)
    zeros = torch.zeros(3, 2, dtype=torch.int32)
    b0, b1 = torch.zeros(3, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    per_head = 4 * tsd.balance_programs_per_sm(True) // 2  # 4 pretend SMs over 2 KV heads
    plain = orig(zeros, b0, b1, None, per_head, 4)
    doubled = orig(zeros, b0, b1, None, per_head, 4, kv_fp8=True)
    assert plain.tolist() == [1, 1, 1] and doubled.tolist() == [2, 2, 2]  # floor(300 * 8 / 870), the grid 4
    _check_fp8(_as_fp8_cache(case, FP8[0], 0.5, 2.0), 0.5, 2.0, num_sms=4, max_kv_len=400, balance=True,
               split_counters=K.make_split_counters(3, 2, DEVICE), min_split_len=16, block_n=16)
    assert [t.tolist() for t in seen] == [[2, 2, 2]]


@gpu_test
@pytest.mark.parametrize("split_major", [False, True])
@pytest.mark.parametrize("fp8", FP8)
def test_gpu_fp8_balanced_launch_as_served(fp8, split_major, fp8_doubles, monkeypatch):
    """The launch a batch of 8 takes over fp8 in a step with an SFI slow row among
    fast ones, split factor 2: the heuristic's 8 splits (programs_per_sm), balanced
    over a 32-split grid, fused merge, one dense row of 32K among compact rows of 2308
    keys; in either grid order (BALANCE_SPLIT_MAJOR)."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "BALANCE_SPLIT_MAJOR", split_major)
    bs, n = 8, 32768
    seq_lens = [n - 37 * i for i in range(bs)]
    a_lens = [0] + [2052] * (bs - 1)
    b_ranges = [(0, seq_lens[0])] + [(m - 256, m) for m in seq_lens[1:]]
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=8, group=2, head_dim=128, cap=2052,
                              dtype=torch.bfloat16, device="cuda", seed=11)
    case = _as_fp8_cache(case, fp8, 0.5, 2.0)
    assert K.choose_num_splits(bs, 8, 140000, 132, kv_fp8=True) == 8 and K.balances(bs, 8, 140000, 132, kv_fp8=True)
    _check_fp8(case, 0.5, 2.0, num_sms=132, max_kv_len=140000, balance=True,
               split_counters=K.make_split_counters(bs, 8, "cuda"))


@gpu_test
def test_gpu_gated_twins_in_a_graph_follow_the_step_s_gate(monkeypatch):
    """The backend's gated pair (BALANCE_GATE) captured once in a CUDA graph: steps whose
    rows are all alike (gate 0: the plain launch) and steps with a dense row among
    sparse ones (gate 1: the balanced one), alternating between replays, each bit for
    bit the ungated balanced launch of the same step; the counters back at 0. bf16 at
    the heuristic's P (an environment's SGLANG_SPARSE_BALANCE_PROGRAMS_PER_SM=4 gives
    rows alike shares past the heuristic's: the gate would never close)."""
    import importlib

    tsd = importlib.import_module(K.two_segment_decode.__module__)
    monkeypatch.setattr(tsd, "BALANCE_GATE", True)
    monkeypatch.setattr(tsd, "BALANCE_PROGRAMS_PER_SM", 0)
    bs, hkv, n = 8, 8, 32768
    case = T.make_decode_case([n] * bs, [2052] * bs, [(n - 256, n)] * bs, num_kv_heads=hkv, group=2, head_dim=128,
                              cap=2052, dtype=torch.bfloat16, device="cuda", seed=13, empty_slot_value=None)
    counters = K.make_split_counters(bs, hkv, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row_splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    gate = torch.empty(1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(case.q)
    common = dict(max_kv_len=140000, out=out, split_counters=counters)

    def step():
        row_splits.copy_(K.step_row_splits(case.a_len, case.b_start, case.b_end, None, hkv, 140000, sms))
        gate.copy_(K.balance_gate(row_splits, None, hkv, 140000, sms))
        K.two_segment_decode(*case.args(), balance=False, gate=(gate, False), **common)
        K.two_segment_decode(*case.args(), balance=True, row_splits=row_splits, gate=(gate, True), **common)

    def dense_row(on: bool):  # row 0: the whole sequence, or 2052 compact + 256 recent
        case.a_len[0].fill_(0 if on else 2052)
        case.b_start[0] = 0 if on else n - 256

    step()  # compiled outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(6):
        dense_row(i % 2 == 1)
        g.replay()
        torch.cuda.synchronize()
        assert int(gate) == i % 2 and int(counters.abs().sum()) == 0, i
        want = K.two_segment_decode(*case.args(), balance=True, max_kv_len=140000,
                                    split_counters=K.make_split_counters(bs, hkv, "cuda"))
        assert torch.equal(out, want), i


@gpu_test
def test_gpu_record_says_where_each_program_ran():
    """record=: every program of the grid writes its SM and start time, those that
    run to the end their end time too (the probe's view of the block scheduler); the
    answers are the unrecorded launch's."""
    bs, hkv, splits = 4, 8, 4
    case = T.make_decode_case([4096] * bs, [0] * bs, [(0, 4096)] * bs, num_kv_heads=hkv, group=2, head_dim=128,
                              cap=16, dtype=torch.bfloat16, device="cuda", seed=39)
    counters = K.make_split_counters(bs, hkv, "cuda")
    want = K.two_segment_decode(*case.args(), num_splits=splits, split_counters=counters, fused_merge=True)
    rec = torch.zeros(bs * hkv * splits, 3, dtype=torch.int64, device="cuda")
    got = K.two_segment_decode(*case.args(), num_splits=splits, split_counters=counters, fused_merge=True, record=rec)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert bool((rec[:, 0] >= 0).all() and (rec[:, 0] < sms).all()), rec[:, 0].unique()
    assert bool((rec[:, 1] > 0).all()) and bool((rec[:, 2] >= rec[:, 1]).all())  # every split holds keys: all ran


def test_values_widen_by_inline_ptx_only_where_its_conversions_exist(monkeypatch):
    """_widen_v's PTX (fp8-pair conversions) needs sm_89 or later: an A100 (sm_80)
    serving an e5m2 cache keeps the compiler's widening; never under the interpreter."""
    from sgl_sparse.kernels import _utils

    cuda = torch.device("cuda", 0)
    assert not _utils.has_fp8_pair_conversions(torch.device("cpu"))
    assert not _utils.has_fp8_pair_conversions(cuda)  # the interpreter (conftest)
    monkeypatch.setattr(_utils, "is_interpreter", lambda: False)
    for cap, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(_utils, "_cuda_capability", lambda index, cap=cap: cap)
        assert _utils.has_fp8_pair_conversions(cuda) == ok, cap


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def _capture_stage1(monkeypatch):
    """(the module, its stage-1 kernel, the list every launch of it appends (args, kw)
    to): the launches still run."""
    import importlib

    mod = importlib.import_module("sgl_sparse.kernels.two_segment_decode")  # the module, not its function
    fn, launches = mod._two_segment_decode_stage1, []

    class Capture:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((args, kw))
                return fn[grid](*args, **kw)
            return launch

    monkeypatch.setattr(mod, "_two_segment_decode_stage1", Capture())
    return mod, fn, launches


def _sm90_launch(fn, args, kw):
    """A captured launch of ``fn`` as compile_sm90 takes it: (signature, constexprs,
    16-divisible arguments, compile options), the options out of ``kw``."""
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if kw.get(k) is not None}
    kw.pop("maxnreg", None)
    sig, const, divisible = {}, {}, []
    for name, value in zip(fn.arg_names, list(args) + [kw[k] for k in fn.arg_names[len(args):]]):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TRITON_TYPES[value.dtype]
            divisible.append(name)
        elif name in kw:
            sig[name], const[name] = "constexpr", value
        else:
            sig[name] = "fp32" if isinstance(value, float) else "i32"
            if isinstance(value, int) and value % 16 == 0 and value:
                divisible.append(name)  # as Triton's launcher specializes 16-divisible ints
    const["FP32_DOT"] = False  # the interpreter's workaround (needs_fp32_dot); compiled code takes the native dot
    return sig, const, divisible, options


@pytest.mark.skipif(HAS_CUDA, reason="the launch is captured from the interpreter")
def test_balanced_slow_step_over_fp8_compiles_within_its_register_cap(monkeypatch):
    """The SFI slow step's balanced launch over e4m3 (dense rows, key norms, the query
    saved, logits kept, fused merge) carries maxnreg = BALANCE_MAX_REGISTERS, and
    compiled for sm_90 with it fits 128 registers without spilling: 4 programs an SM,
    what its shared memory allows (Triton 3.6 on the H200 gave it 142 uncapped, 3 an
    SM, 1.5x slower: session 38; Triton 3.7 here gives 128 either way). Over bf16 and
    unbalanced, Triton chooses."""
    mod, fn, launches = _capture_stage1(monkeypatch)
    n, bs, hkv, group = 160, 2, 2, 2
    case = T.make_decode_case([n] * bs, [0] * bs, [(0, n)] * bs, num_kv_heads=hkv, group=group, head_dim=128,
                              cap=16, dtype=torch.bfloat16, device=DEVICE, seed=38, empty_slot_value=None)
    for kv_dtype in (FP8[0], torch.bfloat16):
        c = case.stored_as(kv_dtype) if kv_dtype != torch.bfloat16 else case
        for balance in (True, False):
            K.two_segment_decode(*c.args(), num_splits=3, fused_merge=True, balance=balance,
                                 split_counters=K.make_split_counters(bs, hkv, DEVICE), max_kv_len=n,
                                 **c.slow_step_outputs(n))
    # and the gated pair as one grid over fp8
    c = case.stored_as(FP8[0])
    K.two_segment_decode(*c.args(), num_splits=3, fused_merge=True, balance=True,
                         split_counters=K.make_split_counters(bs, hkv, DEVICE), max_kv_len=n,
                         gate=(torch.ones(1, dtype=torch.int32, device=DEVICE), None), **c.slow_step_outputs(n))
    # the cap is a program's registers at 4 warps (balance_maxnreg): none for the one grid's 2
    caps = [kw.get("maxnreg") for _, kw in launches]
    assert caps == [mod.BALANCE_MAX_REGISTERS, None, None, None, None], caps
    assert mod.BALANCE_MAX_REGISTERS == 128
    # over fp8 the plain launch and the one grid at FP8_NUM_WARPS, the balanced one at
    # FP8_BALANCED_NUM_WARPS (sessions 45-46)
    warps = [kw.get("num_warps") for _, kw in launches]
    assert warps == [mod.FP8_BALANCED_NUM_WARPS, mod.FP8_NUM_WARPS, 4, 4, mod.FP8_NUM_WARPS], warps
    assert (mod.FP8_BALANCED_NUM_WARPS, mod.FP8_NUM_WARPS) == (4, 2)
    one_grid = launches.pop()
    sig, const, divisible, options = _sm90_launch(fn, *launches[0])
    assert const["BALANCE"] and const["SAVE_LOGITS"] and const["STORE_KNORM"] and options["maxnreg"] == 128
    const["V_ASM"] = const["F16_DOTS"] and mod.FP8_V_ASM  # the interpreter cannot run inline PTX
    # and the split-major variant (BALANCE_SPLIT_MAJOR), a probe's record of each
    # program's SM and times (inline PTX: compiled here, never interpreted), the gated one
    for major, record, gate_run in ((False, False, 0), (True, False, 0), (True, True, 0), (False, False, 1)):
        const["SPLIT_MAJOR"] = major
        const["RECORD"], const["GATE_RUN"] = record, gate_run
        sig["REC"] = "*i64" if record else sig["B_END"]
        got = T.compile_sm90("sgl_sparse.kernels.two_segment_decode", "_two_segment_decode_stage1", sig, const,
                             divisible, options=options, resources=True)
        assert got["registers"] <= 128 and got["stack_bytes"] == 0, (major, record, gate_run, got)
        assert got["shared_bytes"] * 4 <= 228 * 1024, got  # 4 programs an SM by shared memory too
    # the gated pair as one grid (BALANCE_ONE_GRID) at its own launch's options: 2 warps,
    # uncapped (under 128 a thread it spilled), still 4 programs an SM by registers
    sig, const, divisible, options = _sm90_launch(fn, *one_grid)
    assert const["GATE_RUN"] == 3 and options == {"num_warps": 2, "num_stages": options["num_stages"]}
    const["V_ASM"] = const["F16_DOTS"] and mod.FP8_V_ASM
    got = T.compile_sm90("sgl_sparse.kernels.two_segment_decode", "_two_segment_decode_stage1", sig, const,
                         divisible, options=options, resources=True)
    assert got["stack_bytes"] == 0 and got["registers"] * 64 * 4 <= 65536, got
    assert got["shared_bytes"] * 4 <= 228 * 1024, got


def test_balance_maxnreg_keeps_a_programs_registers_at_any_warps(monkeypatch):
    """BALANCE_MAX_REGISTERS is a thread's cap at 4 warps: at other warps the same
    registers a program, none past a thread's 255 or with the knob at 0."""
    import importlib

    mod = importlib.import_module(K.two_segment_decode.__module__)
    assert [mod.balance_maxnreg(w) for w in (1, 2, 4, 8)] == [None, None, 128, 64]
    monkeypatch.setattr(mod, "BALANCE_MAX_REGISTERS", 96)
    assert [mod.balance_maxnreg(w) for w in (1, 2, 4, 8)] == [None, 192, 96, 48]
    monkeypatch.setattr(mod, "BALANCE_MAX_REGISTERS", 0)
    assert [mod.balance_maxnreg(w) for w in (1, 2, 4, 8)] == [None] * 4


@pytest.mark.skipif(HAS_CUDA, reason="the launch is captured from the interpreter")
@pytest.mark.parametrize("kv_dtype,f16_dots", [(FP8[0], True), (FP8[0], False), (FP8[1], True),
                                               (torch.bfloat16, True)])
def test_kernel_compiles_for_sm90_over_fp8_caches(monkeypatch, kv_dtype, f16_dots):
    """The launch serving makes (indexed rows, fused merge) compiles for the H100/H200
    (sm_90) over fp8 caches, its arguments captured from an interpreted launch (the
    interpreter's fp32 dots swapped for the native ones). The K/V tiles stream into
    shared memory by async copies, never byte-wise, and e4m3 widens with sm_90's
    pair conversion (e5m2 is fp16's top byte). With fp16 dots (FP8_F16_DOTS, the
    default) the values widen before P.V's operand is read (``_widen_v``): that
    read is ldmatrix.trans as over bf16, where bf16 dots read the operand one
    value per byte load (the session-30 profile's bound: 40% of copy bandwidth)."""
    mod, fn, launches = _capture_stage1(monkeypatch)
    monkeypatch.setattr(mod, "FP8_F16_DOTS", f16_dots)
    n = [97, 70, 83]
    case = T.make_decode_case(n, [0, [9, 24], 0], [(97 - 17, 97), (70 - 9, 70), (0, 83)], num_kv_heads=2,
                              group=4, head_dim=128, cap=24, dtype=torch.bfloat16, device=DEVICE, seed=9,
                              empty_slot_value=None)
    T.set_indexed_rows(case, {0: [31, 5]}, cap_pos=45, seed=9)
    fp8 = kv_dtype != torch.bfloat16
    if fp8:
        case = _as_fp8_cache(case, kv_dtype, 0.5, 2.0)
    K.two_segment_decode(*case.args(), num_splits=2, split_counters=K.make_split_counters(3, 2, DEVICE),
                         k_scale=0.5, v_scale=2.0, **case.kwargs())
    (args, kw), = launches
    sig, const, divisible, options = _sm90_launch(fn, args, kw)
    assert sig["K_POOL"] == sig["A_K"] == "*" + _TRITON_TYPES[kv_dtype] and const["FUSED_MERGE"] and const["HAS_A_POS"]
    const["V_ASM"] = const["F16_DOTS"] and mod.FP8_V_ASM  # the interpreter cannot run inline PTX
    widen = r"cvt\.rn\.f16x2\.e4m3x2"
    byte_reads = r"ld\.shared\.[bu]8"
    trans = r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16"
    mma = {t: rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32" for t in ("bf16", "f16")}
    copies = {w: rf"cp\.async\.c[ag]\.shared\.global [^;]*, 0x{w:x}," for w in (1, 2, 8, 16)}
    counts = T.compile_sm90("sgl_sparse.kernels.two_segment_decode", "_two_segment_decode_stage1", sig, const,
                            divisible, options=options,
                            patterns=[widen, byte_reads, trans, *mma.values(), *copies.values()])
    got = {w: counts[p] for w, p in copies.items()}
    assert got[1] == got[2] == 0 and got[16] > 0, got  # 16-byte copies: bf16 tiles, q, the lists, fp8 with V_ASM
    f16 = fp8 and f16_dots
    assert (counts[mma["f16"]] > 0) == f16 and (counts[mma["bf16"]] > 0) == (not f16), counts
    if fp8 and not f16_dots:
        assert got[8] > 0 and counts[byte_reads] > 0 and counts[trans] == 0, counts
    else:
        assert counts[byte_reads] == 0 and counts[trans] > 0, counts
    assert (counts[widen] > 0) == (kv_dtype == torch.float8_e4m3fn), counts


@pytest.mark.skipif(HAS_CUDA, reason="the launch is captured from the interpreter")
def test_store_lists_cost_the_served_launch_no_registers(monkeypatch):
    """``a_lists`` (a store's lists read by row) compiled for sm_90 in the launch
    asyncspade's rows take over e4m3 (pool slots, fused merge; plain and balanced):
    within the registers that leave the 4 programs an SM its shared memory allows (128
    a thread at 4 warps, the balanced launch; 256 at the plain launch's 2), no spills,
    and the same 16-byte list and tile copies."""
    mod, fn, launches = _capture_stage1(monkeypatch)
    n = [97, 70, 83]
    case = T.make_decode_case(n, [0, [9, 24], 0], [(97 - 17, 97), (70 - 9, 70), (83 - 20, 83)], num_kv_heads=2,
                              group=2, head_dim=128, cap=24, dtype=torch.bfloat16, device=DEVICE, seed=19,
                              empty_slot_value=None)
    T.set_indexed_rows(case, {0: [31, 5], 2: [8, 40]}, cap_pos=45, seed=19)
    case = _as_fp8_cache(case, FP8[0], 0.5, 2.0)
    slots = T.pool_slots_of(case)
    rows = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEVICE)
    store = (rows, slots[:2].clone(), case.a_len[:2].clone())
    for balance in (False, True):
        for lists in (None, store):
            K.two_segment_decode(*case.args(), num_sms=2, max_kv_len=200, balance=balance, fused_merge=True,
                                 split_counters=K.make_split_counters(3, 2, DEVICE), a_pos=slots, a_pos_slots=True,
                                 a_lists=lists, k_scale=0.5, v_scale=2.0)
    copies = r"cp\.async\.c[ag]\.shared\.global [^;]*, 0x10,"
    got = []
    for args, kw in launches:
        sig, const, divisible, options = _sm90_launch(fn, args, kw)
        const["V_ASM"] = const["F16_DOTS"] and mod.FP8_V_ASM  # the interpreter cannot run inline PTX
        got.append(T.compile_sm90("sgl_sparse.kernels.two_segment_decode", "_two_segment_decode_stage1", sig,
                                  const, divisible, options=options, patterns=[copies], resources=True))
        got[-1]["flags"] = (const["BALANCE"], const["HAS_A_ROW"], options.get("maxnreg"))
        got[-1]["threads"] = 32 * options["num_warps"]
    (plain, plain_rows), (bal, bal_rows) = got[:2], got[2:]
    assert [g["flags"] for g in got] == [(False, False, None), (False, True, None), (True, False, 128),
                                         (True, True, 128)], got
    # 4 programs an SM, what an fp8 tile's shared memory allows (55 KB a program), need
    # at most 64K registers / 4 a program: 128 a thread at the balanced launch's 4
    # warps, 256 at the plain launch's 2 (FP8_NUM_WARPS)
    assert [g["threads"] for g in got] == [64, 64, 128, 128], got
    assert all(g["registers"] * g["threads"] * 4 <= 65536 for g in (plain_rows, bal_rows)), got
    assert plain_rows["shared_bytes"] == plain["shared_bytes"] and plain["shared_bytes"] * 4 <= 228 * 1024, got
    assert all(g["stack_bytes"] == 0 for g in got), got
    assert plain_rows[copies] == plain[copies] > 0 and bal_rows[copies] == bal[copies], got
