"""kernels/lfps_tables.py (LFPS's table work on the CUDA-graph path) against the torch ops it replaced in sgl_sparse/lfps_device.py
(queryaware.lfps.candidates over the masked [slots, Hkv, max_context] tables, the
einsum / softmax weights, Eq. (10)'s decay and scatter_add): slots without a row
(n = 0: nothing read, nothing written), a slot whose sink covers its sequence,
a sequence filling the whole table, bypassed heads, GQA 1 / 3 (a group not a power
of two), ragged lengths, an fp32 and a bf16 output, fp16 and fp8 pools."""

from __future__ import annotations

import math

import pytest
import torch

import triton
import triton.language as tl

from sgl_sparse.kernels.lfps_tables import (POWER_SUMS_BLOCK_M, STATS_BLOCK_M, WORK_W, _lfps_table_stats_kernel,
                                           _row_moments, _work_row, finish_chunks, lfps_finish, lfps_priority,
                                           lfps_select_out, no_rho_args, priority_chunks)
from sgl_sparse.kernels.testing import run_on_device
from sgl_sparse.kernels.topk_range import topk_range
from sgl_sparse.queryaware.lfps import candidates


HKV, D, M = 2, 16, 96
N = [70, 0, 33, 96, 5]  # slot 1: no row; slot 4: its sink covers it
SINK = [4, 2, 0, 3, 6]


def _tables(gen, s):
    # peaked tables (a few large entries), as the learned Φ's are
    ver = torch.randn(s, HKV, M, generator=gen).exp() * (torch.rand(s, HKV, M, generator=gen) < 0.2)
    sla = torch.randn(s, HKV, M, generator=gen).exp() * (torch.rand(s, HKV, M, generator=gen) < 0.2)
    return ver, sla


def _prio_ref(rho, eps, a, ver, sla, n, sink):
    return _prio_ref_hkv(rho, eps, a, ver, sla, n, sink, HKV)


def _prio_ref_hkv(rho, eps, a, ver, sla, n, sink, hkv):
    s, m = ver.shape[0], ver.shape[2]
    pos = torch.arange(m)
    nl = n.long()[:, None]
    valid = ((pos[None, :] >= sink.long()[:, None]) & (pos[None, :] < nl))[:, None, :]
    off = nl - 2 - pos[None, :]
    gathered = torch.gather(sla, -1, off.clamp(0, m - 1)[:, None, :].expand(-1, hkv, -1))
    sla_v = torch.where((off >= 0)[:, None, :], gathered, 0.0)
    _, c1 = candidates(ver, sla_v, valid, a[:, None, None])
    bypass = rho.view(s, hkv, -1).mean(-1) > eps[:, None]
    return torch.where(c1 & ~bypass[..., None], ver + sla_v, float("-inf")), bypass


@pytest.mark.parametrize("group, chunks, block_m", [(1, 1, 32), (3, 1, 32), (3, 4, 16), (1, 7, 8), (3, 12, 32)])
def test_priority(group, chunks, block_m):
    """One program a row, and rows cut into chunks: chunks of 2-8 positions in blocks of
    32 (every chunk's moments merged by every program: 12 chunks, where 32 cost the
    interpreter 3 minutes of CI), chunks not a power of two, ends inside a block, rows
    whose sink covers them (every chunk empty)."""
    gen = torch.Generator().manual_seed(group)
    s = len(N)
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    ver, sla = _tables(gen, s)
    rho = torch.rand(s, HKV * group, generator=gen) * 0.1
    rho[0, :group] = 0.9  # slot 0, head 0 bypasses
    eps = torch.full((s,), 0.2)
    a = torch.tensor([0.02, 0.05, 0.2, 0.05, 0.02])
    prio = torch.full((s, HKV, M), float("nan"))
    prio, bypass = run_on_device(lfps_priority, rho, eps, a, ver, sla, n, sink, prio=prio, chunks=chunks,
                                 block_m=block_m)
    ref, byp_ref = _prio_ref(rho, eps, a, ver, sla, n, sink)
    pos = torch.arange(M)
    live = ((pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None]))[:, None, :].expand_as(prio)
    assert torch.isnan(prio[~live]).all(), "written outside [sink, n)"
    assert torch.equal(prio[live], ref[live])  # the same C1 (thresholds: fp32 sums in another order)
    on = n > 0
    assert torch.equal(bypass[on].bool(), byp_ref[on]) and not bypass[~on].any()
    assert bypass[0, 0] and torch.isneginf(prio[0, 0, 4:70]).all()
    assert torch.isfinite(prio[live]).sum() > 10  # C1 is not empty

    # c1_list: rows whose C1 fits min(budget, k) listed by the priorities' launches,
    # skipped by topk_range; the others selected there: topk_range's output alone
    k = 12
    budget = torch.tensor([6, 9, 100, 10, 3], dtype=torch.int32)
    cand = torch.full((s, HKV, k), -3, dtype=torch.int32)
    cnt = torch.full((s, HKV), -4, dtype=torch.int32)
    skip = torch.full((s, HKV), -5, dtype=torch.int32)
    prio2 = torch.full((s, HKV, M), float("nan"))
    run_on_device(lfps_priority, rho, eps, a, ver, sla, n, sink, prio=prio2, chunks=chunks, block_m=block_m,
                  c1_list=(budget, cand, cnt, skip))
    assert torch.equal(prio2[live], prio[live])
    sizes = torch.isfinite(prio.masked_fill(~live, float("-inf"))).sum(-1)
    fits = (n > 0)[:, None] & (sizes <= budget.clamp(max=k)[:, None])
    assert torch.equal(skip, fits.to(torch.int32)) and fits.any() and (~fits & (n > 0)[:, None]).any()
    run_on_device(topk_range, prio2, sink, n, budget, k, out=cand, out_len=cnt, skip=skip)
    want_pos, want_cnt = run_on_device(topk_range, prio2, sink, n, budget, k)
    assert torch.equal(cnt, want_cnt)
    for i, j in (want_cnt > 0).nonzero().tolist():
        assert torch.equal(cand[i, j, : int(want_cnt[i, j])], want_pos[i, j, : int(want_cnt[i, j])]), (i, j)

    # c2_list: where C1 also fits C2's budget, C2 = C1 (indices 0..|C1|-1) listed too and
    # the rank Top-K skips the row: its output over finite exact scores below n_c1
    k2, budget2 = 6, torch.tensor([4, 6, 2, 100, 3], dtype=torch.int32)
    cand = torch.full((s, HKV, k), -3, dtype=torch.int32)
    cnt = torch.full((s, HKV), -4, dtype=torch.int32)
    idx = torch.full((s, HKV, k2), -7, dtype=torch.int32)
    count = torch.full((s, HKV), -8, dtype=torch.int32)
    skip2 = torch.full((s, HKV), -9, dtype=torch.int32)
    run_on_device(lfps_priority, rho, eps, a, ver, sla, n, sink, prio=prio2, chunks=chunks, block_m=block_m,
                  c1_list=(budget, cand, cnt, skip), c2_list=(budget2, idx, count, skip2))
    fits2 = fits & (sizes <= budget2.clamp(max=k2)[:, None])
    assert torch.equal(skip2, fits2.to(torch.int32)) and fits2.any() and (fits & ~fits2).any()
    run_on_device(topk_range, prio2, sink, n, budget, k, out=cand, out_len=cnt, skip=skip)
    rank = torch.randn(s, HKV, k, generator=gen)  # exact scores: finite below n_c1, -inf after
    rank = rank.masked_fill(torch.arange(k)[None, None, :] >= cnt[..., None], float("-inf"))
    zero = torch.zeros(s, dtype=torch.int32)
    run_on_device(topk_range, rank, zero, budget, budget2, k2, out=idx, out_len=count, skip=skip2)
    want_idx, want_count = run_on_device(topk_range, rank, zero, budget, budget2, k2)
    live2 = (n > 0)[:, None].expand_as(count)
    assert torch.equal(count[live2], want_count[live2])
    for i, j in (want_count > 0).nonzero().tolist():
        assert torch.equal(idx[i, j, : int(want_count[i, j])], want_idx[i, j, : int(want_count[i, j])]), (i, j)


