"""The Selector's exact medians (kernels.selector_stats: median and MAD of the key
norms on A by a radix select whose last passes read the gathered survivors) against
the sorted lower median, on value sets that stress a radix select: ties, all
equal, zeros, values over many binades, |A| = 1 and 2, ranges over many blocks."""

import pytest
import torch
import triton
import triton.language as tl

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.config import SfiPolicy
from sgl_sparse.kernels._mad_bracket import bracketed_mad, median_with_histograms
from sgl_sparse.selector import core


def _lower_median(x: torch.Tensor) -> torch.Tensor:
    return x.sort(dim=-1).values[..., (x.shape[-1] - 1) // 2]


@pytest.mark.parametrize("block_n, gather, mad_bracket", [(16, True, True), (256, True, True), (16, True, False),
                                                         (64, False, False)])
def test_medians_are_exact_on_adversarial_values(block_n, gather, mad_bracket):
    gen = torch.Generator().manual_seed(block_n)
    n, hkv = 700, 2
    rows = [
        torch.rand(hkv, n, generator=gen) * 30,  # plain
        torch.full((hkv, n), 3.25),  # all equal: MAD 0
        (torch.rand(hkv, n, generator=gen) * 4).round(),  # few distinct values, zeros among them
        torch.exp(torch.randn(hkv, n, generator=gen) * 12),  # many binades
        torch.rand(hkv, n, generator=gen) * 1e-38,  # subnormals
        1.0 + torch.randint(0, 3, (hkv, n), generator=gen) * 2.0 ** -20,  # differ only in low bits
        torch.rand(hkv, n, generator=gen) * 30,
    ]
    norms = torch.stack(rows).float()
    r = norms.shape[0]
    # All equal and low-bit-only rows: every value survives the top 16 bits (gathered
    # over many blocks); |A| = 2 and 1 in the last rows but one.
    lo = torch.tensor([0, 3, 5, 1, 0, 2, 10])
    hi = torch.tensor([n, n, 7, n - 3, 513, n, 11])
    u = torch.rand(r, hkv, n, generator=gen).masked_fill(~core.candidate_mask(lo, hi, n), 0.0)
    knobs = core.SelectorKnobs.from_specs([SfiPolicy()] * r, "cpu", torch.float32)
    stats = K.selector_stats(u, norms, lo, hi, knobs, block_n=block_n, gather=gather, mad_bracket=mad_bracket)
    for b in range(r):
        on = norms[b, :, int(lo[b]): int(hi[b])]
        med = _lower_median(on)
        mad = _lower_median((on - med[:, None]).abs())
        assert torch.equal(stats[b, :, 3], med), b
        assert torch.equal(stats[b, :, 4], mad), b
        # the reference's own definition (nanmedian over the masked row)
        ref = core._masked_lower_median(norms[b: b + 1], core.candidate_mask(lo[b: b + 1], hi[b: b + 1], n))
        assert torch.equal(stats[b, :, 3], ref[0, :, 0])


@triton.jit
def _mad_probe(X, LO, HI, SCR, OUT, stride, BLOCK_N: tl.constexpr):
    """Per row: the median's and the bracketed MAD's key bits, and whether it fell back."""
    r = tl.program_id(0)
    lo, hi = tl.load(LO + r), tl.load(HI + r)
    x, scr = X + r * stride, SCR + r * stride
    med, h_top, top, h_next = median_with_histograms(x, lo, hi, scr, BLOCK_N)
    mad, fallback = bracketed_mad(x, lo, hi, med, h_top, top, h_next, scr, BLOCK_N)
    tl.store(OUT + r * 3, med)
    tl.store(OUT + r * 3 + 1, mad)
    tl.store(OUT + r * 3 + 2, fallback.to(tl.int32))


def _key_lower_median(x: torch.Tensor) -> torch.Tensor:
    """The radix select's lower median: by the keys fp32 bits & 0x7FFFFFFF (|x| for
    x >= 0, +inf below NaN), returned as the key's float."""
    keys = x.float().contiguous().view(torch.int32) & 0x7FFFFFFF
    return keys.sort().values[(x.numel() - 1) // 2].view(torch.float32)


def test_bracketed_mad_is_the_exact_lower_mad_and_takes_one_pass_where_the_bins_allow():
    """_mad_bracket: the MAD from the median's histograms == the sorted lower MAD, bit
    for bit, whether its bracket holds (norms within the median's top-digit bin) or it
    falls back (all equal; a median near a power of 4 with a wide spread; negative
    values, outside the bracket's premises); NaN / inf among the values, ties,
    subnormals, |A| = 1 and 2, ranges ending mid-block."""
    gen = torch.Generator().manual_seed(11)
    n = 600
    lognormal = torch.exp(torch.randn(n, generator=gen) * 0.3) * 20
    with_nan = lognormal.clone()
    with_nan[::37] = float("nan")
    with_nan[5::53] = float("inf")
    rows = [
        (lognormal, False),  # the bracket holds: one pass
        ((lognormal * 4).round() / 4, False),  # ties
        (with_nan, False),
        (torch.exp(torch.randn(n, generator=gen) * 0.1) * 1e-39, None),  # subnormals (bins of 2^16 keys: coarse)
        (torch.full((n,), 3.25), True),  # MAD 0: every value gathered -> the radix select
        ((torch.randn(n, generator=gen) + 8).abs(), True),  # median at 8: the MAD's ends in coarse bins
        (torch.randn(n, generator=gen) * 5, None),  # negative values: exact either way
        (lognormal, None),  # |A| = 1
        (lognormal, None),  # |A| = 2
    ]
    x = torch.stack([v for v, _ in rows]).float()
    lo = torch.tensor([0, 3, 1, 0, 0, 7, 2, 100, 40], dtype=torch.int32)
    hi = torch.tensor([n, n - 5, n, 571, n, n, n - 1, 101, 42], dtype=torch.int32)
    out = torch.zeros(len(rows), 3, dtype=torch.int32)
    for block_n in (16, 128):
        _mad_probe[(len(rows),)](x, lo, hi, torch.empty_like(x), out, x.stride(0), BLOCK_N=block_n)
        for b, (_, fallback) in enumerate(rows):
            on = x[b, int(lo[b]): int(hi[b])]
            med = _key_lower_median(on)
            mad = _key_lower_median((on - med).abs())
            assert int(out[b, 0]) == int(med.view(torch.int32)), (b, block_n)
            assert int(out[b, 1]) == int(mad.view(torch.int32)), (b, block_n)
            if fallback is not None:
                assert bool(out[b, 2]) == fallback, (b, block_n)
    assert torch.equal(_key_lower_median(x[0]), _lower_median(x[0]))  # keys order like the values here


def test_stats_kernel_with_the_bracketed_mad_compiles_for_sm90():
    """The interpreter runs the tests; the GPU compiles the MAD's branches (bracket,
    fallbacks) and the bisection loop: compiled here for the H100 (no GPU needed)."""
    from sgl_sparse.kernels import testing as T
    from sgl_sparse.kernels.selector_scores import _selector_stats as fn

    types = {name: "*fp32" for name in ("U", "NORMS", "BETA", "ALPHA", "KAPPA", "ZETA", "CLIP", "EPS", "STATS",
                                        "SCRATCH")}
    types.update(LO="*i32", HI="*i32")
    const = dict(BLOCK_N=1024, GATHER=True, MAD_BRACKET=True)
    sig = {name: "constexpr" if name in const else types.get(name, "i32") for name in fn.arg_names}
    counts = T.compile_sm90("sgl_sparse.kernels.selector_scores", "_selector_stats", sig, const,
                            [name for name in fn.arg_names if sig[name].startswith("*")])
    assert counts.get("ld.global.b32", 0) > 0, counts


@pytest.mark.parametrize("phase", [3, 4, 5, 10])
def test_split_stats_survivor_phases_compile_for_sm90(phase):
    """The split stats' launches over slices of the survivors (3, 4: the median's
    last two digits; 5, 10: the picks from the four histograms) compiled for the
    H100: the interpreter runs the test below, not the compiler."""
    from sgl_sparse.kernels import testing as T
    from sgl_sparse.kernels.selector_stats_split import _selector_stats_split as fn

    ptrs = {"LO": "*i32", "HI": "*i32", "HIST": "*i32"}
    const = dict(PHASE=phase, BLOCK_N=1024)
    sig = {name: "constexpr" if name in const else ptrs.get(name, "*fp32") if name.isupper() else "i32"
           for name in fn.arg_names}
    sig["NSPLIT"] = "i32"
    counts = T.compile_sm90("sgl_sparse.kernels.selector_stats_split", "_selector_stats_split", sig, const,
                            [name for name in fn.arg_names if sig[name].startswith("*")])
    assert counts.get("ld.global.b32", 0) + counts.get("ld.global.v4.b32", 0) > 0, counts


def test_split_stats_match_the_single_program():
    """Each (row, head) split over several programs (selector_stats_split): the same
    exact medians (all equal and low-bit-only rows: every value a survivor, over
    several slices; ties; |A| = 1; an empty range; ranges ending mid-block), the
    sums to fp32 rounding, and the same Top-K from the scores. Compiled on the GPU
    where there is one (the kernels on its tensors, the references on the host)."""
    from sgl_sparse.kernels.topk_range import topk_range

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    n, hkv = 200, 2
    norms = torch.stack([
        (torch.rand(hkv, n, generator=gen) * 8).round() / 2 + 1,  # ties
        torch.full((hkv, n), 3.25),
        1.0 + torch.randint(0, 3, (hkv, n), generator=gen) * 2.0 ** -20,
        torch.rand(hkv, n, generator=gen) * 30,
        torch.rand(hkv, n, generator=gen) * 30,
    ]).float()
    r = norms.shape[0]
    lo = torch.tensor([3, 0, 5, 10, 50])
    hi = torch.tensor([n, 177, n - 1, 11, 20])  # |A| = 1, then empty
    u = (torch.rand(r, hkv, n, generator=gen) ** 3).masked_fill(~core.candidate_mask(lo, hi, n), 0.0)
    specs = [SfiPolicy(beta=(0.5, 1.0, 2.0)[i % 3], clip=(0.02, 1.0)[i % 2]) for i in range(r)]
    knobs = core.SelectorKnobs.from_specs(specs, dev, torch.float32)
    on_dev = [x.to(dev) for x in (u, norms, lo, hi)]
    one = K.selector_stats(*on_dev, knobs, block_n=32, splits=1).cpu()
    got = K.selector_stats(*on_dev, knobs, block_n=32, splits=3).cpu()
    assert not got.isnan().any()
    assert torch.equal(got[..., 3:], one[..., 3:])
    torch.testing.assert_close(got[..., :3], one[..., :3], rtol=1e-5, atol=0.0)
    for b in range(r - 1):
        on = norms[b, :, int(lo[b]): int(hi[b])]
        assert torch.equal(got[b, :, 3], _lower_median(on)), b
    assert (got[r - 1] == 0).all()
    # The scores (rows 0 and 2: the ties, the low bits) and their Top-K.
    rows = [0, 2]
    u, norms, lo, hi = u[rows], norms[rows], lo[rows], hi[rows]
    knobs = core.SelectorKnobs.from_specs([specs[i] for i in rows], dev, torch.float32)
    on_dev = [x.to(dev) for x in (u, norms, lo, hi)]
    s_one = K.selector_scores(*on_dev, knobs, splits=1)
    s_got = K.selector_scores(*on_dev, knobs, splits=3)
    fin = torch.isfinite(s_one)
    assert torch.equal(torch.isfinite(s_got), fin) and fin.any()
    torch.testing.assert_close(s_got[fin], s_one[fin], rtol=1e-5, atol=1e-5)
    budget = torch.full((len(rows),), 17, dtype=torch.int32, device=dev)
    lo32, hi32 = lo.int().to(dev), hi.int().to(dev)
    assert all(torch.equal(x, y) for x, y in zip(topk_range(s_got, lo32, hi32, budget, 17),
                                                 topk_range(s_one, lo32, hi32, budget, 17)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [4099, 32768, 131072])
def test_gpu_medians_exact_with_and_without_gathering(n):
    """Serving sizes: with and without gathering, the sorted lower medians."""
    gen = torch.Generator().manual_seed(n)
    r, hkv = 3, 8
    norms = torch.exp(torch.randn(r, hkv, n, generator=gen) * 0.3) * 20
    norms[1] = (norms[1] * 4).round() / 4  # ties
    lo, hi = torch.tensor([4, 0, 17]), torch.tensor([n - 256, n, n // 3])
    u = torch.rand(r, hkv, n, generator=gen).masked_fill(~core.candidate_mask(lo, hi, n), 0.0)
    norms, u, lo, hi = (x.cuda() for x in (norms, u, lo, hi))
    knobs = core.SelectorKnobs.from_specs([SfiPolicy()] * r, "cuda", torch.float32)
    from sgl_sparse.kernels._split import STATS_RULE, split_count

    # gathering on one program per row, gathering split over the automatic count, no gathering
    for gather, splits in ((True, 1), (True, max(2, split_count(n, r * hkv, u.device, STATS_RULE))), (False, None)):
        stats = K.selector_stats(u, norms, lo, hi, knobs, gather=gather, splits=splits)
        for b in range(r):
            on = norms[b, :, int(lo[b]): int(hi[b])]
            med = _lower_median(on)
            assert torch.equal(stats[b, :, 3], med)
            assert torch.equal(stats[b, :, 4], _lower_median((on - med[:, None]).abs()))
