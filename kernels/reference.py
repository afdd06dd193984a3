"""Plain-PyTorch references for the kernels in this package.

Written for obviousness, not speed: explicit Python loops over requests and
KV heads, explicit gathers, and float64 (CPU) / float32 (CUDA) math. They do
host syncs (``.item()``) freely and must never be used in a serving path.

The references return **float32** outputs (more precise than the kernels,
which round to the input dtype), so tests can measure the kernels' error.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "two_segment_decode_ref",
    "pack_compact_ref",
    "dense_decode_ref",
    "quest_bounds_ref",
    "quest_page_scores_ref",
    "token_scores_ref",
    "token_scores_at_ref",
]


def _default_compute_dtype(device: torch.device) -> torch.dtype:
    # float64 is exact enough to be "the truth" and cheap on CPU; on GPUs fp64
    # can be slow, and fp32 is still ~100x more precise than bf16.
    return torch.float64 if device.type == "cpu" else torch.float32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """Softmax attention of G query rows over L keys, in the dtype of q.

    q: [G, D], k/v: [L, D]. Returns (out [G, D], lse [G]) with natural-log
    LSE; with L == 0 returns zeros and -inf.
    """
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], float("-inf"), dtype=q.dtype, device=q.device)
    scores = (q @ k.T) * sm_scale  # [G, L]
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[:, None])
    return p @ v, lse


def two_segment_decode_ref(
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
    return_lse: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    a_pos: Optional[torch.Tensor] = None,
    a_pos_slots: bool = False,
    a_lists: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    row_mask: Optional[torch.Tensor] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    **_tuning_kwargs,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference for :func:`two_segment_decode` (same positional signature).

    Keys of request b, KV head h are ``a_k[a_slot[b], h, :a_len[b, h]]`` (or, when
    ``a_slot[b] < 0``, pool positions ``[0, min(a_len[b, h], b_start[b]))``; or,
    when ``a_slot[b] == -2`` and ``a_pos`` is given, pool positions
    ``a_pos[b, h, :min(a_len[b, h], cap_pos, b_start[b])]`` clamped into
    ``[0, b_start[b])``; with ``a_pos_slots`` the entries are pool slots, clamped
    into the pool; with ``a_lists = (rows, pos, length)``, a row with ``rows[b] >= 0``
    lists ``pos[rows[b], h, :length[rows[b], h]]`` instead, capped at its width)
    followed by
    ``k_pool[req_to_token[req_pool_idx[b], b_start[b]:b_end[b]], h]``.
    Rows with ``row_mask[b] != 1`` are left at their initial value (zeros in
    ``out``, -inf in ``lse``): the kernel does not write them.
    Keys and values (any dtype, fp8 included) are dequantized as ``k * k_scale``,
    ``v * v_scale`` (None: 1).
    Kernel tuning kwargs (num_splits, block_n, ...) are accepted and ignored.
    Returns float32 ``o [bs, Hq, D]`` (and natural-log ``lse [bs, Hq]``).
    """
    cd = compute_dtype or _default_compute_dtype(q.device)
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    cap = a_k.shape[2]

    out = torch.zeros((bs, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((bs, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bs):
        if row_mask is not None and int(row_mask[b].item()) != 1:
            continue
        rp = int(req_pool_idx[b].item())
        s, e = int(b_start[b].item()), int(b_end[b].item())
        b_tokens = req_to_token[rp, s:e].long() if e > s else req_to_token.new_zeros(0).long()
        slot = int(a_slot[b].item())
        indexed = a_pos is not None and slot == -2
        # the row's list and lengths: its own, or a_lists' row
        lists, lens, row = a_pos, a_len, b
        if a_lists is not None and int(a_lists[0][b].item()) >= 0:
            lists, lens, row = a_lists[1], a_lists[2], int(a_lists[0][b].item())
        for h in range(num_kv_heads):
            lim = min(s, lists.shape[2]) if indexed else (s if slot < 0 else cap)
            n_a = min(max(int(lens[row, h].item()), 0), lim)
            if n_a > 0 and indexed:  # in place: the listed positions
                if a_pos_slots:
                    a_tokens = lists[row, h, :n_a].long().clamp(0, k_pool.shape[0] - 1)
                else:
                    a_tokens = req_to_token[rp, lists[row, h, :n_a].long().clamp(0, s - 1)].long()
                ka, va = k_pool[a_tokens, h], v_pool[a_tokens, h]
            elif n_a > 0 and slot < 0:  # in place: positions [0, n_a) of the pool
                a_tokens = req_to_token[rp, :n_a].long()
                ka, va = k_pool[a_tokens, h], v_pool[a_tokens, h]
            elif n_a > 0:
                ka, va = a_k[slot, h, :n_a], a_v[slot, h, :n_a]
            else:  # a_slot may be garbage here: do not touch it
                ka = a_k.new_zeros((0, head_dim))
                va = a_v.new_zeros((0, head_dim))
            k = torch.cat([ka.to(cd), k_pool[b_tokens, h].to(cd)], dim=0) * (1.0 if k_scale is None else k_scale)
            v = torch.cat([va.to(cd), v_pool[b_tokens, h].to(cd)], dim=0) * (1.0 if v_scale is None else v_scale)
            heads = slice(h * group, (h + 1) * group)
            o_bh, lse_bh = _attend(q[b, heads].to(cd), k, v, sm_scale)
            out[b, heads] = o_bh.float()
            lse[b, heads] = lse_bh.float()
    if return_lse:
        return out, lse
    return out


def dense_decode_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    return_lse: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Full (dense) decode attention over positions ``[0, seq_lens[b])``.

    Same conventions as SGLang's paged KV pool with page_size 1. GQA: query
    head ``j`` uses KV head ``j // (Hq / Hkv)``. Returns float32.
    """
    cd = compute_dtype or _default_compute_dtype(q.device)
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros((bs, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((bs, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bs):
        n = int(seq_lens[b].item())
        if n == 0:
            continue
        tokens = req_to_token[int(req_pool_idx[b].item()), :n].long()
        k = k_pool[tokens].to(cd)  # [n, Hkv, D]
        v = v_pool[tokens].to(cd)
        qb = q[b].to(cd).view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * sm_scale
        l = torch.logsumexp(scores, dim=-1)  # [Hkv, G]
        p = torch.exp(scores - l[..., None])
        o = torch.einsum("hgn,nhd->hgd", p, v)
        out[b] = o.reshape(num_q_heads, head_dim).float()
        lse[b] = l.reshape(num_q_heads).float()
    if return_lse:
        return out, lse
    return out


def pack_compact_ref(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    sel_pos: torch.Tensor,
    sel_len: torch.Tensor,
    do_pack: torch.Tensor,
    a_k: torch.Tensor,
    a_v: torch.Tensor,
    a_slot: torch.Tensor,
    a_len: torch.Tensor,
    **_tuning_kwargs,
) -> None:
    """Reference for :func:`pack_compact` (same positional signature; in place).

    For every request b with ``do_pack[b]`` and every KV head h, with
    ``n = clamp(sel_len[b, h], 0, cap)``::

        a_k[a_slot[b], h, i] = k_pool[req_to_token[req_pool_idx[b], sel_pos[b, h, i]], h]
        a_v[...]             = v_pool[...]                    for i < n
        a_len[b, h] = n

    Rows ``>= n`` of the slot and all requests without ``do_pack`` are left
    untouched.
    """
    bs, num_kv_heads, cap = sel_pos.shape
    for b in range(bs):
        if not bool(do_pack[b].item()):
            continue
        rp = int(req_pool_idx[b].item())
        slot = int(a_slot[b].item())
        for h in range(num_kv_heads):
            n = min(max(int(sel_len[b, h].item()), 0), cap)
            a_len[b, h] = n
            if n == 0:
                continue
            tokens = req_to_token[rp, sel_pos[b, h, :n].long()].long()
            a_k[slot, h, :n] = k_pool[tokens, h]
            a_v[slot, h, :n] = v_pool[tokens, h]


def pack_compact_layers_ref(
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    sel_pos: torch.Tensor,
    sel_len: torch.Tensor,
    sink: torch.Tensor,
    do_pack: torch.Tensor,
    a_k: torch.Tensor,
    a_v: torch.Tensor,
    a_slot: torch.Tensor,
    a_len: torch.Tensor,
) -> None:
    """Reference for :func:`pack_compact_layers` (the pools as per-layer lists):
    per layer, :func:`pack_compact_ref` with the sink prefix spelled out as
    positions ``[0, sink)`` followed by ``sel_pos[l * bs + b, h]``."""
    bs, num_kv_heads = sel_len.shape
    cap = a_k.shape[3]
    j = torch.arange(cap, device=sel_pos.device)
    s = sink.long()[:, None, None]
    for layer in range(len(k_pools)):
        sel = sel_pos[layer * bs: (layer + 1) * bs].long()
        picked = torch.gather(sel, 2, (j - s).clamp(0, sel.shape[2] - 1).expand(bs, num_kv_heads, cap))
        pos = torch.where(j < s, j, picked)
        pack_compact_ref(k_pools[layer], v_pools[layer], req_to_token, req_pool_idx, pos, sel_len, do_pack,
                         a_k[layer], a_v[layer], a_slot, a_len)


# -----------------------------------------------------------------------------
# Quest page bounds and scores; token scores (AsyncSpade / LFPS)
# -----------------------------------------------------------------------------

QUEST_PAGE = 16


def quest_bounds_ref(
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    slot: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
) -> None:
    """Reference for :func:`quest_bounds_update` (in place, same signature).

    For each row with ``slot >= 0`` and each page ``p`` in
    ``[lo // 16, min(ceil(hi / 16), max_pages))``: ``kmin/kmax[slot, h, p]`` =
    element-wise min/max of the keys at positions ``[16p, min(16p + 16, hi))`` (in
    the bounds' dtype: over an fp8 pool, the model's).
    """
    max_pages = kmin.shape[2]
    for b in range(slot.shape[0]):
        s = int(slot[b].item())
        if s < 0:
            continue
        rp = int(req_pool_idx[b].item())
        l, h_ = max(int(lo[b].item()), 0), int(hi[b].item())
        for p in range(l // QUEST_PAGE, min(-(-h_ // QUEST_PAGE), max_pages)):
            toks = req_to_token[rp, p * QUEST_PAGE : min(p * QUEST_PAGE + QUEST_PAGE, h_)].long()
            k = k_pool[toks]  # [n, Hkv, D]
            if k.dtype not in (torch.float32, torch.float64):
                k = k.float()  # exact for bf16 / fp16 / fp8 (torch has no CPU min / max of fp8)
            kmin[s, :, p] = k.amin(dim=0).to(kmin.dtype)
            kmax[s, :, p] = k.amax(dim=0).to(kmax.dtype)


def quest_page_scores_ref(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slot: torch.Tensor,
    first_page: torch.Tensor,
    last_page: torch.Tensor,
) -> torch.Tensor:
    """Reference for :func:`quest_page_scores` in float64: the literal formula
    ``max_g sum_d max(q_gd * kmin_d, q_gd * kmax_d)``; -inf outside the range."""
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads, max_pages = kmin.shape[1], kmin.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.full((bs, num_kv_heads, max_pages), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(bs):
        s = int(slot[b].item())
        f, l = max(int(first_page[b].item()), 0), min(int(last_page[b].item()), max_pages)
        if s < 0 or l <= f:
            continue
        for h in range(num_kv_heads):
            qg = q[b, h * group : (h + 1) * group].double()[:, None, :]  # [G, 1, D]
            lo_, hi_ = kmin[s, h, f:l].double()[None], kmax[s, h, f:l].double()[None]  # [1, P, D]
            bound = torch.maximum(qg * lo_, qg * hi_).sum(-1)  # [G, P]
            out[b, h, f:l] = bound.amax(0)
    return out.float()


def token_scores_ref(
    q_hat: torch.Tensor,
    k_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    n_max: int,
    keys_as: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Reference for :func:`token_scores` in float64, returned as fp32 ``[bs, Hkv, n_max]``:
    ``max_g (q_hat[b, g] . k[pos, h]) * sm_scale`` on ``[lo, min(hi, n_max, max_ctx))``, -inf elsewhere.
    ``keys_as``: each row's gathered keys ``[n, Hkv, D]`` -> the float64 keys scored
    (default: the keys themselves; ``index_token_scores_ref``: their int8 copies)."""
    bs, num_q_heads, _ = q_hat.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.full((bs, num_kv_heads, n_max), float("-inf"), dtype=torch.float64, device=q_hat.device)
    for b in range(bs):
        l, h_ = max(int(lo[b].item()), 0), min(int(hi[b].item()), n_max, req_to_token.shape[1])
        if h_ <= l:
            continue
        toks = req_to_token[int(req_pool_idx[b].item()), l:h_].long()
        k = keys_as(k_pool[toks]) if keys_as is not None else k_pool[toks].double()  # [n, Hkv, D]
        qb = q_hat[b].double().view(num_kv_heads, group, -1)
        s = torch.einsum("hgd,nhd->hgn", qb, k) * sm_scale
        out[b, :, l:h_] = s.amax(1)
    return out.float()


def token_scores_at_ref(
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
) -> torch.Tensor:
    """Reference for :func:`token_scores_at` in float64, fp32 ``[bs, Hkv, C]``: the
    score of each listed position (index ``< cand_len``, position in ``[lo, hi)``),
    -inf for every other entry."""
    bs, num_q_heads, _ = q_hat.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    c = cand_pos.shape[2]
    max_ctx = req_to_token.shape[1]
    out = torch.full((bs, num_kv_heads, c), float("-inf"), dtype=torch.float64, device=q_hat.device)
    for b in range(bs):
        rp = int(req_pool_idx[b].item())
        l = int(lo[b].item()) if lo is not None else 0
        h_ = int(hi[b].item()) if hi is not None else max_ctx
        l, h_ = max(l, 0), min(h_, max_ctx)
        for h in range(num_kv_heads):
            n = c if cand_len is None else min(max(int(cand_len[b, h].item()), 0), c)
            qg = q_hat[b, h * group : (h + 1) * group].double()
            for i in range(n):
                pos = int(cand_pos[b, h, i].item())
                if l <= pos < h_:
                    k = k_pool[int(req_to_token[rp, pos].item()), h].double()
                    out[b, h, i] = (qg @ k).max() * sm_scale
    return out.float()