@triton.jit
def _row_moments_probe(WORK, N, SINK, OUT, M, CHUNKS: tl.constexpr, TREE: tl.constexpr, BLOCK_P: tl.constexpr):
    """The priorities' merge of a row's chunk partials, as their launch runs it (TREE:
    PRIORITY_TREE_MERGE's)."""
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    n = tl.minimum(tl.load(N + cur_s), M)
    lo = tl.maximum(tl.load(SINK + cur_s), 0)
    row = _work_row(WORK, cur_s, cur_h, tl.num_programs(1), CHUNKS)
    mv, m2v, m4v = _row_moments(row, 0, lo, n, CHUNKS, TREE, BLOCK_P)
    ms, m2s, m4s = _row_moments(row, 4, lo, n, CHUNKS, TREE, BLOCK_P)
    out = OUT + (cur_s * tl.num_programs(1) + cur_h) * 6
    tl.store(out + 0, mv)
    tl.store(out + 1, m2v)
    tl.store(out + 2, m4v)
    tl.store(out + 3, ms)
    tl.store(out + 4, m2s)
    tl.store(out + 5, m4s)


def _row_means(ver, sla, n, sink):
    """[S, Hkv, 2] float64: each row's means of Φ_ver and Φ_sla over [sink, n) (0 without a range)."""
    out = torch.zeros(ver.shape[0], ver.shape[1], 2, dtype=torch.float64)
    for i in range(ver.shape[0]):
        if int(n[i]) > int(sink[i]):
            pos = torch.arange(int(sink[i]), int(n[i]))
            off = int(n[i]) - 2 - pos
            out[i, :, 0] = ver[i][:, pos].double().mean(-1)
            out[i, :, 1] = torch.where(off >= 0, sla[i][:, off.clamp(min=0)], 0.0).double().mean(-1)
    return out


@pytest.mark.parametrize("chunks, block_m, tree, shift", [
    (1, 8, False, None), (3, 8, False, None), (7, 16, False, None), (32, 8, False, None), (7, 16, True, None),
    (32, 8, True, None),
    # STATS_POWER_SUMS about a shift: the last step's means (near), a fresh slot's 0, a
    # reused slot's means of another request's tables (here 4x these)
    (1, 8, True, "near"), (3, 8, True, "zero"), (7, 16, True, "near"), (32, 8, True, "far"), (7, 16, False, "far")])
def test_table_moments_in_one_pass_match_float64(chunks, block_m, tree, shift):
    """Eq. 8's statistics in one pass over the tables: each block's mean and central
    sums about its own mean merged into the chunk's (Pébay), the chunks' merged in
    order (or by one tree reduction: tree) by the priorities' launch, give each row's
    mean, Σd² and Σd⁴ of Φ_ver and Φ_sla over [sink, n) (Φ_sla read backwards from
    n - 2): against float64, at chunks of several blocks, of part of one, and empty
    (more chunks than a row has entries).
    Non-negative tables of unequal blocks, as lfps's are (the rows' C1 comparisons
    alone pass wrong merge coefficients: the thresholds move little on these rows)."""
    gen = torch.Generator().manual_seed(chunks)
    s = len(N)
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    ver, sla = _tables(gen, s)
    ver += 3.0 * torch.linspace(0, 1, M)  # a trend across the blocks: their means differ
    work = torch.full((s, HKV, chunks, WORK_W), float("nan"))
    got = torch.full((s, HKV, 6), float("nan"))
    means = _row_means(ver, sla, n, sink)
    shifts = {None: means, "near": means * (1 + 0.1 * torch.randn(means.shape, generator=gen, dtype=torch.float64)),
              "zero": means * 0, "far": 4 * means}[shift].float().contiguous()

    def stats_then_merge(ver, sla, n, sink, work, shifts, got):
        _lfps_table_stats_kernel[(s, HKV, chunks)](ver, sla, n, sink, work, shifts, ver.stride(0), ver.stride(1),
                                                   sla.stride(0), sla.stride(1), M, **no_rho_args(n), CHUNKS=chunks,
                                                   BLOCK_M=block_m, POWER_SUMS=shift is not None)
        _row_moments_probe[(s, HKV)](work, n, sink, got, M, CHUNKS=chunks, TREE=tree,
                                     BLOCK_P=max(2, triton.next_power_of_2(chunks)))

    run_on_device(stats_then_merge, ver, sla, n, sink, work, shifts, got)  # compiled on a GPU, interpreted in CI
    for i in range(s):
        if int(n[i]) <= int(sink[i]):  # no row, or its sink covers it
            continue
        pos = torch.arange(int(sink[i]), int(n[i]))
        off = int(n[i]) - 2 - pos
        for h in range(HKV):
            phi_sla = torch.where(off >= 0, sla[i, h, off.clamp(min=0)], 0.0).double()
            want = []
            for x in (ver[i, h, pos].double(), phi_sla):
                d = x - x.mean()
                want += [x.mean(), (d ** 2).sum(), (d ** 4).sum()]
            want = torch.stack(want)
            assert not got[i, h].isnan().any(), (i, h)
            # about a far shift the expansions cancel more (~3e-5 of Σd⁴ here): what a
            # slot's first step would pay if its shift were not set from its prompt's tables
            rtol = 1e-4 if shift == "far" else 2e-5
            assert torch.allclose(got[i, h].double(), want, rtol=rtol, atol=1e-6), (i, h, got[i, h], want)


