"""kernels/lfps_sparsity.py (LFPS's ρ per query head, keys read in place) against
queryaware.lfps.head_sparsity on the dense view of the same keys: per-row sink and
local knobs (sink 0, a local window clipped by the sink, windows longer than a
block), GQA 1 / 4 / 6 (a group not a power of two), fp16 / bf16 / fp8 pools, fp32 and
16-bit queries, rows without a request (n = 0: ρ = 0), lengths that are no
multiple of the block."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.kernels.lfps_sparsity import lfps_head_sparsity
from sgl_sparse.kernels.testing import run_on_device
from sgl_sparse.queryaware.lfps import LfpsKnobs, head_sparsity


def _case(gen, group, kv_dtype, q_dtype, d=16, hkv=2):
    rows = [(70, 4, 6), (45, 0, 6), (33, 5, 30), (100, 3, 1), (20, 2, 17)]  # (n, sink, local)
    pool = 600
    k = (torch.randn(pool, hkv, d, generator=gen) * 1.5).to(kv_dtype)
    r2t = torch.randperm(pool, generator=gen)[: len(rows) * 120].reshape(len(rows), 120).to(torch.int32)
    q = (torch.randn(len(rows), hkv * group, d, generator=gen) * 1.5).to(q_dtype)
    kbar = torch.randn(len(rows), hkv, d, generator=gen) * 0.3
    sig = torch.rand(len(rows), hkv * group, generator=gen) * 0.5
    return rows, k, r2t, q, kbar, sig


@pytest.mark.parametrize("group, kv_dtype, q_dtype", [
    (1, torch.float16, torch.float16),
    (4, torch.float16, torch.float16),
    (6, torch.bfloat16, torch.bfloat16),
    (4, torch.bfloat16, torch.float32),
    (4, torch.float8_e4m3fn, torch.bfloat16),  # --kv-cache-dtype fp8_*: keys widened to bf16
    (4, torch.float8_e5m2, torch.float32),
])
def test_matches_the_dense_reference(group, kv_dtype, q_dtype):
    gen = torch.Generator().manual_seed(group)
    rows, k, r2t, q, kbar, sig = _case(gen, group, kv_dtype, q_dtype)
    scale = 1 / math.sqrt(k.shape[-1])
    n = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    sink = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    local = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    rpi = torch.arange(len(rows))
    got = run_on_device(lfps_head_sparsity, q, k, r2t, rpi, n, sink, local, kbar, sig, scale)
    for b, (nb, sb, lb) in enumerate(rows):
        keys = k[r2t[b, :nb].long()][None]
        # the reference in float64 (its inputs rounded as the kernel reads them)
        want = head_sparsity(q[b: b + 1].double(), keys.double(), torch.tensor([nb]), kbar[b: b + 1],
                             sig[b: b + 1], scale, LfpsKnobs(n_sink=sb, n_local=lb))
        torch.testing.assert_close(got[b: b + 1].double(), want, rtol=2e-5, atol=1e-6)
    assert got.min() >= 0 and got.max() <= 1


def test_rows_without_a_request_read_nothing():
    gen = torch.Generator().manual_seed(3)
    rows, k, r2t, q, kbar, sig = _case(gen, 2, torch.float16, torch.float16)
    scale = 0.25
    n = torch.tensor([70, 0, -1, 33, 0], dtype=torch.int32)
    sink = torch.full((5,), 4, dtype=torch.int32)
    local = torch.full((5,), 6, dtype=torch.int32)
    r2t_bad = r2t.clone()
    r2t_bad[[1, 2, 4]] = 10 ** 8  # would fault if read
    got = run_on_device(lfps_head_sparsity, q, k, r2t_bad, torch.arange(5), n, sink, local, kbar, sig, scale)
    assert torch.equal(got[[1, 2, 4]], torch.zeros(3, got.shape[1]))
    ref = run_on_device(lfps_head_sparsity, q, k, r2t, torch.arange(5), n, sink, local, kbar, sig, scale)
    assert torch.equal(got[[0, 3]], ref[[0, 3]])
