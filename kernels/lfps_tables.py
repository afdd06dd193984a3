"""
LFPS's table work on the CUDA-graph path
========================================

``sgl_sparse/lfps_device.py`` runs LFPS's decode step over the policy's store
slots with static shapes (so SGLang's decode CUDA graphs can capture it). Its
table work was ~150 small torch ops per layer over ``[slots, Hkv, max_context]``
(Eq. 8's thresholds, C0 / C1 with the position shifts, the priorities, Eq. 10's
decay and scatter), paid by every slot at every step, rows or not. Here it is
kernels over a grid of ``(S, Hkv)`` (the priorities: ``(S, Hkv, chunks)``), whose
programs for a slot without a row this step (``n <= 0``) return at once, so a step
pays for its live slots only and a batch without an lfps row pays near-empty
launches:

* :func:`lfps_priority`: the group-mean ρ against ε (the sink bypass), Eq. (8)'s
  thresholds of both tables over the valid range ``[sink, n)``, C0 / C1 (Eqs. 7,
  9) and the priority ``Φ_ver + Φ_sla`` on C1 (``-inf`` elsewhere and on bypassed
  heads), written over ``[sink, n)`` only (what ``topk_range`` reads).
  ``Φ_sla(i) = sla[n - 2 - i]`` (0 for ``i = n - 1``), as
  ``queryaware.lfps.table_views``. The same math as ``queryaware.lfps.candidates``
  (fp32 sums in another order). Each row's passes are cut into chunks (two
  launches: the chunks' moments, then C1), since one program a row walking the whole
  context three times was latency-bound (session 32: 110 us a layer at 32768 x 8).
* :func:`lfps_select_out`: C2 (``cand[idx[i]]``, ``i < count``, ascending) ->
  the slot's batch row of ``a_pos`` / ``a_len``: its sinks, then the C2
  positions in ``[sink, b_start)`` (``expand_selection``'s listing), ``a_len``
  0 on a bypassed head (V̄ replaces its output); optionally the same entries as
  pool slots (``req_to_token[rpi, pos]``) into ``a_slots``, what the decode
  gathers from fastest, without kernels/indexed_slots.py's launch.
* :func:`lfps_finish`: after the attention, a bypassed head's output rows get
  V̄; otherwise, with ``|C2| > 0``, Eq. (10): the weights ``w_i`` (each query
  head's softmax over C2 of ``scale q.k_i``, the group's mean), the tables
  multiplied by ``r`` and ``w_i - 0.5 / |C2|`` added at ``i`` (``Φ_ver``) and at
  ``n - 1 - i`` (``Φ_sla``). Two launches over ``(S, Hkv, chunks)``, each row's C2
  entries and table slices cut among its chunks: C2's logits (kept, with their
  positions), the softmax partials and the decay, then the weights from every
  chunk's partials and the kept logits, and the scatter (after all of the decay; C2's
  positions are distinct, so no two programs add to one entry). One program a row
  doing it all, gathering C2's keys twice, took 176 us a layer at 32768 x 8 (session
  35). Served with the lazy decay (``tscale``): the decay multiplies a scale per row,
  not both tables (~35 MB a layer at 32768 x 8 read and written every step).

No host sync, grids from static shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._utils import cdiv, device_num_sms, env_switch, needs_bf16_rtne, next_pow2
from .indexed_slots import unpack_slots
from .lfps_sparsity import RhoFrom, _head_sparsity, rho_launch_args
from .asyncspade_predict import _round_bf16_rtne
from .token_scores import _load_q_parts, group_tile_meta
from .two_segment_decode import _dot

__all__ = ["lfps_priority", "priority_chunks", "lfps_select_out", "lfps_finish", "finish_chunks"]


@triton.jit
def _sla_at(SLA_ROW, pos, ok, n, M):
    """Φ_sla at positions `pos` (sla[n - 2 - pos], 0 where that is < 0), 0 where not ok."""
    off = n - 2 - pos
    return tl.load(SLA_ROW + tl.minimum(tl.maximum(off, 0), M - 1), mask=ok & (off >= 0), other=0.0)


@triton.jit
def _c0(VER_ROW, SLA_ROW, i, lo, n, M, tv, ts):
    ok = (i >= lo) & (i < n)
    v = tl.load(VER_ROW + i, mask=ok, other=0.0)
    s = _sla_at(SLA_ROW, i, ok, n, M)
    return ok & ((v > tv) | (s > ts))


@triton.jit
def _share(lo, hi, cur_p, CHUNKS):
    """Chunk cur_p's [start, stop) of [lo, hi) cut into CHUNKS near-equal chunks, in
    order (empty past the range's end, and for an empty range)."""
    size = (tl.maximum(hi - lo, 0) + CHUNKS - 1) // CHUNKS
    start = tl.minimum(lo + cur_p * size, hi)
    return start, tl.minimum(start + size, hi)


@triton.jit
def _chunk_of(N, SINK, M, cur_s, cur_p, CHUNKS):
    """(n, lo, the chunk's [start, stop)): a live row's valid range [lo, n) cut into
    CHUNKS near-equal chunks by its own length (n <= 0: no row)."""
    n = tl.minimum(tl.load(N + cur_s), M)
    lo = tl.maximum(tl.load(SINK + cur_s), 0)
    start, stop = _share(lo, n, cur_p, CHUNKS)
    return n, lo, start, stop


#: Floats a chunk's partials take in WORK: Φ_ver's and Φ_sla's mean and central sums
#: Σd², Σd³, Σd⁴ (columns 0-3 and 4-7), then the chunk's C1 size (column 8). The
#: kernels spell the width 16 (_work_row, _row_column).
WORK_W = 16


@triton.jit
def _work_row(WORK, cur_s, cur_h, nh, CHUNKS):
    """A (slot, KV head) row's chunk partials in WORK [S, Hkv, CHUNKS, 16]."""
    return WORK + ((cur_s * nh + cur_h) * CHUNKS).to(tl.int64) * 16


@triton.jit
def _row_column(WORK_ROW, col, CHUNKS, BLOCK_P: tl.constexpr):
    """Column `col` of a row's chunk partials, one entry a chunk (0 past CHUNKS)."""
    offs_p = tl.arange(0, BLOCK_P)
    return tl.load(WORK_ROW + offs_p * 16 + col, mask=offs_p < CHUNKS, other=0.0)


@triton.jit
def _merge_moments(na, ma, m2a, m3a, m4a, nb, mb, m2b, m3b, m4b):
    """Two parts' (count, mean, Σd², Σd³, Σd⁴ about their means) as one (Pébay 2008,
    the pairwise update behind Welford's). A part of count 0 leaves the other as is:
    every correction term carries a factor of its count."""
    n = na + nb
    n_safe = tl.maximum(n, 1.0)
    d = mb - ma
    dn = d / n_safe
    ab = na * nb
    mean = ma + d * (nb / n_safe)
    m2 = m2a + m2b + d * dn * ab
    m3 = m3a + m3b + d * dn * dn * ab * (na - nb) + 3.0 * dn * (na * m2b - nb * m2a)
    m4 = (m4a + m4b + d * dn * dn * dn * ab * (na * na - ab + nb * nb)
          + 6.0 * dn * dn * (na * na * m2b + nb * nb * m2a) + 4.0 * dn * (na * m3b - nb * m3a))
    return n, mean, m2, m3, m4


@triton.jit
def _add_sums(a1, a2, a3, a4, a5, a6, a7, a8, b1, b2, b3, b4, b5, b6, b7, b8):
    return a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8


@triton.jit
def _powers(y):
    """y, y², y³, y⁴: the terms of the power sums 1-4."""
    y2 = y * y
    return y, y2, y2 * y, y2 * y2


@triton.jit
def _store_sums(ptr, s1, s2, s3, s4, t1, t2, t3, t4):
    """Four figures of Φ_ver then four of Φ_sla at ptr[0..7] (a chunk's moments)."""
    tl.store(ptr + 0, s1)
    tl.store(ptr + 1, s2)
    tl.store(ptr + 2, s3)
    tl.store(ptr + 3, s4)
    tl.store(ptr + 4, t1)
    tl.store(ptr + 5, t2)
    tl.store(ptr + 6, t3)
    tl.store(ptr + 7, t4)


@triton.jit
def _central_from_sums(n, c, s1, s2, s3, s4):
    """(mean, Σd², Σd³, Σd⁴ about the mean) of n entries x from the power sums
    s_k = Σ (x - c)^k about a shift c. Exact in real arithmetic for any c; in floats
    the closer c is to the mean, the less the expansions cancel (c the mean: s1 = 0
    and the sums are the central ones)."""
    u = s1 / tl.maximum(n, 1.0)
    m2 = s2 - u * s1
    m3 = s3 - 3.0 * u * s2 + 2.0 * u * u * s1
    m4 = s4 - 4.0 * u * s3 + 6.0 * u * u * s2 - 3.0 * u * u * u * s1
    return c + u, m2, m3, m4


@triton.jit(do_not_specialize=["M", "stride_vs", "stride_vh", "stride_ss", "stride_sh"])
def _lfps_table_stats_kernel(
    VER,  # [S, Hkv, M] fp32
    SLA,  # [S, Hkv, M] fp32
    N,  # [S] int32 (<= 0: no row)
    SINK,  # [S] int32
    WORK,  # [S, Hkv, CHUNKS, 16] fp32 out: columns 0-7, this chunk's moments of both tables
    SHIFT,  # POWER_SUMS: [S, Hkv, 2] fp32, the row's means of Φ_ver and Φ_sla at its last step
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    M,
    # ρ (HAS_RHO only; lfps_sparsity._head_sparsity's arguments, N and SINK the same)
    Q, K_POOL, REQ_TO_TOKEN, REQ_POOL_IDX, LOCAL, KBAR, SIGMA_HAT2, RHO, Q_ROWS, sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_r2t, stride_kbb, stride_kbh, stride_sb, stride_rb,
    CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RHO: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 1, GROUP: tl.constexpr = 1, BLOCK_H: tl.constexpr = 16, BLOCK_N: tl.constexpr = 16,
    BLOCK_D: tl.constexpr = 16, Q_SPLIT: tl.constexpr = False, FP32_DOT: tl.constexpr = False,
    HAS_Q_ROWS: tl.constexpr = False,
    POWER_SUMS: tl.constexpr = False,
):
    """The chunk's mean and central sums Σd², Σd³, Σd⁴ of Φ_ver and Φ_sla in one pass:
    each lane of the BLOCK_M-wide tile keeps the moments of the entries it has read
    (each new entry merged as a part of count 1), and one tree reduction merges the
    lanes at the end (Pébay's pairwise formulas as the combine: exact in real
    arithmetic, stable in floats). Eq. 8's kurtosis thresholds need the row's, which
    the priorities' launch merges from its chunks'. One read of the tables, and no
    cross-warp reduction inside the loop: the per-block version reduced five sums a
    table a block and ran at 0.94 TB/s served (session 37), where the plain sums ran at
    1.7. HAS_RHO: one more program a row (the grid's last, past the chunks') computes
    its group's ρ (lfps_head_sparsity's formula, what the priorities' bypass reads),
    instead of a launch of its own before this one; beside the chunks' programs, not
    in one of them, so the launch lasts as long as the longer of the two, not their
    sum. POWER_SUMS: each lane sums the powers 1-4 of its entries' distances to the
    row's mean at its last step (SHIFT: the tables change by a few entries a step), and
    one reduction adds the lanes' sums, the chunk's central sums following from them
    (_central_from_sums): no merge an entry, no merge a level of the reduction."""
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_p = tl.program_id(2)
    if HAS_RHO:
        if cur_p == CHUNKS:
            _head_sparsity(Q, K_POOL, REQ_TO_TOKEN, REQ_POOL_IDX, N, SINK, LOCAL, KBAR, SIGMA_HAT2, RHO, Q_ROWS,
                           sm_scale, stride_qb, stride_qh, stride_kt, stride_kh, stride_r2t, stride_kbb, stride_kbh,
                           stride_sb, stride_rb, cur_s, cur_h, HEAD_DIM, GROUP, BLOCK_H, BLOCK_N, BLOCK_D, Q_SPLIT,
                           FP32_DOT, HAS_Q_ROWS)
            return
    n, lo, c0, c1 = _chunk_of(N, SINK, M, cur_s, cur_p, CHUNKS)
    if n <= 0:
        return
    ver = VER + cur_s.to(tl.int64) * stride_vs + cur_h.to(tl.int64) * stride_vh
    sla = SLA + cur_s.to(tl.int64) * stride_ss + cur_h.to(tl.int64) * stride_sh
    work = _work_row(WORK, cur_s, cur_h, tl.num_programs(1), CHUNKS) + cur_p * 16
    rh = (cur_s * tl.num_programs(1) + cur_h).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    zero = tl.zeros([BLOCK_M], dtype=tl.float32)
    if POWER_SUMS:
        cv = tl.load(SHIFT + rh * 2)
        cs = tl.load(SHIFT + rh * 2 + 1)
        a1, a2, a3, a4 = zero, zero, zero, zero
        b1, b2, b3, b4 = zero, zero, zero, zero
        for start in range(c0, c1, BLOCK_M):
            pos = start + offs
            ok = pos < c1
            y1, y2, y3, y4 = _powers(tl.where(ok, tl.load(ver + pos, mask=ok, other=0.0) - cv, 0.0))
            a1, a2, a3, a4 = a1 + y1, a2 + y2, a3 + y3, a4 + y4
            z1, z2, z3, z4 = _powers(tl.where(ok, _sla_at(sla, pos, ok, n, M) - cs, 0.0))
            b1, b2, b3, b4 = b1 + z1, b2 + z2, b3 + z3, b4 + z4
        a1, a2, a3, a4, b1, b2, b3, b4 = tl.reduce((a1, a2, a3, a4, b1, b2, b3, b4), 0, _add_sums)
        cnt = (c1 - c0).to(tl.float32)
        mv, v2, v3, v4 = _central_from_sums(cnt, cv, a1, a2, a3, a4)
        ms, s2, s3, s4 = _central_from_sums(cnt, cs, b1, b2, b3, b4)
    else:
        nv, mv, v2, v3, v4 = zero, zero, zero, zero, zero
        ns, ms, s2, s3, s4 = zero, zero, zero, zero, zero
        for start in range(c0, c1, BLOCK_M):
            pos = start + offs
            ok = pos < c1
            one = ok.to(tl.float32)  # a masked lane merges a part of count 0: unchanged
            nv, mv, v2, v3, v4 = _merge_moments(nv, mv, v2, v3, v4, one, tl.load(ver + pos, mask=ok, other=0.0),
                                                0.0, 0.0, 0.0)
            ns, ms, s2, s3, s4 = _merge_moments(ns, ms, s2, s3, s4, one, _sla_at(sla, pos, ok, n, M), 0.0, 0.0,
                                                0.0)
        nv, mv, v2, v3, v4 = tl.reduce((nv, mv, v2, v3, v4), 0, _merge_moments)
        ns, ms, s2, s3, s4 = tl.reduce((ns, ms, s2, s3, s4), 0, _merge_moments)
    # the chunk's partials: Φ_ver's mean and central sums Σd², Σd³, Σd⁴, then Φ_sla's
    _store_sums(work, mv, v2, v3, v4, ms, s2, s3, s4)


@triton.jit
def _row_moments(ROW, col, lo, n, CHUNKS: tl.constexpr, TREE: tl.constexpr, BLOCK_P: tl.constexpr):
    """A row's (mean, Σd², Σd⁴) of one table (columns col..col+3) from its chunks'
    partials (every program of the row alike: the same thresholds in each); a chunk's
    count from its bounds, as the stats launch cut them. In chunk order, one merge
    after another (each waits on the last: 4 x CHUNKS dependent loads and merges a
    program), or TREE: the chunks' partials loaded as one vector each column and
    merged by one tree reduction (log2 CHUNKS merges deep; the same pairwise formulas,
    another order: fp32 rounding apart)."""
    if TREE:
        offs_p = tl.arange(0, BLOCK_P)
        ok = offs_p < CHUNKS
        start, stop = _share(lo, n, offs_p, CHUNKS)
        cnt = tl.where(ok, (stop - start).to(tl.float32), 0.0)  # a padding lane: a part of count 0
        w = ROW + offs_p * 16 + col
        parts = (cnt, tl.load(w, mask=ok, other=0.0), tl.load(w + 1, mask=ok, other=0.0),
                 tl.load(w + 2, mask=ok, other=0.0), tl.load(w + 3, mask=ok, other=0.0))
        cnt, mean, m2, m3, m4 = tl.reduce(parts, 0, _merge_moments)
    else:
        cnt, mean, m2, m3, m4 = 0.0, 0.0, 0.0, 0.0, 0.0
        for p in range(0, CHUNKS):
            start, stop = _share(lo, n, p, CHUNKS)
            w = ROW + p * 16 + col
            cnt, mean, m2, m3, m4 = _merge_moments(cnt, mean, m2, m3, m4, (stop - start).to(tl.float32),
                                                   tl.load(w), tl.load(w + 1), tl.load(w + 2), tl.load(w + 3))
    return mean, m2, m4


@triton.jit(do_not_specialize=["M", "stride_vs", "stride_vh", "stride_ss", "stride_sh", "stride_ps", "stride_ph"])
def _lfps_priority_kernel(
    RHO,  # [S, Hq] fp32
    EPS,  # [S] fp32
    A,  # [S] fp32
    VER,  # [S, Hkv, M] fp32
    SLA,  # [S, Hkv, M] fp32
    N,  # [S] int32 (<= 0: no row)
    SINK,  # [S] int32
    WORK,  # [S, Hkv, CHUNKS, 16] fp32: columns 0-7 of every chunk; out: this chunk's C1 size
    PRIO,  # [S, Hkv, M] fp32 out, written over [sink, n) only
    BYPASS,  # [S, Hkv] int8 out
    SHIFT,  # POWER_SUMS: [S, Hkv, 2] fp32 out, the row's means (the next step's statistics' shift)
    stride_rs,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    stride_ps,
    stride_ph,
    M,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TREE_MERGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    C0_FROM_READ: tl.constexpr = True,
    POWER_SUMS: tl.constexpr = False,
):
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_p = tl.program_id(2)
    nh = tl.num_programs(1)
    n, lo, c0, c1 = _chunk_of(N, SINK, M, cur_s, cur_p, CHUNKS)
    if n <= 0:  # no row this step: nothing read, nothing bypassed
        if cur_p == 0:
            tl.store(BYPASS + cur_s * nh + cur_h, (tl.load(N + cur_s) < 0).to(tl.int8))
        return
    offs_g = tl.arange(0, BLOCK_G)
    rho = tl.load(RHO + cur_s * stride_rs + cur_h * GROUP + offs_g, mask=offs_g < GROUP, other=0.0)
    bypass = tl.sum(rho, 0) / GROUP > tl.load(EPS + cur_s)
    if cur_p == 0:
        tl.store(BYPASS + cur_s * nh + cur_h, bypass.to(tl.int8))
    a = tl.load(A + cur_s)
    # Eq. (8)'s thresholds from every chunk's moments (each program of the row alike)
    row = _work_row(WORK, cur_s, cur_h, nh, CHUNKS)
    mv, m2v, m4v = _row_moments(row, 0, lo, n, CHUNKS, TREE_MERGE, BLOCK_P)
    ms, m2s, m4s = _row_moments(row, 4, lo, n, CHUNKS, TREE_MERGE, BLOCK_P)
    if POWER_SUMS:
        if cur_p == 0:  # read by the next step's statistics launch, not by this launch
            rh = (cur_s * nh + cur_h).to(tl.int64)
            tl.store(SHIFT + rh * 2, mv)
            tl.store(SHIFT + rh * 2 + 1, ms)
    kv = tl.where(m2v > 0, m4v / tl.where(m2v > 0, m2v * m2v, 1.0), 0.0)
    ks = tl.where(m2s > 0, m4s / tl.where(m2s > 0, m2s * m2s, 1.0), 0.0)
    tv = tl.where((m2v > 0) & (kv > 0), a * mv / tl.where(kv > 0, kv, 1.0), float("inf"))
    ts = tl.where((m2s > 0) & (ks > 0), a * ms / tl.where(ks > 0, ks, 1.0), float("inf"))
    ver = VER + cur_s.to(tl.int64) * stride_vs + cur_h.to(tl.int64) * stride_vh
    sla = SLA + cur_s.to(tl.int64) * stride_ss + cur_h.to(tl.int64) * stride_sh
    prio = PRIO + cur_s.to(tl.int64) * stride_ps + cur_h.to(tl.int64) * stride_ph
    offs = tl.arange(0, BLOCK_M)
    # C1 (Eq. 9) on the chunk: j with some i in {j + 1, j, j - 1, j - 2} in C0 (over the
    # whole row: neighbours across the chunk's ends), above a table's mean
    members = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start in range(c0, c1, BLOCK_M):
        pos = start + offs
        ok = pos < c1
        v = tl.load(ver + pos, mask=ok, other=0.0)
        s = _sla_at(sla, pos, ok, n, M)
        # C0 at j itself from the entries just read (the chunk lies in [lo, n)): eight
        # table reads a position instead of ten (PRIORITY_C0_FROM_READ)
        if C0_FROM_READ:
            c0_here = (v > tv) | (s > ts)
        else:
            c0_here = _c0(ver, sla, pos, lo, n, M, tv, ts)
        grow = _c0(ver, sla, pos + 1, lo, n, M, tv, ts) | c0_here
        grow = grow | _c0(ver, sla, pos - 1, lo, n, M, tv, ts) | _c0(ver, sla, pos - 2, lo, n, M, tv, ts)
        c1_ = ok & grow & ((v > mv) | (s > ms)) & (bypass == 0)
        members += c1_.to(tl.int32)
        tl.store(prio + pos, tl.where(c1_, v + s, float("-inf")), mask=ok)
    # the chunk's C1 size (column 8, as a float: exact below 2^24), for lfps_c1_list
    tl.store(row + cur_p * 16 + 8, tl.sum(members, 0).to(tl.float32))


@triton.jit(do_not_specialize=["M", "K_MAX", "K2_MAX", "stride_ps", "stride_ph", "stride_os", "stride_oh",
                               "stride_ls", "stride_ks", "stride_is", "stride_ih", "stride_cs", "stride_ks2"])
def _lfps_c1_list_kernel(
    N,  # [S] int32 (<= 0: no row)
    SINK,  # [S] int32
    BUDGET,  # [S] int32: C1 entries kept at most (topk_range's budget)
    WORK,  # [S, Hkv, CHUNKS, 16] fp32: column 8, the chunks' C1 sizes
    PRIO,  # [S, Hkv, M] fp32, written over [sink, n)
    OUT,  # [S, Hkv, K_MAX] int32 out: C1's positions, ascending
    OUT_LEN,  # [S, Hkv] int32 out: |C1|
    SKIP,  # [S, Hkv] int32 out: 1 where this listed the row (topk_range leaves it alone)
    BUDGET2,  # [S] int32: C2's budget (HAS_C2 only)
    IDX,  # [S, Hkv, K2_MAX] int32 out: C2 as indices into OUT (HAS_C2 only)
    COUNT,  # [S, Hkv] int32 out: |C2| (HAS_C2 only)
    SKIP2,  # [S, Hkv] int32 out: 1 where C2 = C1 was listed here (HAS_C2 only)
    stride_ps,
    stride_ph,
    stride_os,
    stride_oh,
    stride_ls,
    stride_ks,
    stride_is,
    stride_ih,
    stride_cs,
    stride_ks2,
    M,
    K_MAX,
    K2_MAX,
    CHUNKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_C2: tl.constexpr,
):
    """Where C1 fits its budget (k = F: lfps's usual case, a few % of the context
    against its candidates), C1 listed ascending, each chunk at the sizes of the
    chunks before it: topk_range's k = F output without its passes over the row.
    HAS_C2: where C1 also fits C2's budget, C2 is all of C1 (the Top-budget of |C1|
    finite exact scores keeps them all): its indices 0..|C1|-1 listed too, so the rank
    Top-K skips the row: rows whose C1 is within C2's budget (a few % of a short
    context is) never pay that select."""
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_p = tl.program_id(2)
    nh = tl.num_programs(1)
    n, lo, c0, c1 = _chunk_of(N, SINK, M, cur_s, cur_p, CHUNKS)
    row = _work_row(WORK, cur_s, cur_h, nh, CHUNKS)
    offs_p = tl.arange(0, BLOCK_P)
    # a row without a live request has no sizes written (its programs returned at once)
    sizes = tl.where(n > 0, _row_column(row, 8, CHUNKS, BLOCK_P), 0.0).to(tl.int32)
    total = tl.sum(sizes, 0)
    fits = (n > 0) & (total <= tl.minimum(tl.load(BUDGET + cur_s), K_MAX))
    fits2 = fits
    if HAS_C2:
        fits2 = fits & (total <= tl.minimum(tl.load(BUDGET2 + cur_s), K2_MAX))
    if cur_p == 0:
        tl.store(SKIP + cur_s * stride_ks + cur_h, fits.to(tl.int32))
        if fits:
            tl.store(OUT_LEN + cur_s * stride_ls + cur_h, total)
        if HAS_C2:
            tl.store(SKIP2 + cur_s * stride_ks2 + cur_h, fits2.to(tl.int32))
            if fits2:
                tl.store(COUNT + cur_s * stride_cs + cur_h, total)
    if fits:
        written = tl.sum(tl.where(offs_p < cur_p, sizes, 0), 0)
        prio = PRIO + cur_s.to(tl.int64) * stride_ps + cur_h.to(tl.int64) * stride_ph
        out = OUT + cur_s.to(tl.int64) * stride_os + cur_h.to(tl.int64) * stride_oh
        idx = IDX + cur_s.to(tl.int64) * stride_is + cur_h.to(tl.int64) * stride_ih
        offs = tl.arange(0, BLOCK_M)
        for start in range(c0, c1, BLOCK_M):
            pos = start + offs
            ok = pos < c1
            keep = (ok & (tl.load(prio + pos, mask=ok, other=float("-inf")) > float("-inf"))).to(tl.int32)
            at = written + tl.cumsum(keep, 0) - keep
            tl.store(out + at, pos, mask=keep != 0)
            if HAS_C2:
                tl.store(idx + at, at, mask=(keep != 0) & fits2)
            written += tl.sum(keep, 0)


#: lfps_priority's programs a (slot, KV head) row aim at this many an SM in all (the
#: passes are latency-bound reads of fp32 tables: one program a row, 64 at
#: 32768 x 8, took 110 us a layer on an H200 for ~60 MB, session 32's profile).
#: Counted over every slot of the store, live or not: cut for the batch's rows instead
#: (32 chunks, not 16, at 130000 x 1 on a 4-slot store) the priorities' launch took 1.265
#: against 0.884 ms a step (each program merges every chunk's partials), the statistics'
#: 0.611 against 0.677: lfps 1.13x stock a step against 1.20x (H200, session 43).
PRIORITY_PROGRAMS_PER_SM = 4
PRIORITY_MAX_CHUNKS = 32
#: The priorities' C1 pass takes C0 at a position from the two entries it has just
#: read there (8 table reads a position); False: reads them again (10, as until session
#: 38), for bench_lfps_priority's A/B in one run. The same C1 either way.
PRIORITY_C0_FROM_READ = True
#: The priorities' programs merge the row's chunk moments by one tree reduction
#: (_row_moments' TREE) instead of in chunk order, whose dependent loads and merges grow
#: with the chunks: the candidate for session 43's 0.38 ms a step that 32 chunks cost
#: over 16 at 130000 x 1. The same merges in another order: C1 may differ at its
#: thresholds by fp32 rounding. H200, one layer under CUDA-graph replay
#: (bench_lfps_priority.py, session 44, results/lfps_priority_tree_h200_s44.log), in
#: order -> tree: 130000 x 4 at 16 chunks (the default there) 57.4 -> 52.7 us, 32 chunks
#: 74.7 -> 56.4; 8192 x 32 at 2 chunks (its default) 26.4 -> 26.1, 16 chunks 87.1 ->
#: 58.3; never slower. Served at 130000 x 1: ITL 4.545 against 4.651 ms in order (session
#: 45). SGLANG_SPARSE_LFPS_TREE_MERGE=0: in order.
PRIORITY_TREE_MERGE = env_switch("LFPS_TREE_MERGE", True)
#: The table statistics' tile (its lanes' moments: ten fp32 accumulators an entry a
#: thread): 512 compiles for sm_90 in 96 registers without spilling, 1024 in 168-175
#: with a stack (tests/kernels/test_lfps_tables.py).
STATS_BLOCK_M = 512
#: The table statistics by power sums about the row's last means (the store's
#: ``shift``, written by the priorities' launch, scaled by lfps_finish's
#: renormalization): one reduction of plain sums a program instead of two of Pébay's
#: merges (session 38's profile: the statistics' time is their cross-warp reductions',
#: 16.3 us a layer at 32768 x 8, not HBM's). The same moments to fp32 rounding
#: (tests/kernels/test_lfps_tables.py, against float64, also about a far shift).
#: H200, one layer under CUDA-graph replay (bench_lfps_priority, session 46,
#: results/lfps_priority_stats_h200_s46.log), Pébay -> power sums: 32768 x 8 27.2 ->
#: 21.4 us (28.5 -> 21.6 with ragged rows), 130000 x 4 54.6 -> 49.1, 8192 x 32 27.6
#: -> 20.2, no entry moved. Served: 130000 x 1 231.3 against 224.8 tok/s (ITL 4.362
#: against 4.468 ms), 32768 x 8 over e4m3 ITL 4.354 against 4.440 ms (tok/s level:
#: 1826.6 / 1831.7).
#: SGLANG_SPARSE_LFPS_POWER_SUMS=0: Pébay's merges.
STATS_POWER_SUMS = env_switch("LFPS_POWER_SUMS", True)
#: Its tile: 256 lanes compile for sm_90 in 72 registers without a stack (512: 72 and a
#: 16-byte stack frame; tests/kernels/test_lfps_tables.py).
POWER_SUMS_BLOCK_M = 256


def no_rho_args(n: torch.Tensor) -> dict:
    """_lfps_table_stats_kernel's ρ arguments without HAS_RHO, by name (those of
    ``rho_launch_args`` but N and SINK): ``n`` for the pointers, 1.0 for the scale, 0
    for the strides; stand-ins, unread."""
    names = _lfps_table_stats_kernel.arg_names
    rho = names[names.index("Q"):names.index("stride_rb") + 1]
    return {k: 1.0 if k == "sm_scale" else 0 if k.startswith("stride_") else n for k in rho}


def priority_chunks(slots: int, kv_heads: int, max_context: int, num_sms: int, block_m: int = 1024) -> int:
    """Chunks a row's passes are cut into (static: the grid's third dimension):
    about PRIORITY_PROGRAMS_PER_SM programs an SM over the slots' rows, at most one a
    BLOCK_M of the table and PRIORITY_MAX_CHUNKS."""
    want = (PRIORITY_PROGRAMS_PER_SM * num_sms) // max(1, slots * kv_heads)
    return int(max(1, min(want, cdiv(max_context, block_m), PRIORITY_MAX_CHUNKS)))


def lfps_priority(rho: torch.Tensor, eps: torch.Tensor, a: torch.Tensor, ver: torch.Tensor, sla: torch.Tensor,
                  n: torch.Tensor, sink: torch.Tensor, *, prio: torch.Tensor | None = None,
                  bypass: torch.Tensor | None = None, chunks: int | None = None, block_m: int = 1024,
                  num_warps: int = 4,
                  c1_list: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                  c2_list: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                  rho_from: Optional[RhoFrom] = None, shift: Optional[torch.Tensor] = None):
    """(prio [S, Hkv, M] fp32 over [sink, n) only, bypass [S, Hkv] int8): the module docstring's first kernel.

    rho ``[S, Hq]`` fp32 (``lfps_head_sparsity``), eps / a ``[S]`` fp32, ver / sla
    ``[S, Hkv, M]`` fp32 (one layer of the store), n / sink ``[S]`` int32 (``n <= 0``:
    no row, bypass 0, nothing read or written). ``chunks``: programs a row
    (``priority_chunks`` by default); two launches, grid ``(S, Hkv, chunks)``: the
    chunks' means and central sums (one pass), then the thresholds and C1 (from every
    chunk's partials merged in one order: the same in each program).

    ``c1_list`` = ``(budget [S] int32, out [S, Hkv, K] int32, out_len [S, Hkv] int32,
    skip [S, Hkv] int32)``: a third launch lists C1 where it fits ``min(budget, K)``
    (ascending into ``out``, its size into ``out_len``) and sets ``skip`` there (0
    elsewhere), so ``topk_range(prio, sink, n, budget, K, out=out, out_len=out_len,
    skip=skip)`` gives the same output as without it, selecting only the rows whose C1
    is larger than their budget. ``c2_list`` = ``(budget2 [S], idx [S, Hkv, K2], count
    [S, Hkv], skip2 [S, Hkv])``, with ``c1_list``: where C1 also fits ``min(budget2,
    K2)``, C2 is all of it: ``idx`` 0..|C1|-1, ``count`` |C1|, ``skip2`` 1 (0
    elsewhere), the rank Top-K's output over C1's exact scores when they are finite
    (as ``token_scores_at`` writes them below ``n_c1``).

    ``rho_from`` (a ``lfps_sparsity.RhoFrom``): ``rho`` is not read but written, by
    the first launch's last program of each row, past its chunks
    (``lfps_head_sparsity``'s formula over these slots' n and sink), before the
    priorities read it: one launch fewer.

    ``shift`` ``[S, Hkv, 2]`` fp32 (in place), with ``STATS_POWER_SUMS``: the rows'
    means of Φ_ver and Φ_sla at their last step (any value is correct; the closer to
    this step's means, the more exact), which the statistics take their power sums
    about; the priorities' launch writes this step's there (live rows)."""
    s, hkv, m = ver.shape
    assert sla.shape == ver.shape and ver.stride(2) == 1 and sla.stride(2) == 1
    assert rho.shape[0] == s and rho.shape[1] % hkv == 0 and rho.stride(1) == 1 and rho.dtype == torch.float32
    rho_args, rho_meta = {}, {}
    if rho_from is not None:
        f = rho_from
        rho_args, rho_meta, _ = rho_launch_args(f.q, f.k_pool, f.req_to_token, f.req_pool_idx, n, sink, f.local,
                                                f.kbar, f.sigma_hat2, f.sm_scale, out=rho, q_rows=f.q_rows)
        assert f.k_pool.shape[1] == hkv, "rho_from: the tables' KV heads"
        rho_args = {k: v for k, v in rho_args.items() if k not in ("N", "SINK")}  # the tables' own, passed first
        rho_meta = dict(rho_meta, HAS_RHO=True)
    for name, t in (("n", n), ("sink", sink)):
        assert t.shape == (s,) and t.dtype == torch.int32 and t.is_contiguous(), name
    for name, t in (("eps", eps), ("a", a)):
        assert t.shape == (s,) and t.dtype == torch.float32 and t.is_contiguous(), name
    if prio is None:
        prio = torch.empty(s, hkv, m, dtype=torch.float32, device=ver.device)
    if bypass is None:
        bypass = torch.empty(s, hkv, dtype=torch.int8, device=ver.device)
    assert prio.shape == ver.shape and prio.stride(2) == 1 and bypass.shape == (s, hkv) and bypass.is_contiguous()
    if s == 0 or hkv == 0:
        return prio, bypass
    if chunks is None:
        chunks = priority_chunks(s, hkv, m, device_num_sms(ver.device), block_m)
    chunks = int(chunks)
    assert chunks >= 1, "chunks"
    # every column a launch reads is written first by a live row's programs (never read uninitialised)
    work = torch.empty(s, hkv, chunks, WORK_W, dtype=torch.float32, device=ver.device)
    power_sums = STATS_POWER_SUMS and shift is not None
    if power_sums:
        assert shift.shape == (s, hkv, 2) and shift.dtype == torch.float32 and shift.is_contiguous(), "shift"
    else:
        shift = work  # not read
    group = rho.shape[1] // hkv
    grid = (s, hkv, chunks)
    if not rho_args:
        rho_args = no_rho_args(n)
    rho_programs = 1 if rho_from is not None else 0  # ρ's own program a row, past the chunks'
    _lfps_table_stats_kernel[(s, hkv, chunks + rho_programs)](
        ver, sla, n, sink, work, shift, ver.stride(0), ver.stride(1), sla.stride(0),
        sla.stride(1), m, **rho_args,
        CHUNKS=chunks, BLOCK_M=min(block_m, POWER_SUMS_BLOCK_M if power_sums else STATS_BLOCK_M),
        POWER_SUMS=power_sums, num_warps=num_warps, **rho_meta)
    _lfps_priority_kernel[grid](
        rho, eps, a, ver, sla, n, sink, work, prio, bypass, shift,
        rho.stride(0), ver.stride(0), ver.stride(1), sla.stride(0), sla.stride(1), prio.stride(0), prio.stride(1), m,
        GROUP=group, BLOCK_G=max(2, next_pow2(group)), CHUNKS=chunks, BLOCK_M=block_m,
        C0_FROM_READ=PRIORITY_C0_FROM_READ, TREE_MERGE=PRIORITY_TREE_MERGE, BLOCK_P=max(2, next_pow2(chunks)),
        POWER_SUMS=power_sums, num_warps=num_warps,
    )
    if c1_list is not None:
        budget, out, out_len, skip = c1_list
        assert budget.shape == (s,) and budget.dtype == torch.int32 and budget.is_contiguous(), "c1_list: budget"
        assert out.shape[:2] == (s, hkv) and out.dtype == torch.int32 and out.stride(2) == 1, "c1_list: out"
        for name, t in (("out_len", out_len), ("skip", skip)):
            assert t.shape == (s, hkv) and t.dtype == torch.int32 and t.stride(1) == 1, f"c1_list: {name}"
        if c2_list is not None:
            budget2, idx, count, skip2 = c2_list
            assert budget2.shape == (s,) and budget2.dtype == torch.int32 and budget2.is_contiguous(), \
                "c2_list: budget"
            assert idx.shape[:2] == (s, hkv) and idx.dtype == torch.int32 and idx.stride(2) == 1, "c2_list: idx"
            for name, t in (("count", count), ("skip", skip2)):
                assert t.shape == (s, hkv) and t.dtype == torch.int32 and t.stride(1) == 1, f"c2_list: {name}"
        else:
            budget2, idx, count, skip2 = budget, out, out_len, skip  # not touched without HAS_C2
        _lfps_c1_list_kernel[grid](
            n, sink, budget, work, prio, out, out_len, skip, budget2, idx, count, skip2,
            prio.stride(0), prio.stride(1), out.stride(0), out.stride(1), out_len.stride(0), skip.stride(0),
            idx.stride(0), idx.stride(1), count.stride(0), skip2.stride(0),
            m, out.shape[2], idx.shape[2], CHUNKS=chunks, BLOCK_P=max(2, next_pow2(chunks)), BLOCK_M=block_m,
            HAS_C2=c2_list is not None, num_warps=num_warps,
        )
    else:
        assert c2_list is None, "c2_list: with c1_list only"
    return prio, bypass


@triton.jit
def _lfps_select_out_kernel(
    ROW,  # [S] int64: the slot's batch row
    N,  # [S] int32 (<= 0: no row)
    SINK,  # [S] int32
    B_START,  # [S] int32
    CAND,  # [S, Hkv, C] int32 candidate positions
    IDX,  # [S, Hkv, K] int32 C2 as indices into CAND, ascending
    COUNT,  # [S, Hkv] int32 |C2|
    BYPASS,  # [S, Hkv] int8
    A_POS,  # [bs, Hkv, >= WIDTH] int32 out
    A_LEN,  # [bs, Hkv] int32 out
    REQ_TO_TOKEN,  # [reqs, CTX] int32 (only if HAS_SLOTS)
    REQ_POOL_IDX,  # [S] int: the slot's request (only if HAS_SLOTS)
    A_SLOTS,  # shaped as A_POS, int32 out: the listed positions' pool slots (only if HAS_SLOTS)
    N_C1,  # [S, Hkv] int32: |C1| scored (only if HAS_SCORED)
    SCORED,  # [S, Hkv, 2] fp64, added to: |C1|, max(n - sink, 1) (only if HAS_SCORED)
    stride_cs,
    stride_ch,
    stride_is,
    stride_ih,
    stride_pb,
    stride_ph,
    stride_lb,
    stride_r2t,
    stride_sb,
    stride_sh,
    K,
    WIDTH,
    CTX,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_SCORED: tl.constexpr,
):
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    nh = tl.num_programs(1)
    n = tl.load(N + cur_s)
    if n <= 0:
        return
    row = tl.load(ROW + cur_s).to(tl.int64)
    sink = tl.maximum(tl.load(SINK + cur_s), 0)
    if HAS_SCORED:  # this program's own (slot, head) cell: no other program adds to it
        acc = SCORED + (cur_s * nh + cur_h) * 2
        tl.store(acc, tl.load(acc) + tl.load(N_C1 + cur_s * nh + cur_h).to(tl.float64))
        tl.store(acc + 1, tl.load(acc + 1) + tl.maximum(n - sink, 1).to(tl.float64))
    b_start = tl.load(B_START + cur_s)
    count = tl.load(COUNT + cur_s * nh + cur_h)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = (offs_k < K) & (offs_k < count)
    i = tl.load(IDX + cur_s * stride_is + cur_h * stride_ih + offs_k, mask=in_k, other=0)
    pos = tl.load(CAND + cur_s * stride_cs + cur_h * stride_ch + i, mask=in_k, other=0)
    listed = in_k & (pos >= sink) & (pos < b_start)
    cnt = listed.to(tl.int32)
    n_sink = tl.minimum(sink, tl.maximum(b_start, 0))
    off = n_sink + tl.cumsum(cnt, 0) - cnt
    base = A_POS + row * stride_pb + cur_h * stride_ph
    if HAS_SLOTS:
        r2t = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_s).to(tl.int64) * stride_r2t
        slot_base = A_SLOTS + row * stride_sb + cur_h * stride_sh
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(0, n_sink, BLOCK_S):
        ok_s = (s0 + offs_s < n_sink) & (s0 + offs_s < WIDTH)
        tl.store(base + s0 + offs_s, s0 + offs_s, mask=ok_s)
        if HAS_SLOTS:
            tl.store(slot_base + s0 + offs_s, tl.load(r2t + tl.minimum(s0 + offs_s, CTX - 1), mask=ok_s, other=0),
                     mask=ok_s)
    tl.store(base + off, pos, mask=listed & (off < WIDTH))
    if HAS_SLOTS:
        # the clamp: memory safety only (listed positions are in [sink, b_start))
        ok_l = listed & (off < WIDTH)
        tl.store(slot_base + off, tl.load(r2t + tl.minimum(tl.maximum(pos, 0), CTX - 1), mask=ok_l, other=0),
                 mask=ok_l)
    a_len = tl.minimum(n_sink + tl.sum(cnt, 0), WIDTH)
    byp = tl.load(BYPASS + cur_s * nh + cur_h)
    tl.store(A_LEN + row * stride_lb + cur_h, tl.where(byp != 0, 0, a_len))