@pytest.mark.parametrize("group, chunks, kv_dtype", [(2, 3, torch.bfloat16), (1, 1, torch.float16),
                                                     (3, 7, torch.float8_e4m3fn)])
def test_priority_computes_rho_in_its_first_launch(group, chunks, kv_dtype):
    """lfps_priority(rho_from=...): a program of each row past its chunks computes ρ
    (lfps_head_sparsity's formula over the slots' n and sink, the queries read through
    q_rows) in the tables' first launch; ρ, the bypass and the priorities equal those
    of ρ computed first by its own launch (rows without a request: ρ 0, nothing read)."""
    from sgl_sparse.kernels.lfps_sparsity import RhoFrom, lfps_head_sparsity

    gen = torch.Generator().manual_seed(group * 10 + chunks)
    s, d = len(N), 16
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    local = torch.tensor([6, 1, 30, 5, 2], dtype=torch.int32)
    ver, sla = _tables(gen, s)
    k = (torch.randn(600, HKV, d, generator=gen) * 1.5).to(kv_dtype)
    r2t = torch.randperm(600, generator=gen)[: s * 100].reshape(s, 100).to(torch.int32)
    q_dtype = torch.bfloat16 if kv_dtype == torch.float8_e4m3fn else kv_dtype
    q = (torch.randn(s + 2, HKV * group, d, generator=gen) * 1.5).to(q_dtype)
    q_rows = torch.tensor([2, 0, 4, 6, 1])  # the slots' batch rows
    kbar = torch.randn(s, HKV, d, generator=gen) * 0.3
    sig = torch.rand(s, HKV * group, generator=gen) * 0.5
    rpi, scale, a = torch.arange(s), d ** -0.5, torch.full((s,), 0.05)
    rho_a = run_on_device(lfps_head_sparsity, q, k, r2t, rpi, n, sink, local, kbar, sig, scale, q_rows=q_rows)
    eps = rho_a.view(s, HKV, group).mean(-1).mean(-1)  # heads above their slot's mean bypass
    prio_a, byp_a = run_on_device(lfps_priority, rho_a, eps, a, ver, sla, n, sink, chunks=chunks, block_m=16)
    rho_b = torch.full_like(rho_a, float("nan"))
    prio_b, byp_b = run_on_device(lfps_priority, rho_b, eps, a, ver, sla, n, sink, chunks=chunks, block_m=16,
                                  rho_from=RhoFrom(q, k, r2t, rpi, local, kbar, sig, scale, q_rows=q_rows))
    assert torch.equal(rho_b, rho_a) and torch.equal(rho_b[1], torch.zeros(HKV * group))
    assert torch.equal(byp_b, byp_a)
    live = n > 0
    assert byp_a[live].any() and not byp_a[live].all()
    pos = torch.arange(M)
    rng = (pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None])
    assert torch.equal(prio_b[rng[:, None, :].expand_as(prio_b)], prio_a[rng[:, None, :].expand_as(prio_a)])


def test_priority_chunks_fill_the_gpu_from_static_shapes():
    """A row's chunks: ~PRIORITY_PROGRAMS_PER_SM programs an SM over the slots' rows,
    never more than the table's blocks nor PRIORITY_MAX_CHUNKS, at least one."""
    assert priority_chunks(8, 8, 33792, 132) == 8  # 32768 x 8: 512 programs
    assert priority_chunks(4, 8, 132052, 132) == 16  # 130000 x 4
    assert priority_chunks(1, 8, 1 << 20, 132) == 32  # the bound
    assert priority_chunks(8, 8, 1500, 132) == 2  # the table's blocks
    assert priority_chunks(64, 8, 33792, 132) == 1
    assert priority_chunks(8, 8, 33792, 132, block_m=512) == 8


def test_finish_chunks_fill_the_gpu_from_static_shapes():
    """A row's finish chunks: ~FINISH_PROGRAMS_PER_SM programs an SM over the slots'
    rows, never more than C2's blocks nor FINISH_MAX_CHUNKS, at least one."""
    assert finish_chunks(8, 8, 2048, 132) == 16  # 32768 x 8: 1024 programs a launch
    assert finish_chunks(4, 8, 2048, 132) == 32  # 130000 x 4
    assert finish_chunks(1, 8, 1 << 16, 132) == 32  # the bound
    assert finish_chunks(8, 8, 40, 132) == 2  # C2's blocks
    assert finish_chunks(128, 8, 2048, 132) == 1
    assert finish_chunks(8, 8, 0, 132) == 1


def _c2(gen, n, sink, c, k):
    """Random C1 lists (ascending distinct positions in [sink, n)) and C2 (ascending distinct indices)."""
    s = len(n)
    cand = torch.zeros(s, HKV, c, dtype=torch.int32)
    idx = torch.zeros(s, HKV, k, dtype=torch.int32)
    count = torch.zeros(s, HKV, dtype=torch.int32)
    for i in range(s):
        for h in range(HKV):
            span = max(int(n[i]) - int(sink[i]), 0)
            c1 = min(span, c, 3 + 7 * (i + h))
            if c1 == 0:
                continue
            p = torch.randperm(span, generator=gen)[:c1].sort().values + int(sink[i])
            cand[i, h, :c1] = p.to(torch.int32)
            kk = min(c1, k, 2 + 5 * h + i)
            idx[i, h, :kk] = torch.randperm(c1, generator=gen)[:kk].sort().values.to(torch.int32)
            count[i, h] = kk
    return cand, idx, count


