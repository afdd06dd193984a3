"""kernels/indexed_slots.py (the indexed rows' position lists -> pool slots) against
its torch reference, and the decode on the slots against the decode on the positions."""

import pytest
import torch

from sgl_sparse.kernels import testing as T
from sgl_sparse.kernels import two_segment_decode
from sgl_sparse.kernels.indexed_slots import indexed_pool_slots, indexed_pool_slots_ref
from sgl_sparse.kernels.reference import two_segment_decode_ref
from sgl_sparse.kernels.testing import run_on_device


@pytest.mark.parametrize("block", [16, 1024])
def test_indexed_pool_slots_matches_reference(block):
    """Ragged lists (0, full width, past b_start, past the width), garbage and
    negative entries (clamped as the decode clamps them), rows that are not
    indexed (untouched), an int64 and an int32 req_pool_idx."""
    gen = torch.Generator().manual_seed(block)
    bs, hkv, cap, reqs, ctx = 6, 3, 37, 9, 120
    req_to_token = torch.randperm(reqs * ctx, generator=gen).view(reqs, ctx).to(torch.int32)
    a_pos = torch.randint(-50, 400, (bs, hkv, cap), generator=gen, dtype=torch.int32)
    a_len = torch.randint(0, cap + 5, (bs, hkv), generator=gen, dtype=torch.int32)
    a_len[0, 0], a_len[0, 1], a_len[3, 2] = 0, cap, -4
    a_slot = torch.tensor([-2, -1, -2, -2, 3, -2], dtype=torch.int32)
    b_start = torch.tensor([90, 50, 20, 0, 70, 119], dtype=torch.int32)  # row 2: b_start below a_len
    for idx_dtype in (torch.int64, torch.int32):
        req_pool_idx = torch.randperm(reqs, generator=gen)[:bs].to(idx_dtype)
        out = torch.full_like(a_pos, -7)
        run_on_device(indexed_pool_slots, a_pos, a_len, a_slot, b_start, req_to_token, req_pool_idx, out=out,
                      block=block)
        want = indexed_pool_slots_ref(a_pos, a_len, a_slot, b_start, req_to_token, req_pool_idx,
                                      torch.full_like(a_pos, -7))
        assert torch.equal(out, want)
        assert (out[1] == -7).all() and (out[4] == -7).all() and (out[3] == -7).all()  # not indexed / b_start 0
        assert (out[0, 1] != -7).all() and (out[2, :, 20:] == -7).all()


def test_decode_on_translated_slots_equals_positions():
    """The serving order: positions -> indexed_pool_slots -> the decode with
    a_pos_slots, bit for bit the decode on the positions (mixed rows, GQA 4)."""
    n = [97, 81, 70, 66]
    case = T.make_decode_case(
        n, [0, [5, 9], [4, 4], 0], [(n[0] - 17, n[0]), (n[1] - 9, n[1]), (n[2] - 30, n[2]), (0, n[3])],
        num_kv_heads=2, group=4, head_dim=64, cap=24, dtype=torch.bfloat16, device="cpu", seed=7,
        empty_slot_value=None,
    )
    case.a_slot[2] = -1
    T.set_indexed_rows(case, {0: [40, 3], 3: 0}, cap_pos=45, seed=1)
    slots = torch.full_like(case.a_pos, -1)
    run_on_device(indexed_pool_slots, case.a_pos, case.a_len, case.a_slot, case.b_start, case.req_to_token,
                  case.req_pool_idx, out=slots)
    kw = dict(num_splits=2, block_n=16, min_split_len=16)
    o_pos = run_on_device(two_segment_decode, *case.args(), a_pos=case.a_pos, **kw)
    o_sl = run_on_device(two_segment_decode, *case.args(), a_pos=slots, a_pos_slots=True, **kw)
    assert not torch.isnan(o_sl).any() and torch.equal(o_sl, o_pos)
    ref = two_segment_decode_ref(*case.args(), a_pos=case.a_pos)
    assert T.rel_error(o_sl.float(), ref) < 1e-2
