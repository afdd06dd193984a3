"""Attention-output fidelity of sparse policies vs dense, on the trained model's own Q/K/V.

    python bench/quality/fidelity.py --model bench/quality/out/tiny-recall --lengths 2048,8192 \
        --budgets 64,256,1024 --out-json fid.json --out-md fid.md

Plain transformers/PyTorch: one dense forward pass over prompt + gold completion
records every layer's post-RoPE Q, K and V (a registered attention function, see
`record_qkv`, that computes exact fp32 causal attention in query chunks: memory
O(T x heads x D) for the recordings plus O(chunk x T) for the logits, so 32K fits).
At the decode positions that produce the answer's value tokens (the
queries that must reach the fact far back) each policy picks a set of key
positions per KV head (shared by its G query heads, as the serving kernels do),
and we compare attention restricted to that set with dense attention:

* rel_err: ||o_sparse - o_dense|| / ||o_dense|| over all query heads of a layer;
* overlap: |S ∩ top-|S| exact| / |S| (top by exact attention probability,
  averaged over the group's query heads; S includes sink and recent): a
  whole-set overlap, not the AsyncSpade paper's Eq. 1 ratio (that one is the
  asyncspade rows' pred_overlap);
* mass: exact attention probability that falls inside S;
* retention: |S| / n;
* fact kept: fraction of KV heads whose S holds the queried fact's key and value
  positions (and the value's alone): what recall needs.

Each layer sees dense inputs (the error does not compound through layers): this
isolates the attention approximation; task accuracy under real sparse decoding is
eval.py's job. Policies (budget B tokens per KV head):
  full; streaming (sink 4 + last B); sfi (sink 4 + Selector top-B from
  sgl_sparse.selector.core on a window of w queries ending `lag` steps earlier,
  + `recent` last tokens); quest (pages of 16 tokens, per-page key min/max bound,
  top B/16 pages + the current page); oracle (exact top-B); think examples
  only: sfi-later (the server's SFI schedule replayed on the completion: the
  selection of the last slow step before the value, which in the think variant
  is the w = 1 refresh at the think block's last ".", see `sfi_later_factory`)
  and sfi-later-every (the same with prompt_evidence "every": that refresh's
  window also holds the prompt's last queries);
  the server's sadas (window W = B until `</think>` is consumed, then full),
  asyncspade (Top-B by the query predicted from the last 4 + 1 queries, + sink +
  64 recent; column pred_overlap: the paper's overlap ratio of predicted vs exact
  Top-B) and lfps (k = B, tables from the prompt's last 32 queries evolving over
  the completion's decode steps; columns scored: fraction of keys scored exactly,
  Table 4, and bypassed: share of sink-bypassed heads), run through
  sgl_sparse's own code (`asyncspade_factory`, `LfpsRun`, `sadas_factory`).
  `--policies` picks rows (default: all, ALL_POLICIES).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import tasks  # noqa: E402

SINK = 4
QUEST_PAGE = 16


# --------------------------------------------------------------- recording
@dataclass
class LayerQKV:
    q: torch.Tensor  # [Hq, T, D] post-norm, post-RoPE
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D]
    scaling: float


# fp32 logits per query chunk of the recording forward: 2^27 elements = 512 MiB
# (softmax's output doubles it), whatever the length.
MAX_CHUNK_LOGITS = 1 << 27


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     max_logits: int = MAX_CHUNK_LOGITS) -> torch.Tensor:
    """Exact causal GQA attention in fp32, q [Hq, T, D], k/v [Hkv, T, D] -> [T, Hq, D].

    Query chunks of c rows against the keys up to the chunk's end: memory
    O(Hq * c * T) with no [T, T] mask, where SDPA's fp32 math path materializes
    Hq x T x T (32 GiB at 32K; it OOMed on an 80 GB H100)."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    chunk = max(1, min(t, max_logits // max(1, hq * t)))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        qc = qf[:, s:e].reshape(hkv, g, e - s, d)
        logits = torch.einsum("hgcd,hnd->hgcn", qc, kf[:, :e]) * scaling
        future = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
        probs = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
        del logits
        out[s:e] = torch.einsum("hgcn,hnd->chgd", probs, vf[:, :e]).reshape(e - s, hq, d)
    return out