@pytest.mark.parametrize("group, o_dtype, kv_dtype", [
    (1, torch.float32, torch.float16),
    (3, torch.bfloat16, torch.float16),
    (3, torch.bfloat16, torch.float8_e4m3fn),  # --kv-cache-dtype fp8_e4m3: bf16 queries, keys widened
])
def test_select_out_and_finish(group, o_dtype, kv_dtype):
    gen = torch.Generator().manual_seed(10 + group)
    s, hq, bs, pool, width = len(N), HKV * group, 7, 400, 40
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    row = torch.tensor([3, 7, 0, 5, 1])  # slot -> batch row (7 = bs: none, as SlotRows; slot 1 has n = 0)
    b_start = torch.tensor([60, 0, 20, 90, 5], dtype=torch.int32)
    c, k = 24, 12
    cand, idx, count = _c2(gen, n, sink, c, k)
    bypass = torch.zeros(s, HKV, dtype=torch.int8)
    bypass[2, 1] = 1
    count[2, 1] = 0  # a bypassed head scores nothing (its priorities are -inf)
    k_pool = torch.randn(pool, HKV, D, generator=gen).to(kv_dtype)
    r2t = torch.randint(0, pool, (6, 128), generator=gen, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 4, 1, 5])
    q = torch.randn(bs, hq, D, generator=gen).to(torch.float16 if kv_dtype == torch.float16 else torch.bfloat16)
    o = torch.randn(bs, hq, D, generator=gen).to(o_dtype)
    vbar = torch.randn(s, HKV, D, generator=gen)
    ver, sla = _tables(gen, s)
    ver0, sla0 = ver.clone(), sla.clone()
    r = torch.tensor([0.9, 0.5, 0.99, 0.8, 0.7])
    scale = 1 / math.sqrt(D)

    # select_out: the live slots' rows of a_pos / a_len
    a_pos = torch.full((bs, HKV, width + 8), -7, dtype=torch.int32)
    a_len = torch.full((bs, HKV), -7, dtype=torch.int32)
    run_on_device(lfps_select_out, row, n, sink, b_start, cand, idx, count, bypass, a_pos, a_len, width)
    on = (n > 0).tolist()
    for i in range(s):
        b = int(row[i])
        if not on[i]:
            continue
        for h in range(HKV):
            pos = cand[i, h][idx[i, h, : int(count[i, h])].long()].tolist()
            ns = min(int(sink[i]), max(int(b_start[i]), 0))
            want = (list(range(ns)) + [p for p in pos if int(sink[i]) <= p < int(b_start[i])])[:width]
            assert a_pos[b, h, : len(want)].tolist() == want, (i, h)
            assert int(a_len[b, h]) == (0 if bypass[i, h] else len(want)), (i, h)
    untouched = [b for b in range(bs) if b not in row[torch.tensor(on)].tolist()]
    assert (a_len[untouched] == -7).all() and (a_pos[untouched] == -7).all()
    assert (a_pos[:, :, width:] == -7).all()
    # slots: the same entries (sinks included) as pool slots of the slot's request rpi[i]
    pos_s = torch.full_like(a_pos, -7)
    len_s = torch.full_like(a_len, -7)
    a_slots = torch.full_like(a_pos, -9)
    run_on_device(lfps_select_out, row, n, sink, b_start, cand, idx, count, bypass, pos_s, len_s, width,
                  slots=(r2t, rpi, a_slots))
    assert torch.equal(pos_s, a_pos) and torch.equal(len_s, a_len)
    # scored: each live slot's heads add |C1| and max(n - sink, 1) to their cells, twice
    # here; a slot without a row (n = 0) adds nothing
    n_c1 = torch.randint(0, c + 1, (s, HKV), generator=gen, dtype=torch.int32)
    acc = torch.full((s, HKV, 2), 0.5, dtype=torch.float64)
    for _ in range(2):
        run_on_device(lfps_select_out, row, n, sink, b_start, cand, idx, count, bypass, pos_s, len_s, width,
                      scored=(n_c1, acc))
    live = (n > 0)[:, None].double()
    assert torch.equal(acc[..., 0], 0.5 + 2 * live * n_c1.double())
    assert torch.equal(acc[..., 1], (0.5 + 2 * live * (n - sink).clamp(min=1)[:, None].double()).expand(s, HKV))
    assert torch.equal(pos_s, a_pos) and torch.equal(len_s, a_len)
    for i in range(s):
        if not on[i]:
            continue
        b = int(row[i])
        for h in range(HKV):
            m = int((a_pos[b, h] != -7).sum())  # written entries (a bypassed head's too)
            assert torch.equal(a_slots[b, h, :m], r2t[int(rpi[i])][a_pos[b, h, :m].long()]), (i, h)
            assert (a_slots[b, h, m:] == -9).all()
    assert (a_slots[untouched] == -9).all()

    # finish: the old torch ops (lfps_device.py before the kernels), per slot
    o_ref, ver_ref, sla_ref = o.clone(), ver.clone(), sla.clone()
    for i in range(s):
        if not on[i]:
            continue
        b = int(row[i])
        for h in range(HKV):
            heads = slice(h * group, (h + 1) * group)
            if bypass[i, h]:
                o_ref[b, heads] = vbar[i, h].to(o_dtype)
                continue
            cnt = int(count[i, h])
            if cnt == 0:
                continue
            pos = cand[i, h][idx[i, h, :cnt].long()].long()
            keys = k_pool[r2t[rpi[i], pos].long(), h].float()  # [cnt, D]
            lg = torch.einsum("gd,kd->gk", q[b, heads].float(), keys) * scale
            w = torch.softmax(lg, -1).mean(0)
            inc = w - 0.5 / cnt
            ver_ref[i, h].mul_(r[i]).scatter_add_(-1, pos, inc)
            off = int(n[i]) - 1 - pos
            ok = (off >= 0) & (off < M)
            sla_ref[i, h].mul_(r[i]).scatter_add_(-1, off[ok], inc[ok])
    # one program a row; rows cut into chunks: 3 (not a power of two, the tables'
    # slices ending inside a block), 8 (more chunks than most rows' C2 entries)
    o_in = o.clone()
    for chunks in (1, 3, 8):
        o, ver, sla = o_in.clone(), ver0.clone(), sla0.clone()
        run_on_device(lfps_finish, q, o, k_pool, r2t, rpi, row, n, r, cand, idx, count, bypass, vbar, ver, sla, scale,
                      block_k=16, block_m=32, chunks=chunks)
        assert torch.equal(o, o_ref), chunks
        torch.testing.assert_close(ver, ver_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sla, sla_ref, rtol=1e-5, atol=1e-6)
        assert not (torch.isnan(ver).any() or torch.isnan(sla).any()), chunks
        # no row, bypassed, or an empty C2: the tables as they were, bit for bit
        for i, h in [(1, 0), (1, 1), (2, 1)] + [(i, h) for i in range(s) for h in range(HKV) if count[i, h] == 0]:
            assert torch.equal(ver[i, h], ver0[i, h]) and torch.equal(sla[i, h], sla0[i, h]), (chunks, i, h)

    # the lazy decay: tables stored over a scale per row (true = stored * scale), some
    # rows' scales one decay away from renormalizing (slot 3: below RENORM_BELOW after
    # this step, so its tables are multiplied out and its scale is 1)
    from sgl_sparse.kernels.lfps_tables import RENORM_BELOW

    floor = float(RENORM_BELOW.value if hasattr(RENORM_BELOW, "value") else RENORM_BELOW)
    tscale0 = torch.rand(s, HKV, generator=gen) * 0.5 + 0.5
    tscale0[3] = floor * 1.05  # r = 0.8 takes it below the floor
    # and the statistics' shift (STATS_POWER_SUMS) multiplied as the stored entries are
    shift0 = torch.rand(s, HKV, 2, generator=gen) + 0.5
    for chunks in (1, 3):
        o, ver, sla, tscale, shift = o_in.clone(), ver0.clone(), sla0.clone(), tscale0.clone(), shift0.clone()
        run_on_device(lfps_finish, q, o, k_pool, r2t, rpi, row, n, r, cand, idx, count, bypass, vbar, ver, sla, scale,
                      block_k=16, block_m=32, chunks=chunks, tscale=tscale, shift=shift)
        assert torch.equal(o, o_ref), chunks
        # the reference from the true tables: stored * scale before, decayed and added to
        true_ref_v, true_ref_s = ver0 * tscale0[..., None], sla0 * tscale0[..., None]
        for i in range(s):
            if not on[i]:
                continue
            for h in range(HKV):
                cnt = int(count[i, h])
                if bypass[i, h] or cnt == 0:
                    continue
                moved = (ver_ref[i, h] - ver0[i, h] * r[i], sla_ref[i, h] - sla0[i, h] * r[i])  # the increments
                true_ref_v[i, h] = true_ref_v[i, h] * r[i] + moved[0]
                true_ref_s[i, h] = true_ref_s[i, h] * r[i] + moved[1]
        torch.testing.assert_close(ver * tscale[..., None], true_ref_v, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sla * tscale[..., None], true_ref_s, rtol=1e-5, atol=1e-6)
        for i in range(s):
            for h in range(HKV):
                touched = bool(on[i]) and not bool(bypass[i, h]) and int(count[i, h]) > 0
                if not touched:  # scale and tables as they were
                    assert float(tscale[i, h]) == float(tscale0[i, h]), (chunks, i, h)
                    assert torch.equal(ver[i, h], ver0[i, h]) and torch.equal(sla[i, h], sla0[i, h]), (i, h)
                    assert torch.equal(shift[i, h], shift0[i, h]), (chunks, i, h)
                elif i == 3:  # renormalized: scale 1, the tables and their shift multiplied out
                    assert float(tscale[i, h]) == 1.0, (chunks, h)
                    torch.testing.assert_close(shift[i, h], shift0[i, h] * tscale0[i, h] * r[i])
                else:  # the tables untouched but at C2's entries, the scale decayed
                    assert torch.equal(shift[i, h], shift0[i, h]), (chunks, i, h)
                    assert float(tscale[i, h]) == pytest.approx(float(tscale0[i, h] * r[i]), rel=1e-6)
                    moved = (ver[i, h] != ver0[i, h]).sum() + (sla[i, h] != sla0[i, h]).sum()
                    assert 0 < int(moved) <= 2 * int(count[i, h]), (chunks, i, h)


