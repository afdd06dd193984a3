"""The Selector's exact medians (kernels.selector_stats: median and MAD of the key
norms on A by a radix select whose last passes read the gathered survivors) against
the sorted lower median, on value sets that stress a radix select: ties, all
equal, zeros, values over many binades, |A| = 1 and 2, ranges over many blocks."""

import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.config import SfiPolicy
from sgl_sparse.selector import core


def _lower_median(x: torch.Tensor) -> torch.Tensor:
    return x.sort(dim=-1).values[..., (x.shape[-1] - 1) // 2]


@pytest.mark.parametrize("block_n, gather", [(16, True), (256, True), (64, False)])
def test_medians_are_exact_on_adversarial_values(block_n, gather):
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
    stats = K.selector_stats(u, norms, lo, hi, knobs, block_n=block_n, gather=gather)
    for b in range(r):
        on = norms[b, :, int(lo[b]): int(hi[b])]
        med = _lower_median(on)
        mad = _lower_median((on - med[:, None]).abs())
        assert torch.equal(stats[b, :, 3], med), b
        assert torch.equal(stats[b, :, 4], mad), b
        # the reference's own definition (nanmedian over the masked row)
        ref = core._masked_lower_median(norms[b: b + 1], core.candidate_mask(lo[b: b + 1], hi[b: b + 1], n))
        assert torch.equal(stats[b, :, 3], ref[0, :, 0])


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
    for gather in (True, False):
        stats = K.selector_stats(u, norms, lo, hi, knobs, gather=gather)
        for b in range(r):
            on = norms[b, :, int(lo[b]): int(hi[b])]
            med = _lower_median(on)
            assert torch.equal(stats[b, :, 3], med)
            assert torch.equal(stats[b, :, 4], _lower_median((on - med[:, None]).abs()))
