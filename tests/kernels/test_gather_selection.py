"""kernels/gather_selection.py (per-slot selections -> the batch rows of a_pos /
a_len, rows without a selection untouched) against the torch ops it replaced."""

import torch

from sgl_sparse.kernels.gather_selection import gather_selection
from sgl_sparse.kernels.testing import run_on_device


def test_gather_selection():
    gen = torch.Generator().manual_seed(0)
    s, hkv, w, bs, cap = 5, 3, 40, 6, 48
    pos = torch.randint(0, 1000, (s, hkv, w), generator=gen, dtype=torch.int32)
    length = torch.randint(0, w + 1, (s, hkv), generator=gen, dtype=torch.int32)
    length[2, 1] = w
    length[4, 0] = 0
    src = torch.tensor([2, -1, 4, 0, -1, 1], dtype=torch.int32)
    a_pos = torch.full((bs, hkv, cap), -7, dtype=torch.int32)
    a_len = torch.full((bs, hkv), -7, dtype=torch.int32)
    run_on_device(gather_selection, src, pos, length, a_pos, a_len, block=16)
    for b in range(bs):
        if src[b] < 0:
            assert (a_pos[b] == -7).all() and (a_len[b] == -7).all()
            continue
        assert torch.equal(a_len[b], length[src[b]])
        for h in range(hkv):
            n = int(length[src[b], h])
            assert torch.equal(a_pos[b, h, :n], pos[src[b], h, :n]) and (a_pos[b, h, n:] == -7).all()


def test_gather_selection_slots_and_wide_blocks():
    """slots: the copied entries also as pool slots req_to_token[req_pool_idx[b], pos]
    (kernels/indexed_slots.py's mapping), the rest of a_slots untouched; positions
    and lengths the same whatever the block (16: many iterations; 1024: one)."""
    gen = torch.Generator().manual_seed(1)
    s, hkv, w, bs, cap, ctx = 5, 3, 600, 6, 640, 1000
    pos = torch.randint(0, ctx, (s, hkv, w), generator=gen, dtype=torch.int32)
    length = torch.randint(0, w + 1, (s, hkv), generator=gen, dtype=torch.int32)
    length[2, 1] = w
    length[4, 0] = 0
    src = torch.tensor([2, -1, 4, 0, -1, 1], dtype=torch.int32)
    r2t = torch.randint(0, 1 << 20, (4, ctx), generator=gen, dtype=torch.int32)
    rpi = torch.tensor([3, 0, 1, 2, 0, 1])
    want_pos = torch.full((bs, hkv, cap), -7, dtype=torch.int32)
    want_len = torch.full((bs, hkv), -7, dtype=torch.int32)
    run_on_device(gather_selection, src, pos, length, want_pos, want_len, block=16)
    for block in (16, 1024):
        a_pos = torch.full((bs, hkv, cap), -7, dtype=torch.int32)
        a_len = torch.full((bs, hkv), -7, dtype=torch.int32)
        a_slots = torch.full((bs, hkv, cap), -9, dtype=torch.int32)
        run_on_device(gather_selection, src, pos, length, a_pos, a_len, block=block, slots=(r2t, rpi, a_slots))
        assert torch.equal(a_pos, want_pos) and torch.equal(a_len, want_len), block
        for b in range(bs):
            if src[b] < 0:
                assert (a_slots[b] == -9).all()
                continue
            for h in range(hkv):
                n = int(a_len[b, h])
                assert torch.equal(a_slots[b, h, :n], r2t[int(rpi[b])][a_pos[b, h, :n].long()]), (block, b, h)
                assert (a_slots[b, h, n:] == -9).all()
