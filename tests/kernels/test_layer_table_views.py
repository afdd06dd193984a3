"""A view of the layers' address table that starts at an odd layer (LayerPools.layers,
8 bytes into the table) reads the right layer and needs no binary of its own.

A refresh splits the layers into chunks (selector/refresh.py); at 32768 x 8 the second
chunk starts at layer 15. The kernels used to specialize on the table pointer's 16-byte
alignment, so that chunk compiled `_evidence_pass1` and `_pack_compact_kernel` anew in
the middle of the first SFI batch (H100, session 13: 515 + 350 ms, logged by
sgl_sparse/compile_watch.py). Compiles happen only on a GPU: the count is checked there.
"""

import pytest
import torch

from sgl_sparse.kernels import LayerPools, pack_compact_layers, window_evidence

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens, hkv, hq, d, n = 256, 2, 4, 64, 100
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    k = [rnd(tokens, hkv, d) for _ in range(2)]
    v = [rnd(tokens, hkv, d) for _ in range(2)]
    req_to_token = torch.randperm(tokens, generator=g)[: 2 * n].view(2, n).to(DEVICE, torch.int32)
    return k, v, req_to_token, rnd(1, 1, hq, d), n


def _run(k_pools: LayerPools, v_pools: LayerPools, req_to_token, q, n):
    dev, hkv, d = q.device, k_pools.pool.shape[1], q.shape[-1]
    one = lambda x: torch.tensor([x], dtype=torch.int32, device=dev)  # noqa: E731
    u = window_evidence(q, k_pools, req_to_token, one(1), torch.tensor([[n - 1]], device=dev), one(4), one(n),
                        one(1), torch.ones(1, device=dev), n, d ** -0.5)
    sel = torch.arange(8, 8 + 16, dtype=torch.int32, device=dev).expand(1, hkv, 16).contiguous()
    a_k = torch.full((1, 2, hkv, 24, d), float("nan"), dtype=q.dtype, device=dev)
    a_v = a_k.clone()
    pack_compact_layers(k_pools, v_pools, req_to_token, one(1), sel, one(20)[:, None].expand(1, hkv), one(4),
                        torch.ones(1, dtype=torch.bool, device=dev), a_k, a_v, one(1),
                        torch.zeros(1, hkv, dtype=torch.int32, device=dev))
    return u, a_k, a_v


def test_a_view_at_layer_one_reads_layer_one():
    k, v, r2t, q, n = _inputs()
    viewed = _run(LayerPools.of(k).layers(1, 2), LayerPools.of(v).layers(1, 2), r2t, q, n)
    alone = _run(LayerPools.of(k[1:]), LayerPools.of(v[1:]), r2t, q, n)
    for a, b in zip(viewed, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    # Packed rows hold layer 1's keys: the sink [0, 4) then positions 8.. of request 1.
    tok = r2t[1, torch.tensor([0, 1, 2, 3] + list(range(8, 24)), device=r2t.device)].long()
    torch.testing.assert_close(viewed[1][0, 1, :, :20], k[1][tok].transpose(0, 1), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_view_at_an_odd_layer_compiles_nothing_new(fresh_compile_watch):
    compile_watch = fresh_compile_watch
    assert compile_watch.install()
    k, v, r2t, q, n = _inputs()
    kp, vp = LayerPools.of(k), LayerPools.of(v)
    _run(kp.layers(0, 1), vp.layers(0, 1), r2t, q, n)  # 16-byte aligned view
    before = compile_watch.compiles
    _run(kp.layers(1, 2), vp.layers(1, 2), r2t, q, n)  # 8 bytes in
    torch.cuda.synchronize()
    assert compile_watch.compiles == before
