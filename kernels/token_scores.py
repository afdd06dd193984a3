"""
Token-level scores of a (predicted) query, keys read in place
=============================================================

AsyncSpade scores every key of the context with the *predicted* next query
``q_hat`` and keeps the top-k tokens per KV head; LFPS scores exactly only a
short candidate list per KV head. Both need, for request ``b``, KV head ``h``
and position ``pos``::

    s[b, h, pos] = max_{g in group(h)} (q_hat[b, g] . k[pos, h]) * sm_scale

with the keys read in place from SGLang's paged pool through
``req_to_token``. GQA aggregate: the **max over the group's query heads**
(a token stays a candidate if any head of the group attends to it strongly),
consistent with :func:`quest_page_scores`.

* :func:`token_scores`: every position of ``[lo[b], hi[b])``; fp32
  ``[bs, Hkv, n_max]`` with ``-inf`` elsewhere, ready for ``torch.topk``.
* :func:`token_scores_at`: the listed positions ``cand_pos[b, h, :]`` only;
  fp32 ``[bs, Hkv, C]``, ``-inf`` for padding / out-of-range entries.
* :func:`token_select_positions`: ``torch.topk`` of either, expanded by one
  small kernel into the ``a_pos`` / ``a_len`` (sinks first) that
  ``two_segment_decode`` reads in place for rows with ``a_slot == -2``.

Precision: the group's queries form the rows of a ``[BLOCK_H, D]`` tile and the
scores are tensor-core ``tl.dot``\\ s with fp32 accumulation (products of two
16-bit values are exact in fp32). ``q_hat`` may be the KV dtype or fp32; an
fp32 ``q_hat`` (a ridge-regression prediction) is split into a high and a low
part in the KV dtype, ``q = hi + lo``, scored with two dots, which keeps about
16 mantissa bits of the query instead of 8 for bf16 -- the extra dot is free,
the kernel is bound by reading the keys. Over an fp8 pool (SGLang's
``--kv-cache-dtype fp8_*``) the keys widen exactly to bf16 and the dots run in it
(:func:`dot_dtype`; an fp32 ``q_hat`` split as above); the pool's ``k_scale`` is
left out, the ranking being the same under it.

Grids depend on static shapes only, no host syncs (CUDA-graph friendly). The
output width (``n_max``, ``C``) and the strides that follow from it are not
specialized (``do_not_specialize``), so a caller whose width changes from step
to step does not trigger a compile per divisibility class.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ._radix import desc_key
from ._utils import cdiv, device_num_sms, is_interpreter, needs_fp32_dot, next_pow2
from .index_keys import _quantize_halves, _quantize_tile
from .quest_pages import expand_selection
from .two_segment_decode import FP8_KV_DTYPES, _dot

__all__ = ["token_scores", "token_scores_at", "token_select_positions"]


@triton.jit
def _load_q_group(Q, cur_b, cur_h, stride_qb, stride_qh, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """KV head cur_h's query group of row cur_b as a [BLOCK_H, BLOCK_D] tile, 0 where padded."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(Q + cur_b * stride_qb + (cur_h * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                   mask=mask, other=0.0)


@triton.jit
def _load_q_parts(Q, cur_b, cur_h, stride_qb, stride_qh, KV_DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, Q_SPLIT: tl.constexpr):
    """The group's queries as tile(s) in the dots' dtype (the KV dtype, bf16 over an fp8
    pool: dot_dtype): (hi, lo) with q == hi + lo (lo = 0 unless Q_SPLIT)."""
    q = _load_q_group(Q, cur_b, cur_h, stride_qb, stride_qh, HEAD_DIM, GROUP, BLOCK_H, BLOCK_D)
    dot_dtype: tl.constexpr = tl.bfloat16 if KV_DTYPE.is_fp8() else KV_DTYPE
    q_hi = q.to(dot_dtype)
    if Q_SPLIT:
        q_lo = (q.to(tl.float32) - q_hi.to(tl.float32)).to(dot_dtype)
    else:
        q_lo = q_hi
    return q_hi, q_lo


