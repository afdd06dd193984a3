"""Plain-PyTorch attention: the CPU serving path and the correctness oracle.

Every later kernel is tested against these functions. They loop over requests and
call ``scaled_dot_product_attention`` exactly the way SGLang's stock
``torch_native`` backend does, so a request whose plan covers its whole sequence
gets bit-identical outputs to the stock backend (greedy tokens match).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparse.decision import DecodePlan
from sgl_sparse.policies.query_aware import INDEXED


def _gather_kv(k_cache, v_cache, slots, dtype):
    # [n, H, D] -> [H, n, D]
    k = k_cache[slots].movedim(0, 1)
    v = v_cache[slots].movedim(0, 1)
    if k.dtype != dtype:  # SDPA needs one dtype (e.g. an fp8 KV cache)
        k, v = k.to(dtype), v.to(dtype)
    return k, v


def _listed_kv(k_cache, v_cache, lists):
    """lists [H, n] pool slots per KV head -> their K and V rows [H, n, D], in the cache's dtype."""
    head = torch.arange(lists.shape[0], device=lists.device)[:, None]
    slots = lists.long()
    return k_cache[slots, head], v_cache[slots, head]


def extend_attention(
    q: torch.Tensor,  # [tokens, Hq, D]
    o: torch.Tensor,  # [tokens, Hq, Dv]
    k_cache: torch.Tensor,  # [pool, Hkv, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    scaling: Optional[float],
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix + themselves."""
    qh = q.movedim(0, 1)  # [Hq, tokens, D]
    start_q = 0
    for i, (rpi, n, prefix, ext) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist())
    ):
        end_q = start_q + ext
        # Queries padded to the full length so SDPA's is_causal aligns them with
        # their absolute positions (torch_native's formulation, kept for parity).
        q_full = qh.new_empty((qh.shape[0], n, qh.shape[2]))
        q_full[:, prefix:, :] = qh[:, start_q:end_q, :]
        k, v = _gather_kv(k_cache, v_cache, req_to_token[rpi, :n], q.dtype)
        out = scaled_dot_product_attention(
            q_full.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            enable_gqa=enable_gqa, scale=scaling, is_causal=True,
        ).squeeze(0).movedim(0, 1)
        o[start_q:end_q] = out[prefix:]
        start_q = end_q
    return o


def decode_attention(
    q: torch.Tensor,  # [bs, Hq, D]
    o: torch.Tensor,  # [bs, Hq, Dv]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    plan: DecodePlan,
    scaling: Optional[float],
    enable_gqa: bool,
    compact_k: Optional[torch.Tensor] = None,  # [slots, Hkv, cap, D] this layer's
    compact_v: Optional[torch.Tensor] = None,
    compact_lists: Optional[torch.Tensor] = None,  # [slots, Hkv, cap] int32 pool slots, this layer's
) -> torch.Tensor:
    """One query per request over segment A and segment B [b_start, b_end).

    A is positions [0, a_len) of the pool, or (plan.a_slot >= 0) the first a_len
    rows of the request's compact buffer (with `compact_lists`: per KV head h the
    pool rows compact_lists[a_slot, h, :a_len]), or (plan.a_slot == -2) per KV head h the
    positions plan.a_pos[i, h, :plan.a_len_per_head[i, h]] (a store's, for the rows
    of plan.a_lists)."""
    plan = plan.materialized()
    qh = q.movedim(0, 1)  # [Hq, bs, D]
    a_len, b_start, b_end = (t.tolist() for t in (plan.a_len, plan.b_start, plan.b_end))
    a_slot = plan.a_slot.tolist() if plan.a_slot is not None else [-1] * len(a_len)
    per_head = plan.a_len_per_head.tolist() if INDEXED in a_slot else None
    for i, rpi in enumerate(req_pool_indices.tolist()):
        row = req_to_token[rpi]
        if a_slot[i] == INDEXED:
            _attend_indexed(qh, o, i, k_cache, v_cache, row, plan.a_pos[i], per_head[i],
                            b_start[i], b_end[i], scaling)
            continue
        if a_slot[i] >= 0 and a_len[i] > 0:
            kb, vb = _gather_kv(k_cache, v_cache, row[b_start[i]: b_end[i]], q.dtype)
            if compact_lists is not None:
                ka, va = _listed_kv(k_cache, v_cache, compact_lists[a_slot[i], :, : a_len[i]])
            else:
                ka, va = compact_k[a_slot[i], :, : a_len[i]], compact_v[a_slot[i], :, : a_len[i]]
            k = torch.cat([ka.to(q.dtype), kb], dim=1)
            v = torch.cat([va.to(q.dtype), vb], dim=1)
            _attend_one(qh, o, i, k, v, scaling, enable_gqa)
            continue
        if a_len[i] == 0:
            slots = row[b_start[i]: b_end[i]]
        else:
            slots = torch.cat([row[: a_len[i]], row[b_start[i]: b_end[i]]])
        if slots.numel() == 0:  # nothing to attend: defined output, never NaN
            o[i].zero_()
            continue
        k, v = _gather_kv(k_cache, v_cache, slots, q.dtype)
        _attend_one(qh, o, i, k, v, scaling, enable_gqa)
    return o


def _attend_one(qh, o, i, k, v, scaling, enable_gqa) -> None:
    """Request i's query (qh [Hq, bs, D]) over k/v [Hkv, n, D] -> o[i]."""
    out = scaled_dot_product_attention(
        qh[:, i: i + 1, :].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        enable_gqa=enable_gqa, scale=scaling,
    ).squeeze(0).movedim(0, 1)
    o[i: i + 1] = out


def _attend_indexed(qh, o, i, k_cache, v_cache, row, a_pos, a_lens, b_start, b_end, scaling) -> None:
    """Request i, KV head by KV head: its query heads over the head's own positions
    a_pos[h, :a_lens[h]] then segment B [b_start, b_end)."""
    hkv = k_cache.shape[1]
    g = qh.shape[0] // hkv
    seg_b = row[b_start:b_end]
    for h in range(hkv):
        slots = torch.cat([row[a_pos[h, : a_lens[h]].long()], seg_b])
        if slots.numel() == 0:
            o[i, h * g:(h + 1) * g] = 0
            continue
        k = k_cache[slots, h].to(qh.dtype)[None]  # [1, m, D]
        v = v_cache[slots, h].to(qh.dtype)[None]
        out = scaled_dot_product_attention(qh[h * g:(h + 1) * g, i: i + 1, :], k, v, scale=scaling)
        o[i, h * g:(h + 1) * g] = out[:, 0]
