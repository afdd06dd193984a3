"""SFI's segment A as pool-slot lists (`compact.selections: slot_lists`).

The refresh writes each selected row's pool slot (`list_compact_layers`) where the
packed store copies its K and V (`pack_compact_layers`), and the decode kernel reads
those rows in place (`a_slot_lists`). Both must give the same attention: the same
keys in the same order, so bit-identical outputs, checked here under the interpreter
against the packed path and the plain-PyTorch reference on fresh random inputs
(ragged rows, GQA, lengths off the block size, empty selections, fp8 pools)."""

import dataclasses
import random

import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.kernels import testing as T
from tests.kernels.test_pack_compact import _layered_case
from tests.kernels.test_sfi_kernels import refreshed_two_rows
from tests.kernels.test_two_segment_decode import DEVICE, SMALL, TOL, gpu_test, mixed_batch


def _as_slot_lists(case: T.DecodeCase, seed: int) -> tuple[T.DecodeCase, torch.Tensor]:
    """(the case with its compact buffers holding the pool rows of random lists, the
    lists [slots, Hkv, cap] int32). Entries past a row's length are pool slots too, so a
    kernel reading past a_len reads plausible keys and mismatches the reference."""
    gen = torch.Generator(device=case.q.device).manual_seed(seed)
    num_slots, hkv, cap, _ = case.a_k.shape
    lists = torch.randint(0, case.k_pool.shape[0], (num_slots, hkv, cap), generator=gen,
                          device=case.q.device, dtype=torch.int32)
    head = torch.arange(hkv, device=case.q.device)[None, :, None]
    packed = dataclasses.replace(case, a_k=case.k_pool[lists.long(), head], a_v=case.v_pool[lists.long(), head])
    return packed, lists


def _decode(case: T.DecodeCase, lists=None, **kw):
    """(out, lse), the output NaN-poisoned first; with lists, the compact buffers are
    a one-row stand-in the kernel must not read."""
    if lists is not None:
        stand_in = torch.full_like(case.a_k[:1, :, :1], float("nan"))
        case = dataclasses.replace(case, a_k=stand_in, a_v=stand_in)
        kw["a_slot_lists"] = lists
    out = torch.full_like(case.q, float("nan"))
    return K.two_segment_decode(*case.args(), out=out, return_lse=True, **case.kwargs(), **kw)


CASES = [(dtype, group, splits) for dtype in (torch.bfloat16, torch.float16) for group in (1, 4, 8)
         for splits in (1, 3)]


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_slot_lists_attend_exactly_what_the_packed_rows_do(idx):
    """Mixed batches (compact rows beside sinks, windows, dense rows and empty ones),
    batch sizes 1..5: the lists' output equals the packed rows' bit for bit, and the
    reference's within the dtype's tolerance."""
    dtype, group, splits = CASES[idx]
    rng = random.Random(300 + idx)
    bs, hkv, cap = 1 + idx % 5, (2, 1, 3)[idx % 3], 37
    seq_lens, a_lens, b_ranges = mixed_batch(bs, hkv, cap, rng)
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=hkv, group=group, head_dim=64, cap=cap,
                              dtype=dtype, device=DEVICE, seed=idx)
    packed, lists = _as_slot_lists(case, seed=idx)
    o_packed, lse_packed = _decode(packed, num_splits=splits, **SMALL)
    o_lists, lse_lists = _decode(packed, lists, num_splits=splits, **SMALL)
    assert not o_lists.isnan().any() and not lse_lists.isnan().any()
    assert torch.equal(o_lists, o_packed) and torch.equal(lse_lists, lse_packed)
    ref_o, _ = K.two_segment_decode_ref(*packed.args(), return_lse=True, **packed.kwargs())
    assert T.rel_error(o_lists.float(), ref_o) < TOL[dtype]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_slot_lists_over_an_fp8_pool(fp8):
    """Over an fp8 cache with scales the listed rows widen as the packed copies do."""
    rng = random.Random(11)
    seq_lens, a_lens, b_ranges = mixed_batch(5, 2, 37, rng)
    case = T.make_decode_case(seq_lens, a_lens, b_ranges, num_kv_heads=2, group=4, head_dim=64, cap=37,
                              dtype=torch.bfloat16, device=DEVICE, seed=21).stored_as(fp8, 0.5, 2.0)
    packed, lists = _as_slot_lists(case, seed=21)
    kw = dict(k_scale=0.5, v_scale=2.0, num_splits=2, **SMALL)
    o_packed, _ = _decode(packed, **kw)
    o_lists, _ = _decode(packed, lists, **kw)
    assert not o_lists.isnan().any() and torch.equal(o_lists, o_packed)
    ref_o, _ = K.two_segment_decode_ref(*packed.args(), return_lse=True, k_scale=0.5, v_scale=2.0,
                                        **packed.kwargs())
    assert T.rel_error(o_lists.float(), ref_o) < TOL[torch.bfloat16]