@triton.jit
def _scores_tile(q_hi, q_lo, k, mask_h, Q_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    """max over the group of q . k for a [BLOCK_N, BLOCK_D] key tile -> [BLOCK_N] fp32."""
    s = _dot(q_hi, tl.trans(k), FP32_DOT)
    if Q_SPLIT:
        s += _dot(q_lo, tl.trans(k), FP32_DOT)
    s = tl.where(mask_h[:, None], s, float("-inf"))
    return tl.max(s, 0)


@triton.jit
def _load_q_codes(Q, cur_b, cur_h, stride_qb, stride_qh, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The group's queries as int8 codes and per-head fp32 scales (the keys' formula,
    kernels/index_keys.py); padded heads get codes and scale 0."""
    q = _load_q_group(Q, cur_b, cur_h, stride_qb, stride_qh, HEAD_DIM, GROUP, BLOCK_H, BLOCK_D)
    qq, qs = _quantize_tile(q.to(tl.float32))
    return qq.to(tl.int8), qs


@triton.jit
def _index_scores_tile(qq, qs, kq, ks, mask_h, KEYS_AS_M: tl.constexpr):
    """max over the group of (qq . kq) * qs, times ks, for a [BLOCK_N, BLOCK_D] int8
    key tile -> [BLOCK_N] fp32. The int8 dot's int32 sums stay below 2^24, exact in fp32.

    KEYS_AS_M: the keys are the dot's M side (``kq @ qq^T``, ``[BLOCK_N, BLOCK_H]``):
    with 128-position tiles on sm_90 that is a warpgroup MMA reading the key tile
    from shared memory where the pipeline put it; otherwise the group's BLOCK_H = 16
    queries are M (``mma.sync``, the keys through registers). Same products, same
    fp32 operations per element: the same scores either way."""
    if KEYS_AS_M:
        s_nh = tl.dot(kq, tl.trans(qq)).to(tl.float32) * qs[None, :]
        best = tl.max(tl.where(mask_h[None, :], s_nh, float("-inf")), 1)
    else:
        s_hn = tl.dot(qq, tl.trans(kq)).to(tl.float32) * qs[:, None]
        best = tl.max(tl.where(mask_h[:, None], s_hn, float("-inf")), 0)
    return best * ks


@triton.jit
def _copies_tile(offs, mask, kq_base, ks_base, offs_d, mask_d, HEAD_DIM: tl.constexpr):
    """The int8 key copies and scales of positions ``offs`` where ``mask`` (0 elsewhere)."""
    kq = tl.load(kq_base + offs[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                 mask=mask[:, None] & mask_d[None, :], other=0)
    return kq, tl.load(ks_base + offs, mask=mask, other=0.0)


@triton.jit
def _index_keys_tile(offs, valid, valid_to, kq_base, ks_base, K_POOL, REQ_TO_TOKEN, req_row, stride_r2t, stride_kt,
                     cur_h, stride_kh, offs_d, mask_d, HEAD_DIM: tl.constexpr):
    """A block's int8 key copies (kernels/index_keys.py) and fp32 scales: positions
    below ``valid_to`` read from the copies, the others quantized from the pool and
    copied."""
    cached = valid & (offs < valid_to)
    fresh = valid & (offs >= valid_to)
    kq_c, ks_c = _copies_tile(offs, cached, kq_base, ks_base, offs_d, mask_d, HEAD_DIM)
    c_ptr = kq_base + offs[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + offs, mask=fresh, other=0).to(tl.int64)
    k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :],
                mask=fresh[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    kq_f, ks_f = _quantize_tile(k)
    kq_f = kq_f.to(tl.int8)  # |codes| <= 127: exact
    tl.store(c_ptr, kq_f, mask=fresh[:, None] & mask_d[None, :])
    tl.store(ks_base + offs, ks_f, mask=fresh)
    return tl.where(fresh[:, None], kq_f, kq_c), tl.where(fresh, ks_f, ks_c)


@triton.jit
def _load_q_codes4(Q, F_BASE, cur_b, cur_h, stride_qb, stride_qh, HALF: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """The group's queries times the smoothing ``f`` as int8 codes, in the 4-bit
    layout's two halves (channels ``[0, D/2)`` and ``[D/2, D)``), per-head scales, and
    ``8 * sum(codes)`` per head (the nibble offset's share of each dot)."""
    offs_d = tl.arange(0, HALF)
    qa = _load_q_group(Q, cur_b, cur_h, stride_qb, stride_qh, HALF, GROUP, BLOCK_H, HALF).to(tl.float32)
    qb = _load_q_group(Q + HALF, cur_b, cur_h, stride_qb, stride_qh, HALF, GROUP, BLOCK_H, HALF).to(tl.float32)
    qa = qa * tl.load(F_BASE + offs_d)[None, :]
    qb = qb * tl.load(F_BASE + HALF + offs_d)[None, :]
    ca, cb, qs = _quantize_halves(qa, qb, 127.0)
    qsum8 = (tl.sum(ca, 1) + tl.sum(cb, 1)).to(tl.int32) * 8  # NIBBLE_OFFSET
    return ca.to(tl.int8), cb.to(tl.int8), qs, qsum8


@triton.jit
def _index_scores_tile4(qa, qb, qs, qsum8, ka, kb, ks, mask_h, KEYS_AS_M: tl.constexpr):
    """:func:`_index_scores_tile` over the 4-bit layout: ``ka``/``kb`` [BLOCK_N, D/2]
    int8 hold ``code + 8`` of the two halves' channels; the int32 sum of both
    halves' dots minus ``8 * sum(qq)`` is ``qq . codes``, exact."""
    if KEYS_AS_M:
        acc = tl.dot(ka, tl.trans(qa), out_dtype=tl.int32)
        acc = tl.dot(kb, tl.trans(qb), acc, out_dtype=tl.int32)
        s_nh = (acc - qsum8[None, :]).to(tl.float32) * qs[None, :]
        best = tl.max(tl.where(mask_h[None, :], s_nh, float("-inf")), 1)
    else:
        acc = tl.dot(qa, tl.trans(ka), out_dtype=tl.int32)
        acc = tl.dot(qb, tl.trans(kb), acc, out_dtype=tl.int32)
        s_hn = (acc - qsum8[:, None]).to(tl.float32) * qs[:, None]
        best = tl.max(tl.where(mask_h[:, None], s_hn, float("-inf")), 0)
    return best * ks


@triton.jit
def _nibbles(p, ASM: tl.constexpr):
    """(low, high) nibbles of int8 bytes ``p``, each 0..15 as int8. ``ASM``: on 32-bit
    words of 4 bytes, a mask and a shift + mask a word (the compiler's own lowering
    of the same int8 ops widens each byte to 16 bits: ~5 instructions a byte, which
    made the loop compute-bound, ~1.3x int8's time on an H200); off in the Triton
    interpreter, which runs no PTX."""
    if ASM:
        lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [p], dtype=tl.int8, is_pure=True,
                                       pack=4)
        hi = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                                       [p], dtype=tl.int8, is_pure=True, pack=4)
    else:
        lo = (p & 0xF).to(tl.int8)
        hi = ((p >> 4) & 0xF).to(tl.int8)
    return lo, hi


