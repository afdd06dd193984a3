"""kernels.index_keys against its references, in the Triton interpreter at small shapes.

- The copies the launches leave are bit-identical to ``quantize_keys`` of the pool's
  keys (int8 codes and fp32 scales), on every position a launch scored.
- Scores match the float64 reference of the formula (keys quantized on the fly) to
  fp32 rounding, over several steps of a decode: the first step quantizes the whole
  range, later steps read the copies and quantize the one new position; a step that
  skipped the slot, a counter reset (a new request in the slot), an empty range, a
  range past the copies' width. Ragged lengths not multiples of the 16-position
  block, GQA 1/4/8, bf16 and fp16 pools, q_hat in fp32 (AsyncSpade's prediction).
  The output is NaN-poisoned: an unwritten score in [lo, hi) fails.
- With ``h_top``: the histogram the launches add is ``top_digit_hist_ref`` of the
  scores they wrote in ``[lo, hi)`` (cold and steady steps, several programs a row,
  empty ranges, a range past the copies), and ``topk_range`` given it selects as
  without it, bit for bit, leaving it zeroed for the next step.
- The copy's scores rank like the exact scores (the approximation's size): the Top-K
  of the int8 scores keeps almost all of the exact Top-K on random keys with outlier
  channels.
"""

import pytest
import torch

from sgl_sparse.kernels import testing as T
from sgl_sparse.kernels.index_keys import (channel_smoothing, index_token_scores, index_token_scores_ref, pack_int4,
                                           quantize_keys, smoothed_codes, smoothed_query, unpack_int4)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seq_lens, group, dtype, seed, head_dim=64, num_kv_heads=2):
    n = len(seq_lens)
    return T.make_decode_case(
        seq_lens, [0] * n, [(0, s) for s in seq_lens], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        cap=1, dtype=dtype, device=DEVICE, seed=seed,
    )


def _copies(bs, hkv, ctx, d, bits=8):
    width = d // 2 if bits == 4 else d
    kq = torch.full((bs, hkv, ctx, width), 99, dtype=torch.int8, device=DEVICE)  # garbage: a previous owner's
    ks = torch.full((bs, hkv, ctx), 7.0, device=DEVICE)
    filled = torch.zeros(bs, 2, dtype=torch.int32, device=DEVICE)
    return kq, ks, filled


def _close(s, ref, lo, hi, rtol=2e-5):
    """s matches ref on every [lo, hi) (the only part written); NaN never passes."""
    for b in range(s.shape[0]):
        l, h = int(lo[b]), int(hi[b])
        if h <= l:
            continue
        got, want = s[b, :, l:h], ref[b, :, l:h]
        assert not torch.isnan(got).any(), f"row {b}: unwritten (NaN) score"
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), b
        fin = torch.isfinite(want)
        scale = want[fin].abs().max().item() if fin.any() else 1.0
        torch.testing.assert_close(got[fin], want[fin], rtol=rtol, atol=rtol * scale)


def _check_copies(case, kq, ks, lo, hi, ksmooth=None):
    for b in range(len(lo)):
        l, h = int(lo[b]), min(int(hi[b]), kq.shape[2])
        if h <= l:
            continue
        toks = case.req_to_token[int(case.req_pool_idx[b]), l:h].long()
        if ksmooth is None:
            want_q, want_s = quantize_keys(case.k_pool[toks])  # [n, Hkv, D], [n, Hkv]
            got = kq[b, :, l:h]
        else:
            want_q, want_s = smoothed_codes(case.k_pool[toks], ksmooth[b])
            got = unpack_int4(kq[b, :, l:h])
            assert torch.equal(kq[b, :, l:h], pack_int4(want_q.transpose(0, 1))), f"row {b}: packing differs"
        assert torch.equal(got, want_q.transpose(0, 1)), f"row {b}: copies differ"
        assert torch.equal(ks[b, :, l:h], want_s.T), f"row {b}: scales differ"


