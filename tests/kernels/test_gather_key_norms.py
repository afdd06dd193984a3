"""kernels/gather_key_norms.py: the refresh's key norms in its row layout, equal to
the torch gather-and-permute it replaced (a copy: bit-exact), over layer slices,
Hkv 1-8 (3: not a power of two), lengths not a multiple of the block, int32 and
int64 slot maps, no rows; compiled on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse.kernels import gather_key_norms, gather_key_norms_ref
from sgl_sparse.kernels import testing as T


@pytest.mark.parametrize("hkv, n, block_n", [(8, 300, 256), (1, 37, 16), (3, 129, 64), (2, 1, 256)])
def test_matches_the_torch_gather(hkv, n, block_n):
    gen = torch.Generator().manual_seed(hkv * 1000 + n)
    pool, r = 400, 3
    knorm = torch.rand(5, pool, hkv, generator=gen) * 20
    tok = torch.randint(0, pool, (r, n), generator=gen)
    for layers in (slice(0, 5), slice(2, 4)):  # a chunk of layers: a view into the store
        for t in (tok, tok.int()):
            got = T.run_on_device(gather_key_norms, knorm[layers], t, block_n=block_n)
            want = gather_key_norms_ref(knorm[layers], t)
            assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
    # the rows of a req_to_token slice (its row stride wider than N)
    wide = torch.randint(0, pool, (r, n + 9), generator=gen).int()
    assert torch.equal(T.run_on_device(gather_key_norms, knorm, wide[:, :n]), gather_key_norms_ref(knorm, wide[:, :n]))
    assert T.run_on_device(gather_key_norms, knorm, tok[:0]).shape == (0, hkv, n)


def test_compiles_for_sm90():
    from sgl_sparse.kernels.gather_key_norms import _gather_key_norms_kernel as fn

    const = dict(BLOCK_H=8, BLOCK_N=256)
    sig = {name: "constexpr" if name in const else "*fp32" if name in ("KNORM", "OUT") else
           "*i64" if name == "TOK" else "i32" for name in fn.arg_names}
    counts = T.compile_sm90("sgl_sparse.kernels.gather_key_norms", "_gather_key_norms_kernel", sig, const,
                            ["KNORM", "TOK", "OUT"])
    assert counts.get("st.global.b32", 0) + counts.get("st.global.v4.b32", 0) > 0, counts
