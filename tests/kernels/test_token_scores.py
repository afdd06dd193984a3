"""Tests for kernels.token_scores against float64 references.

Interpreter-sized: ragged ranges not aligned to the 16/64-key blocks, GQA
ratios 1/4/8, bf16 and fp16 pools, q_hat in the KV dtype and in fp32 (the
split-query path). Scores are dot products of 16-bit values accumulated in
fp32, so they must match float64 to fp32 rounding; with an fp32 q_hat the
two-part split keeps ~16 query bits, far tighter than rounding q_hat to the
KV dtype would (checked). -inf must appear exactly outside the range; the
output is NaN-poisoned first so an unwritten entry fails.
"""

import pytest
import torch

from sgl_sparse import kernels as K
from sgl_sparse.kernels import testing as T

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seq_lens, group, dtype, seed, head_dim=64):
    n = len(seq_lens)
    return T.make_decode_case(
        seq_lens, [0] * n, [(0, s) for s in seq_lens], num_kv_heads=2, group=group, head_dim=head_dim,
        cap=1, dtype=dtype, device=DEVICE, seed=seed,
    )


def _close(s, ref, rtol=2e-5):
    assert not torch.isnan(s).any(), "unwritten (NaN) score"
    assert torch.equal(torch.isneginf(s), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    scale = ref[fin].abs().max().item() if fin.any() else 1.0
    torch.testing.assert_close(s[fin], ref[fin], rtol=rtol, atol=rtol * scale)
    return fin


CONFIGS = [(dtype, group) for dtype in (torch.bfloat16, torch.float16) for group in (1, 4, 8)]


@pytest.mark.parametrize("idx", range(len(CONFIGS)))
def test_token_scores_ranges(idx):
    dtype, group = CONFIGS[idx]
    seq_lens = [150, 47, 90, 33]
    case = _case(seq_lens, group, dtype, seed=idx)
    lo = torch.tensor([4, 0, 60, 20], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([150 - 17, 47, 60, 33], dtype=torch.int32, device=DEVICE)  # row 2: empty
    if idx == 1:  # row 2 empty past the output width, row 3 a range past it (clipped)
        lo[2], hi[2] = 170, 180
        lo[3], hi[3] = 140, 190
    n_max = 150
    args = (case.q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, n_max)
    out = torch.full((4, 2, n_max), float("nan"), device=DEVICE)
    s = K.token_scores(*args, out=out, num_programs=2, block_n=16)
    fin = _close(s, K.token_scores_ref(*args))
    assert fin.sum() == 2 * (129 + 47 + 0 + (10 if idx == 1 else 13))


def test_token_scores_no_fill():
    """fill=False (the CUDA-graph path, whose topk_range reads [lo, hi) only): the
    same scores in range (-inf in range past req_to_token's row), nothing written
    outside the key blocks overlapping it, and rows with an empty range untouched."""
    seq_lens = [150, 47, 90, 33]
    case = _case(seq_lens, 4, torch.float16, seed=11)
    lo = torch.tensor([4, 0, 60, 20], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([145, 47, 60, 33], dtype=torch.int32, device=DEVICE)  # row 2: empty
    n_max = 150
    r2t = case.req_to_token[:, :140]  # row 0's range runs past req_to_token's row: -inf there
    args = (case.q, case.k_pool, r2t, case.req_pool_idx, lo, hi, case.sm_scale, n_max)
    ref = K.token_scores_ref(*args)
    for programs in (1, 3):
        out = torch.full((4, 2, n_max), float("nan"), device=DEVICE)
        s = K.token_scores(*args, out=out, num_programs=programs, block_n=16, fill=False)
        pos = torch.arange(n_max, device=DEVICE)
        live = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :].expand_as(s)
        # outside the range: only -inf in the key blocks overlapping it, nothing past them
        assert (torch.isnan(s[~live]) | torch.isneginf(s[~live])).all()
        assert torch.isnan(s[2]).all() and torch.isnan(s[1, :, 48:]).all() and torch.isnan(s[3, :, 48:]).all()
        assert not torch.isnan(s[live]).any()
        assert torch.equal(torch.isneginf(s[live]), torch.isneginf(ref[live]))
        fin = torch.isfinite(ref) & live
        torch.testing.assert_close(s[fin], ref[fin], rtol=2e-5, atol=1e-4)
        assert fin[0].sum() == 2 * (140 - 4) and torch.isneginf(s[0, :, 140:145]).all()


def test_token_scores_fp32_query_split():
    """fp32 q_hat: the hi+lo split matches float64 ~100x better than rounding q_hat."""
    case = _case([120, 70], 4, torch.bfloat16, seed=11, head_dim=128)
    g = torch.Generator(device=DEVICE).manual_seed(12)
    q32 = torch.randn(case.q.shape, generator=g, device=DEVICE)
    lo = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([120, 70], dtype=torch.int32, device=DEVICE)
    pool = (case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 128)
    s = K.token_scores(q32, *pool)  # default tiling
    ref = K.token_scores_ref(q32, *pool)
    fin = _close(s, ref, rtol=2e-5)
    rounded = K.token_scores(q32.to(torch.bfloat16), *pool)
    err_split = (s[fin] - ref[fin]).abs().max().item()
    err_round = (rounded[fin] - ref[fin]).abs().max().item()
    assert err_split * 30 < err_round, (err_split, err_round)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_token_scores_over_an_fp8_pool(fp8, q_dtype):
    """asyncspade over --kv-cache-dtype fp8_*: the keys widen exactly to the query's
    16-bit dtype (bf16 for an fp32 q_hat, split in two parts as over a bf16 pool), so
    the scores match the float64 reference of the fp8 values as tightly as over bf16;
    the raw path and the token_scores_at path (lfps's) alike."""
    case = _case([150, 47, 90], 4, torch.bfloat16, seed=21, head_dim=64)
    pool = case.k_pool.to(fp8)
    g = torch.Generator(device=DEVICE).manual_seed(22)
    q = torch.randn(case.q.shape, generator=g, device=DEVICE).to(q_dtype)
    lo = torch.tensor([4, 0, 60], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([133, 47, 60], dtype=torch.int32, device=DEVICE)  # row 2: empty
    args = (q, pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 150)
    out = torch.full((3, 2, 150), float("nan"), device=DEVICE)
    fin = _close(K.token_scores(*args, out=out, num_programs=2, block_n=16), K.token_scores_ref(*args))
    assert fin.sum() == 2 * (129 + 47)
    cand = torch.randint(-1, 150, (3, 2, 24), generator=g, device=DEVICE, dtype=torch.int32)
    at_args = (q, pool, case.req_to_token, case.req_pool_idx, cand, case.sm_scale)
    kw = dict(lo=lo, hi=hi)
    _close(K.token_scores_at(*at_args, **kw, block_n=16), K.token_scores_at_ref(*at_args, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 8])
def test_token_scores_at_candidates(dtype, group):
    """Per-head candidate lists with per-head lengths (one 0), -1 padding and
    out-of-range positions, over the range [lo, hi)."""
    seq_lens = [130, 60, 80]
    case = _case(seq_lens, group, dtype, seed=20 + group)
    g = torch.Generator(device=DEVICE).manual_seed(21)
    c = 40
    cand = torch.randint(-3, 140, (3, 2, c), generator=g, device=DEVICE, dtype=torch.int32)
    cand[0, 0, :37] = torch.randperm(130, generator=g, device=DEVICE)[:37].to(torch.int32)
    cand_len = torch.tensor([[37, 40], [0, 25], [40, 19]], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([4, 0, 10], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([120, 60, 80], dtype=torch.int32, device=DEVICE)
    args = (case.q, case.k_pool, case.req_to_token, case.req_pool_idx, cand, case.sm_scale)
    out = torch.full((3, 2, c), float("nan"), device=DEVICE)
    s = K.token_scores_at(*args, cand_len=cand_len, lo=lo, hi=hi, out=out, block_n=16)
    ref = K.token_scores_at_ref(*args, cand_len=cand_len, lo=lo, hi=hi)
    fin = _close(s, ref)
    assert fin[0, 0].sum() >= 20 and not fin[1, 0].any()
    # Same positions scored by the dense kernel: identical values.
    dense = K.token_scores(case.q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 130,
                           block_n=16)
    b, h = 0, 0
    pos = cand[b, h, :37].long()
    keep = fin[b, h, :37]
    assert torch.equal(s[b, h, :37][keep], dense[b, h][pos[keep]])


def test_token_scores_at_no_len_no_range():
    """Without cand_len / lo / hi: every entry in [0, max_ctx) is scored, -1 is padding."""
    case = _case([50, 64], 4, torch.float16, seed=31)
    cand = torch.tensor([[[0, 49, -1, 10], [3, -1, -1, 2]], [[63, 1, 2, -1], [5, 6, 7, 8]]],
                        dtype=torch.int32, device=DEVICE)
    args = (case.q, case.k_pool, case.req_to_token, case.req_pool_idx, cand, case.sm_scale)
    s = K.token_scores_at(*args)
    fin = _close(s, K.token_scores_at_ref(*args))
    assert torch.equal(fin, cand >= 0)


def _token_expected(scores, budget, b_start, k, n_sink, cand=None):
    bs, hkv, n = scores.shape
    out = {}
    for b in range(bs):
        s = int(b_start[b])
        for h in range(hkv):
            order = sorted(range(n), key=lambda i: -float(scores[b, h, i]))[:k][: budget[b]]
            keep = [i for i in order if scores[b, h, i] != float("-inf")]
            pos = [int(cand[b, h, i]) if cand is not None else i for i in keep]
            out[b, h] = list(range(min(n_sink, s))) + [p for p in pos if n_sink <= p < s]
    return out


def test_token_select_positions():
    """Top-k of token scores (positions = indices) and of candidate scores
    (positions = cand_pos[index]) -> sinks, then kept positions by descending
    score; per-row budgets, -inf entries, positions outside [n_sink, b_start) dropped."""
    g = torch.Generator().manual_seed(60)
    scores = torch.randn(3, 2, 90, generator=g)
    scores[:, :, :4] = float("-inf")  # sinks are not scored ...
    scores[1, 0, 4] = 50.0  # ... but position 4 of row 1 (n_sink = 6) is: dropped
    scores[0, 1, 30:] = float("-inf")  # head with fewer finite scores than k
    scores = scores.to(DEVICE)
    b_start = torch.tensor([80, 60, 3], dtype=torch.int32, device=DEVICE)  # row 2: b_start < n_sink
    budget = torch.tensor([40, 12, 40], dtype=torch.int32, device=DEVICE)
    k, n_sink = 40, 6
    a_pos, a_len = K.token_select_positions(scores, budget, b_start, max_select=k, n_sink=n_sink)
    assert a_pos.shape == (3, 2, n_sink + k)
    exp = _token_expected(scores.cpu(), budget.tolist(), b_start.tolist(), k, n_sink)
    for (b, h), pos in exp.items():
        assert int(a_len[b, h]) == len(pos), (b, h)
        assert a_pos[b, h, : len(pos)].tolist() == pos, (b, h)
    assert int(a_len[2, 0]) == 3
    # Candidate lists: index i means position cand[b, h, i].
    cand = torch.stack([torch.randperm(200, generator=g)[:90] for _ in range(6)]).view(3, 2, 90).to(torch.int32)
    cand = cand.to(DEVICE)
    b_start2 = torch.tensor([150, 120, 199], dtype=torch.int32, device=DEVICE)
    a_pos, a_len = K.token_select_positions(scores, 25, b_start2, max_select=k, n_sink=n_sink, cand_pos=cand)
    exp = _token_expected(scores.cpu(), [25] * 3, b_start2.tolist(), k, n_sink, cand=cand.cpu())
    for (b, h), pos in exp.items():
        assert a_pos[b, h, : int(a_len[b, h])].tolist() == pos, (b, h)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_gpu_token_scores_long(q_dtype):
    """32K and 128K rows, default tiling and program count; candidates of 4K per head."""
    seq = [131072 - 9, 32768]
    case = _case(seq, 2, torch.bfloat16, seed=50, head_dim=128)
    q = case.q.to(q_dtype)
    lo = torch.tensor([4, 4], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([seq[0] - 256, seq[1] - 256], dtype=torch.int32, device=DEVICE)
    args = (q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 131072)
    _close(K.token_scores(*args), K.token_scores_ref(*args), rtol=1e-4)
    g = torch.Generator(device=DEVICE).manual_seed(51)
    cand = torch.randint(-1, 131072, (2, 2, 4096), generator=g, device=DEVICE, dtype=torch.int32)
    cargs = (q, case.k_pool, case.req_to_token, case.req_pool_idx, cand, case.sm_scale)
    s = K.token_scores_at(*cargs, lo=lo, hi=hi)
    # The reference loops in Python: check 256 entries per (row, head).
    ref = K.token_scores_at_ref(q, case.k_pool, case.req_to_token, case.req_pool_idx, cand[:, :, :256].contiguous(),
                                case.sm_scale, lo=lo, hi=hi)
    _close(s[:, :, :256].contiguous(), ref, rtol=1e-4)
