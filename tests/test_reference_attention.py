"""The reference attention (CPU serving path, oracle for every kernel) against a
float64 softmax written out by hand, on fresh random inputs."""

import math

import pytest
import torch

from sgl_sparse import reference
from sgl_sparse.decision import DecodePlan

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent


def _pool(seq_lens, hkv, d, dtype, gen):
    total = sum(seq_lens) + 7
    k = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)  # non-contiguous pages
    r2t = torch.zeros(len(seq_lens) + 3, max(seq_lens) + 5, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)] + 1
    off = 0
    for r, n in zip(rows.tolist(), seq_lens):
        r2t[r, :n] = perm[off: off + n].int()
        off += n
    return k, v, r2t, rows


def _attend64(q, k, v, scale):  # q [Hq, D], k/v [n, Hkv, D]
    g = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("bs", [1, 3, 6])
def test_decode_matches_float64(dtype, tol, group, bs):
    gen = torch.Generator().manual_seed(1000 * bs + group)
    hkv, d = 2, 32
    lens = torch.randint(1, 70, (bs,), generator=gen).tolist()
    k, v, r2t, rows = _pool(lens, hkv, d, dtype, gen)
    q = torch.randn(bs, hkv * group, d, generator=gen).to(dtype)
    n = torch.tensor(lens, dtype=torch.int32)
    b_start = torch.clamp(n - torch.randint(1, 40, (bs,), generator=gen).int(), min=0)
    a_len = torch.minimum(torch.randint(0, 5, (bs,), generator=gen).int(), b_start)
    plan = DecodePlan(a_len=a_len, b_start=b_start, b_end=n)
    o = torch.full((bs, hkv * group, d), float("nan"), dtype=dtype)
    scale = 1 / math.sqrt(d)
    reference.decode_attention(q, o, k, v, r2t, rows, plan, scale, group > 1)
    assert not torch.isnan(o).any()
    for i in range(bs):
        pos = list(range(int(a_len[i]))) + list(range(int(b_start[i]), lens[i]))
        slots = r2t[rows[i], pos].long()
        ref = _attend64(q[i], k[slots], v[slots], scale)
        assert _rel(o[i], ref) < tol


def test_decode_empty_selection_is_zero_not_nan():
    gen = torch.Generator().manual_seed(7)
    k, v, r2t, rows = _pool([5, 9], 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    plan = DecodePlan(a_len=torch.tensor([0, 0], dtype=torch.int32),
                      b_start=torch.tensor([5, 3], dtype=torch.int32),
                      b_end=torch.tensor([5, 9], dtype=torch.int32))
    o = torch.full_like(q, float("nan"))
    reference.decode_attention(q, o, k, v, r2t, rows, plan, 0.25, True)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and not torch.isnan(o).any()


@pytest.mark.parametrize("group", [1, 2])
def test_extend_matches_float64_with_prefix(group):
    gen = torch.Generator().manual_seed(group)
    hkv, d = 2, 16
    lens, prefix = [13, 40, 7], [0, 17, 6]  # radix-cache hits: prefix already cached
    ext = [n - p for n, p in zip(lens, prefix)]
    k, v, r2t, rows = _pool(lens, hkv, d, torch.float32, gen)
    q = torch.randn(sum(ext), hkv * group, d, generator=gen)
    o = torch.full_like(q, float("nan"))
    reference.extend_attention(q, o, k, v, r2t, rows, torch.tensor(lens), torch.tensor(prefix),
                               torch.tensor(ext), 0.25, group > 1)
    start = 0
    for i, (n, p) in enumerate(zip(lens, prefix)):
        for t in range(n - p):
            slots = r2t[rows[i], : p + t + 1].long()  # causal: itself and before
            ref = _attend64(q[start + t], k[slots], v[slots], 0.25)
            assert _rel(o[start + t], ref) < 1e-5
        start += n - p