@triton.jit
def _copies_tile4(offs, mask, kq_base, ks_base, HALF: tl.constexpr, ASM: tl.constexpr):
    """The 4-bit copies of positions ``offs`` where ``mask``, unpacked to their two
    halves' ``code + 8``, and their scales. Masked positions read byte 0 (codes -8):
    their scores are never kept. A fill other than 0 costs a select in registers
    after the asynchronous copy, and with it a trip of the tile through shared
    memory again before the MMA (TTGIR, sm_90: the loop ran ~1.35x int8's time)."""
    offs_d = tl.arange(0, HALF)
    p = tl.load(kq_base + offs[:, None].to(tl.int64) * HALF + offs_d[None, :], mask=mask[:, None], other=0)
    lo, hi = _nibbles(p, ASM)
    return lo, hi, tl.load(ks_base + offs, mask=mask, other=0.0)


@triton.jit
def _index_keys_tile4(offs, valid, valid_to, kq_base, ks_base, rf_a, rf_b, K_POOL, REQ_TO_TOKEN, req_row,
                      stride_r2t, stride_kt, cur_h, stride_kh, HALF: tl.constexpr, ASM: tl.constexpr):
    """:func:`_index_keys_tile` for the 4-bit copies: new positions' keys times
    ``1 / f``, quantized to 7, packed and copied."""
    cached = valid & (offs < valid_to)
    fresh = valid & (offs >= valid_to)
    ka_c, kb_c, ks_c = _copies_tile4(offs, cached, kq_base, ks_base, HALF, ASM)
    offs_d = tl.arange(0, HALF)
    tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + offs, mask=fresh, other=0).to(tl.int64)
    k_ptr = K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :]
    ka = tl.load(k_ptr, mask=fresh[:, None], other=0.0).to(tl.float32) * rf_a[None, :]
    kb = tl.load(k_ptr + HALF, mask=fresh[:, None], other=0.0).to(tl.float32) * rf_b[None, :]
    ca, cb, ks_f = _quantize_halves(ka, kb, 7.0)  # QMAX4
    ua = (ca + 8.0).to(tl.int32)  # code + NIBBLE_OFFSET, 1..15
    ub = (cb + 8.0).to(tl.int32)
    tl.store(kq_base + offs[:, None].to(tl.int64) * HALF + offs_d[None, :], (ua | (ub << 4)).to(tl.int8),
             mask=fresh[:, None])
    tl.store(ks_base + offs, ks_f, mask=fresh)
    f2 = fresh[:, None]
    return (tl.where(f2, ua.to(tl.int8), ka_c), tl.where(f2, ub.to(tl.int8), kb_c),
            tl.where(fresh, ks_f, ks_c))


@triton.jit
def _top_digit_hist(s):
    """64-bin histogram of the top 6 bits of the KEY_DESC keys (``_radix.desc_key``) of
    the finite values of ``s``: one stored tile's share of ``topk_range``'s ``h_top``
    (its first pass over the row; the tile's -inf, positions not scored, not counted)."""
    bits, ok = desc_key(s, True)
    return tl.histogram((bits >> 26) & 63, 64, mask=ok)


@triton.jit
def _add_top_hist(H_TOP, cur_b, cur_h, stride_tb, stride_th, hist):
    """Adds a program's 64 bins to H_TOP[cur_b, cur_h, :] (the row's other programs add
    theirs): one atomic per non-empty bin. Relaxed: the reader is a later launch."""
    bins = H_TOP + cur_b.to(tl.int64) * stride_tb + cur_h.to(tl.int64) * stride_th + tl.arange(0, 64)
    tl.atomic_add(bins, hist, mask=hist != 0, sem="relaxed")


