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
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


__all__ = ["QMAX", "quantize_keys", "index_token_scores", "index_token_scores_ref"]

#: The int8 code range, symmetric: [-QMAX, QMAX].
QMAX = 127.0
#: Keys whose largest |k| is at most this quantize to 0.
TINY = 1e-30
#: The scoring dot's orientation by default (``index_token_scores``' ``keys_as_m``).
KEYS_AS_M = True


def quantize_keys(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``keys [..., D]`` -> ``(kq [..., D] int8, kscale [...] fp32)`` (the module's
    formula; the definition the kernel's copies must equal bit for bit)."""
    kf = keys.float()
    amax = kf.abs().amax(-1)
    # keys below TINY quantize to 0 (127 / amax would overflow fp32 for subnormal maxima);
    # a tensor / tensor division: `127.0 / amax` is reciprocal-then-multiply in torch,
    # not the correctly rounded quotient the kernel's div_rn computes
    inv = torch.where(amax > TINY, torch.full_like(amax, QMAX) / amax.clamp(min=TINY), torch.zeros_like(amax))
    kq = torch.floor(kf * inv[..., None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return kq, amax / torch.full_like(amax, QMAX)


@triton.jit
def _quantize_tile(k):
    """[BLOCK_N, BLOCK_D] fp32 keys -> (codes as fp32 integers, per-row scale)."""
    amax = tl.max(tl.abs(k), 1)
    qmax = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 1e-30, tl.math.div_rn(qmax, tl.maximum(amax, 1e-30)), 0.0)  # TINY
    x = k * inv[:, None]
    kq = tl.minimum(tl.maximum(tl.floor(x + 0.5), -127.0), 127.0)
    return kq, tl.math.div_rn(amax, qmax)


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
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: Optional[int] = None,
    keys_as_m: bool = KEYS_AS_M,
) -> torch.Tensor:
    """Scores of ``q_hat`` over ``[lo[b], hi[b])`` from row ``b``'s int8 key copies
    (the module's formula), fp32 ``[bs, Hkv, n_max]``; only ``[lo, hi)`` is written
    (``topk_range`` over the same range reads nothing else), rows with an empty
    range cost O(1). Updates the copies and ``filled`` (module docstring).

    Args:
        q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, num_programs,
            num_sms, programs_per_sm: as :func:`token_scores` (row ``b`` is also the
            copies' row).
        kq: ``[bs, Hkv, ctx, D]`` int8; kscale ``[bs, Hkv, ctx]`` fp32; positions
            ``>= ctx`` are never scored (-inf).
        filled: ``[bs, 2]`` int32, zeroed when the row's request changes.
        block_n: 128, twice ``token_scores``' 64: the int8 tile of 128 positions
            moves the bytes of a bf16 tile of 64 (H200, session 20: 0.79x the time of
            64 at 32768 x 8 and 131072 x 8, 0.81x at 32768 x 32).
        keys_as_m: the key tile as the dot's M side (``token_scores._index_scores_tile``):
            a warpgroup MMA from shared memory on sm_90, instead of ``mma.sync`` with
            the group's queries as M. The same scores.
    """
    from .token_scores import launch_token_scores

    bs, _, head_dim = q_hat.shape
    num_kv_heads, ctx = k_pool.shape[1], kq.shape[2]
    assert kq.dtype == torch.int8 and kq.shape == (bs, num_kv_heads, ctx, head_dim)
    assert kq.stride(3) == 1 and kq.stride(2) == head_dim
    assert kscale.dtype == torch.float32 and kscale.shape == (bs, num_kv_heads, ctx) and kscale.stride(2) == 1
    assert filled.dtype == torch.int32 and filled.shape == (bs, 2) and filled.is_contiguous()
    return launch_token_scores(q_hat, k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max, out=out,
                               num_programs=num_programs, num_sms=num_sms, programs_per_sm=programs_per_sm,
                               block_n=block_n, num_warps=num_warps,
                               fill=False, index_keys=(kq, kscale, filled), num_stages=num_stages,
                               keys_as_m=keys_as_m)


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
) -> torch.Tensor:
    """Reference for :func:`index_token_scores` in float64 (returned fp32, -inf outside
    ``[lo, min(hi, n_max, max_ctx, ctx))``): ``token_scores_ref`` with the query and
    each row's gathered keys quantized by :func:`quantize_keys` and scaled back in
    float64, no copies kept (``(qq * qs) . (kq * ks) == (qq . kq) * qs * ks`` up to
    float64 rounding)."""
    from .reference import token_scores_ref

    def dequantized(x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_keys(x)
        return codes.double() * scale.double()[..., None]

    if ctx is not None:
        hi = torch.clamp(hi, max=ctx)
    return token_scores_ref(dequantized(q_hat), k_pool, req_to_token, req_pool_idx, lo, hi, sm_scale, n_max,
                            keys_as=dequantized)