def test_q_rows_read_in_place():
    """q_rows (lfps_head_sparsity, token_scores_at, quest_page_scores): each row reads
    its query from another row of q, bit for bit what the gathered q gives; rows
    with nothing to do never read theirs."""
    from sgl_sparse.kernels.lfps_sparsity import lfps_head_sparsity
    from sgl_sparse.kernels.quest_pages import quest_page_scores
    from sgl_sparse.kernels.token_scores import token_scores_at

    gen = torch.Generator().manual_seed(5)
    group, bs, s, pool = 3, 6, 4, 300
    q3 = torch.randn(bs, HKV * group, D, generator=gen).half()
    rows = torch.tensor([4, 0, 2, 5])
    q = q3[rows]
    k_pool = torch.randn(pool, HKV, D, generator=gen).half()
    r2t = torch.randint(0, pool, (5, 128), generator=gen, dtype=torch.int32)
    rpi = torch.tensor([1, 0, 3, 4])
    n = torch.tensor([90, 0, 40, 120], dtype=torch.int32)
    sink = torch.tensor([4, 0, 2, 3], dtype=torch.int32)
    local = torch.tensor([6, 0, 30, 5], dtype=torch.int32)
    kbar = torch.randn(s, HKV, D, generator=gen)
    sig = torch.rand(s, HKV * group, generator=gen)
    args = (k_pool, r2t, rpi, n, sink, local, kbar, sig, 0.25)
    assert torch.equal(run_on_device(lfps_head_sparsity, q3, *args, q_rows=rows), run_on_device(lfps_head_sparsity, q, *args))
    cand = torch.randint(0, 90, (s, HKV, 40), generator=gen, dtype=torch.int32)
    clen = torch.tensor([[40, 7], [0, 0], [13, 40], [1, 22]], dtype=torch.int32)
    a = run_on_device(token_scores_at, q3, k_pool, r2t, rpi, cand, 0.25, cand_len=clen, q_rows=rows, block_n=16)
    assert torch.equal(a, run_on_device(token_scores_at, q, k_pool, r2t, rpi, cand, 0.25, cand_len=clen, block_n=16))
    on = torch.tensor([3, 0, 0, 1], dtype=torch.int32)  # rows 1, 2: not written at all
    out = torch.full_like(a, float("nan"))
    run_on_device(token_scores_at, q3, k_pool, r2t, rpi, cand, 0.25, cand_len=clen, q_rows=rows, block_n=16, out=out, row_on=on)
    assert torch.equal(out[[0, 3]], a[[0, 3]]) and torch.isnan(out[[1, 2]]).all()
    kmin = torch.randn(5, HKV, 9, D, generator=gen).half()
    kmax = kmin + torch.rand(5, HKV, 9, D, generator=gen).half()
    slot = torch.tensor([3, -1, 0, 4], dtype=torch.int32)
    first, last = torch.tensor([0, 0, 1, 2], dtype=torch.int32), torch.tensor([6, 9, 9, 5], dtype=torch.int32)
    p = run_on_device(quest_page_scores, q3, kmin, kmax, slot, first, last, q_rows=rows, block_p=16)
    assert torch.equal(p, run_on_device(quest_page_scores, q, kmin, kmax, slot, first, last, block_p=16))


def _with_defaults(fn, const: dict) -> dict:
    """`const` with the kernel's other constexpr parameters at their defaults (as a
    launch that leaves them out compiles them)."""
    import inspect

    params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()  # jitted or interpreted
    return {**{p.name: p.default for p in params
               if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty}, **const}