# The copies' strides and width are the store's, fixed per server: specialized, so
# Triton knows the int8 rows are 16-byte aligned and reads them in vectors.
@triton.jit(do_not_specialize=["N_MAX", "stride_ob", "stride_oh"])
def _token_scores_kernel(
    Q,  # [bs, Hq, D]
    K_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    LO,
    HI,
    OUT,  # [bs, Hkv, n_max] fp32
    KQ,  # INDEX_KEYS: [bs, Hkv, IDX_CTX, D] int8, stride 1 along D
    KSCALE,  # INDEX_KEYS: [bs, Hkv, IDX_CTX] fp32, stride 1 along positions
    FILLED,  # INDEX_KEYS: [bs, 2] int32
    KSMOOTH,  # INDEX_BITS 4: [bs, Hkv, D] fp32, stride 1 along D
    H_TOP,  # HIST: [bs, Hkv, 64] int32, stride 1 along the bins; added to
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_ob,
    stride_oh,
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    stride_fs,
    stride_fh,
    stride_tb,
    stride_th,
    N_MAX,
    MAX_CTX,
    IDX_CTX,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FILL: tl.constexpr,
    INDEX_KEYS: tl.constexpr,
    FRESH_N: tl.constexpr = 16,
    KEYS_AS_M: tl.constexpr = False,
    INDEX_BITS: tl.constexpr = 8,
    ASM_NIBBLES: tl.constexpr = False,
    HIST: tl.constexpr = False,  # INDEX_KEYS only: add the written scores' top-digit histogram to H_TOP
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    pid = tl.program_id(2)
    nprog = tl.num_programs(2)
    lo = tl.minimum(tl.maximum(tl.load(LO + cur_b), 0), N_MAX)
    hi_req = tl.minimum(tl.load(HI + cur_b), N_MAX)
    hi = tl.minimum(hi_req, MAX_CTX)  # never past req_to_token's row
    if not FILL:
        if hi_req <= lo:  # an empty range and nothing to fill: the program has nothing to do
            return
    if INDEX_KEYS:
        hi = tl.minimum(hi, IDX_CTX)  # nor past the copies
        # the counter the previous step's launch wrote (its hi was one less); this
        # launch writes the other one (kernels/index_keys.py)
        par = hi_req % 2
        valid_to = tl.load(FILLED + cur_b * 2 + 1 - par)
        kq_base = KQ + cur_b.to(tl.int64) * stride_cs + cur_h.to(tl.int64) * stride_ch
        ks_base = KSCALE + cur_b.to(tl.int64) * stride_ss + cur_h.to(tl.int64) * stride_sh
    req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    if INDEX_KEYS:
        if INDEX_BITS == 4:
            f_base = KSMOOTH + cur_b.to(tl.int64) * stride_fs + cur_h.to(tl.int64) * stride_fh
            qa, qb, qs, qsum8 = _load_q_codes4(Q, f_base, cur_b, cur_h, stride_qb, stride_qh, HALF, GROUP, BLOCK_H)
            # 1 / f, as the reference's torch division (f a power of two: exact)
            rf_a = tl.math.div_rn(tl.full([HALF], 1.0, tl.float32), tl.load(f_base + tl.arange(0, HALF)))
            rf_b = tl.math.div_rn(tl.full([HALF], 1.0, tl.float32), tl.load(f_base + HALF + tl.arange(0, HALF)))
        else:
            qq, qs = _load_q_codes(Q, cur_b, cur_h, stride_qb, stride_qh, HEAD_DIM, GROUP, BLOCK_H, BLOCK_D)
    else:
        q_hi, q_lo = _load_q_parts(Q, cur_b, cur_h, stride_qb, stride_qh, K_POOL.dtype.element_ty, HEAD_DIM, GROUP,
                                   BLOCK_H, BLOCK_D, Q_SPLIT)
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out_base = OUT + cur_b * stride_ob + cur_h * stride_oh
    # Blocks are strided over the programs of this (row, head) for balance.
    # The blocks overlapping [lo, hi) are scored in a loop free of branches (so
    # Triton can software-pipeline its gathers); the rest of the row is filled
    # with -inf by two store-only loops (FILL), or only the part of [lo, hi) past
    # req_to_token's row (not FILL).
    blk_lo = lo // BLOCK_N
    blk_hi = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N), blk_lo)
    if INDEX_KEYS:
        # Blocks wholly below valid_to read the copies only. The rest (after the
        # first step, the one block holding the position that entered the range)
        # also quantize and copy: kept out of the first loop, whose blocks would
        # otherwise pay the quantization's IEEE divisions for masked-off rows
        # (session 20, H200: 4.5x token_scores' time at 32768 x 8 when every
        # block took that path).
        blk_new = tl.minimum(tl.maximum(valid_to // BLOCK_N, blk_lo), blk_hi)
        if HIST:
            # topk_range's first pass over the row (h_top), counted here from the very
            # values stored (their -inf, positions outside [lo, hi) or past MAX_CTX /
            # IDX_CTX, not counted), in registers over both loops (one 64-bin sum
            # whatever the tile), added to H_TOP once at the end: a Top-K over these
            # scores then skips a serial pass over each row
            hist = tl.zeros([64], dtype=tl.int32)
        for blk in range(blk_lo + pid, blk_new, nprog):
            offs = blk * BLOCK_N + offs_n
            valid = (offs >= lo) & (offs < hi)
            if INDEX_BITS == 4:
                ka, kb, ks = _copies_tile4(offs, valid, kq_base, ks_base, HALF, ASM_NIBBLES)
                s = _index_scores_tile4(qa, qb, qs, qsum8, ka, kb, ks, mask_h, KEYS_AS_M) * sm_scale
            else:
                kq, ks = _copies_tile(offs, valid, kq_base, ks_base, offs_d, mask_d, HEAD_DIM)
                s = _index_scores_tile(qq, qs, kq, ks, mask_h, KEYS_AS_M) * sm_scale
            s = tl.where(valid, s, float("-inf"))
            tl.store(out_base + offs, s, mask=offs < N_MAX)
            if HIST:
                hist += _top_digit_hist(s)
        # The rest in FRESH_N-position tiles: a [FRESH_N, D] fp32 tile to quantize
        # instead of [BLOCK_N, D] keeps this loop's registers under the copies
        # loop's. Its 128-position fp32 tile took the kernel to 249-255 registers a
        # thread and 2 programs a SM, for a loop that runs one block a step (ncu,
        # H200, session 22: 12% occupancy, DRAM at 48% of peak).
        offs_f = tl.arange(0, FRESH_N)
        for blk in range(blk_new * (BLOCK_N // FRESH_N) + pid, blk_hi * (BLOCK_N // FRESH_N), nprog):
            offs = blk * FRESH_N + offs_f
            valid = (offs >= lo) & (offs < hi)
            if INDEX_BITS == 4:
                ka, kb, ks = _index_keys_tile4(offs, valid, valid_to, kq_base, ks_base, rf_a, rf_b, K_POOL,
                                               REQ_TO_TOKEN, req_row, stride_r2t, stride_kt, cur_h, stride_kh, HALF,
                                               ASM_NIBBLES)
                s = _index_scores_tile4(qa, qb, qs, qsum8, ka, kb, ks, mask_h, False) * sm_scale
            else:
                kq, ks = _index_keys_tile(offs, valid, valid_to, kq_base, ks_base, K_POOL, REQ_TO_TOKEN, req_row,
                                          stride_r2t, stride_kt, cur_h, stride_kh, offs_d, mask_d, HEAD_DIM)
                s = _index_scores_tile(qq, qs, kq, ks, mask_h, False) * sm_scale
            s = tl.where(valid, s, float("-inf"))
            tl.store(out_base + offs, s, mask=offs < N_MAX)
            if HIST:
                hist += _top_digit_hist(s)
        if HIST:
            _add_top_hist(H_TOP, cur_b, cur_h, stride_tb, stride_th, hist)
    else:
        for blk in range(blk_lo + pid, blk_hi, nprog):
            offs = blk * BLOCK_N + offs_n
            valid = (offs >= lo) & (offs < hi)
            tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + offs, mask=valid, other=0).to(tl.int64)
            k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0).to(q_hi.dtype)
            s = _scores_tile(q_hi, q_lo, k, mask_h, Q_SPLIT, FP32_DOT) * sm_scale
            tl.store(out_base + offs, tl.where(valid, s, float("-inf")), mask=offs < N_MAX)
    neg_inf = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    if not FILL:  # the range's part past req_to_token's row or the copies (if any) holds -inf
        for blk in range(blk_hi + pid, tl.cdiv(hi_req, BLOCK_N), nprog):
            offs = blk * BLOCK_N + offs_n
            tl.store(out_base + offs, neg_inf, mask=(offs >= tl.maximum(hi, lo)) & (offs < hi_req))
    if INDEX_KEYS:
        if (cur_h == 0) & (pid == 0):
            tl.store(FILLED + cur_b * 2 + par, hi)
    if FILL:
        for blk in range(pid, blk_lo, nprog):
            tl.store(out_base + blk * BLOCK_N + offs_n, neg_inf)  # blk < blk_lo: entirely below lo <= N_MAX
        for blk in range(blk_hi + pid, tl.cdiv(N_MAX, BLOCK_N), nprog):
            offs = blk * BLOCK_N + offs_n
            tl.store(out_base + offs, neg_inf, mask=offs < N_MAX)


def dot_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype a query group is scored against keys of ``kv_dtype`` in: the pool's, or
    bf16 over an fp8 pool (SGLang's --kv-cache-dtype fp8_*), to which its keys widen
    exactly (``_load_q_parts`` makes the same choice). The pool's k_scale is left out:
    a positive factor on every key of a layer changes no ranking."""
    return torch.bfloat16 if kv_dtype in FP8_KV_DTYPES else kv_dtype


def group_tile_meta(q, k_pool) -> dict:
    """The constexprs of a kernel whose program holds one KV head's query group as
    a ``[BLOCK_H, BLOCK_D]`` tile (``_load_q_parts``) scored against ``k_pool``."""
    head_dim = k_pool.shape[2]
    group = q.shape[1] // k_pool.shape[1]
    dot = dot_dtype(k_pool.dtype)
    return dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_H=max(16, next_pow2(group)), BLOCK_D=next_pow2(head_dim),
                Q_SPLIT=q.dtype != dot, FP32_DOT=needs_fp32_dot(dot))


def _common_checks(q_hat, k_pool, req_to_token):
    bs, num_q_heads, head_dim = q_hat.shape
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.shape[2] == head_dim
    assert k_pool.dtype in (torch.bfloat16, torch.float16, *FP8_KV_DTYPES), "k_pool: bf16, fp16 or fp8"
    assert q_hat.dtype in (k_pool.dtype, dot_dtype(k_pool.dtype), torch.float32), \
        "q_hat: the KV dtype (bf16 over an fp8 pool) or fp32"
    assert q_hat.stride(2) == 1 and k_pool.stride(2) == 1 and req_to_token.stride(1) == 1
    group = num_q_heads // num_kv_heads
    return bs, num_kv_heads, head_dim, group


def token_scores(
    q_hat: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    n_max: int,
    *,
    out: Optional[torch.Tensor] = None,
    num_programs: Optional[int] = None,
    num_sms: Optional[int] = None,
    programs_per_sm: int = 4,
    blocks_per_program: int = 0,
    block_n: int = 64,
    num_warps: int = 4,
    fill: bool = True,
) -> torch.Tensor:
    """Scaled logits of ``q_hat`` over positions ``[lo[b], hi[b])``, fp32 ``[bs, Hkv, n_max]``.

    ``s[b, h, pos] = max_{g in group(h)} (q_hat[b, g] . k_pool[req_to_token[req_pool_idx[b], pos], h]) * sm_scale``
    for ``lo[b] <= pos < min(hi[b], n_max, max_ctx)``, ``-inf`` at every other ``pos < n_max``.

    Args:
        q_hat: ``[bs, Hq, D]``, the KV dtype or fp32 (see the module docstring).
        k_pool: ``[pool, Hkv, D]`` bf16/fp16; req_to_token ``[max_reqs, max_ctx]``
            int32; req_pool_idx ``[bs]``; lo, hi ``[bs]`` int32.
        n_max: static output width (e.g. the graph's max context). Positions
            ``>= max_ctx`` (the width of ``req_to_token``) are never read: -inf.
        num_programs: programs per (row, KV head) (default: at most
            ``programs_per_sm`` per SM in all, from static shapes only; rounded down,
            since a grid one program past what is resident starts a second wave).
        blocks_per_program: > 0 (and no ``num_programs``): one short program per that
            many ``block_n`` blocks of ``n_max`` instead of persistent ones, so that
            kernels of other streams get SMs while the pass runs.
        fill: write ``-inf`` outside the range. ``False``: only ``[lo, hi)`` is
            written (what ``topk_range`` over the same range reads) and the
            programs of a row with an empty range return at once -- the
            CUDA-graph path's slots without a request cost O(1), not ``n_max``.
    """
    return launch_token_scores(q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, out=out,
                               num_programs=num_programs, num_sms=num_sms, programs_per_sm=programs_per_sm,
                               blocks_per_program=blocks_per_program, block_n=block_n, num_warps=num_warps,
                               fill=fill)


def scoring_programs(n_max: int, block_n: int, bs: int, num_kv_heads: int, device: torch.device, *,
                     num_sms: Optional[int] = None, programs_per_sm: int = 4, blocks_per_program: int = 0) -> int:
    """The scoring launch's programs per (row, KV head), from static shapes only: one
    per ``blocks_per_program`` blocks of ``n_max`` where that is > 0, else persistent
    ones, at most ``programs_per_sm`` per SM in all."""
    n_blocks = cdiv(n_max, block_n)
    if blocks_per_program > 0:
        return cdiv(n_blocks, blocks_per_program)
    sms = num_sms if num_sms is not None else device_num_sms(device)
    # rounded down: a grid one program past what is resident starts a second wave
    # (H200, index keys at 32768 x 8: 9 programs per row and head 94.5 us, 8 74 us)
    return max(1, min(n_blocks, programs_per_sm * sms // max(1, bs * num_kv_heads)))


def launch_token_scores(q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, *, out, num_programs,
                        num_sms, block_n, num_warps, fill, index_keys=None, num_stages=None,
                        keys_as_m: bool = False, programs_per_sm: int = 4, blocks_per_program: int = 0,
                        h_top: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The launch of :func:`token_scores` and of ``index_keys.index_token_scores``
    (``index_keys``: its ``(kq, kscale, filled)``, checked there; ``fill`` False).
    ``h_top`` (index keys only): int32 ``[bs, Hkv, 64]``, the written scores' top-digit
    histograms ADDED to it (``topk_range``'s ``h_top``; the caller zeroes it)."""
    bs, num_kv_heads, _, _ = _common_checks(q_hat, k_pool, req_to_token)
    assert lo.shape == (bs,) and hi.shape == (bs,) and req_pool_idx.shape == (bs,)
    n_max = int(n_max)
    assert n_max > 0
    if out is None:
        out = torch.empty((bs, num_kv_heads, n_max), dtype=torch.float32, device=q_hat.device)
    assert out.shape == (bs, num_kv_heads, n_max) and out.dtype == torch.float32 and out.stride(2) == 1
    if num_programs is None:
        num_programs = scoring_programs(n_max, block_n, bs, num_kv_heads, q_hat.device, num_sms=num_sms,
                                        programs_per_sm=programs_per_sm, blocks_per_program=blocks_per_program)
    grid = (bs, num_kv_heads, int(num_programs))
    ksmooth = None
    if index_keys is None:
        kq = kscale = filled = out  # unread: INDEX_KEYS is off
        idx_strides, idx_ctx = (0, 0, 0, 0), 0
    else:
        assert not fill
        kq, kscale, filled, ksmooth = index_keys
        idx_strides, idx_ctx = (kq.stride(0), kq.stride(1), kscale.stride(0), kscale.stride(1)), kq.shape[2]
    bits = 4 if ksmooth is not None else 8  # ksmooth: the 4-bit copies (index_keys.py)
    f = ksmooth if ksmooth is not None else out  # unread with 8 bits
    if h_top is not None:
        assert index_keys is not None, "h_top: only with index keys"
        assert h_top.shape == (bs, num_kv_heads, 64) and h_top.dtype == torch.int32 and h_top.stride(2) == 1, \
            "h_top: int32 [bs, Hkv, 64], stride 1 along the bins"
        assert h_top.device == out.device, "h_top: on the scores' device"
    # without h_top: a pointer the kernel never reads, strides 0 (no
    # specialization follows the output's width)
    ht, ht_strides = (h_top, (h_top.stride(0), h_top.stride(1))) if h_top is not None else (out, (0, 0))
    _token_scores_kernel[grid](
        q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, out, kq, kscale, filled, f, ht, float(sm_scale),
        q_hat.stride(0), q_hat.stride(1), k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1), *idx_strides, f.stride(0), f.stride(1), *ht_strides, n_max,
        req_to_token.shape[1], idx_ctx,
        BLOCK_N=block_n, **group_tile_meta(q_hat, k_pool), FILL=bool(fill), INDEX_KEYS=index_keys is not None,
        KEYS_AS_M=bool(keys_as_m) and index_keys is not None, FRESH_N=min(16, block_n), INDEX_BITS=bits,
        ASM_NIBBLES=bits == 4 and not is_interpreter(),
        HIST=h_top is not None,
        # index keys: the copies must equal quantize_keys', k * inv + 0.5 rounded twice as torch does
        num_warps=num_warps, enable_fp_fusion=index_keys is None,
        **({} if num_stages is None else dict(num_stages=num_stages)),
    )
    return out


@triton.jit(do_not_specialize=["C", "stride_cb", "stride_ch", "stride_ob", "stride_oh"])
def _token_scores_at_kernel(
    Q,
    K_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    CAND_POS,  # [bs, Hkv, C] int32
    CAND_LEN,  # [bs, Hkv] int32 (only if HAS_LEN)
    LO,  # [bs] int32 (only if HAS_RANGE)
    HI,
    OUT,  # [bs, Hkv, C] fp32
    Q_ROWS,  # [bs] int: the row of Q of each row (only if HAS_Q_ROWS)
    ROW_ON,  # [bs] int: <= 0: the row's programs write nothing (only if HAS_ON)
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_r2t,
    stride_cb,
    stride_ch,
    stride_clb,
    stride_ob,
    stride_oh,
    C,
    MAX_CTX,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
    HAS_ON: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    blk = tl.program_id(2)
    if HAS_ON:
        if tl.load(ROW_ON + cur_b) <= 0:  # nobody reads this row: nothing to do
            return
    offs = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n = C
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(CAND_LEN + cur_b * stride_clb + cur_h), 0), C)
    lo = 0
    hi = MAX_CTX
    if HAS_RANGE:
        lo = tl.maximum(tl.load(LO + cur_b), 0)
        hi = tl.minimum(tl.load(HI + cur_b), MAX_CTX)
    listed = offs < n
    pos = tl.load(CAND_POS + cur_b * stride_cb + cur_h * stride_ch + offs, mask=listed, other=-1)
    # Out-of-range entries (padding such as -1, or positions an expansion pushed
    # past the allowed range) score -inf and are never dereferenced.
    valid = listed & (pos >= lo) & (pos < hi)
    score = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    if blk * BLOCK_N < n:
        req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)
        q_b = cur_b.to(tl.int64)
        if HAS_Q_ROWS:
            q_b = tl.load(Q_ROWS + cur_b).to(tl.int64)
        q_hi, q_lo = _load_q_parts(Q, q_b, cur_h, stride_qb, stride_qh, K_POOL.dtype.element_ty, HEAD_DIM, GROUP,
                                   BLOCK_H, BLOCK_D, Q_SPLIT)
        mask_h = tl.arange(0, BLOCK_H) < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        tok = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
        k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_h * stride_kh + offs_d[None, :],
                    mask=valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(q_hi.dtype)
        s = _scores_tile(q_hi, q_lo, k, mask_h, Q_SPLIT, FP32_DOT) * sm_scale
        score = tl.where(valid, s, float("-inf"))
    tl.store(OUT + cur_b * stride_ob + cur_h * stride_oh + offs, score, mask=offs < C)


def token_scores_at(
    q_hat: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    cand_pos: torch.Tensor,
    sm_scale: float,
    *,
    cand_len: Optional[torch.Tensor] = None,
    lo: Optional[torch.Tensor] = None,
    hi: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    q_rows: Optional[torch.Tensor] = None,
    row_on: Optional[torch.Tensor] = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Scaled logits of ``q_hat`` at listed positions only, fp32 ``[bs, Hkv, C]``.

    ``s[b, h, i]`` is the :func:`token_scores` value at position
    ``cand_pos[b, h, i]`` for ``i < cand_len[b, h]`` (all ``C`` without
    ``cand_len``) whose position lies in ``[lo[b], hi[b])`` (default
    ``[0, max_ctx)``); ``-inf`` for every other entry, which is never read from
    the pool -- pad lists with ``-1``. Each KV head has its own list (LFPS's
    candidates differ per head). Grid ``(bs, Hkv, ceil(C / block_n))``. ``q_rows``
    (int ``[bs]``): row ``b`` scores with ``q_hat[q_rows[b]]`` (``q_hat`` then has any
    number of rows; the CUDA-graph path reads its batch rows' queries in place).
    ``row_on`` (int ``[bs]``): rows with ``row_on[b] <= 0`` are not written at all
    (their programs return at once: the CUDA-graph path's slots without a row,
    whose Top-k has budget 0 and reads nothing).
    """
    _, num_kv_heads, _, _ = _common_checks(q_hat, k_pool, req_to_token)
    bs = cand_pos.shape[0] if q_rows is not None else q_hat.shape[0]
    if q_rows is not None:
        assert q_rows.shape == (bs,) and not q_rows.is_floating_point() and q_rows.is_contiguous()
    if row_on is not None:
        assert row_on.shape == (bs,) and not row_on.is_floating_point() and row_on.is_contiguous()
    assert cand_pos.dim() == 3 and cand_pos.shape[:2] == (bs, num_kv_heads), "cand_pos: [bs, Hkv, C]"
    assert cand_pos.dtype == torch.int32 and cand_pos.stride(2) == 1
    c = cand_pos.shape[2]
    if cand_len is not None:
        assert cand_len.shape == (bs, num_kv_heads) and cand_len.stride(1) == 1
    assert (lo is None) == (hi is None), "give both lo and hi, or neither"
    if out is None:
        out = torch.empty((bs, num_kv_heads, c), dtype=torch.float32, device=q_hat.device)
    assert out.shape == (bs, num_kv_heads, c) and out.dtype == torch.float32 and out.stride(2) == 1
    if c == 0:
        return out
    grid = (bs, num_kv_heads, cdiv(c, block_n))
    _token_scores_at_kernel[grid](
        q_hat, k_pool, req_to_token, req_pool_idx, cand_pos,
        cand_len if cand_len is not None else cand_pos,
        lo if lo is not None else cand_pos,
        hi if hi is not None else cand_pos,
        out, q_rows if q_rows is not None else cand_pos, row_on if row_on is not None else cand_pos, float(sm_scale),
        q_hat.stride(0), q_hat.stride(1), k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        cand_pos.stride(0), cand_pos.stride(1), cand_len.stride(0) if cand_len is not None else 0,
        out.stride(0), out.stride(1), c, req_to_token.shape[1],
        BLOCK_N=block_n, **group_tile_meta(q_hat, k_pool),
        HAS_LEN=cand_len is not None, HAS_RANGE=lo is not None, HAS_Q_ROWS=q_rows is not None,
        HAS_ON=row_on is not None, num_warps=num_warps,
    )
    return out


def token_select_positions(
    scores: torch.Tensor,
    num_tokens: Union[int, torch.Tensor],
    b_start: torch.Tensor,
    *,
    max_select: int,
    n_sink: int = 0,
    cand_pos: Optional[torch.Tensor] = None,
    out_pos: Optional[torch.Tensor] = None,
    out_len: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-level top-k -> ``(a_pos, a_len)`` for ``two_segment_decode``'s ``a_slot == -2``.

    ``torch.topk`` over the scores, then one small kernel (grid ``(bs, Hkv)``)
    writes the sink positions followed by the kept positions.

    Args:
        scores: ``[bs, Hkv, N]`` fp32, ``-inf`` = not selectable. Index ``i``
            is position ``i`` (from :func:`token_scores`), or, with
            ``cand_pos``, position ``cand_pos[b, h, i]`` (from
            :func:`token_scores_at`, LFPS).
        num_tokens: top entries kept per row, an int or an int32 tensor ``[bs]``
            (values above ``max_select`` act as it); a kept entry whose
            position falls outside ``[n_sink, b_start)`` is dropped, not replaced.
        b_start: ``[bs]`` int32; only positions in ``[n_sink, b_start)`` are
            listed (a sink or recent position scored by mistake is dropped, so
            the list stays distinct and below segment B).
        max_select: static k of ``torch.topk`` (fixed per CUDA graph).
        n_sink: positions ``[0, min(n_sink, b_start))`` are listed first.
        cand_pos: ``[bs, Hkv, N]`` int32 candidate positions (distinct per
            (row, head) among the finite-scored entries).

    Returns:
        ``a_pos`` int32 ``[bs, Hkv, n_sink + max_select]`` (sinks, then kept
        positions by descending score; entries past ``a_len`` not written) and
        ``a_len`` int32 ``[bs, Hkv]``.
    """
    bs, num_kv_heads, n = scores.shape
    k = max(1, min(int(max_select), n))
    n_sink = max(0, int(n_sink))
    vals, idx = torch.topk(scores, k, dim=-1)
    width = n_sink + k
    dev = scores.device
    if out_pos is None:
        out_pos = torch.empty((bs, num_kv_heads, width), dtype=torch.int32, device=dev)
    if out_len is None:
        out_len = torch.empty((bs, num_kv_heads), dtype=torch.int32, device=dev)
    assert out_pos.shape == (bs, num_kv_heads, width) and out_pos.dtype == torch.int32 and out_pos.stride(2) == 1
    assert out_len.shape == (bs, num_kv_heads) and out_len.dtype == torch.int32 and out_len.stride(1) == 1
    if cand_pos is not None:
        assert cand_pos.shape == scores.shape, "cand_pos: the shape of scores"
    expand_selection(vals, idx, num_tokens, b_start, out_pos, out_len, page=1, n_sink=n_sink, cand_pos=cand_pos)
    return out_pos, out_len