def test_slot_lists_clamp_a_bad_entry_into_the_pool():
    """A list entry outside the pool reads a pool row (clamped), never out of bounds."""
    case = T.make_decode_case([40], [12], [(30, 40)], num_kv_heads=2, group=2, head_dim=32, cap=16,
                              device=DEVICE, seed=3, empty_slot_value=None)
    packed, lists = _as_slot_lists(case, seed=3)
    slot = int(case.a_slot[0])
    lists[slot, 0, 5], lists[slot, 1, 2] = -7, 1 << 30
    o, _ = _decode(packed, lists, num_splits=1, **SMALL)
    clamped = lists.clamp(0, case.k_pool.shape[0] - 1)
    head = torch.arange(2, device=lists.device)[None, :, None]
    want = dataclasses.replace(packed, a_k=case.k_pool[clamped.long(), head], a_v=case.v_pool[clamped.long(), head])
    o_want, _ = _decode(want, num_splits=1, **SMALL)
    assert torch.equal(o, o_want)


def test_slot_lists_refuse_a_wrong_shape_or_dtype():
    case = T.make_decode_case([40], [12], [(30, 40)], num_kv_heads=2, group=2, head_dim=32, cap=16, device=DEVICE)
    _, lists = _as_slot_lists(case, seed=0)
    with pytest.raises(AssertionError, match="a_slot_lists: int32"):
        _decode(case, lists.long())
    with pytest.raises(AssertionError, match=r"a_slot_lists: \[num_slots, Hkv, cap\]"):
        _decode(case, lists[:, :1])


@pytest.mark.parametrize("layers, bs, hkv, width, block_n, max_chunks", [
    (3, 4, 2, 23, 16, 2),
    (2, 1, 1, 40, 16, None),
    (4, 5, 3, 9, 32, 16),
])
def test_list_compact_layers_lists_the_rows_pack_copies(layers, bs, hkv, width, block_n, max_chunks):
    """The lists' rows are the packed rows, layer by layer (the sink prefix, then the
    selected positions; an empty selection; rows not flagged are left untouched)."""
    args = _layered_case(layers * 10 + bs, layers=layers, bs=bs, hkv=hkv, head_dim=32, cap=45, width=width,
                         dtype=torch.bfloat16)
    k_pools, v_pools, rest = args[0], args[1], list(args[2:])
    r2t, rows, sel_pos, sel_len, sink, do_pack, a_k, a_v, slots, a_len = rest
    K.pack_compact_layers(K.LayerPools.of(k_pools), K.LayerPools.of(v_pools), *rest, block_n=block_n,
                          max_chunks=max_chunks)
    lists = torch.full(a_k.shape[:4], -9, dtype=torch.int32, device=a_k.device)
    list_len = torch.full_like(a_len, -5)
    K.list_compact_layers(K.LayerPools.of(k_pools), r2t, rows, sel_pos, sel_len, sink, do_pack, lists, slots,
                          list_len, block_n=block_n, max_chunks=max_chunks)
    assert torch.equal(list_len, a_len)
    head = torch.arange(hkv, device=lists.device)[:, None]
    for b in range(bs):
        s, n = int(slots[b]), int(sel_len[b, 0])
        if not bool(do_pack[b]):
            assert (lists[:, s] == -9).all() and (list_len[b] == -5).all()
            continue
        assert (lists[:, s, :, n:] == -9).all()
        for layer in range(layers):
            listed = lists[layer, s, :, :n].long()
            assert torch.equal(k_pools[layer][listed, head], a_k[layer, s, :, :n])
            assert torch.equal(v_pools[layer][listed, head], a_v[layer, s, :, :n])