CONFIGS = [(dtype, group, 8) for dtype in (torch.bfloat16, torch.float16) for group in (1, 4, 8)]
CONFIGS += [(torch.bfloat16, 1, 4), (torch.float16, 4, 4), (torch.bfloat16, 8, 4)]


def _smoothing(case, seq_lens, bs):
    """Each row's 4-bit smoothing from its whole sequence's keys (serving takes the
    prompt's), with a few channels scaled up first so the factors differ by channel."""
    case.k_pool[:, :, :3] *= 16
    rows = [case.k_pool[case.req_to_token[int(case.req_pool_idx[b]), :seq_lens[b]].long()] for b in range(bs)]
    f = torch.stack([channel_smoothing(k) for k in rows])
    assert f.unique().numel() > 1
    return f


@pytest.mark.parametrize("idx", range(len(CONFIGS)))
def test_steps_read_and_fill_the_copies(idx):
    """int8 copies, and 4-bit ones under a channel smoothing (the last configs)."""
    dtype, group, bits = CONFIGS[idx]
    keys_as_m = idx % 2 == 0  # both orientations of the scoring dot over the configs
    seq_lens = [150, 47, 90, 33]
    case = _case(seq_lens, group, dtype, seed=idx)
    bs, hkv, d = 4, case.k_pool.shape[1], case.k_pool.shape[2]
    ctx = 140  # row 0's range runs past the copies' width at its last steps
    kq, ks, filled = _copies(bs, hkv, ctx, d, bits)
    f = _smoothing(case, seq_lens, bs) if bits == 4 else None
    gen = torch.Generator(device=DEVICE).manual_seed(100 + idx)
    lo = torch.tensor([4, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    # hi per step: +1 a step; row 1 skips steps 2-3 (hi grows by 3), row 3 has no row at step 1 (hi 0)
    steps = [[120, 30, 50, 20], [121, 31, 51, 0], [122, 32, 52, 21], [141, 35, 53, 22], [146, 36, 3, 23]]
    n_max = 150
    for step, his in enumerate(steps):
        hi = torch.tensor(his, dtype=torch.int32, device=DEVICE)
        q = torch.randn(bs, hkv * group, d, generator=gen, device=DEVICE)  # fp32, as the prediction
        args = (q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, n_max)
        out = torch.full((bs, hkv, n_max), float("nan"), device=DEVICE)
        s = index_token_scores(*args, kq, ks, filled, out=out, num_programs=2, block_n=16, keys_as_m=keys_as_m,
                               ksmooth=f)
        ref = index_token_scores_ref(*args, ctx=ctx, ksmooth=f)
        _close(s, ref, lo, hi)
        _check_copies(case, kq, ks, lo, hi, f)
        for b, h in enumerate(his):
            if h > int(lo[b]):  # scored: this step's counter says how far the copies go
                assert int(filled[b, h % 2]) == min(h, ctx), (step, b)
        if step == 2:
            # row 2 changes owner: its counters are zeroed, its stale copies are rewritten
            filled[2] = 0
            kq[2] = -5
    # the range past the copies' width scores -inf (row 0: [140, 146))
    assert torch.isneginf(s[0, :, ctx:146]).all()


@pytest.mark.parametrize("fp8,bits", [(torch.float8_e4m3fn, 8), (torch.float8_e5m2, 8), (torch.float8_e4m3fn, 4)])
def test_copies_of_an_fp8_pool(fp8, bits):
    """asyncspade over --kv-cache-dtype fp8_*: the copies are quantize_keys (or the 4-bit
    codes) of the fp8 keys' exact values, and the scores match the reference, over a
    cold step and a steady one."""
    import dataclasses

    seq_lens = [150, 47, 90]
    case = _case(seq_lens, 4, torch.bfloat16, seed=41)
    f = _smoothing(case, seq_lens, 3) if bits == 4 else None  # from the keys before they are stored as fp8
    case = dataclasses.replace(case, k_pool=case.k_pool.to(fp8))
    if f is not None:  # serving takes the smoothing from the cached (fp8) prompt keys
        f = torch.stack([channel_smoothing(case.k_pool[case.req_to_token[int(case.req_pool_idx[b]), :n].long()])
                         for b, n in enumerate(seq_lens)])
    bs, hkv, d, ctx, n_max = 3, case.k_pool.shape[1], case.k_pool.shape[2], 150, 150
    kq, ks, filled = _copies(bs, hkv, ctx, d, bits)
    gen = torch.Generator(device=DEVICE).manual_seed(42)
    lo = torch.tensor([4, 0, 3], dtype=torch.int32, device=DEVICE)
    for his in ([120, 30, 50], [121, 31, 51]):
        hi = torch.tensor(his, dtype=torch.int32, device=DEVICE)
        q = torch.randn(bs, hkv * 4, d, generator=gen, device=DEVICE)  # fp32, as the prediction
        args = (q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, n_max)
        out = torch.full((bs, hkv, n_max), float("nan"), device=DEVICE)
        s = index_token_scores(*args, kq, ks, filled, out=out, num_programs=2, block_n=16, ksmooth=f)
        _close(s, index_token_scores_ref(*args, ctx=ctx, ksmooth=f), lo, hi)
        _check_copies(case, kq, ks, lo, hi, f)


def _in_range(s, lo, hi):
    """s with -inf outside each row's [lo, hi): what a reference may read (the rest is
    not written, NaN here)."""
    clean = torch.full_like(s, float("-inf"))
    for b in range(s.shape[0]):
        clean[b, :, int(lo[b]):max(int(hi[b]), int(lo[b]))] = s[b, :, int(lo[b]):int(hi[b])]
    return clean


@pytest.mark.parametrize("bits,group", [(8, 1), (8, 4), (4, 1), (4, 4)])
def test_scores_add_the_topk_top_digit_histogram(bits, group):
    """h_top: each step's launch adds to a zeroed histogram exactly the top digits of
    the finite scores it wrote in [lo, hi) (top_digit_hist_ref), summed over the row's
    2-3 programs and over both of a program's loops (copies in 32-position tiles, new
    keys quantized in 16-position ones); then topk_range given it keeps what it keeps
    without it, bit for bit, and leaves it zeroed for the next step's launch, as
    serving runs them. Steps: cold (all quantized), steady (copies read, one new
    position), a skipped step, empty ranges (row 3 at step 1, row 4 always: hi <= lo),
    row 0 past the copies' width (-inf there, not counted)."""
    from sgl_sparse.kernels.topk_range import top_digit_hist_ref, topk_range

    seq_lens = [150, 47, 90, 33, 40]
    case = _case(seq_lens, group, torch.bfloat16, seed=40 + bits + group)
    bs, hkv, d = 5, case.k_pool.shape[1], case.k_pool.shape[2]
    ctx, n_max = 140, 150
    kq, ks, filled = _copies(bs, hkv, ctx, d, bits)
    f = _smoothing(case, seq_lens, bs) if bits == 4 else None
    gen = torch.Generator(device=DEVICE).manual_seed(200 + bits + group)
    lo = torch.tensor([4, 0, 3, 1, 30], dtype=torch.int32, device=DEVICE)
    steps = [[120, 30, 50, 20, 30], [121, 31, 51, 0, 12], [122, 34, 52, 21, 30], [141, 35, 53, 22, 0],
             [146, 36, 54, 23, 29]]
    budget = torch.tensor([20, 5, 0, 7, 3], dtype=torch.int32, device=DEVICE)  # row 2: h_top zeroed unread
    h = torch.zeros(bs, hkv, 64, dtype=torch.int32, device=DEVICE)
    for step, his in enumerate(steps):
        hi = torch.tensor(his, dtype=torch.int32, device=DEVICE)
        q = torch.randn(bs, hkv * group, d, generator=gen, device=DEVICE)
        out = torch.full((bs, hkv, n_max), float("nan"), device=DEVICE)
        s = index_token_scores(q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, n_max,
                               kq, ks, filled, out=out, num_programs=2 + step % 2, block_n=32,
                               keys_as_m=step % 2 == 0, ksmooth=f, h_top=h)
        want = top_digit_hist_ref(_in_range(s, lo, hi), lo, hi)
        assert torch.equal(h, want), step
        # every position scored but those past the copies; none of an empty range
        assert int(want[0].sum()) == hkv * (min(his[0], ctx) - 4) and int(want[3].sum()) == hkv * max(his[3] - 1, 0)
        assert not want[4].any(), step
        plain = topk_range(s, lo, hi, budget, 24, one_block=False)
        given = topk_range(s, lo, hi, budget, 24, h_top=h)
        assert torch.equal(given[1], plain[1]) and torch.equal(given[0], plain[0]), step
        assert not h.any(), step  # consumed: the next launch adds to zeros
        assert int(plain[1][0].min()) == 20 and not plain[1][2].any()


def test_h_top_launch_checks():
    """h_top is the index keys' only, int32 [bs, Hkv, 64] with unit stride along the bins."""
    from sgl_sparse.kernels.token_scores import launch_token_scores

    case = _case([40, 20], 1, torch.bfloat16, seed=3)
    hkv, d = case.k_pool.shape[1], case.k_pool.shape[2]
    kq, ks, filled = _copies(2, hkv, 48, d)
    lo = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([30, 10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hkv, d, device=DEVICE)
    args = (q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 48)
    for bad in (torch.zeros(2, hkv, 32, dtype=torch.int32), torch.zeros(2, hkv, 64, dtype=torch.int64),
                torch.zeros(2, hkv, 128, dtype=torch.int32)[..., ::2]):
        with pytest.raises(AssertionError, match="h_top"):
            index_token_scores(*args, kq, ks, filled, h_top=bad.to(DEVICE))
    with pytest.raises(AssertionError, match="h_top"):
        launch_token_scores(*args, out=None, num_programs=1, num_sms=None, block_n=16, num_warps=4, fill=False,
                            h_top=torch.zeros(2, hkv, 64, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("bits", [8, 4])
def test_dot_orientations_give_the_same_scores(bits):
    """keys_as_m (the key tile as the dot's M side: a warpgroup MMA on sm_90) and the
    queries as M: the same int32 sums and the same fp32 operations, so the same scores
    bit for bit, on a first step (new keys quantized, 16 positions at a time within
    32-position tiles) and on the next (the copies read); ragged lengths, GQA 4; int8
    and 4-bit copies."""
    case = _case([77, 45, 100], 4, torch.bfloat16, seed=21 if bits == 8 else 22)
    bs, hkv, d = 3, case.k_pool.shape[1], case.k_pool.shape[2]
    f = _smoothing(case, [77, 45, 100], bs) if bits == 4 else None
    lo = torch.tensor([4, 0, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(bs, hkv * 4, d, device=DEVICE)
    got = {}
    for keys_as_m in (True, False):
        kq, ks, filled = _copies(bs, hkv, 104, d, bits)
        for hi_v in ([60, 30, 99], [61, 31, 100]):
            hi = torch.tensor(hi_v, dtype=torch.int32, device=DEVICE)
            out = torch.full((bs, hkv, 104), float("nan"), device=DEVICE)
            s = index_token_scores(q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 104,
                                   kq, ks, filled, out=out, num_programs=3, block_n=32, keys_as_m=keys_as_m,
                                   ksmooth=f)
            got[keys_as_m, hi_v[0]] = s.clone()
    for h in (60, 61):
        a, b = got[True, h], got[False, h]
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), h


def test_covering_range_equals_token_scores_of_quantized_pool():
    """At one step with nothing copied yet, the scores equal token_scores of the
    dequantized query qq * qscale over a pool holding the dequantized keys kq * kscale,
    up to the products' rounding: the same dots, the scales applied after."""
    from sgl_sparse.kernels import token_scores

    case = _case([77, 64], 4, torch.float16, seed=9)
    bs, hkv, d = 2, case.k_pool.shape[1], case.k_pool.shape[2]
    kq, ks, filled = _copies(bs, hkv, 80, d)
    lo = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([77, 60], dtype=torch.int32, device=DEVICE)
    q = torch.randn(bs, hkv * 4, d, device=DEVICE).to(torch.float16)
    s = index_token_scores(q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 80, kq, ks,
                           filled, block_n=16)
    codes, scales = quantize_keys(case.k_pool)
    pool = (codes.float() * scales[..., None]).to(torch.float32)
    q_codes, q_scales = quantize_keys(q)
    want = token_scores(q_codes.float() * q_scales[..., None], pool.to(torch.float16), case.req_to_token, case.req_pool_idx, lo, hi,
                        case.sm_scale, 80, block_n=16)
    _close(s, want, lo, hi, rtol=3e-3)  # the dequantized fp16 pool rounds kq * kscale


def test_quantize_keys_edges():
    k = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -1.0, 0.5, -0.25], [1e-35, 0.0, -1e-35, 0.0],
                      [3.0, 1.5, -0.0117, 2.9999]], dtype=torch.float32)
    kq, ks = quantize_keys(k)
    assert kq.dtype == torch.int8 and ks.dtype == torch.float32
    assert kq[0].eq(0).all() and ks[0] == 0  # all-zero key
    assert kq[1].tolist() == [127, -127, 64, -32]  # 63.5 rounds half up, -31.75 to -32
    assert kq[2].eq(0).all()  # below TINY: zero codes, no inf / NaN
    assert kq[3, 0] == 127 and kq[3, 2] == -0 and kq[3, 3] == 127
    assert not torch.isnan(ks).any() and (kq.abs() <= 127).all()
    # relative reconstruction error of a key is at most half a code of its largest entry
    x = torch.randn(64, 128) * torch.rand(64, 1) * 10
    q, s = quantize_keys(x)
    err = (q.float() * s[:, None] - x).abs().amax(-1)
    assert (err <= 0.5 * s * (1 + 1e-5) + 1e-12).all()


def test_topk_of_int8_scores_keeps_the_exact_topk():
    """The approximation's size on keys with a few large channels (as LLM keys have):
    the Top-64 of 2048 positions by int8 scores (query and keys quantized, as the
    kernel scores) against the Top-64 by exact scores."""
    gen = torch.Generator().manual_seed(0)
    n, d, k = 2048, 128, 64
    keys = torch.randn(n, 1, d, generator=gen)
    keys[..., :4] *= 8  # outlier channels
    q = torch.randn(d, generator=gen)
    exact = keys[:, 0] @ q
    codes, scales = quantize_keys(keys.to(torch.bfloat16))
    q_codes, q_scale = quantize_keys(q)
    approx = (codes[:, 0].float() @ q_codes.float()) * q_scale * scales[:, 0]
    overlap = len(set(exact.topk(k).indices.tolist()) & set(approx.topk(k).indices.tolist())) / k
    assert overlap >= 0.9, overlap


def test_int4_packing_and_smoothing_edges():
    codes = torch.randint(-8, 8, (7, 3, 64), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (7, 3, 32) and packed.dtype == torch.int8
    assert torch.equal(unpack_int4(packed), codes)
    # code + 8 in each nibble: channel d low, channel d + 32 high
    assert int(packed[0, 0, 0]) & 0xFF == (int(codes[0, 0, 0]) + 8) | ((int(codes[0, 0, 32]) + 8) << 4)
    keys = torch.tensor([[[0.3, -5.0, 0.0, 1e-35]], [[-0.2, 2.0, 0.0, 0.0]], [[0.5, 1.0, 0.0, -1e-36]]])
    f = channel_smoothing(keys)  # [1, 4]
    assert f.tolist() == [[1.0, 8.0, 1.0, 1.0]]  # max |k| in [f/2, f); 1 where max <= TINY
    assert channel_smoothing(keys[:0]).eq(1).all()  # no positions: no smoothing
    # exact: the codes of k / f times f are the codes of the smoothed keys, and q * f . k / f == q . k
    k = torch.randn(50, 2, 64) * torch.linspace(0.01, 40, 64)
    f = channel_smoothing(k)
    assert torch.equal((k * (1.0 / f)) * f, k)
    codes, scales = smoothed_codes(k, f)
    assert codes.abs().max() <= 7 and codes.dtype == torch.int8
    qq, qs = smoothed_query(torch.randn(3, 4, 64), f.expand(3, 2, 64))
    assert qq.shape == (3, 4, 64) and qs.shape == (3, 4)


def _topk_overlap(approx: torch.Tensor, exact: torch.Tensor, k: int) -> float:
    return len(set(exact.topk(k).indices.tolist()) & set(approx.topk(k).indices.tolist())) / k


def test_topk_of_4bit_scores_with_smoothing():
    """Why the 4-bit copies are smoothed: on keys with a few large channels, per-token
    4-bit codes alone spend their 15 levels on those channels (the others round to 0
    or +-1) and the Top-64 of 2048 loses much of the exact one; dividing each channel
    by its power of two first keeps most of it."""
    gen = torch.Generator().manual_seed(0)
    n, d, k = 2048, 128, 64
    keys = torch.randn(n, 1, d, generator=gen)
    keys[..., :4] *= 8  # outlier channels
    keys = keys.to(torch.bfloat16)
    q = torch.randn(1, 1, d, generator=gen)
    exact = keys[:, 0].float() @ q[0, 0]
    plain_c, plain_s = quantize_keys(keys, 7.0)
    q8, q8s = quantize_keys(q)
    plain = (plain_c[:, 0].float() @ q8[0, 0].float()) * q8s[0, 0] * plain_s[:, 0]
    f = channel_smoothing(keys)
    codes, scales = smoothed_codes(keys, f)
    qq, qs = smoothed_query(q, f[None])
    smooth = (codes[:, 0].float() @ qq[0, 0].float()) * qs[0, 0] * scales[:, 0]
    o_plain, o_smooth = _topk_overlap(plain, exact, k), _topk_overlap(smooth, exact, k)
    assert o_smooth >= 0.75 and o_smooth > o_plain + 0.1, (o_smooth, o_plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_index_scores_long(bits):
    """128K and 32K rows at D 128, default tiling and program count: a first step
    (everything copied), then two steps reading the copies; copies bit-identical to
    quantize_keys on the GPU (IEEE division, no fused multiply-add). 4 bits: the
    compiled kernel unpacks nibbles with PTX on 32-bit words (the interpreter runs
    the plain int8 ops instead): this is where that path is checked."""
    seq = [131072 - 9, 32768]
    case = _case(seq, 2, torch.bfloat16, seed=60, head_dim=128)
    kq, ks, filled = _copies(2, 2, 131072, 128, bits)
    f = _smoothing(case, seq, 2) if bits == 4 else None
    lo = torch.tensor([4, 4], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(61)
    for step in range(3):
        hi = torch.tensor([seq[0] - 258 + step, seq[1] - 258 + step], dtype=torch.int32, device=DEVICE)
        q = torch.randn(2, 4, 128, generator=gen, device=DEVICE)
        args = (q, case.k_pool, case.req_to_token, case.req_pool_idx, lo, hi, case.sm_scale, 131072)
        out = torch.full((2, 2, 131072), float("nan"), device=DEVICE)
        s = index_token_scores(*args, kq, ks, filled, out=out, ksmooth=f)
        _close(s, index_token_scores_ref(*args, ksmooth=f), lo, hi, rtol=1e-4)
        _check_copies(case, kq, ks, lo, hi, f)


VEC16 = r"cp\.async\.cg\.shared\.global[^;]*0x10"
INT8_MMA = r"mma[^;]*\.s32\.s8\.s8"  # mma.sync or wgmma with int8 operands


WGMMA = r"wgmma\.mma_async[^;]*\.s8\.s8"
NIBBLE_MASK = r"and\.b32[^;]*0x0F0F0F0F"
GLOBAL_ATOMIC = r"atom\.global[^;]*\.add"  # HIST's adds to h_top


def _sm90(index_keys: bool, block_n: int = 64, keys_as_m: bool = False, resources: bool = False,
          bits: int = 8, hist: bool = False, pool: str = "*bf16") -> dict:
    """token_scores' kernel compiled for the H100 (no GPU needed), as the backend
    launches it: fp32 q_hat, bf16 pool, D 128, GQA 2, 4 warps, 3 stages; the index
    variant with fp fusion off, as index_token_scores launches it (``hist``: with
    ``h_top``, the HIST variant; ``pool``: an fp8 KV cache's type)."""
    from sgl_sparse.kernels.token_scores import _token_scores_kernel as fn

    ptrs = {"Q": "*fp32", "K_POOL": pool, "REQ_TO_TOKEN": "*i32", "REQ_POOL_IDX": "*i64", "LO": "*i32",
            "HI": "*i32", "OUT": "*fp32", "KQ": "*i8", "KSCALE": "*fp32", "FILLED": "*i32", "KSMOOTH": "*fp32",
            "H_TOP": "*i32"}
    const = dict(HEAD_DIM=128, GROUP=2, BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=128, Q_SPLIT=True, FP32_DOT=False,
                 FILL=False, INDEX_KEYS=index_keys, FRESH_N=16, KEYS_AS_M=keys_as_m, INDEX_BITS=bits,
                 ASM_NIBBLES=bits == 4, HIST=hist)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "sm_scale" else "i32") for n in fn.arg_names}
    # as the launcher specializes serving's strides and widths (multiples of 16): without
    # the copies' strides Triton cannot prove their rows aligned and does not pipeline them
    divisible = [n for n in fn.arg_names
                 if n in ptrs or n in ("stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_r2t", "stride_cs",
                                       "stride_ch", "stride_ss", "stride_sh", "stride_fs", "stride_fh",
                                       "stride_tb", "stride_th", "MAX_CTX", "IDX_CTX")]
    # the loop's tiles go through cp.async (software pipelining): count its 16-byte copies
    patterns = [r"div\.rn\.f32", r"fma\.rn\.f32", VEC16, INT8_MMA, r"cvt\.rn\.bf16", WGMMA, NIBBLE_MASK,
                GLOBAL_ATOMIC, r"mma\.sync[^;]*\.bf16\.bf16"]
    return T.compile_sm90("sgl_sparse.kernels.token_scores", "_token_scores_kernel", sig, const, divisible,
                          options={"enable_fp_fusion": not index_keys, "num_warps": 4, "num_stages": 3},
                          patterns=patterns, resources=resources)


def test_index_variant_compiles_for_sm90_with_ieee_divisions_and_no_fma():
    """What the interpreter cannot check: Triton's compiler takes the INDEX_KEYS
    variant for sm_90 (a kernel the interpreter runs may still fail to compile),
    the quantization divides with IEEE rounding (div.rn, the reference's torch
    division) and no multiply-add is fused (the reference rounds k * inv, then
    + 0.5), the int8 copies are read in 16-byte vectors like the pool's bf16 rows, and
    the scores are int8 tensor-core dots (no conversion of key tiles to bf16)."""
    kv, idx = _sm90(False), _sm90(True)
    assert idx[INT8_MMA] > 0 and kv[INT8_MMA] == 0 and idx[r"cvt\.rn\.bf16"] == 0, (idx, kv)
    assert idx[r"div\.rn\.f32"] >= 2, idx  # 127 / amax and amax / 127
    assert idx[r"fma\.rn\.f32"] == 0, idx
    assert kv[VEC16] > 0 and idx[VEC16] > kv[VEC16], (idx, kv)  # the copies' tiles beside the gathered ones


@pytest.mark.parametrize("pool", ["*fp8e4nv", "*fp8e5"])
def test_scoring_over_an_fp8_pool_compiles_for_sm90(pool):
    """asyncspade over --kv-cache-dtype fp8_*: the raw-key and the int8-copy variants
    compile for sm_90 over an fp8 pool; the raw one widens the key tiles to bf16 for
    bf16 tensor-core dots (fp32 q_hat split in two), its tiles still 16-byte copies."""
    kv, idx = _sm90(False, pool=pool), _sm90(True, pool=pool)
    assert kv[VEC16] > 0 and kv[INT8_MMA] == 0, kv
    assert kv[r"mma\.sync[^;]*\.bf16\.bf16"] > 0, kv
    assert idx[INT8_MMA] > 0 and idx[r"div\.rn\.f32"] >= 2 and idx[r"fma\.rn\.f32"] == 0, idx


def test_4bit_variant_compiles_for_sm90():
    """The 4-bit copies' variant for sm_90: int8 tensor-core dots over the unpacked
    halves (a warpgroup MMA with the keys as M), IEEE divisions and no fused
    multiply-add (its copies must equal the reference's), no spills, and registers
    and shared memory for 4 programs an SM at the serving tile."""
    r = _sm90(True, block_n=128, keys_as_m=True, resources=True, bits=4)
    assert r[WGMMA] > 0 and r[r"cvt\.rn\.bf16"] == 0, r
    assert r[NIBBLE_MASK] >= 2, r  # nibbles unpacked on 32-bit words (_nibbles' PTX)
    assert r[r"div\.rn\.f32"] >= 2 and r[r"fma\.rn\.f32"] == 0, r
    assert r["stack_bytes"] == 0 and r["registers"] * 128 * 4 <= 65536, r
    assert (r["shared_bytes"] + 1024) * 4 <= 233472, r


@pytest.mark.parametrize("keys_as_m", [False, True])
def test_index_variant_fits_several_programs_per_sm(keys_as_m):
    """The serving tile (128 positions, 4 warps, 3 stages) in registers and shared
    memory that leave room for 4+ programs an SM. Before session 22 the loop that
    quantizes new keys held a [128, D] fp32 tile: 249 registers a thread (ncu, H200),
    2 programs an SM, 12% occupancy and the pass at 48% of DRAM peak; it now
    quantizes 16 positions at a time. With ``keys_as_m`` the scores are a warpgroup
    MMA over the key tile in shared memory."""
    r = _sm90(True, block_n=128, keys_as_m=keys_as_m, resources=True)
    assert r["stack_bytes"] == 0, r  # no spills
    assert r["registers"] * 128 * 4 <= 65536, r  # 4 programs of 128 threads in the register file
    assert (r["shared_bytes"] + 1024) * 4 <= 233472, r  # and in shared memory (+1 KiB the driver's)
    assert r[VEC16] > 0, r  # the copies' tiles pipelined
    assert (r[WGMMA] > 0) == keys_as_m, r


@pytest.mark.parametrize("bits", [8, 4])
def test_hist_variant_fits_several_programs_per_sm(bits):
    """With h_top (HIST) at the serving tile, keys as M (sm_90's warpgroup MMA): the
    histogram adds no spills and keeps 4 programs an SM in registers and shared
    memory; its one atomic a bin is in, and only in, that variant. Registers a thread
    before -> with HIST: triton 3.7 int8 72 -> 79, int4 125 -> 126; triton 3.6 (the
    GPU's) 72 -> 81, 127 -> 126; shared memory unchanged (53760 / 28672 bytes)."""
    for hist in (False, True):
        r = _sm90(True, block_n=128, keys_as_m=True, resources=True, bits=bits, hist=hist)
        assert r["stack_bytes"] == 0 and r["registers"] * 128 * 4 <= 65536, (hist, r)
        assert (r["shared_bytes"] + 1024) * 4 <= 233472, (hist, r)
        assert (r[GLOBAL_ATOMIC] > 0) == hist, (hist, r)