def _store_layer_32k(seed: int):
    """32768 x 8's store layer (8 slots of 33792, 8 KV heads, GQA 2), peaked tables,
    ragged rows, one slot without a row: (ver, sla, n, sink, rho, eps, a, live)."""
    gen = torch.Generator().manual_seed(seed)
    s, hkv, m, group = 8, 8, 33792, 2
    ver = torch.randn(s, hkv, m, generator=gen).exp() * (torch.rand(s, hkv, m, generator=gen) < 0.05)
    sla = torch.randn(s, hkv, m, generator=gen).exp() * (torch.rand(s, hkv, m, generator=gen) < 0.05)
    n = torch.tensor([32768, 33792, 0, 20001, 32769, 1000, 33000, 4], dtype=torch.int32)
    sink = torch.tensor([4, 4, 4, 0, 4, 4, 16, 4], dtype=torch.int32)
    rho = torch.rand(s, hkv * group, generator=gen) * 0.1
    eps, a = torch.full((s,), 0.2), torch.full((s,), 0.05)
    pos = torch.arange(m)
    live = ((pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None]))[:, None, :].expand(s, hkv, m)
    return ver, sla, n, sink, rho, eps, a, live


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_power_sums_at_32k(monkeypatch):
    """STATS_POWER_SUMS compiled at 32768 x 8's store layer (rows of up to 33792
    entries): about a shift 10% off the rows' means (a step's drift), then about the
    means the first launch wrote, the reference's C1 and priorities (at most one entry
    in 10^4 on the other side of a threshold, fp32 rounding) and the means within 1e-5."""
    import importlib

    monkeypatch.setattr(importlib.import_module("sgl_sparse.kernels.lfps_tables"), "STATS_POWER_SUMS", True)
    dev = torch.device("cuda")
    ver, sla, n, sink, rho, eps, a, live = _store_layer_32k(33)
    ref, _ = _prio_ref_hkv(rho, eps, a, ver, sla, n, sink, ver.shape[1])
    means = _row_means(ver, sla, n, sink)
    shift = (1.1 * means).float().to(dev)
    args = [t.to(dev) for t in (rho, eps, a, ver, sla, n, sink)]
    for _ in range(2):
        prio, _ = lfps_priority(*args, shift=shift)
        prio = prio.cpu()
        assert int((prio[live] != ref[live]).sum()) <= int(live.sum()) // 10000
        assert torch.isfinite(prio[live]).sum() > 1000
        ranged = n > sink
        torch.testing.assert_close(shift.cpu()[ranged].double(), means[ranged], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_priority_at_32k_slots_as_served():
    """32768 x 8's store layer (8 slots of 33792, 8 KV heads, GQA 2), compiled, at the
    default chunks (8 on 132 SMs) and one program a row: both give the reference's C1,
    ragged rows, one slot without a row."""
    dev = torch.device("cuda")
    ver, sla, n, sink, rho, eps, a, live = _store_layer_32k(32)
    s, hkv, m = ver.shape
    rho[3, 2:4] = 0.9
    ref, byp_ref = _prio_ref_hkv(rho, eps, a, ver, sla, n, sink, hkv)
    args = [t.to(dev) for t in (rho, eps, a, ver, sla, n, sink)]
    for chunks in (None, 1):
        prio = torch.full((s, hkv, m), float("nan"), device=dev)
        prio, bypass = lfps_priority(*args, prio=prio, chunks=chunks)
        prio, bypass = prio.cpu(), bypass.cpu()
        assert torch.isnan(prio[~live]).all(), chunks
        assert torch.equal(prio[live], ref[live]), chunks
        assert torch.equal(bypass[n > 0].bool(), byp_ref[n > 0]), chunks
        assert torch.isfinite(prio[live]).sum() > 1000
    # the served C1 stage: listed where it fits 8192 candidates (one row's budget below
    # its C1: selected by topk_range), the same C1 as topk_range alone
    k = 8192
    budget = torch.tensor([k, k, k, k, 64, k, k, k], dtype=torch.int32, device=dev)
    cand = torch.empty(s, hkv, k, dtype=torch.int32, device=dev)
    cnt = torch.empty(s, hkv, dtype=torch.int32, device=dev)
    listed = torch.empty(s, hkv, dtype=torch.int32, device=dev)
    k2 = 2048
    budget2 = torch.tensor([k2, k2, k2, 16, k2, k2, k2, k2], dtype=torch.int32, device=dev)
    idx = torch.empty(s, hkv, k2, dtype=torch.int32, device=dev)
    count = torch.empty(s, hkv, dtype=torch.int32, device=dev)
    all_c1 = torch.empty(s, hkv, dtype=torch.int32, device=dev)
    prio, _ = lfps_priority(*args, c1_list=(budget, cand, cnt, listed), c2_list=(budget2, idx, count, all_c1))
    topk_range(prio, args[6], args[5], budget, k, out=cand, out_len=cnt, skip=listed)
    want_pos, want_cnt = topk_range(prio, args[6], args[5], budget, k)
    assert torch.equal(cnt, want_cnt) and bool(listed[1].all()) and not bool(listed[4].any())
    for i, j in (want_cnt > 0).nonzero().tolist():
        assert torch.equal(cand[i, j, : int(want_cnt[i, j])], want_pos[i, j, : int(want_cnt[i, j])]), (i, j)
    # C2 = C1 where C1 fits 2048 (row 5: 1000 keys), not where its budget is 16 (row 3),
    # except on row 3's bypassed head 1 (rho 0.9: its C1 is empty, so it fits any budget)
    rank = torch.randn(s, hkv, k, device=dev).masked_fill(torch.arange(k, device=dev) >= cnt[..., None],
                                                          float("-inf"))
    zero = torch.zeros(s, dtype=torch.int32, device=dev)
    topk_range(rank, zero, budget, budget2, k2, out=idx, out_len=count, skip=all_c1)
    want_idx, want_count = topk_range(rank, zero, budget, budget2, k2)
    live = n.to(dev) > 0
    fits2 = listed.bool() & (cnt <= budget2.clamp(max=k2)[:, None])
    assert torch.equal(count[live], want_count[live]) and torch.equal(all_c1.bool(), fits2)
    assert bool(all_c1[5].all()) and all_c1[3].tolist() == [0, 1, 0, 0, 0, 0, 0, 0] and int(cnt[3, 1]) == 0
    for i, j in (want_count > 0).nonzero().tolist():
        assert torch.equal(idx[i, j, : int(want_count[i, j])], want_idx[i, j, : int(want_count[i, j])]), (i, j)


@pytest.mark.parametrize("group, chunks, block_m", [(1, 7, 8), (3, 12, 32)])
def test_priority_tree_merge(monkeypatch, group, chunks, block_m):
    """PRIORITY_TREE_MERGE: each program merges its row's chunk moments by one tree
    reduction (padding lanes of count 0 past 7 / 12 chunks, rows whose chunks are all
    empty): the reference's C1 and priorities, as the merge in chunk order gives them."""
    import importlib

    lt = importlib.import_module("sgl_sparse.kernels.lfps_tables")
    gen = torch.Generator().manual_seed(40 + group)
    s = len(N)
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    ver, sla = _tables(gen, s)
    rho = torch.rand(s, HKV * group, generator=gen) * 0.1
    eps, a = torch.full((s,), 0.2), torch.tensor([0.02, 0.05, 0.2, 0.05, 0.02])
    pos = torch.arange(M)
    live = ((pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None]))[:, None, :].expand(s, HKV, M)
    got = {}
    for tree in (True, False):
        monkeypatch.setattr(lt, "PRIORITY_TREE_MERGE", tree)
        prio = torch.full((s, HKV, M), float("nan"))
        prio, _ = run_on_device(lfps_priority, rho, eps, a, ver, sla, n, sink, prio=prio, chunks=chunks,
                                block_m=block_m)
        assert torch.isnan(prio[~live]).all()
        got[tree] = prio[live]
    ref, _ = _prio_ref(rho, eps, a, ver, sla, n, sink)
    assert torch.equal(got[True], ref[live]) and torch.equal(got[True], got[False])
    assert torch.isfinite(got[True]).sum() > 10


