"""The CUDA decode path's data flow on CPU: state rows -> plan_decode -> the Triton
two-segment kernel (interpreted) must equal the serving reference path."""

import math

import pytest
import torch

from sgl_sparse import reference
from sgl_sparse.decision import plan_decode
from sgl_sparse.kernels import two_segment_decode  # interpreted on CPU: tests/conftest.py
from sgl_sparse.policies import PolicyId, RowInit
from sgl_sparse.state import SparseState

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

THINK, END = 3, 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_mixed_policy_batch_kernel_equals_reference(dtype, group):
    gen = torch.Generator().manual_seed(group)
    hkv, d, rows = 2, 32, [2, 7, 5, 1, 3]
    lens = [90, 33, 71, 20, 64]
    st = SparseState(9, "cpu")
    st.admit(rows, [
        RowInit(PolicyId.FULL),
        RowInit(PolicyId.STREAMING, window=16, sink=4),
        RowInit(PolicyId.SADAS, window=8, sink=2),  # stays in window mode
        RowInit(PolicyId.SADAS, window=8, sink=2),  # latches on END below: full
        RowInit(PolicyId.STREAMING, window=100, sink=4),  # window > length
    ])
    total = sum(lens) + 5
    k = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    r2t = torch.zeros(9, 128, dtype=torch.int32)
    off = 0
    for r, n in zip(rows, lens):
        r2t[r, :n] = perm[off: off + n].int()
        off += n
    rpi = torch.tensor(rows)
    last = torch.tensor([9, 9, THINK, END, 9])
    plan = plan_decode(st, rpi, last, torch.tensor(lens), (THINK, END), num_kv_heads=hkv)
    assert plan.attended().tolist() == [90, 20, 10, 20, 64]
    q = torch.randn(len(rows), hkv * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    ref = torch.full_like(q, float("nan"))
    reference.decode_attention(q, ref, k, v, r2t, rpi, plan, scale, group > 1)
    no_compact = k.new_zeros((1, hkv, 1, d))
    for splits in (1, 3):
        out = two_segment_decode(q, no_compact, no_compact, plan.a_slot, plan.a_len_per_head, k, v, r2t, rpi,
                                 plan.b_start, plan.b_end, scale, num_splits=splits, block_n=16, min_split_len=16)
        assert not torch.isnan(out).any()
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 5e-3), err