def record_qkv(model, ids: Sequence[int], max_logits: int = MAX_CHUNK_LOGITS) -> list[LayerQKV]:
    """One dense forward over `ids`; returns every layer's Q/K/V (float32, on the model's device).

    The registered attention function records Q/K/V and computes the layer's
    attention itself (`causal_attention`): a custom attention name also makes
    transformers build no mask (one unpadded causal sequence needs none)."""
    from transformers import AttentionInterface

    store: dict[int, LayerQKV] = {}

    def recording(module, query, key, value, attention_mask, **kw):
        assert query.shape[0] == 1 and attention_mask is None, "one unpadded causal sequence"
        scaling = float(kw.get("scaling") or module.scaling)
        L = LayerQKV(query[0].float(), key[0].float(), value[0].float(), scaling)
        store[module.layer_idx] = L
        out = causal_attention(L.q, L.k, L.v, scaling, max_logits)
        return out[None].to(query.dtype), None

    AttentionInterface.register("sgl_sparse_record", recording)
    old = model.config._attn_implementation
    model.config._attn_implementation = "sgl_sparse_record"
    try:
        with torch.no_grad():
            # No KV cache and only the last position's logits: at 32K the cache and
            # the [T, vocab] logits would be dead weight.
            model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=False, logits_to_keep=1)
    finally:
        model.config._attn_implementation = old
    return [store[i] for i in sorted(store)]


