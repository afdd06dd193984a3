"""`quest` (baseline, Quest): page-level query-aware Top-K from per-page key bounds.

Page p of a request = its positions [16p, 16p + 16). Per page and KV head the
store keeps the elementwise min and max of the page's keys. At a decode step, per
query head, the page's upper bound of q.k is
    score(p) = sum_d max(q_d * kmin_d, q_d * kmax_d)
GQA [ours]: a KV head ranks its pages by the max of this bound over its group's
query heads (an upper bound for every head of the group, as the paper's bound is
for one head). The Top budget/16 pages among those with a position in
[sink, b_start) are kept; segment A = the sink positions [0, min(sink, b_start))
then the chosen pages' positions clipped to [sink, b_start), ascending.

Pure tensor functions (no host sync, fixed shapes given the host bounds).
"""

from __future__ import annotations

import torch

from sgl_sparse.config import QUEST_PAGE, QuestPolicy
from sgl_sparse.policies import query_aware
from sgl_sparse.policies.base import PolicyId, RowInit

ID = PolicyId.QUEST
PAGE = QUEST_PAGE


def init_row(spec: QuestPolicy, prompt_ids, output_ids, think_ids) -> RowInit:
    return query_aware.init_row(ID, spec, spec.recent)


windowed = query_aware.windowed


def page_bounds(keys: torch.Tensor, n: int, max_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [>= n, Hkv, D] of positions 0..n-1 -> (kmin, kmax) [Hkv, max_pages, D]
    (float32, float64 kept); pages past the sequence get (+inf, -inf) bounds [never
    read: never candidates]."""
    hkv, d = keys.shape[1], keys.shape[2]
    pages = -(-n // PAGE)
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32  # (torch has no fp8 promotion)
    k = keys[:n].to(dt)
    pad = pages * PAGE - n
    lo = torch.cat([k, k.new_full((pad, hkv, d), float("inf"))]).view(pages, PAGE, hkv, d).amin(1)
    hi = torch.cat([k, k.new_full((pad, hkv, d), float("-inf"))]).view(pages, PAGE, hkv, d).amax(1)
    kmin = keys.new_full((hkv, max_pages, d), float("inf"), dtype=dt)
    kmax = keys.new_full((hkv, max_pages, d), float("-inf"), dtype=dt)
    kmin[:, :pages] = lo.movedim(0, 1)
    kmax[:, :pages] = hi.movedim(0, 1)
    return kmin, kmax


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [bs, Hq, D], kmin/kmax [bs, Hkv, P, D] -> [bs, Hkv, P] float32 (float64 in):
    max over the group's query heads of sum_d max(q_d kmin_d, q_d kmax_d)."""
    bs, hq, d = q.shape
    hkv = kmin.shape[1]
    dt = torch.promote_types(torch.promote_types(q.dtype, kmin.dtype), torch.float32)
    qg = q.to(dt).view(bs, hkv, hq // hkv, 1, d)
    lo, hi = kmin.to(dt)[:, :, None], kmax.to(dt)[:, :, None]  # [bs, Hkv, 1, P, D]
    s = torch.maximum(qg * lo, qg * hi).sum(-1)  # [bs, Hkv, G, P]
    return s.amax(2)


def select_positions(scores: torch.Tensor, sink: torch.Tensor, b_start: torch.Tensor,
                     budget: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [bs, Hkv, P], per-row sink / b_start / budget [bs] (budget in tokens,
    a multiple of 16) -> (positions [bs, Hkv, k_max] int32 ascending in the first
    `count` entries, 0 after; count [bs, Hkv] int32). k_max >= sink + budget."""
    bs, hkv, P = scores.shape
    dev = scores.device
    sink, b_start = sink.long(), b_start.long()
    first = torch.arange(P, device=dev) * PAGE  # [P]
    # a page is a candidate if it holds a position in [sink, b_start)
    cand = (first[None, :] + PAGE > sink[:, None]) & (first[None, :] < b_start[:, None])  # [bs, P]
    s = scores.masked_fill(~cand[:, None, :], float("-inf"))
    want = torch.minimum((budget.long() // PAGE)[:, None], cand.sum(-1, keepdim=True)).expand(bs, hkv)
    k = min(P, max(1, k_max // PAGE + 1))
    top = torch.topk(s, k, dim=-1).indices  # [bs, Hkv, k]
    keep = torch.arange(k, device=dev)[None, None, :] < want[..., None]
    chosen = torch.zeros(bs, hkv, P, dtype=torch.bool, device=dev)
    chosen.scatter_(-1, top, keep)
    n_pos = P * PAGE
    pos = torch.arange(n_pos, device=dev)
    in_a = chosen.repeat_interleave(PAGE, dim=-1) & (pos >= sink[:, None, None]) & (pos < b_start[:, None, None])
    in_a |= (pos < torch.minimum(sink, b_start)[:, None, None])
    count = in_a.sum(-1)
    big = torch.iinfo(torch.int64).max
    srt = torch.sort(torch.where(in_a, pos, big), dim=-1).values[..., :k_max]
    if srt.shape[-1] < k_max:
        srt = torch.nn.functional.pad(srt, (0, k_max - srt.shape[-1]), value=big)
    out = torch.where(srt == big, 0, srt)
    return out.to(torch.int32), count.clamp(max=k_max).to(torch.int32)