@gpu_test
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_slot_lists_long_context(kv_dtype):
    """32K rows on the GPU (compiled, default tiling): sfi-like rows (2052 listed +
    256 recent) beside a dense one; the lists' output is the packed rows'."""
    seq_lens = [32768 - 37, 32768 - 5, 30001]
    b_ranges = [(n - 256, n) for n in seq_lens[:2]] + [(0, seq_lens[2])]
    case = T.make_decode_case(seq_lens, [2052, 2052, 0], b_ranges, num_kv_heads=8, group=2, head_dim=128,
                              cap=2052, dtype=torch.bfloat16, device="cuda", seed=5)
    if kv_dtype != torch.bfloat16:
        case = case.stored_as(kv_dtype)
    packed, lists = _as_slot_lists(case, seed=5)
    o_packed, _ = _decode(packed)
    o_lists, _ = _decode(packed, lists)
    assert not o_lists.isnan().any()
    torch.testing.assert_close(o_lists, o_packed, rtol=0, atol=0)


@pytest.mark.parametrize("use_kernels", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_refresh_lists_the_rows_it_would_pack(use_kernels, kv_dtype):
    """selector.refresh into slot lists (kernel and torch paths): the pool rows the
    lists name are the rows the packed store holds after the same refresh, in order."""
    packed, k, v = refreshed_two_rows(use_kernels, kv_dtype=kv_dtype, seed=4)
    listed, _, _ = refreshed_two_rows(use_kernels, kv_dtype=kv_dtype, selections="slot_lists", seed=4)
    assert listed.compact.k is None and listed.compact.v is None and listed.compact.slot_lists
    assert torch.equal(packed.sel_count, listed.sel_count) and packed.sel_count[1:].min() > 0
    assert torch.equal(packed.slot, listed.slot)
    head = torch.arange(2)[:, None]
    for r in (1, 2):
        s, n = int(listed.slot[r]), int(listed.sel_count[r].max())
        for layer in range(2):
            rows = listed.compact.lists[layer, s, :, :n].long()
            assert torch.equal(k[rows, head].view(torch.uint8), packed.compact.k[layer, s, :, :n].view(torch.uint8))
            assert torch.equal(v[rows, head].view(torch.uint8), packed.compact.v[layer, s, :, :n].view(torch.uint8))


def test_slot_lists_store_is_the_lists_bytes():
    """The store's bytes (what store_budget takes out of the KV pool) count the lists,
    4 bytes a row and KV head, instead of the packed K/V."""
    from sgl_sparse.compact import CompactStore

    dims = dict(slots=3, capacity=50, num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=64,
                dtype=torch.bfloat16, pool_size=10, prompt_queries=1, device=torch.device("meta"))
    packed, listed = CompactStore(**dims), CompactStore(**dims, selections="slot_lists")
    assert packed.selection_bytes() == 2 * 3 * 2 * 50 * 64 * 2 * 2
    assert listed.selection_bytes() == 2 * 3 * 2 * 50 * 4
    assert packed.nbytes() - listed.nbytes() == packed.selection_bytes() - listed.selection_bytes()
