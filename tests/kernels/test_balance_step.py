"""kernels/balance_step.py against its oracle, two_segment_decode's step_row_splits and
balance_gate (torch ops): the same splits and gate bit for bit on random batches --
sparse rows with dense ones among them, every row dense, rows the launch does not
serve (the row mask), none served, bf16 and fp8 (P doubled from FP8_DENSE_SPLIT_KEYS),
the gate with and without the segments' test, and off."""

from __future__ import annotations

import importlib

import pytest
import torch

from sgl_sparse.kernels import balance_gate, step_row_splits
from sgl_sparse.kernels.balance_step import step_balance

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

tsd = importlib.import_module("sgl_sparse.kernels.two_segment_decode")


def _batch(g: torch.Generator, bs: int, hkv: int, ctx: int, dense: float, served: float):
    """A decode batch's descriptors: sparse rows of ~2K compact + 256 recent keys, a
    `dense` share of them attending [0, ctx) instead, a `served` share served."""
    is_dense = torch.rand(bs, generator=g) < dense
    n = torch.randint(ctx // 2, ctx + 1, (bs,), generator=g, dtype=torch.int32)
    a_len = torch.randint(0, 2053, (bs, hkv), generator=g, dtype=torch.int32)
    a_len[is_dense] = 0
    b_end = n
    b_start = torch.where(is_dense, 0, (n - 256).clamp(min=0)).to(torch.int32)
    mask = (torch.rand(bs, generator=g) < served).to(torch.int32)
    return a_len, b_start, b_end, mask


def _reference(a_len, b_start, b_end, mask, hkv, max_kv_len, sms, fp8, segments):
    splits = step_row_splits(a_len, b_start, b_end, mask, hkv, max_kv_len, sms, kv_fp8=fp8)
    if splits is None:
        return None, None
    gate = balance_gate(splits, mask, hkv, max_kv_len, sms, fp8,
                        segments=(a_len, b_start, b_end) if segments else None)
    return splits, gate


@pytest.mark.parametrize("block, fp8, sms, hkv, ctx, one_grid", [
    (128, False, 132, 8, 32768, None), (128, True, 132, 8, 32768, None), (128, True, 132, 8, 131072, None),
    (128, False, 4, 2, 600, None), (128, True, 16, 4, 8192, None), (16, True, 132, 8, 32768, None),
    (16, False, 16, 4, 8192, None), (128, True, 132, 8, 8192, False)])
def test_splits_and_gate_equal_the_torch_ops(monkeypatch, block, fp8, sms, hkv, ctx, one_grid):
    """Batch sizes 1..64, in one tile and in tiles of 16 (the kernel walks the batch in
    _BLOCK-wide tiles: several where the batch is longer than one); the gated pair
    forced (``one_grid`` False), whose plain twin over fp8 splits twice at batch 17-33."""
    import sgl_sparse.kernels.balance_step as bstep

    monkeypatch.setattr(bstep, "_BLOCK", block)
    monkeypatch.setattr(tsd, "BALANCE_ONE_GRID", one_grid)
    g = torch.Generator().manual_seed(sms * 7 + hkv + ctx + fp8)
    max_kv_len = ctx + 512
    checked, gates = 0, set()
    for bs in (1, 2, 3, 4, 5, 8, 13, 32, 64):
        for dense, served in ((0.0, 1.0), (0.15, 1.0), (1.0, 1.0), (0.3, 0.6), (0.5, 0.0)):
            a_len, b_start, b_end, mask = _batch(g, bs, hkv, ctx, dense, served)
            for segments in (True, False):
                for m in (mask, None):
                    want = _reference(a_len, b_start, b_end, m, hkv, max_kv_len, sms, fp8, segments)
                    got = step_balance(a_len, b_start, b_end, m, hkv, max_kv_len, sms, fp8, segments=segments)
                    if want[0] is None:
                        assert got == (None, None)
                        continue
                    checked += 1
                    assert torch.equal(got[0], want[0]), (bs, dense, served, got[0], want[0])
                    assert got[0].dtype == torch.int32 and got[1].shape == (1,) and got[1].dtype == torch.int32
                    assert torch.equal(got[1], want[1]), (bs, dense, served, segments, got[1], want[1])
                    gates.add(int(got[1]))
    assert checked > 0 and gates == {0, 1}, (checked, gates)  # balanced shapes, the gate open and closed


def test_the_gate_off_and_the_mask_wider_than_the_batch(monkeypatch):
    """BALANCE_GATE off: the splits alone (gate None), as balance_gate gives None; and
    a row mask of the graph's width (the backend's [max rows] buffer) read to bs."""
    g = torch.Generator().manual_seed(5)
    a_len, b_start, b_end, mask = _batch(g, 8, 8, 32768, 0.2, 0.8)
    wide = torch.cat([mask, torch.ones(24, dtype=torch.int32)])
    want = step_row_splits(a_len, b_start, b_end, mask, 8, 33280, 132, kv_fp8=True)
    got, gate = step_balance(a_len, b_start, b_end, wide, 8, 33280, 132, True)
    assert torch.equal(got, want) and gate is not None
    monkeypatch.setattr(tsd, "BALANCE_GATE", False)
    got, gate = step_balance(a_len, b_start, b_end, wide, 8, 33280, 132, True)
    assert torch.equal(got, want) and gate is None


def test_fp8_doubling_follows_the_dense_split_keys_switch(monkeypatch):
    """FP8_DENSE_SPLIT_KEYS 0 never doubles P (read at the call, as the torch ops do)."""
    g = torch.Generator().manual_seed(9)
    a_len, b_start, b_end, mask = _batch(g, 4, 8, 131072, 1.0, 1.0)
    for keys in (12288, 0):
        monkeypatch.setattr(tsd, "FP8_DENSE_SPLIT_KEYS", keys)
        want = step_row_splits(a_len, b_start, b_end, mask, 8, 140000, 132, kv_fp8=True)
        got, _ = step_balance(a_len, b_start, b_end, mask, 8, 140000, 132, True)
        assert torch.equal(got, want), (keys, got, want)


@pytest.mark.parametrize("fp8, segments", [(True, True), (False, False)])
def test_compiles_for_sm90(fp8, segments):
    """The launch as served compiles for the H100/H200 (no GPU needed): int32
    descriptors, int64 arithmetic, one program."""
    from sgl_sparse.kernels import testing as T

    sig = {"A_LEN": "*i32", "B_START": "*i32", "B_END": "*i32", "ROW_MASK": "*i32", "SPLITS": "*i32",
           "GATE": "*i32", "COUNT": "*i64", "bs": "i32", "stride_a": "i32", "programs": "i32", "double_keys": "i32",
           "base_splits": "i32", "min_program_keys": "i32", "HAS_MASK": "constexpr", "FP8_DOUBLE": "constexpr",
           "GATE_ON": "constexpr", "COUNT_ON": "constexpr", "SEGMENT_GATE": "constexpr",
           "MAX_S": "constexpr", "BLOCK": "constexpr"}
    const = {"HAS_MASK": True, "FP8_DOUBLE": fp8, "GATE_ON": True, "COUNT_ON": True, "SEGMENT_GATE": segments,
             "MAX_S": 64, "BLOCK": 128}
    counts = T.compile_sm90("sgl_sparse.kernels.balance_step", "_step_balance_kernel", sig, const,
                            ["A_LEN", "B_START", "B_END", "ROW_MASK", "SPLITS", "GATE", "COUNT"], {"num_warps": 4},
                            resources=True)
    assert counts["stack_bytes"] == 0 and counts["registers"] <= 64, counts


def test_the_gate_is_added_to_the_count_in_the_same_launch(monkeypatch):
    """``count`` (balanced_launches' counter): every call adds its gate, in the launch
    that computes it; with the gate off (BALANCE_GATE) or no count nothing is added."""
    g = torch.Generator().manual_seed(13)
    n = torch.full((8,), 32768, dtype=torch.int32)
    alike = (torch.full((8, 8), 2052, dtype=torch.int32), n - 256, n, None)  # the gate closed
    count = torch.full((1,), 5, dtype=torch.int64)
    gates = []
    for dense in (0.0, 0.15, 1.0, 0.3, 0.0, 0.5):
        a_len, b_start, b_end, mask = _batch(g, 8, 8, 32768, dense, 1.0) if dense else alike
        _, gate = step_balance(a_len, b_start, b_end, mask, 8, 33280, 132, True, count=count)
        gates.append(int(gate))
        _, again = step_balance(a_len, b_start, b_end, mask, 8, 33280, 132, True)  # no count: untouched
        assert torch.equal(again, gate)
    assert set(gates) == {0, 1} and int(count) == 5 + sum(gates), (gates, count)
    monkeypatch.setattr(tsd, "BALANCE_GATE", False)
    _, gate = step_balance(a_len, b_start, b_end, mask, 8, 33280, 132, True, count=count)
    assert gate is None and int(count) == 5 + sum(gates)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_splits_and_gate_replayed_in_a_graph_equal_the_torch_ops():
    """On the device, as served: the launch captured once in a CUDA graph per batch size
    (one tile and several), replayed over fresh batches copied into its inputs, gives
    the torch ops' splits and gate (computed on the CPU)."""
    g = torch.Generator().manual_seed(490)
    # 130: two tiles of _BLOCK and still balancing (160 rows make too many waves)
    for bs in (4, 32, 130):
        assert tsd.balances(bs, 8, 8704, 132, kv_fp8=True), bs
        batch = _batch(g, bs, 8, 8192, 0.1, 0.9)
        static = [t.cuda() for t in batch]
        step_balance(*static, 8, 8704, 132, True)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            splits, gate = step_balance(*static, 8, 8704, 132, True)
        for dense in (0.0, 0.03, 0.2, 1.0):
            batch = _batch(g, bs, 8, 8192, dense, 0.9)
            for dst, src in zip(static, batch):
                dst.copy_(src)
            graph.replay()
            want = _reference(*batch, 8, 8704, 132, True, True)
            assert torch.equal(splits.cpu(), want[0]), (bs, dense)
            assert torch.equal(gate.cpu(), want[1]), (bs, dense)