def lfps_select_out(row: torch.Tensor, n: torch.Tensor, sink: torch.Tensor, b_start: torch.Tensor,
                    cand: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, bypass: torch.Tensor,
                    a_pos: torch.Tensor, a_len: torch.Tensor, width: int, *,
                    slots: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                    scored: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """C2 of each live slot -> its batch row ``row[s]`` of ``a_pos`` (first ``width``
    entries: sinks, then C2 in ``[sink, b_start)``) and ``a_len`` (0 if bypassed), in place.

    ``slots`` = ``(req_to_token [reqs, ctx] int32, rpi [S] int, a_slots)``: the same
    entries of ``a_slots`` (shaped as ``a_pos``) get ``req_to_token[rpi[s], pos]``
    (``rpi`` per slot, like ``n``). ``scored`` = ``(n_c1 [S, Hkv] int32, acc [S, Hkv, 2]
    fp64``: a long request's sums pass fp32's exact integers): each live slot's head
    adds ``n_c1`` and ``max(n - sink, 1)`` to its cell of ``acc`` (the scored
    fraction's sums, ``queryaware.lfps.step``'s ``scored`` and denominator)."""
    s, hkv, k = idx.shape
    assert cand.shape[:2] == (s, hkv) and cand.dtype == torch.int32 and cand.stride(2) == 1
    assert idx.dtype == torch.int32 and idx.stride(2) == 1 and count.shape == (s, hkv) and count.is_contiguous()
    assert row.shape == (s,) and bypass.shape == (s, hkv) and bypass.is_contiguous()
    assert a_pos.dtype == torch.int32 and a_pos.stride(2) == 1 and a_len.stride(1) == 1
    assert width <= a_pos.shape[2]
    req_to_token, rpi, a_slots = unpack_slots(slots, s, a_pos, n)
    if scored is not None:
        n_c1, acc = scored
        assert n_c1.shape == (s, hkv) and n_c1.dtype == torch.int32 and n_c1.is_contiguous(), "scored: n_c1"
        assert acc.shape == (s, hkv, 2) and acc.dtype == torch.float64 and acc.is_contiguous(), "scored: acc"
    else:
        n_c1, acc = count, a_len  # not read without HAS_SCORED
    if s == 0 or hkv == 0:
        return
    _lfps_select_out_kernel[(s, hkv)](
        row, n, sink, b_start, cand, idx, count, bypass, a_pos, a_len, req_to_token, rpi, a_slots, n_c1, acc,
        cand.stride(0), cand.stride(1), idx.stride(0), idx.stride(1), a_pos.stride(0), a_pos.stride(1),
        a_len.stride(0), req_to_token.stride(0) if slots is not None else 0, a_slots.stride(0), a_slots.stride(1),
        k, int(width), req_to_token.shape[1] if slots is not None else 1,
        BLOCK_K=max(16, next_pow2(k)), BLOCK_S=16, HAS_SLOTS=slots is not None, HAS_SCORED=scored is not None,
        num_warps=1 if k <= 64 else 4,
    )


@triton.jit
def _c2_logits(q_hi, q_lo, CAND_ROW, IDX_ROW, K_POOL, tok_row, cur_h, stride_kt, stride_kh, start, count, sm_scale,
               mask_h, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
               Q_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    """C2 entries [start, start + BLOCK_K): (positions, in C2, logits [BLOCK_H, BLOCK_K] (-inf outside))."""
    offs_k = start + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    in_k = offs_k < count
    i = tl.load(IDX_ROW + offs_k, mask=in_k, other=0)
    pos = tl.load(CAND_ROW + i, mask=in_k, other=0)
    tok = tl.load(tok_row + pos, mask=in_k, other=0).to(tl.int64)
    k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :],
                mask=in_k[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(q_hi.dtype)
    lg = _dot(q_hi, tl.trans(k), FP32_DOT)
    if Q_SPLIT:
        lg += _dot(q_lo, tl.trans(k), FP32_DOT)
    lg = tl.where(mask_h[:, None] & in_k[None, :], lg * sm_scale, float("-inf"))
    return pos, in_k, lg


@triton.jit
def _finish_live(N, BYPASS, COUNT, cur_s, cur_h, nh, K2):
    """(n, bypassed, |C2|) of a (slot, KV head) row; |C2| within C2's width K2 (the
    select's output never exceeds it; the bound keeps the kept logits' writes in
    their buffer whatever the count holds)."""
    n = tl.load(N + cur_s)
    byp = tl.load(BYPASS + cur_s * nh + cur_h)
    count = tl.minimum(tl.load(COUNT + cur_s * nh + cur_h), K2)
    return n, byp, count


#: The lazy decay's floor: a row's tables are renormalized (multiplied by their
#: scale, scale 1) once the scale falls below it, every ~108 steps at r = 0.95 (the
#: tables' pass once in that many steps instead of every step). It bounds the stored
#: values at 2^8 times the true ones, which keeps the thresholds' fourth central
#: moments (Σd⁴ over up to ~2^17 positions) inside fp32 for any r: an entry gains at
#: most 1 a step, so it stays below the steps decoded (~2^17) as well as 1 / (1 - r).
RENORM_BELOW = tl.constexpr(2.0 ** -8)


# the strides of the tables and of C2's lists follow their (static) widths
_FINISH_WIDTHS = ["M", "K2", "stride_cs", "stride_is", "stride_vs", "stride_vh", "stride_ss", "stride_sh"]


@triton.jit(do_not_specialize=_FINISH_WIDTHS)
def _lfps_finish_stats_kernel(
    Q,  # [bs, Hq, D] this layer's queries
    O,  # [bs, Hq, Dv] the attention's output (V̄ on bypassed heads, in place)
    K_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,  # [S]
    ROW,  # [S] int64 the slot's batch row
    N,  # [S] int32 (<= 0: no row)
    R,  # [S] fp32 decay
    CAND,
    IDX,
    COUNT,
    BYPASS,
    VBAR,  # [S, Hkv, Dv] fp32
    VER,  # [S, Hkv, M] fp32, in place
    SLA,
    WORK,  # [S, Hkv, CHUNKS, 2, BLOCK_H] fp32 out: each chunk's softmax max and normalizer
    LOGITS,  # [S, Hkv, GROUP, K2] fp32 out: C2's logits, for the update launch
    POS,  # [S, Hkv, K2] int32 out: C2's positions
    TSCALE,  # LAZY: [S, Hkv] fp32 the tables' scale (true value = stored * scale); read only here
    NEWSCALE,  # LAZY: [S, Hkv, CHUNKS] fp32 out: the scale after this step, for the update launch
    SHIFT,  # SCALE_SHIFT: [S, Hkv, 2] fp32 in place, the statistics' shift (lfps_priority's), decayed alike
    sm_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_cs,
    stride_ch,
    stride_is,
    stride_ih,
    stride_bs,
    stride_bh,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    M,
    K2,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNKS: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    LAZY: tl.constexpr,
    SCALE_SHIFT: tl.constexpr = False,
):
    """Grid (S, Hkv, CHUNKS). A bypassed head: V̄ into its output rows (chunk 0).
    Otherwise, with |C2| > 0: the logits of this chunk's C2 entries (kept, with their
    positions, so the update launch reads them instead of gathering the keys again),
    each query head's online softmax max and normalizer over them, and Eq. (10)'s
    decay of this chunk's slice of both tables -- LAZY: the row's scale times r
    instead, the slice multiplied (to true values, scale 1) only once the scale falls
    below RENORM_BELOW. SCALE_SHIFT: the row's shift multiplied as its stored
    entries are (chunk 0), so that it stays near their means."""
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_p = tl.program_id(2)
    nh = tl.num_programs(1)
    n, byp, count = _finish_live(N, BYPASS, COUNT, cur_s, cur_h, nh, K2)
    if n <= 0:
        return
    row = tl.load(ROW + cur_s).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    if byp != 0:
        if cur_p == 0:
            offs_v = tl.arange(0, BLOCK_DV)
            vb = tl.load(VBAR + cur_s * stride_bs + cur_h * stride_bh + offs_v, mask=offs_v < V_DIM, other=0.0)
            if BF16_RTNE:
                vb = _round_bf16_rtne(vb)
            o = O + row * stride_ob + (cur_h * GROUP + offs_h)[:, None] * stride_oh + offs_v[None, :]
            tl.store(o, tl.broadcast_to(vb[None, :], [BLOCK_H, BLOCK_DV]).to(O.dtype.element_ty),
                     mask=mask_h[:, None] & (offs_v < V_DIM)[None, :])
    elif count > 0:
        tok_row = REQ_TO_TOKEN + tl.load(REQ_POOL_IDX + cur_s).to(tl.int64) * stride_r2t
        q_hi, q_lo = _load_q_parts(Q, row, cur_h, stride_qb, stride_qh, K_POOL.dtype.element_ty, HEAD_DIM, GROUP,
                                   BLOCK_H, BLOCK_D, Q_SPLIT)
        cand = CAND + cur_s * stride_cs + cur_h * stride_ch
        idx = IDX + cur_s * stride_is + cur_h * stride_ih
        rh = (cur_s * nh + cur_h).to(tl.int64)
        lg_row = LOGITS + rh * GROUP * K2
        pos_row = POS + rh * K2
        # 1. this chunk's C2 logits, kept, and its share of each query head's softmax (online)
        k0, k1 = _share(0, count, cur_p, CHUNKS)  # this chunk's C2 entries
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(k0, k1, BLOCK_K):
            pos, in_k, lg = _c2_logits(q_hi, q_lo, cand, idx, K_POOL, tok_row, cur_h, stride_kt, stride_kh, start, k1,
                                       sm_scale, mask_h, HEAD_DIM, BLOCK_K, BLOCK_D, Q_SPLIT, FP32_DOT)
            offs_k = start + tl.arange(0, BLOCK_K)
            tl.store(lg_row + offs_h[:, None] * K2 + offs_k[None, :], lg, mask=mask_h[:, None] & in_k[None, :])
            tl.store(pos_row + offs_k, pos, mask=in_k)
            m_new = tl.maximum(m_i, tl.max(lg, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), 1)
            m_i = m_new
        work = WORK + (rh * CHUNKS + cur_p) * 2 * BLOCK_H
        tl.store(work + offs_h, m_i)
        tl.store(work + BLOCK_H + offs_h, l_i)
        # 2. Eq. (10)'s decay of this chunk's slice of both tables (the scatter, next
        # launch, adds to decayed entries); LAZY: of the row's scale, the tables
        # touched only to renormalize (every program of the row decides alike)
        r = tl.load(R + cur_s)
        factor = r
        decay = True
        if LAZY:
            factor = tl.load(TSCALE + rh) * r
            decay = factor < RENORM_BELOW
            tl.store(NEWSCALE + rh * CHUNKS + cur_p, tl.where(decay, 1.0, factor))
        if decay:
            if SCALE_SHIFT:
                if cur_p == 0:
                    shift = SHIFT + rh * 2
                    tl.store(shift, tl.load(shift) * factor)
                    tl.store(shift + 1, tl.load(shift + 1) * factor)
            ver = VER + cur_s.to(tl.int64) * stride_vs + cur_h.to(tl.int64) * stride_vh
            sla = SLA + cur_s.to(tl.int64) * stride_ss + cur_h.to(tl.int64) * stride_sh
            m0, m1 = _share(0, M, cur_p, CHUNKS)
            offs_m = tl.arange(0, BLOCK_M)
            for start in range(m0, m1, BLOCK_M):
                pos = start + offs_m
                ok = pos < m1
                tl.store(ver + pos, tl.load(ver + pos, mask=ok, other=0.0) * factor, mask=ok)
                tl.store(sla + pos, tl.load(sla + pos, mask=ok, other=0.0) * factor, mask=ok)


@triton.jit(do_not_specialize=_FINISH_WIDTHS)
def _lfps_finish_update_kernel(
    N,
    COUNT,
    BYPASS,
    VER,
    SLA,
    WORK,
    LOGITS,
    POS,
    TSCALE,  # LAZY: written by chunk 0 (the stats launch's NEWSCALE)
    NEWSCALE,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    M,
    K2,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    LAZY: tl.constexpr,
):
    """Grid (S, Hkv, CHUNKS), after the stats launch: the row's softmax from every
    chunk's partials (the same order in each program), then for this chunk's C2 entries
    (their kept logits and positions) ``w_i - 0.5 / |C2|`` added at i (Φ_ver) and at
    n - 1 - i (Φ_sla); LAZY: divided by the row's new scale, which chunk 0 stores
    (each program reads its own chunk's copy, so none reads it while it changes).
    C2's entries are distinct: no two programs add to one entry."""
    cur_s = tl.program_id(0)
    cur_h = tl.program_id(1)
    cur_p = tl.program_id(2)
    nh = tl.num_programs(1)
    n, byp, count = _finish_live(N, BYPASS, COUNT, cur_s, cur_h, nh, K2)
    k0, k1 = _share(0, count, cur_p, CHUNKS)  # this chunk's C2 entries
    if (n <= 0) | (byp != 0) | (k1 <= k0):
        return
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    offs_p = tl.arange(0, BLOCK_P)
    rh = (cur_s * nh + cur_h).to(tl.int64)
    work = WORK + rh * CHUNKS * 2 * BLOCK_H
    at = (offs_p * 2 * BLOCK_H)[:, None] + offs_h[None, :]
    in_p = (offs_p < CHUNKS)[:, None]
    m_p = tl.load(work + at, mask=in_p, other=float("-inf"))  # [BLOCK_P, BLOCK_H]
    l_p = tl.load(work + BLOCK_H + at, mask=in_p, other=0.0)
    m_i = tl.max(m_p, 0)
    m_safe = tl.where(m_i > float("-inf"), m_i, 0.0)
    l_i = tl.sum(tl.where(l_p > 0, l_p * tl.exp(m_p - m_safe[None, :]), 0.0), 0)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lg_row = LOGITS + rh * GROUP * K2
    pos_row = POS + rh * K2
    ver = VER + cur_s.to(tl.int64) * stride_vs + cur_h.to(tl.int64) * stride_vh
    sla = SLA + cur_s.to(tl.int64) * stride_ss + cur_h.to(tl.int64) * stride_sh
    half = 0.5 / count.to(tl.float32)
    unit = 1.0
    if LAZY:
        unit = tl.load(NEWSCALE + rh * CHUNKS + cur_p)
        if cur_p == 0:
            tl.store(TSCALE + rh, unit)
    last = n - 1
    for start in range(k0, k1, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        in_k = offs_k < k1
        lg = tl.load(lg_row + offs_h[:, None] * K2 + offs_k[None, :], mask=mask_h[:, None] & in_k[None, :],
                     other=float("-inf"))
        pos = tl.load(pos_row + offs_k, mask=in_k, other=0)
        p = tl.exp(lg - m_safe[:, None]) / l_safe[:, None]
        w = tl.sum(tl.where(mask_h[:, None], p, 0.0), 0) / GROUP
        inc = (w - half) / unit
        tl.store(ver + pos, tl.load(ver + pos, mask=in_k, other=0.0) + inc, mask=in_k)
        off = last - pos
        ok = in_k & (off >= 0) & (off < M)
        tl.store(sla + off, tl.load(sla + off, mask=ok, other=0.0) + inc, mask=ok)


#: lfps_finish's programs a row aim at this many an SM in all: one program a (slot,
#: KV head) row walked its C2 keys (gathered through req_to_token, latency-bound)
#: twice and its whole tables once, 176 us a layer at 32768 x 8 with C1 at 2.1% of
#: the positions (session 35's profile, 4.9 ms a step). H200, e4m3 pool, the lazy
#: decay, graph replay (bench_lfps_finish.py, results/lfps_finish_h200_s36.log), 4
#: against 8 an SM: 32768 x 8 with |C2| 688 12.8 / 13.0 us, |C2| 2048 32.1 / 22.0,
#: 130000 x 4 with |C2| 2048 17.1 / 14.8 (bf16 pools alike, 13.6 / 14.4 at 688).
FINISH_PROGRAMS_PER_SM = 8
FINISH_MAX_CHUNKS = 32


def finish_chunks(slots: int, kv_heads: int, c2_max: int, num_sms: int, block_k: int = 32) -> int:
    """Chunks each row's finish is cut into (static: the grids' third dimension):
    about FINISH_PROGRAMS_PER_SM programs an SM over the slots' rows, at most one a
    BLOCK_K of C2's width and FINISH_MAX_CHUNKS."""
    want = (FINISH_PROGRAMS_PER_SM * num_sms) // max(1, slots * kv_heads)
    return int(max(1, min(want, cdiv(max(c2_max, 1), block_k), FINISH_MAX_CHUNKS)))


def lfps_finish(q: torch.Tensor, o: torch.Tensor, k_pool: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_idx: torch.Tensor, row: torch.Tensor, n: torch.Tensor, r: torch.Tensor, cand: torch.Tensor,
                idx: torch.Tensor, count: torch.Tensor, bypass: torch.Tensor, vbar: torch.Tensor, ver: torch.Tensor,
                sla: torch.Tensor, sm_scale: float, *, block_k: int = 32, block_m: int = 1024,
                chunks: int | None = None, tscale: Optional[torch.Tensor] = None,
                shift: Optional[torch.Tensor] = None) -> None:
    """The module docstring's third step, in place on ``o`` (bypassed heads of the
    live slots' rows) and ``ver`` / ``sla`` (live, not bypassed, ``|C2| > 0``): two
    launches over a grid ``(S, Hkv, chunks)`` (``finish_chunks`` by default), each row's
    C2 entries and table slices cut among its chunks -- the logits (kept), softmax
    partials and the decay, then the weights and the scatter.

    ``tscale`` ``[S, Hkv]`` fp32 (in place): the lazy decay. The tables are stored
    divided by their row's scale (true value = stored * scale), so Eq. (10)'s decay
    multiplies the scale by ``r`` instead of both tables, and the increments are
    added divided by the new scale; a row is renormalized (its tables multiplied by
    the scale, the scale set to 1) once the scale falls below ``RENORM_BELOW``. Every
    decision read from the tables (Eq. 8's thresholds, C0 / C1, the priorities'
    order) is the same under a common positive factor, so the selections do not see
    the scale. Without it the tables decay in place at every step.

    ``shift`` ``[S, Hkv, 2]`` fp32 (in place): lfps_priority's, multiplied by the
    factor a row's stored entries are (the decay, or a renormalization)."""
    s, hkv, k2 = idx.shape
    m = ver.shape[2]
    assert ver.shape == (s, hkv, m) and sla.shape == ver.shape and ver.stride(2) == 1 and sla.stride(2) == 1
    assert vbar.shape[:2] == (s, hkv) and vbar.stride(2) == 1 and vbar.dtype == torch.float32
    assert o.stride(2) == 1 and q.stride(2) == 1 and o.shape[1] == q.shape[1] and o.shape[2] == vbar.shape[2]
    assert r.shape == (s,) and r.dtype == torch.float32 and row.shape == (s,) and req_pool_idx.shape == (s,)
    assert count.is_contiguous() and bypass.is_contiguous() and cand.stride(2) == 1 and idx.stride(2) == 1
    if s == 0 or hkv == 0:
        return
    if chunks is None:
        chunks = finish_chunks(s, hkv, k2, device_num_sms(q.device), block_k)
    chunks = int(chunks)
    assert chunks >= 1, "chunks"
    meta = group_tile_meta(q, k_pool)
    group = meta["GROUP"]
    # each written by the stats launch where the update launch reads it (a live, not
    # bypassed row with |C2| > 0: every chunk's partials, its own entries' logits)
    work = torch.empty(s, hkv, chunks, 2, meta["BLOCK_H"], dtype=torch.float32, device=q.device)
    logits = torch.empty(s, hkv, group, k2, dtype=torch.float32, device=q.device)
    pos = torch.empty(s, hkv, k2, dtype=torch.int32, device=q.device)
    lazy = tscale is not None
    if lazy:
        assert tscale.shape == (s, hkv) and tscale.dtype == torch.float32 and tscale.is_contiguous(), "tscale"
        newscale = torch.empty(s, hkv, chunks, dtype=torch.float32, device=q.device)
    else:
        tscale = newscale = work  # not read without LAZY
    scale_shift = shift is not None
    if scale_shift:
        assert shift.shape == (s, hkv, 2) and shift.dtype == torch.float32 and shift.is_contiguous(), "shift"
    else:
        shift = work  # not read
    grid = (s, hkv, chunks)
    dv = vbar.shape[2]
    _lfps_finish_stats_kernel[grid](
        q, o, k_pool, req_to_token, req_pool_idx, row, n, r, cand, idx, count, bypass, vbar, ver, sla, work,
        logits, pos, tscale, newscale, shift, float(sm_scale), q.stride(0), q.stride(1), o.stride(0),
        o.stride(1), k_pool.stride(0),
        k_pool.stride(1), req_to_token.stride(0), cand.stride(0), cand.stride(1), idx.stride(0), idx.stride(1),
        vbar.stride(0), vbar.stride(1), ver.stride(0), ver.stride(1), sla.stride(0), sla.stride(1), m, k2,
        V_DIM=dv, BLOCK_DV=next_pow2(dv), BLOCK_K=block_k, BLOCK_M=block_m, CHUNKS=chunks,
        BF16_RTNE=needs_bf16_rtne(o.dtype), LAZY=lazy, SCALE_SHIFT=scale_shift, num_warps=4, **meta,
    )
    _lfps_finish_update_kernel[grid](
        n, count, bypass, ver, sla, work, logits, pos, tscale, newscale,
        ver.stride(0), ver.stride(1), sla.stride(0), sla.stride(1), m, k2,
        GROUP=group, BLOCK_H=meta["BLOCK_H"], BLOCK_K=block_k, CHUNKS=chunks, BLOCK_P=max(2, next_pow2(chunks)),
        LAZY=lazy, num_warps=4,
    )