# ---------------------------------------------------------- exact attention
def group_probs(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [Hq, D] one position, k [Hkv, n, D] -> probs [Hkv, G, n]."""
    hkv = k.shape[0]
    qg = q.view(hkv, -1, q.shape[-1])
    return torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) * scaling, dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention output [Hkv, G, D] of one query over keys `keep` [Hkv, n] (None: all)."""
    hkv = k.shape[0]
    qg = q.view(hkv, -1, q.shape[-1])
    logits = torch.einsum("hgd,hnd->hgn", qg, k) * scaling
    if keep is not None:
        logits = logits.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("hgn,hnd->hgd", torch.softmax(logits, dim=-1), v)


# ------------------------------------------------------------------ policies
@dataclass
class Selection:
    """What a policy attends at one step when a keep mask alone cannot say it.

    keep [Hkv, n]: the attended positions; bypass [Hkv] (LFPS's sink bypass): those
    heads output `vbar` [Hkv, D] instead of attention (their keep row is empty);
    extra: the policy's own per-step metrics (lfps: scored, bypassed; asyncspade:
    pred_overlap), averaged like the others."""

    keep: torch.Tensor
    bypass: Optional[torch.Tensor] = None
    vbar: Optional[torch.Tensor] = None
    extra: Optional[dict[str, float]] = None


# A policy maps (layer Q/K/V, decode position t, budget) -> keep mask [Hkv, n], n = t + 1
# (or a Selection).
Policy = Callable[[LayerQKV, int, int], "torch.Tensor | Selection"]


def full_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    return torch.ones(L.k.shape[0], t + 1, dtype=torch.bool, device=L.k.device)


def streaming_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    n = t + 1
    keep = torch.zeros(L.k.shape[0], n, dtype=torch.bool, device=L.k.device)
    keep[:, :SINK] = True
    keep[:, max(0, n - budget):] = True
    return keep


def oracle_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    p = group_probs(L.q[:, t], L.k[:, : t + 1], L.scaling).mean(1)  # [Hkv, n]
    return _topk_mask(p, budget)


def _topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.zeros_like(score, dtype=torch.bool)
    k = min(k, score.shape[-1])
    keep.scatter_(1, torch.topk(score, k, dim=-1).indices, True)
    return keep


def quest_policy(L: LayerQKV, t: int, budget: int, page: int = QUEST_PAGE) -> torch.Tensor:
    """Quest: per page, the upper bound sum_d max(q_d min_d, q_d max_d) of q.k; top
    ceil(budget/page) pages per KV head (bound maxed over the group's query heads),
    the page holding the current token always in."""
    n = t + 1
    k = L.k[:, :n]
    hkv, _, d = k.shape
    n_pages = math.ceil(n / page)
    padded = torch.nn.functional.pad(k, (0, 0, 0, n_pages * page - n))
    pk = padded.view(hkv, n_pages, page, d)
    valid = (torch.arange(n_pages * page, device=k.device) < n).view(1, n_pages, page, 1)
    kmin = pk.masked_fill(~valid, float("inf")).amin(2)
    kmax = pk.masked_fill(~valid, float("-inf")).amax(2)
    qg = L.q[:, t].view(hkv, -1, d)  # [Hkv, G, D]
    bound = torch.maximum(qg[:, :, None, :] * kmin[:, None], qg[:, :, None, :] * kmax[:, None]).sum(-1)
    score = bound.amax(1)  # [Hkv, pages]
    score[:, -1] = float("inf")
    sel = _topk_mask(score, max(1, math.ceil(budget / page)))
    return sel.repeat_interleave(page, dim=1)[:, :n]


def _sfi_keep(L: LayerQKV, t: int, budget: int, recent: int, qpos: Sequence[int], n0: int) -> torch.Tensor:
    """What an SFI fast step at t attends: sink + the `recent` last tokens of the
    t + 1 + the Selector's top-`budget` of A = [sink, n0 - recent), chosen at a
    slow step whose sequence length was n0, from the queries at `qpos` (its
    evidence window; all < n0). The server's `covers` rule makes t dense; its
    `min_saving` rule is not applied (0 here): this measures the selection, where the
    server by default keeps a sequence dense until a sparse step skips half of it."""
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.selector.core import SelectorKnobs, select

    n = t + 1
    hkv, dev = L.k.shape[0], L.k.device
    if SINK + budget + recent >= n:
        return full_policy(L, t, budget)
    keep = torch.zeros(hkv, n, dtype=torch.bool, device=dev)
    keep[:, :SINK] = True
    keep[:, max(0, n - recent):] = True
    lo, hi = SINK, n0 - recent
    if hi <= lo:
        return keep
    qp = torch.as_tensor(list(qpos), device=dev)
    qw = L.q[:, qp].view(hkv, -1, len(qp), L.q.shape[-1])  # [Hkv, G, w, D]
    logits = torch.einsum("hgwd,hnd->hgwn", qw, L.k[:, :n0]) * L.scaling
    future = torch.arange(n0, device=dev)[None, :] > qp[:, None]
    logits = logits.masked_fill(future[None, None], float("-inf"))[None]
    spec = SfiPolicy(budget=budget, recent=recent, sink=SINK)
    knobs = SelectorKnobs.from_specs([spec], dev, torch.float32)
    norms = L.k[:, :n0].norm(dim=-1)[None]
    pos, count = select(logits, norms, torch.tensor([lo], device=dev), torch.tensor([hi], device=dev),
                        torch.ones(1, len(qp), dtype=torch.bool, device=dev),
                        torch.tensor([budget], device=dev), knobs, budget)
    keep.scatter_(1, pos[0, :, : int(count[0])], True)
    return keep


def _selector_importable() -> bool:
    try:
        import sgl_sparse.selector.core  # noqa: F401
    except ImportError:
        return False
    return True


def sfi_policy_factory(recent: int, window: int, lag: int) -> Optional[Policy]:
    """SFI fast step at t with the selection of a slow step at t - lag, made by the
    project's Selector (sgl_sparse.selector.core.select) from the last `window`
    queries up to that step; None if sgl_sparse is not importable."""
    if not _selector_importable():
        return None

    def policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
        n0 = max(0, t - lag) + 1
        return _sfi_keep(L, t, budget, recent, range(max(0, n0 - window), n0), n0)

    return policy


def sfi_slow_steps(ex: tasks.Example, upto: int, t_max: Optional[int] = None) -> list[int]:
    """Query positions p <= upto of the decode steps the server makes slow for `ex`,
    replaying sgl_sparse.policies.sfi.HostMirror on the gold completion: the step at
    p consumes token seq[p] (its K/V and query are at p; sequence length p + 1) and
    is slow iff it is the first decode step (p = len(prompt)), seq[p] ends a
    sentence (tasks.TRIGGER_IDS = the server's trigger set on this vocabulary), or
    the t_max steps before it were all fast."""
    from sgl_sparse.config import SfiPolicy

    t_max = SfiPolicy().t_max if t_max is None else t_max
    seq = ex.prompt + ex.completion
    since, out = t_max, []  # a request starts with since_slow = t_max
    for p in range(len(ex.prompt), upto + 1):
        slow = seq[p] in tasks.TRIGGER_IDS or since >= t_max
        since = 0 if slow else since + 1
        if slow:
            out.append(p)
    return out


def sfi_later_factory(recent: int, w_prefill: int,
                      keep_prompt: bool = False) -> Optional[Callable[[tasks.Example], Policy]]:
    """`sfi-later`: what the server's SFI attends at t, from the selection of the
    last slow step p < t (`sfi_slow_steps`): a later slow step (p > len(prompt),
    e.g. right after a think block's ".") refreshes the selection from its own
    query alone (w = 1, selector/refresh.py's `later` rows), with A = [sink, p + 1 -
    recent); the first decode step's window is its query plus the prompt's last
    w_prefill - 1 queries. `keep_prompt` (`sfi-later-every`, the server's
    prompt_evidence "every"): a later slow step's window is its query plus those
    same prompt queries. Built per example (the slow steps depend on its tokens)."""
    if not _selector_importable():
        return None

    def for_example(ex: tasks.Example) -> Policy:
        def policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
            slow = sfi_slow_steps(ex, t)
            if not slow or slow[-1] == t:  # the prefill and slow steps attend densely
                return full_policy(L, t, budget)
            p, first = slow[-1], len(ex.prompt)
            prompt_q = list(range(max(0, first + 1 - w_prefill), first))  # the prompt's last w_prefill - 1
            window = prompt_q + [p] if p == first or keep_prompt else [p]
            return _sfi_keep(L, t, budget, recent, window, p + 1)

        return policy

    return for_example


# ------------------------------------------- the query-aware server policies
# asyncspade, lfps and sadas call the project's own code (sgl_sparse.queryaware's
# math, and the serving glue's prepend_sink / covers / sadas.init_row), so that these
# rows measure what the server's CPU path attends, not a re-implementation.
def _server_code_importable() -> bool:
    try:
        import sgl_sparse.policies.sadas  # noqa: F401
        import sgl_sparse.query_serving  # noqa: F401
        import sgl_sparse.queryaware.asyncspade  # noqa: F401
        import sgl_sparse.queryaware.lfps  # noqa: F401
    except ImportError:
        return False
    return True


def _indexed_keep(n: int, hkv: int, pos: torch.Tensor, count: torch.Tensor, recent: int,
                  device) -> torch.Tensor:
    """The server's keep set of an indexed row with sequence length n: segment A =
    query_serving.prepend_sink of the selection (sink, then the selected positions
    below b_start = n - recent) and segment B = [b_start, n). pos [1, Hkv, K],
    count [1, Hkv]."""
    from sgl_sparse.query_serving import prepend_sink

    b_start = max(0, n - recent)
    k_out = SINK + pos.shape[-1]  # the capacity the request needs (sink + budget)
    a_pos, a_len = prepend_sink(pos, count, torch.tensor([SINK], device=device),
                                torch.tensor([b_start], device=device), k_out)
    keep = torch.zeros(hkv, n, dtype=torch.bool, device=device)
    keep[:, b_start:] = True
    valid = torch.arange(k_out, device=device)[None, :] < a_len[0, :, None].long()
    # unused slots point at b_start, which segment B holds anyway (recent >= 1: b_start < n)
    keep.scatter_(1, torch.where(valid, a_pos[0].long(), b_start), True)
    return keep


def asyncspade_window(L: LayerQKV, t: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the server's AsyncSpade ring holds when it predicts the query of step t
    (at the end of step t - 1): the last window + 1 true queries up to t - 1 (the
    `window` regressors and the fit's target, queryaware.asyncspade's convention;
    query_serving._predict reads window + 1), right-aligned -> ([1, window + 1, Hq, D], count [1])."""
    w = window + 1
    q = L.q[:, max(0, t - w): t].permute(1, 0, 2)  # [c, Hq, D] chronological
    win = q.new_zeros(1, w, *q.shape[1:])
    win[0, w - q.shape[0]:] = q
    return win, torch.tensor([q.shape[0]], device=q.device)


def asyncspade_factory(window: Optional[int] = None, recent: Optional[int] = None,
                       ridge: Optional[float] = None) -> Optional[Callable[[tasks.Example], Policy]]:
    """`asyncspade` as the server serves it (query_serving._predict, query_aware.decide):
    at step t - 1 the next query q̂_t is predicted from the last `window` + 1 true
    queries (queryaware.asyncspade.predict_next_query: assembled ridge regression),
    the keys [sink, t + 1 - recent) are scored by it (score_positions: max over the
    group's G query heads of scale q̂.k) and the Top-`budget` per KV head kept
    (select_topk); step t attends sink + those + its last `recent` tokens. Dense:
    the prefill, the first decode step (no prediction yet) and covered steps (sink +
    budget + recent >= n). Extra metric `pred_overlap`: the paper's overlap ratio
    (Eq. 1, queryaware.asyncspade.topk_overlap) of the predicted Top-budget with the
    Top-budget of the true q_t on the same candidate range. Defaults: the server's
    AsyncSpadePolicy (window 4, recent 64, ridge 1e-2). Built per example (its
    prompt length says which steps are dense)."""
    if not _server_code_importable():
        return None
    from sgl_sparse.config import AsyncSpadePolicy
    from sgl_sparse.policies import query_aware
    from sgl_sparse.queryaware import asyncspade as aspd

    spec = AsyncSpadePolicy()
    assert spec.sink == SINK
    window = spec.window if window is None else window
    recent = spec.recent if recent is None else recent
    ridge = spec.ridge if ridge is None else ridge

    def for_example(ex: tasks.Example) -> Policy:
        first = len(ex.prompt)  # query position of the first decode step

        def policy(L: LayerQKV, t: int, budget: int) -> "torch.Tensor | Selection":
            if t <= first:  # prefill, or the first decode step: dense, nothing predicted yet
                return full_policy(L, t, budget)
            dev, hkv = L.k.device, L.k.shape[0]
            win, count = asyncspade_window(L, t, window)
            q_hat = aspd.predict_next_query(win, count, ridge)  # [1, Hq, D] fp32
            keys = L.k[:, :t].permute(1, 0, 2)[None]  # the t keys that exist at step t - 1
            n_prev = torch.tensor([t], device=dev)
            lo = torch.tensor([SINK], device=dev)
            hi = torch.tensor([max(0, t + 1 - recent)], device=dev)  # b_start of step t
            b = torch.tensor([budget], device=dev)
            pos, cnt = aspd.select_topk(aspd.score_positions(q_hat, keys, n_prev, lo, hi, L.scaling), b, budget)
            ov = aspd.topk_overlap(q_hat, L.q[:, t][None], keys, n_prev, lo, hi, L.scaling, b, budget)
            extra = {"pred_overlap": ov.mean().item()}
            if query_aware.covers(SINK, budget, recent, t + 1):
                return Selection(full_policy(L, t, budget), extra=extra)
            return Selection(_indexed_keep(t + 1, hkv, pos, cnt, recent, dev), extra=extra)

        return policy

    return for_example


def lfps_knobs():
    """The server's default LFPS knobs (config.LfpsPolicy via query_serving.lfps_knobs)."""
    from sgl_sparse.config import LfpsPolicy
    from sgl_sparse.query_serving import lfps_knobs as server_knobs

    knobs = server_knobs(LfpsPolicy())
    assert knobs.n_sink == SINK
    return knobs


class LfpsRun:
    """`lfps` on one example, as the server runs it: per layer, the tables are
    initialized at the prompt's end from its last s queries (queryaware.lfps.init_tables,
    as query_serving.on_extend), then every decode step p = len(prompt), ... in order
    runs queryaware.lfps.step and update_tables (Eq. 10), so the tables evolve as in
    serving; covered steps (sink + k + local + 1 >= n) are dense and leave the tables
    (query_serving.plan_step). One state per (layer, budget k), advanced lazily to
    the asked position (positions come in ascending order).

    Step t attends sink + C2 (Top-k of the scored candidates) + its last local + 1
    tokens (query_serving.select's segments); bypassed heads output the mean
    prefill value V̄ (query_serving.finish). Extra metrics: `scored` = res.scored_frac
    (|C1| scored exactly / non-sink keys, Table 4; bypassed heads score 0, dense
    steps 1), `bypassed` = share of KV heads that took the sink bypass.
    `c_max`: the server's candidate buffer (QueryStoreConfig.candidates, 8192)."""

    def __init__(self, ex: tasks.Example, c_max: Optional[int] = None):
        from sgl_sparse.config import QueryStoreConfig

        self.first = len(ex.prompt)
        self.knobs = lfps_knobs()
        self.c_max = QueryStoreConfig().candidates if c_max is None else c_max
        self.init: dict[int, object] = {}  # id(layer) -> tables at the prompt's end
        self.runs: dict[tuple[int, int], list] = {}  # (id(layer), k) -> [state, next step, last result]

    def _init_state(self, L: LayerQKV):
        from sgl_sparse.queryaware import lfps as lf

        if id(L) not in self.init:
            P, s = self.first, min(self.knobs.s, self.first)
            perm = lambda x: x.permute(1, 0, 2)[None]  # [H, T, D] -> [1, T, H, D]
            self.init[id(L)] = lf.init_tables(perm(L.q[:, P - s: P]), perm(L.k[:, :P]), perm(L.v[:, :P]),
                                              torch.tensor([P], device=L.k.device), L.scaling,
                                              L.k.shape[1], self.knobs)
        st = self.init[id(L)]
        return lf.LfpsState(*(x.clone() for x in (st.ver, st.sla, st.kbar, st.vbar, st.sigma_hat2)))

    def advance(self, L: LayerQKV, t: int, budget: int):
        """Run the steps up to t; the step result at t (None: t was dense)."""
        from sgl_sparse.policies import query_aware
        from sgl_sparse.queryaware import lfps as lf

        key = (id(L), budget)
        if key not in self.runs:
            self.runs[key] = [self._init_state(L), self.first, None]
        run = self.runs[key]
        if t < run[1] - 1:
            raise ValueError(f"lfps: position {t} after {run[1] - 1}: positions must ascend")
        dev = L.k.device
        while run[1] <= t:
            p = run[1]
            n = p + 1
            res = None
            if not query_aware.covers(SINK, budget, self.knobs.n_local + 1, n):
                nt = torch.tensor([n], device=dev)
                res = lf.step(run[0], L.q[:, p][None], L.k[:, :n].permute(1, 0, 2)[None], nt,
                              torch.tensor([budget], device=dev), budget, self.c_max, L.scaling, self.knobs)
                lf.update_tables(run[0], res, nt, self.knobs)
            run[1], run[2] = p + 1, res
        return run[2], run[0]

    def policy(self, L: LayerQKV, t: int, budget: int) -> Selection:
        if t < self.first:  # the prefill is dense
            return Selection(full_policy(L, t, budget), extra={"scored": 1.0, "bypassed": 0.0})
        res, state = self.advance(L, t, budget)
        if res is None:  # covered: dense, every key scored
            return Selection(full_policy(L, t, budget), extra={"scored": 1.0, "bypassed": 0.0})
        hkv, dev = L.k.shape[0], L.k.device
        keep = _indexed_keep(t + 1, hkv, res.positions, res.counts, self.knobs.n_local + 1, dev)
        bypass = res.bypass[0]
        keep[bypass] = False  # the server attends nothing for them (a_len 0) and outputs V̄
        return Selection(keep, bypass=bypass, vbar=state.vbar[0],
                         extra={"scored": res.scored_frac.mean().item(), "bypassed": bypass.float().mean().item()})


def lfps_factory(c_max: Optional[int] = None) -> Optional[Callable[[tasks.Example], Policy]]:
    if not _server_code_importable():
        return None
    return lambda ex: LfpsRun(ex, c_max).policy


def sadas_factory() -> Optional[Callable[[tasks.Example], Policy]]:
    """`sadas` (ALGORITHMS.md §2): window mode (sink + last W, W = the row's budget)
    until the step that consumes `</think>`, full attention from then on (latched).
    The state at step t is sgl_sparse.policies.sadas.init_row's replay of the prompt
    and the tokens consumed through step t (seq[len(prompt) .. t]), i.e. the server's
    update with y_{t-1} = seq[t]. Plain prompts have no think tokens: window mode
    throughout (= streaming with W = budget). Think prompts end in `<think>`; the
    answer comes after `</think>`: full. The prefill is dense."""
    if not _server_code_importable():
        return None
    from sgl_sparse.config import SadasPolicy
    from sgl_sparse.policies import sadas

    think_ids = (tasks.ID[tasks.THINK], tasks.ID[tasks.END_THINK])

    def for_example(ex: tasks.Example) -> Policy:
        first, seq = len(ex.prompt), ex.prompt + ex.completion

        def policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
            if t < first:
                return full_policy(L, t, budget)
            init = sadas.init_row(SadasPolicy(window=budget, sink=SINK), ex.prompt, seq[first: t + 1], think_ids)
            return full_policy(L, t, budget) if init.latch else streaming_policy(L, t, budget)

        return policy

    return for_example


# ------------------------------------------------------------------ metrics
EXTRA_COLUMNS = ("scored", "bypassed", "pred_overlap")  # blank (None) for the policies without them


def step_metrics(L: LayerQKV, t: int, keep: "torch.Tensor | Selection",
                 fact: Sequence[int] = ()) -> dict[str, float]:
    """Metrics of one query; `fact`: the queried fact's key position then its value
    positions (tasks.Example.fact_pos, + 1 ...): fact_kept = fraction of KV heads whose
    set holds all of them, value_kept = the same for the value tokens alone (the
    induction copy reads the value's key, which carries the preceding KEY).
    A Selection's bypassed heads output its vbar and keep nothing (mass, retention
    and fact kept 0 for them); the overlap is averaged over the heads that keep
    something (absent if none does). A non-finite metric raises: a NaN never
    reaches a mean."""
    sel = keep if isinstance(keep, Selection) else Selection(keep)
    keep = sel.keep
    q, k, v = L.q[:, t], L.k[:, : t + 1], L.v[:, : t + 1]
    dense = attend(q, k, v, L.scaling)
    sparse = attend(q, k, v, L.scaling, keep)
    if sel.bypass is not None:  # where, not arithmetic: the empty rows' NaN must not leak
        sparse = torch.where(sel.bypass[:, None, None], sel.vbar[:, None, :].to(sparse.dtype), sparse)
    err = ((sparse - dense).norm() / dense.norm().clamp(min=1e-30)).item()
    p = group_probs(q, k, L.scaling).mean(1)  # [Hkv, n]
    sizes = keep.sum(-1)
    overlaps = []
    for h in range(keep.shape[0]):
        m = int(sizes[h])
        if m == 0:
            continue
        top = torch.topk(p[h], m).indices
        overlaps.append(keep[h, top].float().mean().item())
    out = {"rel_err": err, "mass": (p * keep).sum(-1).mean().item(),
           "retention": (sizes.float().mean() / (t + 1)).item()}
    if overlaps:
        out["overlap"] = sum(overlaps) / len(overlaps)
    if fact:
        f = keep[:, list(fact)]
        out["fact_kept"] = f.all(-1).float().mean().item()
        out["value_kept"] = f[:, 1:].all(-1).float().mean().item()
    out.update(sel.extra or {})
    bad = {key: val for key, val in out.items() if not math.isfinite(val)}
    if bad:
        raise FloatingPointError(f"non-finite metrics at position {t}: {bad}")
    return out


def decode_positions(ex: tasks.Example, which: str = "answer") -> list[int]:
    """Query positions whose next token is an answer value token ('answer'), or
    every completion position ('completion')."""
    seq = ex.prompt + ex.completion
    start = len(ex.prompt) - 1
    pos = range(start, len(seq) - 1)
    if which == "completion":
        return list(pos)
    vals = set(ex.answer)
    first = [p for p in pos if seq[p + 1] in vals]
    return first[: len(ex.answer)]


# Every policy, in table order. sfi-later(-every) apply to think and think-long examples only (plain
# completions have no sentence end before the value, so their last slow step is the
# first decode step: `sfi`'s case).
ALL_POLICIES = ("full", "streaming", "sadas", "sfi", "sfi-later", "sfi-later-every", "quest",
                "asyncspade", "lfps", "oracle")
THINK_ONLY = ("sfi-later", "sfi-later-every")


def evaluate(model, lengths: Sequence[int], budgets: Sequence[int], n_examples: int = 2,
             variants: Sequence[str] = ("plain", "think"), sfi_recent: int = 256, sfi_window: int = 32,
             sfi_lag: int = 1, seed: int = 777, depth: float = 0.25, which: str = "answer",
             policies: Sequence[str] = ALL_POLICIES, asyncspade_window: Optional[int] = None,
             asyncspade_recent: Optional[int] = None, lfps_candidates: Optional[int] = None) -> dict:
    """Mean metrics per (length, variant, policy, budget) over examples x positions x
    layers; example i has variant variants[i % len(variants)]. `policies`: names
    from ALL_POLICIES (sfi-later and sfi-later-every: think examples only).
    Budget B per policy: streaming/sadas the window, sfi/asyncspade/quest/oracle
    the selected tokens, lfps its Top-k."""
    unknown = [n for n in policies if n not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    fixed: dict[str, Optional[Policy]] = {
        "full": full_policy, "streaming": streaming_policy, "quest": quest_policy,
        "sfi": sfi_policy_factory(sfi_recent, sfi_window, sfi_lag), "oracle": oracle_policy,
    }
    # Built per example (they depend on its tokens or keep state across its steps).
    # The first slow step's window is the server's w_prefill queries: sfi_window here.
    per_example: dict[str, Optional[Callable[[tasks.Example], Policy]]] = {
        "sfi-later": sfi_later_factory(sfi_recent, sfi_window),
        "sfi-later-every": sfi_later_factory(sfi_recent, sfi_window, keep_prompt=True),
        "sadas": sadas_factory(),
        "asyncspade": asyncspade_factory(asyncspade_window, asyncspade_recent),
        "lfps": lfps_factory(lfps_candidates),
    }
    why = {n: "sgl_sparse.selector.core not importable" for n in ("sfi", "sfi-later", "sfi-later-every")}
    missing = {n: why.get(n, "sgl_sparse (queryaware / query_serving) not importable") for n in policies
               if (fixed[n] if n in fixed else per_example[n]) is None}
    rows = []
    for length in lengths:
        acc: dict[tuple[str, str, int], list[dict]] = {}
        for i in range(n_examples):
            ex = tasks.make_example(length, depth, variants[i % len(variants)], seed + i)
            pols: dict[str, Policy] = {}
            for name in policies:  # in ALL_POLICIES' order whatever the caller's
                if name in missing or (name in THINK_ONLY and ex.variant not in tasks.THINK_VARIANTS):
                    continue
                pols[name] = fixed[name] if name in fixed else per_example[name](ex)
            fact = [ex.fact_pos + j for j in range(1 + tasks.VALUE_LEN)]
            layers = record_qkv(model, ex.prompt + ex.completion)
            for t in decode_positions(ex, which):
                for L in layers:
                    for name, pol in pols.items():
                        for b in ([0] if name == "full" else budgets):
                            try:
                                m = step_metrics(L, t, pol(L, t, b), fact)
                            except FloatingPointError as e:
                                raise FloatingPointError(f"{name} budget {b}, length {length}: {e}") from None
                            acc.setdefault((ex.variant, name, b), []).append(m)
            del layers
        order = {n: i for i, n in enumerate(ALL_POLICIES)}
        for (variant, name, b), ms in sorted(acc.items(), key=lambda kv: (variants.index(kv[0][0]), order[kv[0][1]],
                                                                          kv[0][2])):
            row = {"length": length, "variant": variant, "policy": name,
                   "budget": b if name != "full" else None, "samples": len(ms)}
            for key in dict.fromkeys(k for m in ms for k in m):
                vals = [m[key] for m in ms if key in m]  # overlap: samples where some head keeps a set
                row[key] = sum(vals) / len(vals)
                if key == "rel_err":
                    row["rel_err_max"] = max(vals)
            row.setdefault("overlap", None)
            for key in EXTRA_COLUMNS:
                row.setdefault(key, None)
            rows.append(row)
    from_cfg = {}
    if _server_code_importable():
        from sgl_sparse.config import AsyncSpadePolicy, QueryStoreConfig

        spec = AsyncSpadePolicy()
        from_cfg = {"asyncspade_window": spec.window if asyncspade_window is None else asyncspade_window,
                    "asyncspade_recent": spec.recent if asyncspade_recent is None else asyncspade_recent,
                    "lfps": {**vars(lfps_knobs()),
                             "candidates": QueryStoreConfig().candidates if lfps_candidates is None else lfps_candidates}}
    return {"rows": rows, "not_available": missing,
            "settings": {"sink": SINK, "quest_page": QUEST_PAGE, "sfi_recent": sfi_recent,
                         "sfi_window": sfi_window, "sfi_lag": sfi_lag, "depth": depth, "positions": which,
                         "n_examples": n_examples, "variants": list(variants), "policies": list(policies),
                         **from_cfg}}


def _fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    s = result["settings"]
    qa = ""
    if "asyncspade_window" in s:
        lf = s["lfps"]
        qa = (f" asyncspade: window {s['asyncspade_window']} queries, recent {s['asyncspade_recent']}; "
              f"lfps: s {lf['s']}, a {lf['a']}, r {lf['r']}, eps {lf['eps']}, local {lf['n_local']}, "
              f"<= {lf['candidates']} candidates scored; sadas: window = budget, full after `</think>`.")
    lines = [
        f"Attention fidelity per layer at the answer's decode positions (dense inputs per layer; "
        f"sink {s['sink']}, sfi recent {s['sfi_recent']} / window {s['sfi_window']} queries / lag {s['sfi_lag']}, "
        f"quest pages {s['quest_page']}; fact at depth {s['depth']}; {s['n_examples']} examples per length, "
        f"variants {', '.join(s['variants'])} in turn). sfi-later: the selection of the server's last slow "
        f"step before the value (think: the w = 1 refresh at the think block's last `.`).{qa} "
        f"Fact kept: fraction of KV heads whose set holds the fact's key and value / the value. "
        f"Top-k overlap: |S ∩ exact top-|S|| / |S| of the whole attended set S; pred. overlap (asyncspade): "
        f"the paper's overlap ratio, predicted vs true query's Top-B on the candidate range; "
        f"scored (lfps): fraction of the non-sink keys scored exactly (Table 4); bypassed (lfps): "
        f"share of KV heads that output V̄.", "",
        "| length | variant | policy | budget | retention | rel. error (mean / max) | top-k overlap "
        "| attn. mass kept | fact kept (K+V / V) | pred. overlap | scored | bypassed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b = "-" if r["budget"] is None else r["budget"]
        lines.append(f"| {r['length']} | {r['variant']} | {r['policy']} | {b} | {r['retention']:.3f} | "
                     f"{r['rel_err']:.4f} / {r['rel_err_max']:.4f} | {_fmt(r['overlap'])} | {r['mass']:.3f} | "
                     f"{r['fact_kept']:.3f} / {r['value_kept']:.3f} | {_fmt(r['pred_overlap'])} | "
                     f"{_fmt(r['scored'], '.4f')} | {_fmt(r['bypassed'])} |")
    for n, why in result["not_available"].items():
        lines.append(f"| all | all | {n} | - | not available: {why} | | | | | | | |")
    return "\n".join(lines) + "\n"


def load_model(path: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--budgets", default="64,256,1024")
    ap.add_argument("--n", type=int, default=2, help="examples per length (variants in turn)")
    ap.add_argument("--variants", default="plain,think",
                    help="comma list; think examples also get sfi-later (README)")
    ap.add_argument("--depth", type=float, default=0.25)
    ap.add_argument("--sfi-recent", type=int, default=256)
    ap.add_argument("--sfi-window", type=int, default=32)
    ap.add_argument("--sfi-lag", type=int, default=1)
    ap.add_argument("--positions", choices=("answer", "completion"), default="answer")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES),
                    help="comma list (default: all); sfi-later* rows come from think examples only")
    ap.add_argument("--asyncspade-window", type=int, help="queries regressed from (default: the server's, 4)")
    ap.add_argument("--asyncspade-recent", type=int, help="recent tokens attended (default: the server's, 64)")
    ap.add_argument("--lfps-candidates", type=int,
                    help="max |C1| scored per KV head (default: the server's query_aware.lfps.candidates, 8192)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-json")
    ap.add_argument("--out-md")
    a = ap.parse_args()
    model = load_model(a.model, a.device)
    res = evaluate(model, [int(x) for x in a.lengths.split(",")], [int(x) for x in a.budgets.split(",")],
                   a.n, variants=a.variants.split(","), sfi_recent=a.sfi_recent, sfi_window=a.sfi_window,
                   sfi_lag=a.sfi_lag, depth=a.depth, which=a.positions, policies=a.policies.split(","),
                   asyncspade_window=a.asyncspade_window, asyncspade_recent=a.asyncspade_recent,
                   lfps_candidates=a.lfps_candidates)
    res["model"] = a.model
    md = markdown(res)
    report.emit(res, md, a.out_json, a.out_md)


if __name__ == "__main__":
    main()
