"""
Two-segment sparse decode attention (one launch for a mixed-policy batch)
==========================================================================

Every decode request attends to the concatenation of two key segments:

* **Segment A -- compact buffer.** A per-request, per-KV-head list of packed
  K/V rows living in ``a_k``/``a_v`` ``[num_slots, Hkv, cap, D]`` at slot
  ``a_slot[b]``; only the first ``a_len[b, h]`` rows are valid. Different KV
  heads may keep a different number of tokens. This is where sparse policies
  put "sink" tokens or top-k selected tokens (see ``pack_compact.py``).
  Two in-place variants skip the packing: ``a_slot == -1`` reads the
  positions ``[0, a_len)`` of the request straight from the pool (sink tokens
  of window policies), and ``a_slot == -2`` reads the listed positions
  ``a_pos[b, h, :a_len[b, h]]`` (page- or token-level selections that change
  every step, e.g. Quest, AsyncSpade, LFPS), again per KV head.
* **Segment B -- in-place range.** The contiguous *position* range
  ``[b_start[b], b_end[b])`` of the request, read directly from SGLang's paged
  KV pool (page_size 1) through ``req_to_token[req_pool_idx[b], pos]``. This
  is the recent window, or the whole context ``[0, n)`` for dense requests.

So one batch can mix dense requests (A empty, B = [0, n)), sink + window
(A = sinks, B = window) and selected + recent (A = top-k, B = recent) and
still be served by *one* kernel launch.

Flash-decoding (split-KV)
-------------------------
Decode has one query token per request, so a (request, KV head) pair alone
gives only ``bs * Hkv`` programs -- 8 for batch 1 of Qwen3-1.7B, far too few
to fill 132 SMs. As in flash-decoding we cut the combined key range
(A first, then B) of every request into ``num_splits`` chunks processed by
separate programs (grid ``(bs, Hkv, num_splits)``); each writes an fp32
partial output (already normalised by its own softmax denominator) plus its
log-sum-exp. A second small kernel merges the partials with LSE weights.
When ``num_splits == 1`` stage 1 writes the final output directly and the
merge launch is skipped. With ``fused_merge=True`` there is never a second
launch: the last split program of each (request, KV head) to finish merges
the partials itself (an arrival counter per (request, KV head), see the
epilogue for the memory-ordering argument), and rows whose keys fit a single
chunk are written directly by split 0.

CUDA-graph friendliness
-----------------------
The grid depends only on ``bs``, ``Hkv`` and ``num_splits``, and
``num_splits`` is chosen on the host from *static* quantities only
(``bs``, ``Hkv``, SM count and a static upper bound ``max_kv_len``). The
actual per-request lengths are read *inside* the kernel, where each program
derives its own chunk as ``ceil(kv_len / num_splits)`` (rounded to BLOCK_N,
at least ``min_split_len``); with ``balance`` the grid allows more splits and a
request takes its share of them by its keys against the batch's, computed on the
device too (``balanced_splits``), so one long request among short ones does not
leave a few programs working while the rest of the GPU waits. That keeps the
launch free of host syncs, lets a graph captured for a 128K upper bound still
spread a 4K request over all splits, and means a wrong ``max_kv_len`` can only cost speed, never
correctness (the chunks always tile the whole range). Programs whose chunk
is empty write a zero partial with LSE = -inf, which the merge ignores.

Numerics
--------
fp32 accumulation; online softmax in base 2 (``exp2``), with
``sm_scale * log2(e)`` folded into a single multiply of the scores, as in the
FlashAttention Triton tutorial. All ``G = Hq / Hkv`` query heads of a GQA
group are processed by the same program as the rows of a ``[BLOCK_H, D]``
tile, so every K/V row is loaded once per group and the scores are a
tensor-core ``tl.dot``. ``BLOCK_H >= 16`` because ``tl.dot`` needs M >= 16;
padding rows are zero queries that are never stored.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from ._utils import (QUEST_PAGE_SIZE, cdiv, device_num_sms, env_count, env_switch, env_value,
                     has_fp8_pair_conversions, is_interpreter, needs_fp32_dot, next_pow2)

__all__ = ["two_segment_decode", "choose_num_splits", "plain_fp8_splits", "plain_partition_splits", "programs_per_sm",
           "make_split_counters", "balances",
           "balanced_splits", "balanced_grid_splits", "balance_factor", "balance_programs_per_sm", "step_row_splits",
           "dense_step_balances", "balance_gate"]

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
#: The fp8 KV caches the kernel reads (SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Split heuristic knobs (see choose_num_splits()); tuned on an H100 (132 SMs),
# see bench/kernels/bench_decode.py --sweep.
MAX_SPLITS = 64
DEFAULT_MIN_SPLIT_LEN = 128
CTAS_PER_SM_TARGET = 2
# Over fp8 caches: programs_per_sm doubles the target; batch 1 (8 KV heads) measured
# best at 32 splits, the most measured there (H200, s31).
FP8_MAX_SPLITS = 32
# The factor itself, SGLANG_SPARSE_FP8_SPLIT_FACTOR, 1 by default (bf16's splits over
# fp8 too). The kernel alone is 1.4x faster on dense rows at 2 and even on sparse
# ones, but served at 32768 x 8 over e4m3 (session 32, factor 2) sfi-pinned, quest,
# asyncspade and sfi ran 8%, 3%, 4% and 1% slower than with session 31's factor 1 (two
# leases apart, stock within 0.6%): 2 is the A/B knob until one run compares both.
FP8_SPLIT_FACTOR = env_count("FP8_SPLIT_FACTOR", 1, 1, 4)
# fused_merge=None picks the one-launch merge up to this many splits. H100, bf16,
# D=128 (bench/results/kernels_h100_run3.json.gz, CUDA-graph times): with 4 splits
# (batch >= 8) it is 0.76-0.80x the two launches for rows of <= 256 keys (and
# saves a launch for rows another kernel serves), 1.00-1.06x at 512-2K keys and
# within 1% above; with 32-33 splits (batch 1) the last arriving program's serial
# merge of every partial costs up to 1.6x once rows hold more than ~2K keys, so
# batch 1 keeps the merge kernel. Balanced launches need it (``balances``), so it also
# bounds where the fp8 heuristic doubles: SGLANG_SPARSE_FUSED_MERGE_MAX_SPLITS=16 lets
# batch 4 over fp8 take 16 splits, still balanced (an A/B knob: not measured end to end).
FUSED_MERGE_MAX_SPLITS = env_count("FUSED_MERGE_MAX_SPLITS", 8, 1, 64)
# Balanced splits (``balance``): the grid allows BALANCE_FACTOR x the heuristic's
# splits per (request, KV head) and each request takes its share of them by keys
# (balanced_splits). H100, Qwen3-1.7B shape, 28 layers, one dense row among sparse
# rows of ~2.3K keys (bench/kernels/bench_mixed_rows.py, session 15): 8192 x 32
# 7.74 -> 4.22 ms, 32768 x 8 6.64 -> 2.64 ms, 131072 x 4 12.6 -> 5.9 ms; with every row
# alike it costs 8% (2.93 -> 3.17 ms at 8192 x 32), so it is asked for per launch.
# Only while the launch is at most BALANCE_MAX_WAVES waves of the heuristic's
# programs: past that the waves themselves even out a long request.
# SGLANG_SPARSE_BALANCE_SPLITS=0: never (the grid and chunks as before).
# A balanced launch that fills the GPU, over fp8 (BALANCE_FACTOR 16, the shares' P 4 an
# SM: an fp8 tile's resident programs). With BALANCE_GATE on, the balanced launch runs
# where a request's share differs from the heuristic's splits (a dense row among sparse
# ones), and at factor 4 and the heuristic's 2 an SM its shares starved the sparse rows:
# at 32768 x 8 one dense row took 16 splits (the grid's cap) and each sparse row 1,
# 184 programs of ~2K keys. H200, e4m3, 28 layers (bench_mixed_rows.py, session 41),
# factor 4 / P 2 -> factor 16 / P 4, gated pair: one dense row among sparse ones
# 3.366 -> 2.477 ms at 8192 x 32, 2.838 -> 1.582 at 32768 x 8, 5.663 -> 3.453 at
# 131072 x 4; every row dense 7.098 -> 5.333, 7.622 -> 5.375, 10.395 -> 10.431; rows
# alike 1.744 -> 1.656, 0.627 -> 0.711, 0.489 -> 0.509 (P 4 shares differ from the
# heuristic's 2 there too, so the gate runs the balanced launch). Served natural sfi at
# 32768 x 8 over e4m3: inter-token 3.262 -> 3.088 ms, stock 8.578 in the same run
# (bench/README "Session 41"). Over bf16 the factor stays 4 and P the heuristic's
# (untimed there). SGLANG_SPARSE_BALANCE_FACTOR / _PROGRAMS_PER_SM set both dtypes' (0:
# these defaults).
BALANCE_FACTOR = env_count("BALANCE_FACTOR", 0, 0, 64)
BALANCE_PROGRAMS_PER_SM = env_count("BALANCE_PROGRAMS_PER_SM", 0, 0, 16)
# Rows alike balance only where each balanced program still reads this many keys
# (dense_step_balances for an all-dense step, balance_gate on the device): with rows
# alike the balanced launch was faster
# at ~1.1K keys a program (8192 x 32, sparse rows, 1.678 -> 1.582 ms over 28 layers at
# P 4 an SM) and slower at ~280 (32768 x 8, 0.544 -> 0.666; session 41).
BALANCE_MIN_PROGRAM_KEYS = 1024
BALANCE_MAX_WAVES = 4
BALANCE_ENABLED = env_switch("BALANCE_SPLITS", True)
# A balanced launch's registers a thread over an fp8 cache, at most (ptxas's maxnreg; 0:
# Triton's choice). Reading each request's splits costs the balanced variant registers
# the plain one does not need, and the cut matters where the launch fills the GPU: H200,
# 131072 x 4 over e4m3, the SFI slow step's launch (every row dense, fp8's doubled
# programs: 16 a request, 512 in all) compiled to 142 registers, 3 programs resident an
# SM (Nsight Compute: 1.29 waves, achieved occupancy 15%) and took 628 us where the plain
# launch of the same partition, at 128 registers and 4 an SM (0.97 waves), took 400; at
# 128 as served: 402 us against 620 uncapped (bench/results/slow_step_*_h200_s38.*).
# 128 at 4 warps leaves the 4 programs an SM that fp8 tiles' shared memory (55 KB a
# program) allows; a bf16 tile's (110 KB) leaves 2 whatever the registers, and there
# the cap measured 1-3.5% slower (28 layers of bench_mixed_rows.py: all dense and all
# sparse rows, 131072 x 4 to 8192 x 32; over e4m3 the cap was 3-5% faster all dense).
# The cap is the registers a program of 4 warps may hold; a launch at other warps gets
# the same registers a program (balance_maxnreg), none past a thread's 255: the one grid
# at 2 warps (BALANCE_ONE_GRID) compiled to 128 registers and 8 spilled under a cap of
# 128 a thread, to 192 without, and ran 28 layers at 8192 x 32 over e4m3 in 1.366 /
# 1.965 / 4.875 ms uncapped against 1.429 / 2.279 / 5.073 capped (0 / 1 / all rows
# dense; bench/results/mixed_rows_one_grid_w2_cap{128,0}_s46.log).
BALANCE_MAX_REGISTERS = env_count("BALANCE_MAX_REGISTERS", 128, 0, 255)
# A balanced launch's grid order: (splits, Hkv, bs) instead of (bs, Hkv, splits), so
# that each (request, KV head)'s splits are neighbours in launch order and the programs
# past a request's share (which exit at once) are spread through the grid instead of
# trailing it. H200, e4m3, every row alike (2052 compact + 256 recent keys; Nsight
# Compute, bench/results/fast_balance_ncu_*_h200_s39.txt): the balanced launch of the
# plain one's partition ran the same instructions with the same average SM-active
# cycles but 1.75x the elapsed ones at 8192 x 32 (60.6 -> 101.7 us; 256 working of
# 1024 programs, all first in launch order) and 1.55x at 32768 x 8 (22.6 -> 33.8 us):
# the SMs sat idle ~45% of the launch. Session 40 recorded each program's SM
# (two_segment_decode(record=...)): every SM got working programs, but up to 3 of them
# where the plain grid deals at most 2, and the launch lasts as long as its busiest SM
# (bench/results/probe_timed_*_h200_s40.json.gz). This order made that worse (up to 4 an
# SM, 113 of 132 SMs working at 8192 x 32; 28 layers of rows all alike 2.16 -> 2.75 ms)
# but a step with one dense row among sparse ones faster (3.28 -> 3.23 ms at 8192 x 32,
# 2.76 -> 2.61 at 32768 x 8, 5.60 -> 4.92 at 131072 x 4; bench_mixed_rows, e4m3,
# results/mixed_rows_factor4_h200_s40.log). Off by default: with BALANCE_GATE the rows
# all alike run the plain grid, so the two together are the next A/B (run_all.sh
# fastbalance's gated split-major column).
BALANCE_SPLIT_MAJOR = env_switch("BALANCE_SPLIT_MAJOR", False)
# A caller that balances every step (natural SFI triggers: any step may be slow) can
# launch the plain partition beside the balanced one, each gated on one device flag a
# step (``balance_gate``: does any served request's share differ from the heuristic's
# splits?), so the step whose rows are all alike runs the plain grid (its SMs all busy)
# and the other one empty launch (its programs return at their first load). H200, e4m3,
# 28 layers of rows all alike (bench_mixed_rows, session 40): 1.75 against the
# balanced launch's 2.16 ms at 8192 x 32 (plain 1.67), 0.63 against 0.72 at 32768 x 8
# (0.54), 0.49 against 0.51 at 131072 x 4 (0.42); one dense row among them 2-3% over
# the balanced launch alone (the empty launch). Served natural sfi at 32768 x 8: fast
# steps 2.875 -> 2.742 ms, inter-token time 3.307 -> 3.263 ms (bench/README "Session 40").
BALANCE_GATE = env_switch("BALANCE_GATE", True)
# The gated pair as one launch (gate=(flag, None)): the plain partition's programs first
# in the grid, the balanced partition's after them, the flag read by every program. A
# step replays one kernel node a layer instead of two: natural sfi, which replays the
# pair at every step (its host cannot know a slow step in time), paid ~0.10 ms a step at
# 32768 x 8 over e4m3 for the closed twins (bench/README "Session 43"). The closed
# partition's programs still start and return, now beside the working ones, and both
# partitions run at one launch's warps and register cap: over fp8 the plain launch's 2
# warps, uncapped (balance_maxnreg; two_segment_decode's num_warps).
# Measured (H200, e4m3, natural sfi; bench/README "Session 45", "Session 46"): served
# +2.1% tok/s at 8192 x 32 (ITL 4.292 against 4.390 ms), where the plain launch has one
# split a row; -1.1% at 32768 x 8 (ITL 3.083 against 3.052), where it has several and
# by kernel the one grid ran 0.715 against 0.658 ms without a dense row. Hence, unset,
# one_grid(): one grid over fp8 where the heuristic splits a row once (bf16 untimed:
# the pair; the one grid's plain partition keeps that one split, which a plain launch
# alone doubles there, plain_fp8_splits). 1 / 0 force it on / off.
BALANCE_ONE_GRID: Optional[bool] = (None if env_value("BALANCE_ONE_GRID") is None
                                    else env_switch("BALANCE_ONE_GRID", False))
# Over an fp8 cache, a balanced step whose programs would each read at least this many
# keys at the heuristic's program count takes twice the programs: such long rows are
# bound by widening the keys, not by HBM. H200, 131072 x 4 over e4m3, the dense launch
# keeping its logits (an SFI slow step, every row dense): 548.6 us at the heuristic's 8
# splits, 398.7 at 16, with either merge (session 33, bench_decode.py --slow-step); 28
# layers of the balanced launch with every row dense 17.25 -> 15.39 ms
# (bench_mixed_rows.py --kv-dtype fp8_e4m3; the other rows within 2%). Decided on the
# device from the step's keys, so a fast step (rows of ~2.3K keys) keeps its splits.
# 32768 x 8's dense step (~8K keys a program) stays below it: served there the doubled
# splits were not faster (session 32). SGLANG_SPARSE_FP8_DENSE_SPLIT_KEYS=0: never.
FP8_DENSE_SPLIT_KEYS = env_count("FP8_DENSE_SPLIT_KEYS", 12288, 0, 1 << 30)
# Over an fp8 KV cache the kernel's dots run in fp16 (the query, the widened keys and
# values, P), fp32 accumulation, whatever the model's dtype: e4m3 widens to fp16 in one
# conversion a pair, and compiled, the values widen before P.V reads its operand
# (_widen_v, FP8_V_ASM), which bf16 dots read one byte load a value.
# SGLANG_SPARSE_FP8_F16_DOTS=0 / SGLANG_SPARSE_FP8_V_ASM=0: the query's dtype / the
# compiler's own widening, as before (A/B timing; every variant is tested).
FP8_F16_DOTS = env_switch("FP8_F16_DOTS", True)
# Warps a program over an fp8 cache (bf16's 4 otherwise): the plain launch at
# FP8_NUM_WARPS, the balanced one at FP8_BALANCED_NUM_WARPS. H200, e4m3, 28 layers,
# rows of 2052 compact + 256 recent keys (bench_mixed_rows.py --variants, session 45):
# the plain launch at 2 warps 1.590 / 0.530 / 0.408 ms against 4's 1.678 / 0.551 /
# 0.421 at 8192 x 32 / 32768 x 8 / 131072 x 4 (session 44 alike), and with every row
# dense 6.918 / 7.036 / 13.758 against 7.039 / 7.573 / 14.582; served sfi-pinned at
# 8192 x 32 7790.8 / 7781.6 tok/s against 7400.2 (fast steps at 32768 x 8 alike). The
# balanced launch at 2 warps spilled under a maxnreg of 128 (8 registers; balance_maxnreg
# since lifts it at 2 warps: untimed for this launch) and ran the steps
# that need it, one dense row among sparse ones, 3-9% slower (2.429 / 1.598 / 3.680
# against 2.355 / 1.511 / 3.374 ms): it keeps 4.
FP8_NUM_WARPS = env_count("FP8_NUM_WARPS", 2, 1, 8)
# The plain launch over fp8 (no balanced partition) where the heuristic splits a row
# once: FP8_NUM_WARPS's 2-warp programs, one a (request, KV head), leave ~4 warps an SM
# at 8192 x 32 (256 programs on 132 SMs), too few to keep HBM busy; the heuristic's
# 2 programs an SM were set when a program had 4 warps. Twice the splits there, where
# twice the programs stay within FP8_PLAIN_WARPS_PER_SM warps an SM (8: the heuristic's
# target at 4 warps). Only from one split: a row of sfi's ~2.3K keys keeps ~1.2K a
# program; at 32768 x 8 (4 splits, ~580 keys) doubling was slower. H200, e4m3, 28
# layers, rows of 2052 compact + 256 recent keys (bench_mixed_rows.py, session 48,
# SGLANG_SPARSE_FP8_SPLIT_FACTOR 1 / 2, which doubles every fp8 launch):
# 8192 x 32 1.578 -> 1.355 ms, 32768 x 8 0.526 -> 0.560; served sfi-pinned at
# 8192 x 32 7814.6 -> 8423.5 tok/s (2.126x -> 2.291x stock's 3676.2 in one call), where
# the factor, through the one-grid gate and the balanced grid, cost natural sfi 8%
# (7689.1 -> 7042.8; 7413.0 with the one grid forced): so the plain launch alone
# doubles. 0 turns it off.
FP8_PLAIN_WARPS_PER_SM = env_count("FP8_PLAIN_WARPS_PER_SM", 8, 0, 64)
FP8_BALANCED_NUM_WARPS = env_count("FP8_BALANCED_NUM_WARPS", 4, 1, 8)
FP8_V_ASM = env_switch("FP8_V_ASM", True)


# -----------------------------------------------------------------------------
# Device helpers
# -----------------------------------------------------------------------------


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    # FP32_DOT is only set under the CPU interpreter for bf16 (see
    # _utils.needs_fp32_dot); compiled code always takes the native dot.
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(q, k, v, mask_n, m_i, l_i, acc, qk_scale, FP32_DOT: tl.constexpr, V_ASM: tl.constexpr):
    """One BLOCK_N step of the online softmax for a [BLOCK_H, D] query tile.

    q: [BLOCK_H, BLOCK_D] (the dots' dtype: the input's, fp16 over fp8), k/v:
    [BLOCK_N, BLOCK_D] (the KV cache's dtype: q's, or fp8, widened to q's here), mask_n: [BLOCK_N] valid keys. Scores
    live in the base-2 domain: s = (q . k) * sm_scale * log2(e), so
    exp(x*sm_scale) == exp2(s).
    Callers only pass blocks with at least one valid key, so the running max
    is finite after the first step and no (-inf) - (-inf) = NaN can occur.
    """
    qk = _scores(q, k, mask_n, qk_scale, FP32_DOT)
    return _softmax_update(qk, _widen_v(v, q.dtype, V_ASM), m_i, l_i, acc, FP32_DOT)


@triton.jit
def _widen_v(v, dt: tl.constexpr, V_ASM: tl.constexpr):
    """Values in the dots' dtype. V_ASM (fp8 values, fp16 dots, compiled for sm_89
    or later, whose PTX has the fp8-pair conversions): widen them by inline PTX,
    which the compiler neither fuses into the dot operand's shared-memory read nor
    moves past it: the values reach P.V's operand as fp16 through ldmatrix.trans
    instead of one byte load per value (sm_90 has no 8-bit transposing ldmatrix)."""
    if V_ASM:
        raw = v.to(tl.uint8, bitcast=True)
        if v.dtype == tl.float8e4nv:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
                "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return v.to(dt)


@triton.jit
def _scores(q, k, mask_n, qk_scale, FP32_DOT: tl.constexpr):
    """Base-2 scaled scores [BLOCK_H, BLOCK_N] fp32, -inf where the key is masked.
    An fp8 KV cache's keys are widened to q's dtype (a no-op for bf16/fp16 caches);
    their scale is folded into qk_scale."""
    qk = _dot(q, tl.trans(k.to(q.dtype)), FP32_DOT)
    qk = qk * qk_scale
    return tl.where(mask_n[None, :], qk, float("-inf"))


@triton.jit
def _softmax_update(qk, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """The online-softmax update of _online_softmax_step from its scores (v in the
    query's dtype: callers widen an fp8 cache's values, so P is never rounded to fp8)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rescale what we accumulated so far to the new max (alpha == 0 on the
    # very first block, where m_i == -inf).
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the V dtype so the PV product runs on tensor cores, the
    # standard FlashAttention trade-off (error ~2^-9 relative, averaged out).
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l_i, acc


# -----------------------------------------------------------------------------
# Stage 1: one program per (request, KV head, split)
# -----------------------------------------------------------------------------


@triton.jit
def _two_segment_decode_stage1(
    Q,
    A_K,  # [slots, Hkv, cap, D] compact K, or [slots, Hkv, cap] int32 pool slots (A_SLOT_LISTS)
    A_V,  # compact V (A_SLOT_LISTS: unread)
    A_SLOT,
    A_LEN,
    A_POS,  # [bs, Hkv, cap_pos] int32 positions of segment A (only if HAS_A_POS)
    A_ROW,  # [bs] int32: the row of A_POS2 / A_LEN2 a row's list is, < 0: its own (only if HAS_A_ROW)
    A_POS2,  # [rows, Hkv, cap_pos2] int32: lists kept elsewhere, e.g. a store's by slot (only if HAS_A_ROW)
    A_LEN2,  # [rows, Hkv] int32: their lengths
    K_POOL,
    V_POOL,
    REQ_TO_TOKEN,
    REQ_POOL_IDX,
    B_START,
    B_END,
    ROW_MASK,  # [bs] int32: 1 = attend; 0 = served elsewhere, skip; 2 = side effects only
    ROW_SPLITS,  # [bs] int32 splits of each request (only if BALANCE)
    REC,  # [programs, 3] int64: SM, start and end (ns) of each program in launch order (only if RECORD)
    GATE,  # [1] int32: the step's balance gate (only if GATE_RUN)
    KNORM,  # [pool, Hkv] fp32 key norms (only if STORE_KNORM)
    Q_SAVE,  # [slots, Hq, D] saved queries (only if SAVE_Q)
    Q_SAVE_SLOT,  # [bs] int32 slot of Q_SAVE taking this row's query, -1: none
    QB_MIN,  # [slots, Hkv, max_pages, D] Quest page bounds of this layer (only if QUEST_BOUNDS)
    QB_MAX,
    QB_SLOT,  # [bs] int32 row of the bounds store, < 0: none
    OUT,  # [bs, Hq, S, D] fp32 partials, or final [bs, Hq, D] when DIRECT
    LSE,  # [bs, Hq, S] fp32 partial LSE (base 2), or final [bs, Hq] (natural log)
    COUNTER,  # [bs * Hkv] int32 split arrival counters, all 0 between launches (FUSED_MERGE)
    FOUT,  # [bs, Hq, D] final output (FUSED_MERGE)
    FLSE,  # [bs, Hq] fp32 final natural-log LSE (FUSED_MERGE and STORE_LSE)
    LOGITS,  # [slots, Hkv, G, LG_LEN] fp32 slow-step logits by position (only if SAVE_LOGITS)
    qk_scale,  # sm_scale * log2(e) * k_scale
    q_mul,  # sm_scale * log2(e): the query's factor before its fp16 cast (F16_DOTS)
    v_scale,  # the values' dequantization scale (1.0 but for a scaled fp8 KV cache)
    k_scale,  # the keys' (folded into qk_scale; the key norms take it here)
    stride_qb,
    stride_qh,
    stride_aks,
    stride_akh,
    stride_akn,
    stride_avs,
    stride_avh,
    stride_avn,
    stride_alen_b,
    stride_apb,
    stride_aph,
    stride_ap2b,
    stride_ap2h,
    stride_al2b,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_kn,
    stride_qss,
    stride_qsh,
    stride_qbs,
    stride_qbh,
    stride_qbp,
    QB_MAX_PAGES,
    stride_fob,
    stride_foh,
    stride_flb,
    stride_flh,
    stride_lgs,
    stride_lgh,
    stride_lgg,
    LG_LEN,
    LG_SLOTS,
    A_CAP,
    A_POS_CAP,
    A_POS2_CAP,
    MIN_SPLIT_BLOCKS,
    PLAIN_SPLITS,  # GATE_RUN 3: the plain partition's splits, the grid's first ones
    POOL_ROWS,  # k_pool.shape[0]: the clamp of listed pool slots (A_POS_SLOTS)
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr,
    STORE_KNORM: tl.constexpr,
    SAVE_Q: tl.constexpr,
    QUEST_BOUNDS: tl.constexpr,
    QB_PAGE: tl.constexpr,
    HAS_A_POS: tl.constexpr,
    A_POS_SLOTS: tl.constexpr,  # a_pos lists pool slots (req_to_token applied), not positions
    HAS_A_ROW: tl.constexpr,  # rows may read their list from A_POS2 (``a_lists``)
    A_SLOT_LISTS: tl.constexpr,  # A_K (= A_V) holds each slot's pool-slot lists (``a_slot_lists``)
    FUSED_MERGE: tl.constexpr,
    SAVE_LOGITS: tl.constexpr,
    BALANCE: tl.constexpr,
    F16_DOTS: tl.constexpr,  # an fp8 cache: the dots in fp16 (see FP8_F16_DOTS)
    V_ASM: tl.constexpr,  # with F16_DOTS, compiled: the values widened by _widen_v's PTX
    SPLIT_MAJOR: tl.constexpr,  # grid (splits, Hkv, bs): see BALANCE_SPLIT_MAJOR
    RECORD: tl.constexpr,  # a probe's record of where and when each program ran (``record``)
    GATE_RUN: tl.constexpr,  # 0: always; 1: only if GATE != 0; 2: only if GATE == 0; 3: both (``gate``)
):
    # A gated launch whose turn it is not this step: nothing read or written (its twin
    # does the side effects too, and records the step if asked).
    if GATE_RUN == 1:
        if tl.load(GATE) == 0:
            return
    if GATE_RUN == 2:
        if tl.load(GATE) != 0:
            return
    # Launch order: program_id(0) fastest. Only a probe asks (RECORD), compiled GPUs only.
    rec = REC + (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1)
                                                          * tl.program_id(2))).to(tl.int64) * 3
    if RECORD:
        tl.store(rec, smid().to(tl.int64))
        tl.store(rec + 1, globaltimer())
    if SPLIT_MAJOR:
        split = tl.program_id(0)
        num_splits = tl.num_programs(0)
        cur_b = tl.program_id(2)
    else:
        cur_b = tl.program_id(0)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
    cur_kvh = tl.program_id(1)
    if GATE_RUN == 3:
        # One grid, both partitions (request-major): splits [0, PLAIN_SPLITS) are the
        # plain launch's, first in launch order so that they are dealt to the SMs as
        # its grid is; the rest the balanced launch's. The flag picks one; the other's
        # programs return here, as a closed twin's would, without a launch of their own.
        balanced_now = tl.load(GATE) != 0
        split = tl.where(balanced_now, split - PLAIN_SPLITS, split)
        num_splits = tl.where(balanced_now, num_splits - PLAIN_SPLITS, PLAIN_SPLITS)
        if (split < 0) | (split >= num_splits):
            return
    row_mode = 1
    if HAS_ROW_MASK:
        # Rows another kernel serves (e.g. `full` rows through FlashInfer) are
        # left untouched: the grid stays fixed for CUDA graphs, the work does not.
        row_mode = tl.load(ROW_MASK + cur_b)
        if row_mode == 0:
            return
    splits_here = num_splits
    if BALANCE:
        # This request's splits of the grid's (balanced_splits, once per step).
        splits_here = tl.minimum(tl.maximum(tl.load(ROW_SPLITS + cur_b), 1), num_splits)
        if GATE_RUN == 3:
            splits_here = tl.where(balanced_now, splits_here, num_splits)
        if FUSED_MERGE:
            if split >= splits_here:  # never split 0: the side effects below are its
                return

    # ---- Per-request lengths (read on device: no host sync, graph-safe). ----
    # Clamp defensively so a bad descriptor can never read out of bounds.
    a_len = tl.load(A_LEN + cur_b * stride_alen_b + cur_kvh)
    pos_cap = A_POS_CAP
    if HAS_A_ROW:
        # A row whose list lives elsewhere (a store's row, written by another
        # stream's selection) reads its length and positions there: no per-layer
        # copy into this step's a_pos / a_len.
        a_row = tl.load(A_ROW + cur_b).to(tl.int64)
        a_alt = a_row >= 0
        a_row = tl.maximum(a_row, 0)
        a_len = tl.where(a_alt, tl.load(A_LEN2 + a_row * stride_al2b + cur_kvh), a_len)
        pos_cap = tl.where(a_alt, A_POS2_CAP, A_POS_CAP)
    b_start = tl.load(B_START + cur_b)
    b_end = tl.load(B_END + cur_b)
    # a_slot < 0: segment A is read in place from the pool and must end before
    # segment B starts: positions [0, a_len) (sink tokens of window policies),
    # or, for a_slot == -2 with HAS_A_POS, the listed positions
    # a_pos[b, h, :a_len] (page/token selections). Distinct positions below
    # b_start number at most b_start, so both clamp a_len to b_start.
    slot = tl.load(A_SLOT + cur_b).to(tl.int64)
    a_in_pool = slot < 0
    a_lim = tl.where(a_in_pool, b_start, A_CAP)
    if HAS_A_POS:
        a_indexed = slot == -2
        a_lim = tl.where(a_indexed, tl.minimum(b_start, pos_cap), a_lim)
    a_len = tl.minimum(tl.maximum(a_len, 0), a_lim)
    b_len = tl.maximum(b_end - b_start, 0)
    kv_len = a_len + b_len  # combined key index space: [0, a_len) is A, rest is B

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q_heads = cur_kvh * GROUP + offs_h  # the G query heads sharing this KV head

    # Padding rows (offs_h >= GROUP) load zeros: their scores are 0, finite,
    # and they are never stored.
    q = tl.load(
        Q + cur_b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    req_row = tl.load(REQ_POOL_IDX + cur_b).to(tl.int64)

    # ---- Side effects for SFI, once per (request, KV head): the norm of the key
    # written this step (position b_end - 1) and, on a slow step, the query. ----
    if split == 0:
        if STORE_KNORM:
            if b_end > 0:
                tok_last = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + b_end - 1).to(tl.int64)
                k_last = tl.load(K_POOL + tok_last * stride_kt + cur_kvh * stride_kh + offs_d,
                                 mask=mask_d, other=0.0).to(tl.float32)
                tl.store(KNORM + tok_last * stride_kn + cur_kvh, tl.sqrt(tl.sum(k_last * k_last, 0)) * k_scale)
        if SAVE_Q:
            q_slot = tl.load(Q_SAVE_SLOT + cur_b).to(tl.int64)
            if q_slot >= 0:
                tl.store(Q_SAVE + q_slot * stride_qss + q_heads[:, None] * stride_qsh + offs_d[None, :],
                         q.to(Q_SAVE.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        if QUEST_BOUNDS:
            # Quest: fold this step's key into its page's bounds, exactly as
            # quest_pages.quest_bounds_decode does, without its launch. The page
            # is in the recent window, which this layer's page scores (computed
            # before this kernel) leave out.
            qb_slot = tl.load(QB_SLOT + cur_b).to(tl.int64)
            pos_last = b_end - 1
            if (qb_slot >= 0) & (pos_last >= 0) & (pos_last // QB_PAGE < QB_MAX_PAGES):
                tok_q = tl.load(REQ_TO_TOKEN + req_row * stride_r2t + pos_last).to(tl.int64)
                k_new = tl.load(K_POOL + tok_q * stride_kt + cur_kvh * stride_kh + offs_d,
                                mask=mask_d, other=0.0).to(tl.float32)
                qb_off = (qb_slot * stride_qbs + cur_kvh * stride_qbh
                          + (pos_last // QB_PAGE).to(tl.int64) * stride_qbp + offs_d)
                keep = (pos_last % QB_PAGE) != 0  # a page's first position starts it afresh
                old_min = tl.load(QB_MIN + qb_off, mask=mask_d & keep, other=float("inf")).to(tl.float32)
                old_max = tl.load(QB_MAX + qb_off, mask=mask_d & keep, other=float("-inf")).to(tl.float32)
                tl.store(QB_MIN + qb_off, tl.minimum(old_min, k_new).to(QB_MIN.dtype.element_ty), mask=mask_d)
                tl.store(QB_MAX + qb_off, tl.maximum(old_max, k_new).to(QB_MAX.dtype.element_ty), mask=mask_d)
    if row_mode != 1:
        return

    # The dots' query (qd) and their scores' factor. Over an fp8 cache the keys
    # and values widen to fp16 in one conversion per pair (to bf16 it takes
    # two more), so the query joins them in fp16, scaled first by sm_scale *
    # log2(e) in fp32 (far from fp16's 65504; k_scale stays outside, a small
    # one would push the query into fp16's subnormals). P then rounds to fp16
    # too: 3 more bits than bf16.
    if F16_DOTS:
        qd = (q.to(tl.float32) * q_mul).to(tl.float16)
        s_scale = k_scale
    else:
        qd = q
        s_scale = qk_scale

    # ---- This program's chunk of the combined range. ----
    # Chunks are a whole number of BLOCK_N blocks so segment-A loads stay
    # aligned; every request is spread over all its splits (down to a minimum
    # chunk size), independent of the static max_kv_len used to size the grid.
    # BALANCE: a request's splits are its share of the launch's programs by its
    # keys against the batch's (ROW_SPLITS), up to the grid's.
    n_blocks = tl.cdiv(kv_len, BLOCK_N)
    blocks_per_split = tl.maximum(tl.cdiv(n_blocks, splits_here), MIN_SPLIT_BLOCKS)
    chunk_start = split * blocks_per_split * BLOCK_N
    chunk_end = tl.minimum(chunk_start + blocks_per_split * BLOCK_N, kv_len)
    if FUSED_MERGE:
        # Only the splits whose chunk holds keys take part (see the epilogue):
        # a graph sized for 128K serving a 4K request runs its empty splits as
        # no-ops instead of writing partials that would be merged as zeros.
        n_active = tl.maximum(tl.cdiv(n_blocks, blocks_per_split), 1)
        if split >= n_active:
            return

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # ---- Segment A: contiguous rows of the compact buffer, or in place. ----
    # a_slot is only dereferenced inside the loop, so it may hold garbage for
    # requests whose a_len is 0. 64-bit offsets: a large compact buffer easily
    # exceeds 2^31 elements.
    a_hi = tl.minimum(chunk_end, a_len)
    if a_in_pool:
        r2t_a = REQ_TO_TOKEN + req_row * stride_r2t
        apos_base = A_POS + cur_b * stride_apb + cur_kvh * stride_aph
        if HAS_A_ROW:
            if a_alt:
                apos_base = A_POS2 + a_row * stride_ap2b + cur_kvh * stride_ap2h
        for n0 in range(chunk_start, a_hi, BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < a_hi
            kv_mask = mask_n[:, None] & mask_d[None, :]
            if HAS_A_POS and A_POS_SLOTS:
                # The lists hold pool slots: no load's address waits on another
                # load but the K/V tiles', as in segment B (prefix rows map offs
                # through req_to_token, indexed rows skip that load).
                listed = tl.load(apos_base + offs, mask=mask_n & a_indexed, other=0)
                t_pre = tl.load(r2t_a + offs, mask=mask_n & (slot != -2), other=0)
                tok = tl.where(a_indexed, tl.minimum(tl.maximum(listed, 0), POOL_ROWS - 1), t_pre).to(tl.int64)
            else:
                pos = offs
                if HAS_A_POS:
                    # Indexed rows read their position list; prefix rows skip the
                    # load (masked off) and keep pos = offs. The clamp only guards
                    # memory against a bad list: a valid one is already in range.
                    listed = tl.load(apos_base + offs, mask=mask_n & a_indexed, other=0)
                    pos = tl.where(a_indexed, tl.minimum(tl.maximum(listed, 0), b_start - 1), offs)
                tok = tl.load(r2t_a + pos, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V_POOL + tok[:, None] * stride_vt + cur_kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = _online_softmax_step(qd, k, v, mask_n, m_i, l_i, acc, s_scale, FP32_DOT, V_ASM)
    else:
        ak_base = A_K + slot * stride_aks + cur_kvh * stride_akh
        av_base = A_V + slot * stride_avs + cur_kvh * stride_avh
        for n0 in range(chunk_start, a_hi, BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < a_hi
            kv_mask = mask_n[:, None] & mask_d[None, :]
            if A_SLOT_LISTS:
                # The slot's rows are pool slots (A_K is the lists): gathered from
                # the pool like an indexed row, one load ahead of the K/V tiles.
                # The clamp only guards memory against a bad list.
                listed = tl.load(ak_base + offs * stride_akn, mask=mask_n, other=0)
                tok = tl.minimum(tl.maximum(listed, 0), POOL_ROWS - 1).to(tl.int64)
                k = tl.load(K_POOL + tok[:, None] * stride_kt + cur_kvh * stride_kh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                v = tl.load(V_POOL + tok[:, None] * stride_vt + cur_kvh * stride_vh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
            else:
                k = tl.load(ak_base + offs[:, None] * stride_akn + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(av_base + offs[:, None] * stride_avn + offs_d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = _online_softmax_step(qd, k, v, mask_n, m_i, l_i, acc, s_scale, FP32_DOT, V_ASM)

    # ---- Segment B: position range gathered from the paged pool. ----
    # Combined index i >= a_len maps to position b_start + (i - a_len), whose
    # pool slot comes from the req_to_token row of this request.
    b_lo = tl.maximum(chunk_start, a_len)
    r2t_base = REQ_TO_TOKEN + req_row * stride_r2t + (b_start - a_len)
    if SAVE_LOGITS:
        # SFI's slow step: a dense row (B = [0, n)) with a compact slot keeps its
        # scores by position, so the Selector's evidence needs no second read of
        # the keys (window_evidence.stored_evidence). Only the G real query heads.
        lg_slot = tl.load(Q_SAVE_SLOT + cur_b)
        lg_on = (lg_slot >= 0) & (lg_slot < LG_SLOTS) & (b_start == 0)
        lg_base = (LOGITS + tl.maximum(lg_slot, 0).to(tl.int64) * stride_lgs + cur_kvh * stride_lgh
                   + offs_h[:, None] * stride_lgg - a_len)
    for n0 in range(b_lo, chunk_end, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < chunk_end
        kv_mask = mask_n[:, None] & mask_d[None, :]
        tok = tl.load(r2t_base + offs, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_POOL + tok[:, None] * stride_kt + cur_kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V_POOL + tok[:, None] * stride_vt + cur_kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        qk = _scores(qd, k, mask_n, s_scale, FP32_DOT)
        if SAVE_LOGITS:
            lg_ok = mask_h[:, None] & (mask_n & (offs < LG_LEN + a_len) & lg_on)[None, :]
            tl.store(lg_base + offs[None, :], qk, mask=lg_ok)
        m_i, l_i, acc = _softmax_update(qk, _widen_v(v, qd.dtype, V_ASM), m_i, l_i, acc, FP32_DOT)

    # ---- Epilogue. Empty chunk (l_i == 0): output 0 and LSE -inf, no NaN. ----
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    # Partials scaled alike merge to the scaled whole, so this covers every path.
    out = acc * (v_scale / l_safe)[:, None]
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # base-2 LSE

    store_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT:
        # Single split: this is already the final answer.
        tl.store(
            OUT + cur_b * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=store_mask,
        )
        if STORE_LSE:
            tl.store(LSE + cur_b * stride_lb + q_heads * stride_lh, lse2 * 0.6931471805599453, mask=mask_h)
    elif FUSED_MERGE:
        if n_active == 1:
            # The whole range fits one chunk (short contexts): final answer now,
            # no partial, no counter.
            tl.store(
                FOUT + cur_b * stride_fob + q_heads[:, None] * stride_foh + offs_d[None, :],
                out.to(FOUT.dtype.element_ty),
                mask=store_mask,
            )
            if STORE_LSE:
                tl.store(FLSE + cur_b * stride_flb + q_heads * stride_flh, lse2 * 0.6931471805599453, mask=mask_h)
        else:
            # Last-arriver merge ("serial split-K" / threadFenceReduction
            # pattern), replacing the second launch. Memory ordering on sm_70+
            # (PTX memory model), step by step:
            # 1. every thread stores its part of this split's partial (weak st.global);
            # 2. tl.debug_barrier() = bar.sync: those stores happen-before what
            #    any thread of the CTA does next (CTA-scope synchronization);
            # 3. one thread performs atom.add.acq_rel.gpu on the (row, KV head)
            #    counter. The release half is cumulative, so it publishes all
            #    of the CTA's stores ordered before it by step 2; RMWs on one
            #    location form a release sequence, so whichever program later
            #    reads the count n_active - 1 with its acquire half
            #    synchronizes-with *every* earlier arrival's release;
            # 4. that program (the last to arrive) broadcasts the old value to
            #    its threads through shared memory behind another barrier
            #    (Triton's scalar-atomic lowering; the explicit debug_barrier
            #    below makes it independent of that), so its loads of the
            #    partials are ordered after the acquire and see every split's
            #    stores. They are .cg loads (L2, not the SM's L1) as well.
            # Exactly one program reads n_active - 1 (the RMWs are totally
            # ordered), so exactly one merges; nobody waits for anybody, so no
            # deadlock whatever the scheduling. It then stores 0: no other
            # program of this launch touches the counter after the last
            # arrival, and the next launch on the stream (the next layer, the
            # next graph replay) is ordered after this kernel's completion, so
            # it finds every counter at 0 again. Rows skipped by row_mask and
            # splits past n_active never touch the counter.
            tl.store(
                OUT + cur_b * stride_ob + q_heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
                out,
                mask=store_mask,
            )
            tl.store(LSE + cur_b * stride_lb + q_heads * stride_lh + split, lse2, mask=mask_h)
            tl.debug_barrier()
            cnt = COUNTER + cur_b * tl.num_programs(1) + cur_kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == n_active - 1:
                tl.debug_barrier()
                m_f = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                l_f = tl.zeros([BLOCK_H], dtype=tl.float32)
                acc_f = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
                # Every active split holds >= 1 key, so its LSE is finite and
                # the first step's alpha = exp2(-inf - finite) = 0, never NaN.
                for s in range(0, n_active):
                    lse_s = tl.load(LSE + cur_b * stride_lb + q_heads * stride_lh + s, mask=mask_h, other=0.0,
                                    cache_modifier=".cg")
                    o_s = tl.load(OUT + cur_b * stride_ob + q_heads[:, None] * stride_oh + s * stride_os + offs_d[None, :],
                                  mask=store_mask, other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m_f, lse_s)
                    alpha = tl.exp2(m_f - m_new)
                    w = tl.exp2(lse_s - m_new)
                    l_f = l_f * alpha + w
                    acc_f = acc_f * alpha[:, None] + o_s * w[:, None]
                    m_f = m_new
                tl.store(
                    FOUT + cur_b * stride_fob + q_heads[:, None] * stride_foh + offs_d[None, :],
                    (acc_f / l_f[:, None]).to(FOUT.dtype.element_ty),
                    mask=store_mask,
                )
                if STORE_LSE:
                    tl.store(FLSE + cur_b * stride_flb + q_heads * stride_flh,
                             (m_f + tl.log2(l_f)) * 0.6931471805599453, mask=mask_h)
                tl.store(cnt, 0)
    else:
        tl.store(
            OUT + cur_b * stride_ob + q_heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
            out,
            mask=store_mask,
        )
        tl.store(LSE + cur_b * stride_lb + q_heads * stride_lh + split, lse2, mask=mask_h)
    if RECORD:
        tl.store(rec + 2, globaltimer())


# -----------------------------------------------------------------------------
# Stage 2: merge split partials by log-sum-exp, one program per (request, head)
# -----------------------------------------------------------------------------


@triton.jit
def _merge_splits_kernel(
    ROW_MASK,
    MID_O,  # [bs, Hq, S, D] fp32
    MID_LSE,  # [bs, Hq, S] fp32, base 2
    O,  # [bs, Hq, D]
    LSE,  # [bs, Hq] fp32 natural log (only if STORE_LSE)
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr,
):
    cur_b = tl.program_id(0)
    cur_h = tl.program_id(1)
    if HAS_ROW_MASK:
        if tl.load(ROW_MASK + cur_b) != 1:
            return

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(MID_LSE + cur_b * stride_mlb + cur_h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty -> m == -inf; use 0 as the reference so that
    # exp2(-inf - 0) == 0 rather than exp2(-inf - -inf) == NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits get weight exactly 0
    denom = tl.sum(w, 0)

    part = tl.load(
        MID_O + cur_b * stride_mob + cur_h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    acc = tl.sum(part * w[:, None], 0)
    has_keys = denom > 0.0
    out = acc / tl.where(has_keys, denom, 1.0)
    tl.store(O + cur_b * stride_ob + cur_h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)
    if STORE_LSE:
        lse_out = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, denom, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + cur_b * stride_lb + cur_h * stride_lh, lse_out)


# -----------------------------------------------------------------------------
# Host side
# -----------------------------------------------------------------------------


def choose_num_splits(
    batch_size: int,
    num_kv_heads: int,
    max_kv_len: int,
    num_sms: int,
    *,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    max_splits: int = MAX_SPLITS,
    kv_fp8: bool = False,
) -> int:
    """Number of KV splits (grid dim 2) from *static* quantities only.

    Aim for about CTAS_PER_SM_TARGET programs per SM in total (rounding
    *down*): with BLOCK_N = 128 a program keeps 2 x 32 KiB of K/V in flight
    per pipeline stage, so one or two resident programs per SM already
    saturate HBM, while every extra split costs a partial-output write, a
    longer merge and, past one full wave, a tail. On an H100 this measured
    best: e.g. batch 32 x 8 KV heads -> 1 split (no merge launch), batch 8 ->
    4, batch 1 -> 33. Never create more splits than ``max_kv_len /
    min_split_len`` and cap at ``max_splits`` (bounds the fp32 workspace and
    the merge's BLOCK_S). ``kv_fp8``: programs_per_sm's programs (at factor 2: twice), up to
    FP8_MAX_SPLITS, and within the fused merge's range where the bf16 choice is in
    it: a launch that balanced its splits over bf16 still does (``balances``).
    """
    programs = max(1, batch_size * num_kv_heads)
    want = (num_sms * programs_per_sm(kv_fp8)) // programs
    if kv_fp8 and FP8_SPLIT_FACTOR > 1:
        if (num_sms * programs_per_sm(False)) // programs <= FUSED_MERGE_MAX_SPLITS:
            want = min(want, FUSED_MERGE_MAX_SPLITS)
        want = min(want, FP8_MAX_SPLITS)
    by_len = _splits_by_len(max_kv_len, min_split_len)
    return int(max(1, min(want, by_len, max_splits)))


def _splits_by_len(max_kv_len: int, min_split_len: int) -> int:
    """The most splits ``max_kv_len`` keys allow at ``min_split_len`` keys a split (>= 1)."""
    return max(1, cdiv(max(int(max_kv_len), 1), max(int(min_split_len), 1)))


def plain_fp8_splits(base: int, batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                     min_split_len: int = DEFAULT_MIN_SPLIT_LEN) -> int:
    """The splits of a plain (unbalanced) launch over fp8 whose heuristic splits are
    ``base``: two where ``base`` is one and twice the programs, at FP8_NUM_WARPS warps
    each, stay within FP8_PLAIN_WARPS_PER_SM warps an SM (the note there), else ``base``.
    Static, like the heuristic: a captured graph keeps its grid."""
    if base != 1 or FP8_PLAIN_WARPS_PER_SM <= 0:
        return base
    programs = 2 * max(1, batch_size * num_kv_heads)
    by_len = _splits_by_len(max_kv_len, min_split_len)
    fits = programs * FP8_NUM_WARPS <= num_sms * FP8_PLAIN_WARPS_PER_SM
    return 2 if fits and by_len >= 2 else 1


def plain_partition_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                           min_split_len: int = DEFAULT_MIN_SPLIT_LEN, kv_fp8: bool = False) -> int:
    """The splits a row of a gated launch's plain partition runs, which the gate
    compares the balanced shares with (same work where they are equal): the
    heuristic's in the one grid; in the pair of launches the plain twin is an
    unbalanced launch, which over fp8 takes ``plain_fp8_splits`` of them."""
    base = choose_num_splits(batch_size, num_kv_heads, max_kv_len, num_sms, min_split_len=min_split_len,
                             kv_fp8=kv_fp8)
    if not kv_fp8 or one_grid(batch_size, num_kv_heads, max_kv_len, num_sms, min_split_len, kv_fp8=True):
        return base
    return plain_fp8_splits(base, batch_size, num_kv_heads, max_kv_len, num_sms, min_split_len)


def programs_per_sm(kv_fp8: bool = False) -> int:
    """The split heuristic's target of programs per SM: CTAS_PER_SM_TARGET, times
    FP8_SPLIT_FACTOR over an fp8 cache (1 by default: session 32's end-to-end rows).
    At 2: fp8 tiles take half the shared memory (so twice the programs are
    resident) and their programs read half the bytes;
    H200, Qwen3-1.7B shape, e4m3 (fp16 dots, values widened by _widen_v), CUDA
    graphs (bench/results/decode_splits_fp8_h200_s31.log): twice the bf16
    heuristic's splits was the best or within 5% of it at 32768 and 131072 x
    batch 4 / 8 / 16 / 32, dense and sparse, e.g. dense 32768 x 8 268.8 -> 192.8 us,
    32768 x 32 985.8 -> 735.0 us, 131072 x 4 524.8 -> 375.8 us (batch 4 keeps 8:
    16 would lose the balanced launch, choose_num_splits); rows of 512 keys +0.8
    to +1.6 us. Over bf16 the H100's target held on the H200 (within 1% on sparse
    rows, 2-7% on dense ones: decode_splits_h200_s31.log)."""
    return CTAS_PER_SM_TARGET * (FP8_SPLIT_FACTOR if kv_fp8 else 1)


def balances(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
             min_split_len: int = DEFAULT_MIN_SPLIT_LEN, kv_fp8: bool = False) -> bool:
    """Whether a launch whose splits the heuristic picks can balance them
    (``balance=True``, given split counters, i.e. a fused merge): several requests,
    the heuristic's splits within the fused merge's range, at most
    BALANCE_MAX_WAVES waves, and SGLANG_SPARSE_BALANCE_SPLITS not 0."""
    splits = choose_num_splits(batch_size, num_kv_heads, max_kv_len, num_sms, min_split_len=min_split_len,
                               kv_fp8=kv_fp8)
    return _balance_fits(batch_size, num_kv_heads, splits, num_sms, kv_fp8)


def _balance_fits(batch_size: int, num_kv_heads: int, splits: int, num_sms: int, kv_fp8: bool = False) -> bool:
    """`balances` for the heuristic's `splits`, already chosen."""
    return (BALANCE_ENABLED and batch_size > 1 and splits <= FUSED_MERGE_MAX_SPLITS
            and batch_size * num_kv_heads * splits <= BALANCE_MAX_WAVES * num_sms * programs_per_sm(kv_fp8))


def balanced_splits(a_len: torch.Tensor, b_start: torch.Tensor, b_end: torch.Tensor,
                    row_mask: Optional[torch.Tensor], programs_per_head: int, max_splits: int,
                    kv_fp8: bool = False) -> torch.Tensor:
    """Splits per request for ``balance``: floor(keys x P / batch keys), clamped to
    ``[1, max_splits]``, with P = ``programs_per_head`` (the balanced program target
    over the KV heads, :func:`balance_programs_per_sm` an SM) and the keys those of KV
    head 0 (segment A's count and segment B's range, as the descriptors give them: an
    estimate for balance, never for what is read), over the rows the launch serves
    (``row_mask`` 1).
    ``kv_fp8``: P doubles where the batch holds at least ``FP8_DENSE_SPLIT_KEYS`` keys
    per program of P (dense fp8 rows: see that constant).

    A uniform batch gets P / bs a request (the heuristic's split count over bf16, twice
    it over fp8 by default); a request with many more keys than the others -- a dense
    row (an SFI slow step, a policy attending everything) among ~2K-key sparse rows -- gets
    proportionally more programs, instead of one program per KV head doing its
    whole range while the step waits for it. Device ops only, no host sync: CUDA
    graph capturable. Returns ``[bs]`` int32.
    """
    keys = _row_keys(a_len, b_start, b_end, row_mask)
    total = keys.sum().clamp(min=1)
    programs = programs_per_head
    if kv_fp8 and FP8_DENSE_SPLIT_KEYS > 0:
        programs = torch.where(total >= _dense_double_keys(programs_per_head), 2 * programs_per_head,
                               programs_per_head)
    # Floored, so the shares sum to at most P (but for the one program every row gets):
    # rounded, four dense rows of a slow step at 131072 x 4 over fp8 took 17 each of
    # P = 66, 68 programs a KV head where 66 fill one wave at 4 resident an SM, and
    # the launch ran 548 us against 378 at 16 each (H200, session 38's
    # bench_decode.py --slow-step, without the slow step's side effects).
    # The floor leaves programs unused where shares are small (at 8192 x 32 over e4m3
    # one slow row among 31 sparse ones: 6 programs and 1 each, 37 of P 66 a KV head).
    # Shares making the longest program shortest within P (ceil(keys / L), least L:
    # 4 and 2, all 66) ran slower (H200, 28 layers: 3.02 against 1.95 ms in the one
    # grid, 2.50 against 2.20 with 4 dense rows; bench/README "Session 50"): removed.
    share = (keys * programs // total).clamp(1, max_splits)
    return share.int()


def _served_rows(per_row: torch.Tensor, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Which of ``per_row``'s requests the launch serves (``row_mask`` 1; all where None):
    bool ``[bs]``."""
    if row_mask is None:
        return torch.ones_like(per_row, dtype=torch.bool)
    return row_mask[:per_row.shape[0]] == 1


def _row_keys(a_len: torch.Tensor, b_start: torch.Tensor, b_end: torch.Tensor,
              row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Each request's keys of KV head 0 as the descriptors give them (0 where
    ``row_mask`` is not 1), int64 ``[bs]``."""
    keys = (a_len[:, 0].clamp(min=0) + (b_end - b_start).clamp(min=0)).long()
    if row_mask is not None:
        keys = torch.where(_served_rows(keys, row_mask), keys, 0)
    return keys


def _programs_per_head(num_sms: int, num_kv_heads: int, kv_fp8: bool) -> int:
    """The P that balanced launches share out among the requests a KV head: the split
    programs an SM of :func:`balance_programs_per_sm` over the KV heads."""
    return num_sms * balance_programs_per_sm(kv_fp8) // num_kv_heads


def balance_factor(kv_fp8: bool = False) -> int:
    """A balanced launch's grid over the heuristic's splits: BALANCE_FACTOR where set,
    else 16 over fp8 and 4 over bf16 (the note at BALANCE_FACTOR)."""
    return BALANCE_FACTOR or (16 if kv_fp8 else 4)


def balance_programs_per_sm(kv_fp8: bool = False) -> int:
    """The programs an SM that balanced shares divide: BALANCE_PROGRAMS_PER_SM where
    set, else 4 over fp8 (an fp8 tile's resident programs) and the heuristic's over bf16."""
    return BALANCE_PROGRAMS_PER_SM or (4 if kv_fp8 else programs_per_sm(False))


def _dense_double_keys(programs_per_head: int) -> int:
    """A step's keys (KV head 0, served rows) from which balanced_splits doubles its
    programs over fp8 (FP8_DENSE_SPLIT_KEYS a program)."""
    return programs_per_head * FP8_DENSE_SPLIT_KEYS


def dense_step_balances(batch_size: int, step_keys: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                        kv_fp8: bool) -> bool:
    """Host side: whether a step whose kernel rows are all dense (every request an SFI
    slow step), ``step_keys`` keys in all, is faster balanced than plain. All rows alike,
    balance changes nothing but the program count: over fp8 it balances where a
    request's share (balanced_splits' P over the batch) passes the heuristic's splits
    and each program still reads BALANCE_MIN_PROGRAM_KEYS keys. H200, e4m3, 28 layers
    all dense (bench_mixed_rows.py): at P 2 an SM (session 38) 131072 x 4 14.64 ->
    10.31 ms (P doubled past FP8_DENSE_SPLIT_KEYS), 32768 x 8 7.50 -> 8.30 and 8192 x 32
    7.04 -> 8.31 (the shares were the heuristic's, in a larger grid); at P 4 an SM
    (session 41) 32768 x 8 7.58 -> 5.34 and 8192 x 32 7.05 -> 5.28 (twice the
    heuristic's splits), 131072 x 4 14.60 -> 10.40; over bf16 slower (15.49 -> 16.95 at
    131072 x 4)."""
    if not (kv_fp8 and balances(batch_size, num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8)):
        return False
    programs = _programs_per_head(num_sms, num_kv_heads, kv_fp8)
    if FP8_DENSE_SPLIT_KEYS > 0 and step_keys >= _dense_double_keys(programs):
        programs *= 2  # as balanced_splits does on the device
    base = choose_num_splits(batch_size, num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8)
    return programs // batch_size > base and step_keys >= programs * BALANCE_MIN_PROGRAM_KEYS


def balance_gate(row_splits: torch.Tensor, row_mask: Optional[torch.Tensor], num_kv_heads: int, max_kv_len: int,
                 num_sms: int, kv_fp8: bool = False,
                 segments: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """The step's gate between a balanced launch and its plain twin (BALANCE_GATE; None
    when off): ``[1]`` int32, 1 where a served request's (``row_mask`` 1) share differs
    from the plain partition's splits (``plain_partition_splits``; else both launches
    are the same work) and, given the
    step's ``segments`` (``a_len, b_start, b_end``), the shares are unequal (a long row
    among short ones) or the balanced programs each read at least
    BALANCE_MIN_PROGRAM_KEYS keys. Rows alike at P 4 an SM (fp8) take twice the
    heuristic's splits, which pays only on long rows: 28 layers over e4m3, sparse rows
    alike, 8192 x 32 (~1.1K keys a balanced program) 1.677 ms plain, 1.656 balanced;
    32768 x 8 (~290) 0.539 plain, 0.711 balanced, 0.678 with the gate closed
    (bench/README "Session 41"). Device ops, once a step."""
    if not BALANCE_GATE:
        return None
    base = plain_partition_splits(row_splits.shape[0], num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8)
    served = _served_rows(row_splits, row_mask)
    gate = ((row_splits != base) & served).any()
    if segments is not None:
        shares = row_splits.long()
        unequal = (torch.where(served, shares, 0).amax() != torch.where(served, shares, 1 << 30).amin())
        programs = torch.where(served, shares, 0).sum()
        long_rows = _row_keys(*segments, row_mask).sum() >= programs * BALANCE_MIN_PROGRAM_KEYS
        gate = gate & (unequal | long_rows)
    return gate.to(torch.int32).reshape(1)


def balance_maxnreg(num_warps: int) -> Optional[int]:
    """A balanced launch's register cap a thread over fp8 at ``num_warps`` warps a
    program: BALANCE_MAX_REGISTERS's registers a program of 4 warps, None (Triton's
    choice) where that is more than a thread can hold or the knob is 0."""
    if BALANCE_MAX_REGISTERS <= 0:
        return None
    cap = BALANCE_MAX_REGISTERS * 4 // max(1, int(num_warps))
    return cap if cap <= 255 else None


def one_grid(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
             min_split_len: int = DEFAULT_MIN_SPLIT_LEN, kv_fp8: bool = False) -> bool:
    """Whether a gated pair of launches runs as one grid (``gate=(flag, None)``):
    BALANCE_ONE_GRID where set, else over fp8 where the heuristic splits a row once
    (the shape it was faster at served; see BALANCE_ONE_GRID)."""
    if BALANCE_ONE_GRID is not None:
        return BALANCE_ONE_GRID
    return kv_fp8 and choose_num_splits(batch_size, num_kv_heads, max_kv_len, num_sms,
                                        min_split_len=min_split_len, kv_fp8=True) == 1


def balanced_grid_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                         min_split_len: int = DEFAULT_MIN_SPLIT_LEN, kv_fp8: bool = False) -> Tuple[int, int]:
    """(the heuristic's splits, the balanced grid's splits) of a launch whose splits
    the heuristic picks: the grid allows balance_factor() x the heuristic's, bounded by
    MAX_SPLITS and by the keys (one split per ``min_split_len``)."""
    base = choose_num_splits(batch_size, num_kv_heads, max_kv_len, num_sms, min_split_len=min_split_len,
                             kv_fp8=kv_fp8)
    by_len = _splits_by_len(max_kv_len, min_split_len)
    return base, min(MAX_SPLITS, by_len, base * balance_factor(kv_fp8))


def step_row_splits(a_len: torch.Tensor, b_start: torch.Tensor, b_end: torch.Tensor,
                    row_mask: Optional[torch.Tensor], num_kv_heads: int, max_kv_len: int, num_sms: int,
                    kv_fp8: bool = False) -> Optional[torch.Tensor]:
    """A step's splits per request for every layer's balanced launch (computed once a
    step and passed as ``row_splits``), or None where the batch's shape does not
    balance (:func:`balances`). The shares are of the heuristic's program target
    over the KV heads, bounded by the grid inside the kernel."""
    if not balances(b_end.shape[0], num_kv_heads, max_kv_len, num_sms, kv_fp8=kv_fp8):
        return None
    return balanced_splits(a_len, b_start, b_end, row_mask, _programs_per_head(num_sms, num_kv_heads, kv_fp8),
                           MAX_SPLITS, kv_fp8=kv_fp8)


def make_split_counters(max_batch_size: int, num_kv_heads: int, device) -> torch.Tensor:
    """Zeroed arrival counters for ``two_segment_decode(..., fused_merge=True)``.

    Allocate once (outside CUDA-graph capture) for the largest batch and pass
    the same tensor to every call on the stream: each launch returns every
    counter to zero.
    """
    return torch.zeros(max(1, max_batch_size * num_kv_heads), dtype=torch.int32, device=device)


def _default_block_n(head_dim: int) -> int:
    # 64 keys x 128 dims x 2 B = 16 KiB per K (and V) tile, three stages in flight
    # (num_stages=3). H100 sweep of block_n x warps x stages x splits (session 12,
    # bench/results/decode_sweep_h100_s12_*): (64, 4 warps, 3 stages) at the
    # heuristic's splits was the best or within 10% of it at 32768 x 8 and 131072 x 4,
    # dense and sparse, against (128, 4, 2): dense 402.8 -> 376.7 us and 795.5 -> 743.6
    # us (FlashInfer 367.7 / 716.4), ~2K selected keys 37.6 -> 29.4 us and 20.1 -> 14.2
    # us. Larger heads halve it to stay within shared memory.
    return 64 if head_dim <= 128 else 32


def two_segment_decode(
    q: torch.Tensor,
    a_k: torch.Tensor,
    a_v: torch.Tensor,
    a_slot: torch.Tensor,
    a_len: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    b_start: torch.Tensor,
    b_end: torch.Tensor,
    sm_scale: float,
    *,
    max_kv_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    num_sms: Optional[int] = None,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    row_mask: Optional[torch.Tensor] = None,
    key_norms: Optional[torch.Tensor] = None,
    q_save: Optional[torch.Tensor] = None,
    q_save_slot: Optional[torch.Tensor] = None,
    a_pos: Optional[torch.Tensor] = None,
    a_pos_slots: bool = False,
    a_lists: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    a_slot_lists: Optional[torch.Tensor] = None,
    fused_merge: Optional[bool] = None,
    split_counters: Optional[torch.Tensor] = None,
    balance: bool = False,
    row_splits: Optional[torch.Tensor] = None,
    record: Optional[torch.Tensor] = None,
    gate: Optional[Tuple[torch.Tensor, bool]] = None,
    quest_bounds: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    logits_out: Optional[torch.Tensor] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: int = 3,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Sparse decode attention over segment A (compact) + segment B (paged range).

    Args:
        q: ``[bs, Hq, D]`` bf16/fp16, ``Hq = G * Hkv``.
        a_k, a_v: ``[num_slots, Hkv, cap, D]`` compact buffers (the pool's dtype).
        a_slot: ``[bs]`` int32 slot of each request (ignored where a_len == 0);
            ``-1``: segment A is positions ``[0, a_len)`` read in place from the
            pool through ``req_to_token`` (sink tokens), clamped to ``b_start``;
            ``-2`` (only with ``a_pos``): segment A is the positions
            ``a_pos[b, h, :a_len[b, h]]`` read in place (see ``a_pos``). Without
            ``a_pos`` every negative value means ``-1``.
        a_len: ``[bs, Hkv]`` int32 valid rows per request and KV head (0..cap).
        k_pool, v_pool: ``[num_tokens_total, Hkv, D]`` paged KV pool (page_size 1),
            in q's dtype or fp8 (``float8_e4m3fn`` / ``float8_e5m2``, SGLang's
            ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): keys and values are
            widened to q's dtype as they are read.
        req_to_token: ``[max_reqs, max_ctx]`` int32 (req_pool_idx, pos) -> pool slot.
        req_pool_idx: ``[bs]`` int32/int64.
        b_start, b_end: ``[bs]`` int32; segment B is positions ``[b_start, b_end)``.
        sm_scale: softmax scale (usually ``D ** -0.5``).
        max_kv_len: static upper bound on ``a_len + (b_end - b_start)``; only used
            to choose ``num_splits``. Defaults to ``cap + max_ctx`` (from shapes).
            Keep it fixed per CUDA graph. A too-small value costs speed only.
        num_splits: override the split heuristic (grid dim 2).
        num_sms: SM count for the heuristic (default: queried from the device).
        min_split_len: smallest chunk (in keys) a split is given.
        return_lse: also return the natural-log LSE ``[bs, Hq]`` fp32
            (``-inf`` for requests with no keys).
        out: optional preallocated ``[bs, Hq, D]`` output.
        row_mask: optional ``[bs]`` int32; rows where it is 0 are skipped entirely
            (their ``out``/``lse`` rows are not written): one fixed launch serves
            only the rows that need it, e.g. next to FlashInfer for dense rows.
            Rows where it is 2 only get the side effects below, no output.
        key_norms: optional ``[pool, Hkv]`` fp32: each served row stores the L2 norm
            of its key at position ``b_end - 1`` (the one written this step) at
            ``key_norms[req_to_token[req, b_end - 1], h]`` (times ``k_scale``: the
            dequantized key's, over a scaled fp8 cache).
        q_save, q_save_slot: optional ``[slots, Hq, D]`` and ``[bs]`` int32: rows with
            ``q_save_slot >= 0`` copy their query to ``q_save[q_save_slot]``.
        a_pos: optional ``[bs, Hkv, cap_pos]`` int32 (last dim contiguous): for
            rows with ``a_slot == -2``, KV head ``h`` attends (as segment A) to
            the positions ``a_pos[b, h, :a_len[b, h]]`` of the request, read in
            place through ``req_to_token`` -- so each KV head may attend a
            different token set, without packing. The caller guarantees the
            listed positions are distinct and in ``[0, b_start[b])`` (sink
            positions included by the caller); ``a_len`` is clamped to
            ``min(cap_pos, b_start)``, and out-of-range entries are clamped into
            ``[0, b_start)`` so a bad list can never read out of bounds. Rows
            with other ``a_slot`` values never read ``a_pos``.
        a_pos_slots: ``a_pos`` lists pool slots (``req_to_token[req, pos]``, what
            the caller read when it listed the positions) instead of positions:
            the kernel's gather then waits on one load before the K/V tiles
            instead of two, as segment B's does. Entries are clamped into the
            pool (``[0, k_pool.shape[0])``); the caller guarantees they are
            slots of the request's own positions below ``b_start``.
        a_lists: optional ``(rows [bs] int32, pos [R, Hkv, cap_pos2] int32, length
            [R, Hkv] int32)`` (with ``a_pos``): a row with ``rows[b] >= 0`` reads its
            list and lengths from ``pos[rows[b]]`` and ``length[rows[b]]`` instead of
            ``a_pos[b]`` and ``a_len[b]`` (clamped as they are, to ``cap_pos2``), the
            same kind as ``a_pos`` (``a_pos_slots``): a store's selections by slot,
            read where they are instead of copied into the step's rows each layer.
        a_slot_lists: optional ``[num_slots, Hkv, cap]`` int32 (last dim contiguous):
            rows with ``a_slot >= 0`` read segment A as the pool slots
            ``a_slot_lists[a_slot, h, :a_len]`` in place (SFI's ``selections:
            slot_lists``) instead of the compact buffers, which are then unread
            (any 4-D tensor of the pool's dtype, e.g. ``[1, Hkv, 1, D]`` zeros). The
            same keys in the same order as packed ones give the same output. Entries
            are clamped into the pool; the caller guarantees they are slots of the
            request's own positions below ``b_start``.
        fused_merge: with ``num_splits > 1``, merge the split partials inside
            the same launch (the last split program of each (row, KV head) to
            finish merges, see the kernel's epilogue) instead of a second
            kernel; only the splits whose chunk holds keys take part, and a row
            whose keys fit one chunk is written directly. ``False`` keeps the
            two-launch path (stage 1 + merge kernel). ``None`` (default): fused
            when ``split_counters`` is given and ``num_splits <=
            FUSED_MERGE_MAX_SPLITS`` (see that constant for the measurement).
        split_counters: with ``fused_merge``, a persistent int32 tensor of at
            least ``bs * Hkv`` elements, **all zero** before the first call (see
            :func:`make_split_counters`); each launch leaves it all zero again.
            Reuse one per stream across layers and CUDA-graph replays; two
            launches running concurrently must not share one. ``None``
            allocates a zeroed one per call (correct, but one extra memset
            launch).
        balance: each request's splits its share of the launch's programs by its
            keys against the batch's: a dense request among sparse ones is spread
            over more programs instead of one program per KV head doing its whole
            range (:func:`balanced_splits`). When the heuristic picks the splits,
            the grid allows :func:`balance_factor` x them, and only where
            :func:`balances` says so (with ``split_counters``: the merge is
            fused); with an explicit ``num_splits`` that is the grid's bound. Off
            by default: where every request is alike the larger grid costs 7-13%
            (H100, bench/README "Session 15"), so the caller turns it on for the
            launches that have a long request among short ones (the backend: a
            decode step that may hold an SFI slow step).
        row_splits: with ``balance``, ``[bs]`` int32 splits per request as
            :func:`balanced_splits` computes them (default: computed here; a
            caller launching once per layer computes them once per step).
        record: a probe's ``[programs, 3]`` int64, zeroed (programs: the stage-1
            grid's, at least): each program writes its SM (``%smid``) and start time
            (``%globaltimer``, ns) at its start and its end time if it runs to the end
            (programs that exit early leave 0), in launch order (grid dimension 0
            fastest): how the block scheduler dealt a launch to the SMs. Compiled
            GPUs only (inline PTX).
        gate: ``(flag, when_set)``: the launch runs only where the ``[1]`` int32
            ``flag`` (on the device) is non-zero (``when_set``) or zero (not
            ``when_set``); otherwise its programs return at once, side effects
            included. Two launches with one flag and opposite ``when_set`` are one
            launch chosen on the device (``balance_gate``). Its launch must need no
            merge kernel (one split, or the one-launch merge). ``(flag, None)``
            (with ``balance``): both in one launch, its grid the plain launch's
            splits followed by the balanced launch's, the flag picking which
            programs work (``BALANCE_ONE_GRID``): no closed twin to launch. Where
            the launch is not balanced the two partitions are one: it runs ungated.
        quest_bounds: optional ``(kmin, kmax, slot)``: Quest's page bounds of
            this layer (``[slots, Hkv, max_pages, D]``, KV dtype, see
            ``quest_pages``) and ``[bs]`` int32 rows of the store. Every row with
            ``slot >= 0`` that this call serves (``row_mask`` 1 or 2) folds its
            key at position ``b_end - 1`` into page ``(b_end - 1) // 16``
            (``row_mask`` 0 rows do not), with
            the same result as ``quest_pages.quest_bounds_decode`` (saving its
            launch). Call page scores for this step before this kernel.
        logits_out: optional ``[slots, Hkv, G, L]`` fp32 (last dim contiguous), with
            ``q_save``/``q_save_slot``: every row served (``row_mask`` 1) with
            ``0 <= q_save_slot < slots`` and ``b_start == 0`` (SFI's dense slow
            step) stores ``q . k * sm_scale * log2(e)`` of each query head ``g`` of
            KV head ``h`` and each position ``p < L`` of segment B at
            ``logits_out[q_save_slot, h, g, p]`` (base-2 logits; the Selector's
            evidence, ``window_evidence.stored_evidence``). Other entries are
            left untouched.
        k_scale, v_scale: the KV cache's dequantization scales (SGLang's
            ``layer.k_scale_float`` / ``v_scale_float``; None: 1): the cache holds
            ``k / k_scale`` and ``v / v_scale``. ``k_scale`` is folded into the
            softmax scale (``logits_out`` and the LSE are the dequantized keys'),
            ``v_scale`` multiplies the output.
        block_n, num_warps, num_stages: Triton tuning knobs (``num_warps`` None: 4, or
            over an fp8 cache ``FP8_NUM_WARPS``, ``FP8_BALANCED_NUM_WARPS`` for a
            balanced launch).

    Returns:
        ``o`` ``[bs, Hq, D]`` (dtype of q), or ``(o, lse)`` if ``return_lse``.
        A request with zero keys gets ``o == 0`` and ``lse == -inf``.

    Launches 1 kernel (num_splits == 1 or fused_merge) or 2 kernels, with no
    host sync; the grid depends only on ``bs``, ``Hkv`` and ``num_splits``.
    """
    assert q.dim() == 3 and k_pool.dim() == 3 and a_k.dim() == 4
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_q_heads // num_kv_heads
    assert k_pool.shape[2] == head_dim and v_pool.shape == k_pool.shape
    assert a_k.shape[1] == num_kv_heads and a_k.shape[3] == head_dim and a_v.shape == a_k.shape
    assert k_pool.dtype in (q.dtype, *FP8_KV_DTYPES) and a_k.dtype == k_pool.dtype, \
        "K and V: q's dtype or fp8, the compact buffers the pool's"
    assert v_pool.dtype == k_pool.dtype and a_v.dtype == a_k.dtype
    assert a_len.shape == (bs, num_kv_heads) and a_slot.shape[0] == bs
    assert b_start.shape[0] == bs and b_end.shape[0] == bs and req_pool_idx.shape[0] == bs
    for t in (q, a_k, a_v, k_pool, v_pool):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    assert a_len.stride(1) == 1 and req_to_token.stride(1) == 1

    if row_mask is not None:
        assert row_mask.shape == (bs,) and row_mask.dtype == torch.int32, "row_mask: [bs] int32"
    if key_norms is not None:
        assert key_norms.dtype == torch.float32 and key_norms.shape[1] == num_kv_heads and key_norms.stride(1) == 1
    if q_save is not None:
        assert q_save_slot is not None and q_save_slot.shape == (bs,) and q_save_slot.dtype == torch.int32
        assert q_save.shape[1:] == (num_q_heads, head_dim) and q_save.stride(-1) == 1
    if quest_bounds is not None:
        qb_min, qb_max, qb_slot = quest_bounds
        assert qb_min.shape == qb_max.shape and qb_min.stride() == qb_max.stride() and qb_min.dim() == 4
        assert qb_min.shape[1] == num_kv_heads and qb_min.shape[3] == head_dim and qb_min.stride(3) == 1
        # the bounds: the pool's dtype, or q's over an fp8 pool (the page scores read them beside q)
        assert qb_min.dtype in (k_pool.dtype, q.dtype) and qb_slot.shape == (bs,) and qb_slot.dtype == torch.int32
    if logits_out is not None:
        assert q_save is not None, "logits_out: rows are chosen by q_save_slot"
        assert logits_out.dim() == 4 and logits_out.shape[1:3] == (num_kv_heads, group), \
            "logits_out: [slots, Hkv, G, L]"
        assert logits_out.dtype == torch.float32 and logits_out.stride(3) == 1
    if a_pos is not None:
        assert a_pos.dim() == 3 and a_pos.shape[:2] == (bs, num_kv_heads), "a_pos: [bs, Hkv, cap_pos]"
        assert a_pos.dtype == torch.int32 and a_pos.stride(2) == 1, "a_pos: int32, last dim contiguous"
    if a_lists is not None:
        l_rows, l_pos, l_len = a_lists
        assert a_pos is not None, "a_lists: rows read instead of a_pos's, which must be given"
        assert l_rows.shape == (bs,) and l_rows.dtype == torch.int32 and l_rows.is_contiguous(), \
            "a_lists: rows [bs] int32"
        assert l_pos.dim() == 3 and l_pos.shape[1] == num_kv_heads and l_pos.dtype == torch.int32 \
            and l_pos.stride(2) == 1, "a_lists: pos [R, Hkv, cap] int32, last dim contiguous"
        assert l_len.shape == l_pos.shape[:2] and l_len.dtype == torch.int32 and l_len.stride(1) == 1, \
            "a_lists: length [R, Hkv] int32"
    if a_slot_lists is not None:
        assert a_slot_lists.dim() == 3 and a_slot_lists.shape[1] == num_kv_heads, \
            "a_slot_lists: [num_slots, Hkv, cap]"
        assert a_slot_lists.dtype == torch.int32 and a_slot_lists.stride(2) == 1, \
            "a_slot_lists: int32, last dim contiguous"
    seg_a = a_slot_lists if a_slot_lists is not None else a_k  # what A_K points at
    cap = seg_a.shape[2]
    if max_kv_len is None:
        max_kv_len = cap + req_to_token.shape[1]
    if num_sms is None:
        num_sms = device_num_sms(q.device)
    kv_fp8 = k_pool.dtype in FP8_KV_DTYPES
    plain_splits = num_splits  # the one grid's plain partition: the caller's splits, else the heuristic's
    if num_splits is None:
        base, grid_splits = balanced_grid_splits(bs, num_kv_heads, max_kv_len, num_sms, min_split_len, kv_fp8)
        num_splits = plain_splits = base
        balance = balance and split_counters is not None and _balance_fits(bs, num_kv_heads, base, num_sms, kv_fp8)
        if balance:
            num_splits = grid_splits
            if fused_merge is None:  # a request's splits stay around the heuristic's: see FUSED_MERGE_MAX_SPLITS
                fused_merge = split_counters is not None and base <= FUSED_MERGE_MAX_SPLITS
        elif kv_fp8:
            num_splits = plain_fp8_splits(base, bs, num_kv_heads, max_kv_len, num_sms, min_split_len)
    num_splits = int(max(1, num_splits))
    balance = bool(balance) and num_splits > 1
    if balance and row_splits is None:
        row_splits = balanced_splits(a_len, b_start, b_end, row_mask, _programs_per_head(num_sms, num_kv_heads, kv_fp8),
                                     num_splits, kv_fp8)

    if block_n is None:
        block_n = _default_block_n(head_dim)
    if num_warps is None:
        # The one grid (gate=(flag, None)) at the plain launch's warps: at 8192 x 32
        # over e4m3 it ran 1.428 / 2.293 / 5.059 ms (28 layers; 0 / 1 / all rows dense)
        # at 2 warps against 1.588 / 2.283 / 5.295 at 4 (under a cap of 128 registers;
        # uncapped at 2: 1.366 / 1.965 / 4.875), served +2.1% (bench/README "Session 45",
        # "Session 46"). With rows alike there the gate opens its balanced partition
        # (~1.1K keys a program), which at 2 warps beat the plain launch's 1.584.
        one_grid_warps = gate is not None and gate[1] is None
        num_warps = (FP8_BALANCED_NUM_WARPS if balance and not one_grid_warps else FP8_NUM_WARPS) if kv_fp8 else 4
    block_d = next_pow2(head_dim)
    block_h = max(16, next_pow2(group))  # tl.dot needs M >= 16
    min_split_blocks = max(1, cdiv(min_split_len, block_n))

    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    lse = torch.empty((bs, num_q_heads), dtype=torch.float32, device=q.device) if return_lse else None

    direct = num_splits == 1
    if fused_merge is None:
        fused_merge = split_counters is not None and num_splits <= FUSED_MERGE_MAX_SPLITS
    fused = bool(fused_merge) and not direct
    if fused:
        if split_counters is None:
            split_counters = torch.zeros(bs * num_kv_heads, dtype=torch.int32, device=q.device)
        assert split_counters.dtype == torch.int32 and split_counters.is_contiguous()
        assert split_counters.numel() >= bs * num_kv_heads, "split_counters: >= bs * Hkv int32"
    if direct:
        stage1_out, stage1_lse = out, (lse if return_lse else out)  # dummy LSE ptr when unused
        s_ob, s_oh, s_os = out.stride(0), out.stride(1), 0
        s_lb, s_lh = (lse.stride(0), lse.stride(1)) if return_lse else (0, 0)
    else:
        # fp32 workspace; under CUDA-graph capture this comes from the graph pool.
        mid_o = torch.empty((bs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        stage1_out, stage1_lse = mid_o, mid_lse
        s_ob, s_oh, s_os = mid_o.stride(0), mid_o.stride(1), mid_o.stride(2)
        s_lb, s_lh = mid_lse.stride(0), mid_lse.stride(1)

    if gate is not None:
        assert gate[0].dtype == torch.int32 and gate[0].device == q.device, "gate: ([1] int32 flag, when_set)"
        assert direct or fused, "gate: a launch with the merge kernel would merge a skipped stage 1"
    one_grid = gate is not None and gate[1] is None
    if one_grid and not balance:
        # Not balanced here (one split, no fused merge, a batch balances() refuses): the
        # balanced partition would be the plain one, so the plain launch runs, ungated,
        # as exactly one of the two twins would.
        one_grid, gate = False, None
    if one_grid:
        plain_splits = int(max(1, plain_splits))
    if record is not None:
        assert record.dtype == torch.int64 and record.is_contiguous() and record.device == q.device
        assert not is_interpreter(), "record: inline PTX (%smid, %globaltimer), compiled GPUs only"
    # A grid's second and third dimensions stop at 65535: a batch that large keeps
    # the request-major order.
    split_major = balance and BALANCE_SPLIT_MAJOR and bs <= 65535 and not one_grid
    grid_splits_axis = plain_splits + num_splits if one_grid else num_splits
    grid = (num_splits, num_kv_heads, bs) if split_major else (bs, num_kv_heads, grid_splits_axis)
    assert record is None or record.numel() >= 3 * bs * num_kv_heads * grid_splits_axis, "record: [programs, 3]"
    f16_dots = FP8_F16_DOTS and kv_fp8
    _two_segment_decode_stage1[grid](
        q,
        seg_a,
        a_v,
        a_slot,
        a_len,
        a_pos if a_pos is not None else a_len,
        a_lists[0] if a_lists is not None else b_end,
        a_lists[1] if a_lists is not None else a_len,
        a_lists[2] if a_lists is not None else a_len,
        k_pool,
        v_pool,
        req_to_token,
        req_pool_idx,
        b_start,
        b_end,
        row_mask if row_mask is not None else b_end,
        row_splits if balance else b_end,
        record if record is not None else b_end,
        gate[0] if gate is not None else b_end,
        key_norms if key_norms is not None else b_end,
        q_save if q_save is not None else q,
        q_save_slot if q_save is not None else b_end,
        qb_min if quest_bounds is not None else q,
        qb_max if quest_bounds is not None else q,
        qb_slot if quest_bounds is not None else b_end,
        stage1_out,
        stage1_lse,
        split_counters if fused else b_end,
        out,
        lse if return_lse else b_end,
        logits_out if logits_out is not None else b_end,
        float(sm_scale) * _LOG2E * (1.0 if k_scale is None else float(k_scale)),
        float(sm_scale) * _LOG2E,
        1.0 if v_scale is None else float(v_scale),
        1.0 if k_scale is None else float(k_scale),
        q.stride(0),
        q.stride(1),
        seg_a.stride(0),
        seg_a.stride(1),
        seg_a.stride(2),
        a_v.stride(0),
        a_v.stride(1),
        a_v.stride(2),
        a_len.stride(0),
        a_pos.stride(0) if a_pos is not None else 0,
        a_pos.stride(1) if a_pos is not None else 0,
        a_lists[1].stride(0) if a_lists is not None else 0,
        a_lists[1].stride(1) if a_lists is not None else 0,
        a_lists[2].stride(0) if a_lists is not None else 0,
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        s_ob,
        s_oh,
        s_os,
        s_lb,
        s_lh,
        key_norms.stride(0) if key_norms is not None else 0,
        q_save.stride(0) if q_save is not None else 0,
        q_save.stride(1) if q_save is not None else 0,
        qb_min.stride(0) if quest_bounds is not None else 0,
        qb_min.stride(1) if quest_bounds is not None else 0,
        qb_min.stride(2) if quest_bounds is not None else 0,
        qb_min.shape[2] if quest_bounds is not None else 0,
        out.stride(0),
        out.stride(1),
        lse.stride(0) if return_lse else 0,
        lse.stride(1) if return_lse else 0,
        logits_out.stride(0) if logits_out is not None else 0,
        logits_out.stride(1) if logits_out is not None else 0,
        logits_out.stride(2) if logits_out is not None else 0,
        logits_out.shape[3] if logits_out is not None else 0,
        logits_out.shape[0] if logits_out is not None else 0,
        cap,
        a_pos.shape[2] if a_pos is not None else 0,
        a_lists[1].shape[2] if a_lists is not None else 0,
        min_split_blocks,
        plain_splits if one_grid else 0,
        k_pool.shape[0],
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DIRECT=direct,
        STORE_LSE=return_lse,
        FP32_DOT=needs_fp32_dot(q.dtype),
        HAS_ROW_MASK=row_mask is not None,
        STORE_KNORM=key_norms is not None,
        SAVE_Q=q_save is not None,
        QUEST_BOUNDS=quest_bounds is not None,
        QB_PAGE=QUEST_PAGE_SIZE,
        HAS_A_POS=a_pos is not None,
        A_POS_SLOTS=bool(a_pos_slots) and a_pos is not None,
        HAS_A_ROW=a_lists is not None,
        A_SLOT_LISTS=a_slot_lists is not None,
        FUSED_MERGE=fused,
        SAVE_LOGITS=logits_out is not None,
        BALANCE=balance,
        F16_DOTS=f16_dots,
        V_ASM=f16_dots and FP8_V_ASM and has_fp8_pair_conversions(q.device),
        SPLIT_MAJOR=split_major,
        RECORD=record is not None,
        GATE_RUN=0 if gate is None else 3 if gate[1] is None else 1 if gate[1] else 2,
        num_warps=num_warps,
        num_stages=num_stages,
        maxnreg=balance_maxnreg(num_warps) if balance and kv_fp8 else None,
    )

    if not direct and not fused:
        _merge_splits_kernel[(bs, num_q_heads)](
            row_mask if row_mask is not None else b_end,
            mid_o,
            mid_lse,
            out,
            lse if return_lse else mid_lse,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0) if return_lse else 0,
            lse.stride(1) if return_lse else 0,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_D=block_d,
            STORE_LSE=return_lse,
            HAS_ROW_MASK=row_mask is not None,
            num_warps=4 if head_dim >= 128 else 2,
        )

    if return_lse:
        return out, lse
    return out