def _gqa2_case(seed: int):
    """The module's slots (ragged, one without a row, one its sink covers), peaked
    tables, GQA 2: (s, n, sink, ver, sla, rho, eps, a)."""
    gen = torch.Generator().manual_seed(seed)
    s = len(N)
    n, sink = torch.tensor(N, dtype=torch.int32), torch.tensor(SINK, dtype=torch.int32)
    ver, sla = _tables(gen, s)
    rho = torch.rand(s, HKV * 2, generator=gen) * 0.1
    eps, a = torch.full((s,), 0.2), torch.tensor([0.02, 0.05, 0.2, 0.05, 0.02])
    return s, n, sink, ver, sla, rho, eps, a


@pytest.mark.parametrize("chunks, block_m", [(1, 32), (3, 8), (7, 16)])
def test_priority_by_power_sums(monkeypatch, chunks, block_m):
    """STATS_POWER_SUMS: the statistics' power sums about each row's shift (here 1.3x
    its means, as a step's changes leave them) give the reference's C1 and priorities,
    as the Pébay merges do; the priorities' launch writes each live row's means into the
    shift for the next step and leaves the other rows' alone."""
    import importlib

    lt = importlib.import_module("sgl_sparse.kernels.lfps_tables")
    monkeypatch.setattr(lt, "STATS_POWER_SUMS", True)
    s, n, sink, ver, sla, rho, eps, a = _gqa2_case(70 + chunks)
    means = _row_means(ver, sla, n, sink)
    shift = (1.3 * means + 0.01).float().contiguous()
    shift_in = shift.clone()
    prio = torch.full((s, HKV, M), float("nan"))
    prio, bypass = run_on_device(lfps_priority, rho, eps, a, ver, sla, n, sink, prio=prio, chunks=chunks,
                                 block_m=block_m, shift=shift)
    pos = torch.arange(M)
    live = ((pos[None, :] >= sink[:, None]) & (pos[None, :] < n[:, None]))[:, None, :].expand(s, HKV, M)
    ref, byp_ref = _prio_ref_hkv(rho, eps, a, ver, sla, n, sink, HKV)
    assert torch.isnan(prio[~live]).all() and torch.equal(prio[live], ref[live])
    assert torch.isfinite(prio[live]).sum() > 10
    ranged = n > sink  # rows with entries: their means written; no row (n <= 0): untouched
    torch.testing.assert_close(shift[ranged].double(), means[ranged], rtol=1e-5, atol=1e-6)
    assert torch.equal(shift[n <= 0], shift_in[n <= 0])


@pytest.mark.parametrize("kernel, const", [
    ("_lfps_table_stats_kernel", dict(CHUNKS=8, BLOCK_M=POWER_SUMS_BLOCK_M, HAS_RHO=False, HEAD_DIM=1, GROUP=1,
                                      BLOCK_H=16, BLOCK_N=16, BLOCK_D=16, Q_SPLIT=False, FP32_DOT=False,
                                      HAS_Q_ROWS=False, POWER_SUMS=True)),
    ("_lfps_priority_kernel", dict(GROUP=2, BLOCK_G=2, CHUNKS=16, BLOCK_M=1024, TREE_MERGE=True, BLOCK_P=16,
                                   POWER_SUMS=True)),
    ("_lfps_table_stats_kernel", dict(CHUNKS=8, BLOCK_M=STATS_BLOCK_M, HAS_RHO=False, HEAD_DIM=1, GROUP=1, BLOCK_H=16,
                                      BLOCK_N=16, BLOCK_D=16, Q_SPLIT=False, FP32_DOT=False, HAS_Q_ROWS=False)),
    ("_lfps_priority_kernel", dict(GROUP=2, BLOCK_G=2, CHUNKS=8, BLOCK_M=1024, TREE_MERGE=False, BLOCK_P=8)),
    ("_lfps_priority_kernel", dict(GROUP=2, BLOCK_G=2, CHUNKS=32, BLOCK_M=1024, TREE_MERGE=True, BLOCK_P=32)),
    ("_lfps_c1_list_kernel", dict(CHUNKS=8, BLOCK_P=8, BLOCK_M=1024, HAS_C2=False)),
    ("_lfps_c1_list_kernel", dict(CHUNKS=8, BLOCK_P=8, BLOCK_M=1024, HAS_C2=True)),
    ("_lfps_select_out_kernel", dict(BLOCK_K=2048, BLOCK_S=16, HAS_SLOTS=True, HAS_SCORED=True)),
])
def test_priority_kernels_compile_for_sm90(kernel, const):
    """The chunked priorities, the C1 listing and the C2 output with the scored
    sums as lfps_device launches them at 32768 x 8 (8 chunks) compile for the
    H100/H200 (sm_90). Their table reads are
    4-byte loads (coalesced across a warp): a chunk starts anywhere (the sink, the
    row's own length) and Φ_sla is read backwards, so no wider load is provable."""
    import importlib

    from sgl_sparse.kernels.testing import compile_sm90

    fn = getattr(importlib.import_module("sgl_sparse.kernels.lfps_tables"), kernel)
    ptrs = {"RHO": "*fp32", "EPS": "*fp32", "A": "*fp32", "VER": "*fp32", "SLA": "*fp32", "N": "*i32",
            "SINK": "*i32", "WORK": "*fp32", "SHIFT": "*fp32", "PRIO": "*fp32", "BYPASS": "*i8", "BUDGET": "*i32",
            "OUT": "*i32",
            "OUT_LEN": "*i32", "SKIP": "*i32", "BUDGET2": "*i32", "IDX": "*i32", "COUNT": "*i32", "SKIP2": "*i32",
            # lfps_select_out (C2 into the batch rows, the scored fraction's sums)
            "ROW": "*i64", "B_START": "*i32", "CAND": "*i32", "A_POS": "*i32", "A_LEN": "*i32",
            "REQ_TO_TOKEN": "*i32", "REQ_POOL_IDX": "*i64", "A_SLOTS": "*i32", "N_C1": "*i32", "SCORED": "*fp64"}
    const = _with_defaults(fn, const)
    sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
    got = compile_sm90("sgl_sparse.kernels.lfps_tables", kernel, sig, const, [a for a in fn.arg_names if a in ptrs],
                       options={"num_warps": 4})
    assert got.get("ld.global.b32", 0) > 0 and got.get("st.global.b32", 0) > 0, got


