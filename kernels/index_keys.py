"""
Index keys: AsyncSpade's scoring pass over int8 copies of the keys
==================================================================

AsyncSpade scores every key of the context with the predicted query at every
step (``token_scores``): on one GPU that pass reads half the KV cache's bytes a
step and bounds the policy's TPOT at >= 0.64x ``full`` at 32768 x 8 on the H100
(bench/README, "Session 17"), above the paper's 0.5x, which moves the pass to a
separate GPU. DeepSeek-V3.2's indexer keeps low-precision copies of its keys for
the same job (score every token, keep the top 2048). Here: per (slot, KV head,
position) an int8 key and its fp32 scale, 132 bytes instead of 256 at D = 128,
read contiguously instead of gathered through ``req_to_token``::

    amax  = max_d |k[d]|                      (fp32)
    kq[d] = clamp(floor(k[d] * (127 / amax) + 0.5), -127, 127)   (0 where amax <= 1e-30)
    kscale = amax / 127
    s[b, h, pos] = max_{g in group(h)} ((qq[b, g] . kq[pos, h]) * qscale[b, g]) * kscale[pos, h] * sm_scale

with ``(qq, qscale)`` the predicted query quantized per head by the same formula:
the dots are int8 tensor-core dots with int32 sums (exact: |sum| < 2^24), so the key
tiles go from memory to the MMA unit as they are. Converting each int8 tile to
bf16 for a bf16 dot made the pass compute-bound (session 20, H200: 0.88x of
``token_scores``' time at 32768 x 8 for 0.52x of its bytes). The query's own
rounding (1/254 of its largest entry) is below the keys'.

Every fp32 operation above is rounded once, in this order, in the kernel, in
``quantize_keys`` and in the serving path's torch scoring (IEEE divisions, no fused
multiply-add: the launch turns fp fusion off), so the kernel's copies are
bit-identical to the reference's and its scores to the torch path's.

The copies are filled lazily by the scoring launch itself, so neither prefill
nor the decode step's KV write needs a hook: per (layer, slot) two counters
``filled[slot, 2]`` say up to which position the copies of the slot's current
request are valid. A launch scoring ``[lo, hi)`` reads ``filled[slot, 1 - hi % 2]``
(what the launch of the previous step, whose ``hi`` was one less, wrote), scores
the positions below it from the copies, quantizes the ones above it from the KV
pool (all of them on a request's first step, then the one position a step that
enters the scored range), stores those copies, and writes ``hi`` to
``filled[slot, hi % 2]``: the counter it reads is never the one a program of the
same launch writes. A step that skipped the slot (``hi`` grew by more than one)
reads an older, smaller count and re-quantizes a few more positions: same
values. The owner of the store zeroes both counters when a request takes the
slot (query_serving.on_extend). The scored range never reaches the decode
step's own position (``hi <= n + 1 - recent``), so every key copied is final.

The launch is ``token_scores``'s kernel with its ``INDEX_KEYS`` variant.

4-bit copies (``index_keys: int4``), 68 bytes a position and KV head at D = 128
instead of 132: the scoring pass reads what it scores, so it takes about half the
time of the int8 one. Per-token 4-bit codes alone would lose the keys: LLM keys have
a few channels far larger than the rest (a per-token scale set by them leaves the
others 0 or +-1 codes), so each (slot, KV head) first divides its keys by a
per-channel power of two (SmoothQuant's move, exact in fp32) and multiplies the
query by it, which leaves every dot product unchanged::

    f[c]   = 2^(floor(log2 m[c]) + 1),  m[c] = max over the request's prompt of |k[c]|
                                        (m[c] in [f/2, f); f = 1 where m[c] <= 1e-30)
    k'[d]  = k[d] * (1 / f[d]),   q'[d] = q[d] * f[d]                (exact: powers of two)
    kq4, kscale = the formula above on k' with 7 for 127              (codes in [-7, 7])
    (qq, qscale) = the formula above on q' (int8, 127)
    s[b, h, pos] = max_g ((qq[b, g] . kq4[pos, h]) * qscale[b, g]) * kscale[pos, h] * sm_scale

``f`` comes from the prompt's keys at prefill (query_serving.on_extend, per layer
and chunk, over the whole prefix so far), decoded keys larger than it only raise
their own per-token scale. Two codes share a byte, channel ``d`` in the low
nibble of byte ``d`` and channel ``d + D/2`` in its high nibble, each stored as
``code + 8`` (unsigned, 1..15): the kernel unpacks a tile into its two halves by a
mask and a shift and takes two int8 dots of ``D/2``, and subtracts ``8 * sum(qq)``
(the offset's share, exact in int32).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


__all__ = ["QMAX", "QMAX4", "quantize_keys", "channel_smoothing", "pack_int4", "unpack_int4",
           "index_token_scores", "index_token_scores_ref"]

#: The int8 code range, symmetric: [-QMAX, QMAX].
QMAX = 127.0
#: The 4-bit copies' code range, [-QMAX4, QMAX4], stored as code + NIBBLE_OFFSET.
QMAX4 = 7.0
NIBBLE_OFFSET = 8
#: Keys whose largest |k| is at most this quantize to 0.
TINY = 1e-30
#: The scoring dot's orientation by default (``index_token_scores``' ``keys_as_m``).
KEYS_AS_M = True


def quantize_keys(keys: torch.Tensor, qmax: float = QMAX) -> Tuple[torch.Tensor, torch.Tensor]:
    """``keys [..., D]`` -> ``(kq [..., D] int8, kscale [...] fp32)`` (the module's
    formula, codes in ``[-qmax, qmax]``: 127 or :data:`QMAX4`; the definition the
    kernel's copies must equal bit for bit)."""
    kf = keys.float()
    amax = kf.abs().amax(-1)
    # keys below TINY quantize to 0 (qmax / amax would overflow fp32 for subnormal maxima);
    # a tensor / tensor division: `qmax / amax` is reciprocal-then-multiply in torch,
    # not the correctly rounded quotient the kernel's div_rn computes
    inv = torch.where(amax > TINY, torch.full_like(amax, qmax) / amax.clamp(min=TINY), torch.zeros_like(amax))
    kq = torch.floor(kf * inv[..., None] + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    return kq, amax / torch.full_like(amax, qmax)


def channel_smoothing(keys: torch.Tensor) -> torch.Tensor:
    """``keys [n, Hkv, D]`` -> fp32 ``[Hkv, D]``: per channel the power of two ``f``
    with the largest ``|k|`` over the ``n`` positions in ``[f/2, f)`` (1 where that is
    <= TINY or ``n == 0``). Powers of two make ``k / f`` and ``q * f`` exact in fp32."""
    amax = keys.float().abs().amax(0) if keys.shape[0] else keys.new_zeros(keys.shape[1:], dtype=torch.float32)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): amax in [2^exp / 2, 2^exp)
    return torch.where(amax > TINY, torch.ldexp(torch.ones_like(amax), exp), torch.ones_like(amax))


def smoothed_codes(keys: torch.Tensor, f: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit copies' codes (unpacked, int8 in [-7, 7]) and scales of ``keys
    [..., Hkv, D]`` under the smoothing ``f [..., Hkv, D]`` (broadcast)."""
    return quantize_keys(keys.float() * (1.0 / f), QMAX4)


def smoothed_query(q: torch.Tensor, f: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and scales of ``q [bs, Hq, D]`` times ``f [bs, Hkv, D]`` (each KV
    head's factors over its query group): the query the 4-bit copies are scored with."""
    group = q.shape[1] // f.shape[1]
    return quantize_keys(q.float() * f.repeat_interleave(group, dim=1))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[..., D]`` in [-8, 7] -> ``[..., D/2]`` int8 bytes: channel ``d``'s
    ``code + 8`` in the low nibble of byte ``d``, channel ``d + D/2``'s in its high one."""
    half = codes.shape[-1] // 2
    u = (codes.to(torch.int32) + NIBBLE_OFFSET)
    byte = u[..., :half] | (u[..., half:] << 4)
    return torch.where(byte > 127, byte - 256, byte).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., D/2]`` int8 -> codes ``[..., D]`` int8."""
    u = packed.to(torch.int32) & 0xFF
    return torch.cat([(u & 0xF) - NIBBLE_OFFSET, (u >> 4) - NIBBLE_OFFSET], dim=-1).to(torch.int8)


@triton.jit
def _quantize_tile(k):
    """[BLOCK_N, BLOCK_D] fp32 keys -> (codes as fp32 integers, per-row scale)."""
    amax = tl.max(tl.abs(k), 1)
    qmax = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 1e-30, tl.math.div_rn(qmax, tl.maximum(amax, 1e-30)), 0.0)  # TINY
    x = k * inv[:, None]
    kq = tl.minimum(tl.maximum(tl.floor(x + 0.5), -127.0), 127.0)
    return kq, tl.math.div_rn(amax, qmax)


@triton.jit
def _quantize_halves(a, b, QMAX_C: tl.constexpr):
    """:func:`_quantize_tile`'s formula for rows held as two [R, D/2] fp32 halves
    (the 4-bit layout's), codes in [-QMAX_C, QMAX_C] -> (codes of a, codes of b, scale)."""
    amax = tl.maximum(tl.max(tl.abs(a), 1), tl.max(tl.abs(b), 1))
    qmax = tl.full(amax.shape, QMAX_C, tl.float32)
    inv = tl.where(amax > 1e-30, tl.math.div_rn(qmax, tl.maximum(amax, 1e-30)), 0.0)  # TINY
    ca = tl.minimum(tl.maximum(tl.floor(a * inv[:, None] + 0.5), -QMAX_C), QMAX_C)
    cb = tl.minimum(tl.maximum(tl.floor(b * inv[:, None] + 0.5), -QMAX_C), QMAX_C)
    return ca, cb, tl.math.div_rn(amax, qmax)


def index_token_scores(
    q_hat: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    n_max: int,
    kq: torch.Tensor,
    kscale: torch.Tensor,
    filled: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    num_programs: Optional[int] = None,
    num_sms: Optional[int] = None,
    programs_per_sm: int = 4,
    blocks_per_program: int = 0,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: Optional[int] = None,
    keys_as_m: bool = KEYS_AS_M,
    ksmooth: Optional[torch.Tensor] = None,
    h_top: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scores of ``q_hat`` over ``[lo[b], hi[b])`` from row ``b``'s int8 or 4-bit key
    copies (the module's formulas), fp32 ``[bs, Hkv, n_max]``; only ``[lo, hi)`` is written
    (``topk_range`` over the same range reads nothing else), rows with an empty
    range cost O(1). Updates the copies and ``filled`` (module docstring).

    Args:
        q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, num_programs,
            num_sms, programs_per_sm, blocks_per_program: as :func:`token_scores` (row ``b`` is also the
            copies' row).
        kq: ``[bs, Hkv, ctx, D]`` int8 codes, or ``[bs, Hkv, ctx, D/2]`` int8 bytes of
            4-bit codes (:func:`pack_int4`; then ``ksmooth`` is required); kscale
            ``[bs, Hkv, ctx]`` fp32; positions ``>= ctx`` are never scored (-inf).
        ksmooth: the 4-bit copies' ``f`` (:func:`channel_smoothing`), fp32
            ``[bs, Hkv, D]``, stride 1 along ``D``.
        filled: ``[bs, 2]`` int32, zeroed when the row's request changes.
        block_n: 128, twice ``token_scores``' 64: the int8 tile of 128 positions
            moves the bytes of a bf16 tile of 64 (H200, session 20: 0.79x the time of
            64 at 32768 x 8 and 131072 x 8, 0.81x at 32768 x 32).
        keys_as_m: the key tile as the dot's M side (``token_scores._index_scores_tile``):
            a warpgroup MMA from shared memory on sm_90, instead of ``mma.sync`` with
            the group's queries as M. The same scores.
        h_top: optional int32 ``[bs, Hkv, 64]`` (stride 1 along the bins): each
            (row, KV head)'s 64-bin histogram of the top 6 bits of the ``KEY_DESC`` keys
            of the finite scores written in ``[lo, hi)`` is ADDED to it (atomics, the
            row's programs each add theirs once) -- ``topk_range``'s ``h_top`` for a
            Top-K over these scores and the same ``lo``/``hi``, which skips its first
            pass over the row and leaves it zeroed again. Give it zeroed.
    """
    from .token_scores import launch_token_scores

    bs, _, head_dim = q_hat.shape
    num_kv_heads, ctx = k_pool.shape[1], kq.shape[2]
    bits = 4 if kq.shape[3] * 2 == head_dim else 8
    width = head_dim // 2 if bits == 4 else head_dim
    assert kq.dtype == torch.int8 and kq.shape == (bs, num_kv_heads, ctx, width)
    assert kq.stride(3) == 1 and kq.stride(2) == width
    if bits == 4:
        # two dots over D/2 channels each; an int8 dot's K is >= 32 on NVIDIA GPUs
        assert head_dim >= 64 and head_dim & (head_dim - 1) == 0, "4-bit copies: D a power of two >= 64"
        assert ksmooth is not None, "4-bit copies need ksmooth"
        assert ksmooth.dtype == torch.float32 and ksmooth.shape == (bs, num_kv_heads, head_dim)
        assert ksmooth.stride(2) == 1
    assert kscale.dtype == torch.float32 and kscale.shape == (bs, num_kv_heads, ctx) and kscale.stride(2) == 1
    assert filled.dtype == torch.int32 and filled.shape == (bs, 2) and filled.is_contiguous()
    return launch_token_scores(q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, out=out,
                               num_programs=num_programs, num_sms=num_sms, programs_per_sm=programs_per_sm,
                               blocks_per_program=blocks_per_program, block_n=block_n, num_warps=num_warps,
                               fill=False, index_keys=(kq, kscale, filled, ksmooth if bits == 4 else None),
                               num_stages=num_stages, keys_as_m=keys_as_m, h_top=h_top)


def index_token_scores_ref(
    q_hat: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    n_max: int,
    ctx: Optional[int] = None,
    ksmooth: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference for :func:`index_token_scores` in float64 (returned fp32, -inf outside
    ``[lo, min(hi, n_max, max_ctx, ctx))``): ``token_scores_ref`` with the query and
    each row's gathered keys quantized by :func:`quantize_keys` and scaled back in
    float64, no copies kept (``(qq * qs) . (kq * ks) == (qq . kq) * qs * ks`` up to
    float64 rounding). With ``ksmooth [bs, Hkv, D]``: the 4-bit copies' formula, the
    smoothing divided back out of the dequantized keys."""
    from .reference import token_scores_ref

    def dequantized(x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_keys(x)
        return codes.double() * scale.double()[..., None]

    if ctx is not None:
        hi = torch.clamp(hi, max=ctx)
    if ksmooth is None:
        return token_scores_ref(dequantized(q_hat), k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max,
                                keys_as=dequantized)
    # q' . k' with both dequantized: the smoothing cancels in the product
    qq, qs = smoothed_query(q_hat, ksmooth)
    q_deq = qq.double() * qs.double()[..., None]
    rows = []
    for b in range(q_hat.shape[0]):  # token_scores_ref hands keys_as a row's keys: one row a call
        def dequantized4(x: torch.Tensor, f=ksmooth[b]) -> torch.Tensor:
            codes, scale = smoothed_codes(x, f)
            return codes.double() * scale.double()[..., None]

        rows.append(token_scores_ref(q_deq[b:b + 1], k_pool, req_to_token, req_pool_idx[b:b + 1], lo[b:b + 1],
                                     hi[b:b + 1], sm_scale, n_max, keys_as=dequantized4))
    return torch.cat(rows)