@pytest.mark.parametrize("power_sums", [False, True])
def test_stats_with_rho_compiles_for_sm90(power_sums):
    """The tables' first launch as lfps_device makes it (ρ in a program of each row past
    its chunks, over an e4m3 pool with bf16 queries read through q_rows, GQA 2, 8 chunks, its tile
    of STATS_BLOCK_M lanes' moments, or POWER_SUMS_BLOCK_M lanes' power sums) compiles for the H100/H200 (sm_90) without
    spilling in no more than 128 registers a thread, so the chunks' programs keep
    their occupancy."""
    import importlib

    from sgl_sparse.kernels.testing import compile_sm90

    fn = importlib.import_module("sgl_sparse.kernels.lfps_tables")._lfps_table_stats_kernel
    ptrs = {"VER": "*fp32", "SLA": "*fp32", "N": "*i32", "SINK": "*i32", "WORK": "*fp32", "SHIFT": "*fp32",
            "Q": "*bf16",
            "K_POOL": "*fp8e4nv", "REQ_TO_TOKEN": "*i32", "REQ_POOL_IDX": "*i64", "LOCAL": "*i32",
            "KBAR": "*fp32", "SIGMA_HAT2": "*fp32", "RHO": "*fp32", "Q_ROWS": "*i64"}
    block_m = POWER_SUMS_BLOCK_M if power_sums else STATS_BLOCK_M
    const = dict(CHUNKS=8, BLOCK_M=block_m, HAS_RHO=True, HEAD_DIM=128, GROUP=2, BLOCK_H=16, BLOCK_N=16,
                 BLOCK_D=128, Q_SPLIT=False, FP32_DOT=False, HAS_Q_ROWS=True, POWER_SUMS=power_sums)
    const = _with_defaults(fn, const)
    sig = {a: ptrs.get(a, "constexpr" if a in const else ("fp32" if a == "sm_scale" else "i32"))
           for a in fn.arg_names}
    got = compile_sm90("sgl_sparse.kernels.lfps_tables", "_lfps_table_stats_kernel", sig, const, list(ptrs),
                       options={"num_warps": 4}, resources=True)
    assert got["stack_bytes"] == 0 and got["registers"] <= 128 and got.get("st.global.b32", 0) > 0, got


@pytest.mark.parametrize("kernel", ["_lfps_finish_stats_kernel", "_lfps_finish_update_kernel"])
def test_finish_kernels_compile_for_sm90(kernel):
    """The chunked finish as lfps_device launches it at 32768 x 8 over an e4m3 pool
    (bf16 queries and output, GQA 2, 8 chunks, the lazy decay) compiles for the H100/H200 (sm_90),
    its tables read and written in place with 4-byte accesses (the update launch:
    from the stats launch's kept logits and positions, no key gathered again)."""
    import importlib

    from sgl_sparse.kernels.testing import compile_sm90

    fn = getattr(importlib.import_module("sgl_sparse.kernels.lfps_tables"), kernel)
    const = dict(GROUP=2, BLOCK_H=16, BLOCK_K=32, CHUNKS=8, LAZY=True)
    if kernel == "_lfps_finish_stats_kernel":
        const.update(HEAD_DIM=128, BLOCK_D=128, Q_SPLIT=False, FP32_DOT=False, V_DIM=128, BLOCK_DV=128,
                     BLOCK_M=1024, BF16_RTNE=False, SCALE_SHIFT=True)
    else:
        const.update(BLOCK_P=8)
    const = _with_defaults(fn, const)
    ptrs = {"Q": "*bf16", "O": "*bf16", "K_POOL": "*fp8e4nv", "REQ_TO_TOKEN": "*i32", "REQ_POOL_IDX": "*i64",
            "ROW": "*i64", "N": "*i32", "R": "*fp32", "CAND": "*i32", "IDX": "*i32", "COUNT": "*i32",
            "BYPASS": "*i8", "VBAR": "*fp32", "VER": "*fp32", "SLA": "*fp32", "WORK": "*fp32", "LOGITS": "*fp32",
            "POS": "*i32", "TSCALE": "*fp32", "NEWSCALE": "*fp32", "SHIFT": "*fp32"}
    sig = {a: ptrs.get(a, "constexpr" if a in const else ("fp32" if a == "sm_scale" else "i32"))
           for a in fn.arg_names}
    got = compile_sm90("sgl_sparse.kernels.lfps_tables", kernel, sig, const, [a for a in fn.arg_names if a in ptrs],
                       options={"num_warps": 4})
    assert got.get("ld.global.b32", 0) > 0 and got.get("st.global.b32", 0) > 0, got


def test_finish_without_c2_width_still_writes_the_bypassed_heads():
    """A C2 list of width 0 (no entry to update): the tables stay as they are and a
    bypassed head's output rows still get V̄."""
    gen = torch.Generator().manual_seed(3)
    s, group, bs = 2, 2, 3
    q = torch.randn(bs, HKV * group, D, generator=gen).half()
    o = torch.zeros(bs, HKV * group, D, dtype=torch.float32)
    k_pool = torch.randn(50, HKV, D, generator=gen).half()
    r2t = torch.randint(0, 50, (2, 40), generator=gen, dtype=torch.int32)
    rpi, row = torch.tensor([0, 1]), torch.tensor([2, 0])
    n, r = torch.tensor([30, 20], dtype=torch.int32), torch.tensor([0.9, 0.9])
    cand = torch.zeros(s, HKV, 4, dtype=torch.int32)
    idx = torch.zeros(s, HKV, 0, dtype=torch.int32)
    count = torch.zeros(s, HKV, dtype=torch.int32)
    bypass = torch.tensor([[1, 0], [0, 0]], dtype=torch.int8)
    vbar = torch.randn(s, HKV, D, generator=gen)
    ver, sla = _tables(gen, s)
    ver0, sla0 = ver.clone(), sla.clone()
    tscale = torch.ones(s, HKV)
    run_on_device(lfps_finish, q, o, k_pool, r2t, rpi, row, n, r, cand, idx, count, bypass, vbar, ver, sla, 0.25,
                  tscale=tscale)
    assert torch.equal(o[2, :group], vbar[0, 0].expand(group, D)) and not o[2, group:].any() and not o[:2].any()
    assert torch.equal(ver, ver0) and torch.equal(sla, sla0) and torch.equal(tscale, torch.ones(s, HKV))
