"""LFPS — Learn From the Past for Sparse indexing (ALGORITHMS.md §3;
papers/001_61778cd289a30805.txt), as pure vectorized tensor math.

Pure torch on the inputs' device: no host sync, no loop over rows or heads, no
data-dependent shape (candidate sets are masks over positions, then a fixed
`c_max`-sized buffer), so `step` and `update_tables` can be captured in a CUDA graph.

State (`LfpsState`, one per layer; row r = one request)
-------------------------------------------------------
    ver  [R, Hkv, M]   vertical table Φ_ver by absolute key position (M = max_ctx)
    sla  [R, Hkv, M]   slash table by relative offset: sla[o] is the score of the
                       diagonal "query index - key position = o". Eq. (10)'s shift
                       Φ_sla(i) <- r Φ_sla(i-1) is then implicit (no data moves).
                       Read as the paper's Φ_sla(i) at a step with n keys:
                       Φ_sla(i) = sla[n - 2 - i]  (0 for i = n - 1), i.e. Eqs. (4)
                       and (10) taken literally: the table used for the query at
                       index T holds the diagonals through the keys of query T-1.
    kbar, vbar [R, Hkv, D]  mean prefill key / value of the non-sink keys
    sigma_hat2 [R, Hq]      σ̂² = σ²/|q|² of the last prefill query (Eq. 5)
Positions < n_sink (the sink tokens, "retained on the GPU") are never in a table
or a candidate set; the serving path always attends them, and its local window.

Call sequence, per layer
------------------------
    prefill end:  state = init_tables(q_last_s, keys, values, n, scale, max_ctx)
                  (or init_tables(..., out=state, rows=rows) into a preallocated one)
    decode step, once q ([bs, Hq, D]) is computed and its key written (n counts it):
        res = step(state, q, keys, n, budget, k_max, c_max, scale, rows=rows)
        heads with res.bypass: output state.vbar (sink bypass, Step 1);
        others: attention over sink + local window + res.positions[:, :, :count]
        update_tables(state, res, n, rows=rows)      # in place, Eq. (10)
`keys` is the dense [bs, n_max, Hkv, D] view of the cache (CPU/reference path);
only the `c_max` candidate keys per (row, KV head) are read for exact q.k.
`res.scored_frac` = |C1| / (non-sink keys): the fraction scored exactly (Table 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from sgl_sparse.queryaware._dtypes import compute_dtype

_NEG_INF = float("-inf")


@dataclass
class LfpsKnobs:
    """The paper's defaults (§5 Setup): s = 32, r = 0.95, ε = 0.85, a ∈ {0.2, 0.3}."""

    s: int = 32  # prefill queries used to initialize the tables (Eq. 4)
    r: float = 0.95  # decay (Eq. 10)
    eps: float = 0.85  # sink-bypass threshold on ρ_h (Eq. 6)
    a: float = 0.2  # threshold scale (Eq. 8)
    n_local: int = 6  # w_local sums keys t-6 .. t-1 (Eq. 5)
    n_sink: int = 4  # "we retain only the first four tokens" (§5 Setup)


@dataclass
class LfpsState:
    ver: torch.Tensor  # [R, Hkv, M]
    sla: torch.Tensor  # [R, Hkv, M]
    kbar: torch.Tensor  # [R, Hkv, D]
    vbar: torch.Tensor  # [R, Hkv, D]
    sigma_hat2: torch.Tensor  # [R, Hq]


class LfpsStep(NamedTuple):
    positions: torch.Tensor  # [bs, Hkv, k_max] int32, C2 ascending, 0 after `counts`
    counts: torch.Tensor  # [bs, Hkv] int32 (0 on bypassed heads)
    bypass: torch.Tensor  # [bs, Hkv] bool: output vbar, skip the update
    scored_frac: torch.Tensor  # [bs, Hkv] float32: |C1 scored| / (n - n_sink)
    weights: torch.Tensor  # [bs, Hkv, k_max]: w_i on C2 (group mean softmax over C2), 0 after
    scored: torch.Tensor  # [bs, Hkv] int64: |C1 scored| (scored_frac's numerator)


# ---- initialization (prefill) -------------------------------------------------------
def init_tables(q_last: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: torch.Tensor,
                scale: float, max_ctx: int, knobs: LfpsKnobs = LfpsKnobs(),
                out: Optional[LfpsState] = None, rows: Optional[torch.Tensor] = None) -> LfpsState:
    """Tables from the last s prefill queries (Eq. 4) and the global priors (§4.2).

    q_last [bs, s, Hq, D]: the queries of prompt indices n-s .. n-1 (right-aligned:
    slot s-1 is index n-1; rows with n < s use their last n slots). keys/values
    [bs, n_max, Hkv, D], n [bs] prompt lengths (n_max <= max_ctx).

    w^(t) = causal softmax of query t over the non-sink keys n_sink..t (the sink is
    kept out of the tables, footnote 1), averaged over the G query heads of a KV
    head [ours: GQA aggregation]. With s' = the number of those queries that see a
non-sink key, min(s, n - n_sink) [ours, for short prompts]:
        Φ_ver(i) = 1/(2 s'(1-r)) Σ_{j=1..s'} w^(n-j)_i
        Φ_sla(i) = 1/(2 s'(1-r)) Σ_{j=1..s'} w^(n-j)_{i-j+1}  ->  sla[o], o = n-1-i
    K̄, V̄: means over the non-sink prompt keys/values; σ² = Var_i(scale q_{n-1}.k_i)
    over the same keys, σ̂² = σ²/|q_{n-1}|² per query head.
    """
    bs, s, Hq, D = q_last.shape
    n_max, Hkv = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    dt = torch.promote_types(compute_dtype(q_last), compute_dtype(keys))
    dev = keys.device
    r, ns = knobs.r, knobs.n_sink
    nn = n.to(torch.int64)
    pos = torch.arange(n_max, device=dev)
    qi = nn[:, None] - s + torch.arange(s, device=dev)[None, :]  # query index of slot j: [bs, s]
    slot_ok = qi >= ns  # a query below n_sink sees no non-sink key: not counted in s'
    q = q_last.to(dt).reshape(bs, s, Hkv, G, D)
    k = keys.to(dt)
    logits = torch.einsum("bshgd,bnhd->bhgsn", q, k) * scale  # [bs, Hkv, G, s, n_max]
    kmask = (pos[None, None, :] >= ns) & (pos[None, None, :] <= qi[:, :, None])  # [bs, s, n_max]
    kmask &= slot_ok[:, :, None]
    p = torch.softmax(logits.masked_fill(~kmask[:, None, None], _NEG_INF), dim=-1).nan_to_num(0.0)
    w = p.mean(dim=2)  # [bs, Hkv, s, n_max]; rows with no non-sink key: all 0
    s_eff = slot_ok.sum(-1).clamp(min=1).to(dt)  # [bs]
    c = 1.0 / (2.0 * s_eff * (1.0 - r))
    ver0 = w.sum(dim=2) * c[:, None, None]  # [bs, Hkv, n_max]
    # slash: the weight of query qi at key position i goes to offset o = qi - i
    off = (qi[:, :, None] - pos[None, None, :])  # [bs, s, n_max]
    off_ok = kmask & (off >= 0) & (off < max_ctx)
    sla0 = torch.zeros(bs, Hkv, max_ctx, device=dev, dtype=dt)
    src = torch.where(off_ok[:, None], w, 0.0) * c[:, None, None, None]
    idx = torch.where(off_ok, off, 0)[:, None].expand(-1, Hkv, -1, -1)
    sla0.scatter_add_(-1, idx.reshape(bs, Hkv, -1), src.reshape(bs, Hkv, -1))
    ver = torch.zeros(bs, Hkv, max_ctx, device=dev, dtype=dt)
    ver[..., :n_max] = ver0
    # global priors over the non-sink prompt keys
    kv_ok = (pos[None, :] >= ns) & (pos[None, :] < nn[:, None])  # [bs, n_max]
    cnt = kv_ok.sum(-1).clamp(min=1).to(dt)[:, None, None]
    m = kv_ok[:, :, None, None].to(dt)
    kbar = (k * m).sum(1) / cnt
    vbar = (values.to(dt) * m).sum(1) / cnt
    last = logits[:, :, :, s - 1]  # [bs, Hkv, G, n_max]: query n-1
    lm = kv_ok[:, None, None, :].to(dt)
    mu = (last * lm).sum(-1, keepdim=True) / cnt[..., None]
    var = (((last - mu) * lm) ** 2).sum(-1) / cnt  # [bs, Hkv, G]
    qn2 = (q[:, s - 1] ** 2).sum(-1)  # [bs, Hkv, G]
    sigma_hat2 = (var / qn2.clamp(min=torch.finfo(dt).tiny)).reshape(bs, Hq)
    st = LfpsState(ver=ver, sla=sla0, kbar=kbar, vbar=vbar, sigma_hat2=sigma_hat2)
    if out is None:
        return st
    rows = torch.arange(bs, device=dev) if rows is None else rows
    for f in ("ver", "sla", "kbar", "vbar", "sigma_hat2"):
        getattr(out, f)[rows] = getattr(st, f).to(getattr(out, f).dtype)
    return out


# ---- one decode step ----------------------------------------------------------------
def head_sparsity(q: torch.Tensor, keys: torch.Tensor, n: torch.Tensor, kbar: torch.Tensor,
                  sigma_hat2: torch.Tensor, scale: float, knobs: LfpsKnobs = LfpsKnobs()) -> torch.Tensor:
    """ρ_h of Eq. (6) per query head, [bs, Hq], in log space (no exp overflow):
        w_sink   = Σ_{sink keys} exp(scale q.k)  [ours: the sum over the n_sink sink
                   tokens; the paper's single K_sink is n_sink = 1]
        w_global = exp(scale q.K̄ + |q|² σ̂²/2) · n'   (Eq. 5; n' = n - n_sink, the
                   offloaded keys the log-normal estimate stands for)
        w_local  = Σ_{i=t-6..t-1} exp(scale q.k_i), t = n-1 (own key excluded as in
                   Eq. 5; positions below n_sink excluded)
    """
    bs, Hq, D = q.shape
    n_max, Hkv = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    dt = torch.promote_types(compute_dtype(q), compute_dtype(keys))
    qq = q.to(dt).reshape(bs, Hkv, G, D)
    nn = n.to(torch.int64)
    ns, nl = knobs.n_sink, knobs.n_local
    # sink keys: positions 0..n_sink-1 (n_max >= n_sink assumed)
    ks = keys[:, :ns].to(dt)  # [bs, ns, Hkv, D]
    ls = torch.logsumexp(torch.einsum("bhgd,bnhd->bhgn", qq, ks) * scale, dim=-1)
    # local keys: the nl positions before the own key, gathered (fixed size nl)
    lpos = nn[:, None] - 1 - nl + torch.arange(nl, device=q.device)[None, :]  # [bs, nl]
    lok = lpos >= ns
    li = lpos.clamp(0, n_max - 1)
    kl = torch.gather(keys.to(dt), 1, li[:, :, None, None].expand(-1, -1, Hkv, D))
    ll = (torch.einsum("bhgd,bnhd->bhgn", qq, kl) * scale).masked_fill(~lok[:, None, None, :], _NEG_INF)
    ll = torch.logsumexp(ll, dim=-1)
    noff = (nn - ns).clamp(min=1).to(dt)
    q2 = (qq * qq).sum(-1)
    lg = (qq * kbar.to(dt)[:, :, None, :]).sum(-1) * scale \
        + q2 * sigma_hat2.to(dt).reshape(bs, Hkv, G) / 2 + torch.log(noff)[:, None, None]
    rho = torch.softmax(torch.stack([ls, lg, ll], dim=-1), dim=-1)[..., 0]
    return rho.reshape(bs, Hq)


def table_views(state_ver: torch.Tensor, state_sla: torch.Tensor, n: torch.Tensor, n_max: int,
                n_sink: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Φ_ver, Φ_sla as functions of position, valid mask), each [bs, Hkv, n_max];
    valid = n_sink <= i < n; Φ_sla(i) = sla[n-2-i] (0 at i = n-1)."""
    nn = n.to(torch.int64)
    pos = torch.arange(n_max, device=n.device)
    valid = ((pos[None, :] >= n_sink) & (pos[None, :] < nn[:, None]))[:, None, :]
    ver = state_ver[..., :n_max]
    o = nn[:, None] - 2 - pos[None, :]  # [bs, n_max]
    o_ok = (o >= 0) & (o < state_sla.shape[-1])
    sla = torch.gather(state_sla, -1, o.clamp(0, state_sla.shape[-1] - 1)[:, None, :].expand(-1, state_sla.shape[1], -1))
    sla = torch.where(o_ok[:, None, :], sla, 0.0)
    return ver, sla, valid


def kurtosis_threshold(x: torch.Tensor, valid: torch.Tensor, a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (8) over the valid entries of the last dim: (τ = a·mean/κ, mean), κ =
    Σ(x-x̄)^4 / (Σ(x-x̄)^2)^2. A flat table (Σ(x-x̄)^2 = 0) has no pattern: τ = +inf
    (nothing passes) [ours]."""
    vm = valid.to(x.dtype)
    cnt = vm.sum(-1, keepdim=True).clamp(min=1)
    mean = (x * vm).sum(-1, keepdim=True) / cnt
    d = (x - mean) * vm
    m2 = (d * d).sum(-1, keepdim=True)
    m4 = (d ** 4).sum(-1, keepdim=True)
    ok = m2 > 0
    kappa = torch.where(ok, m4 / torch.where(ok, m2 * m2, 1.0), 0.0)
    tau = torch.where(ok & (kappa > 0), a * mean / torch.where(kappa > 0, kappa, 1.0), float("inf"))
    return tau, mean


def candidates(ver: torch.Tensor, sla: torch.Tensor, valid: torch.Tensor, a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(C0, C1) masks [bs, Hkv, n_max]. C0 by Eq. (7); C1 by Eq. (9): j = i + δ,
    δ ∈ {-1, 0, 1, 2}, i ∈ C0, kept when Φ_ver(j) > mean(Φ_ver) or Φ_sla(j) >
    mean(Φ_sla) (and j a valid position)."""
    tv, mv = kurtosis_threshold(ver, valid, a)
    ts, ms = kurtosis_threshold(sla, valid, a)
    c0 = ((ver > tv) | (sla > ts)) & valid
    # j ∈ C1 iff some i ∈ {j+1, j, j-1, j-2} is in C0
    f = c0.to(torch.uint8)
    grow = f.clone()
    grow[..., :-1] |= f[..., 1:]  # i = j + 1  (δ = -1)
    grow[..., 1:] |= f[..., :-1]  # i = j - 1  (δ = +1)
    grow[..., 2:] |= f[..., :-2]  # i = j - 2  (δ = +2)
    c1 = grow.bool() & ((ver > mv) | (sla > ms)) & valid
    return c0, c1


def step(state: LfpsState, q: torch.Tensor, keys: torch.Tensor, n: torch.Tensor, budget: torch.Tensor,
         k_max: int, c_max: int, scale: float, knobs: LfpsKnobs = LfpsKnobs(),
         rows: Optional[torch.Tensor] = None) -> LfpsStep:
    """One LFPS decode step (Algorithm 1, steps 1-4 of §4.2) for a batch of rows.

    q [bs, Hq, D], keys [bs, n_max, Hkv, D], n [bs] keys incl. the current token's,
    budget [bs] (Top-k size), host bounds k_max >= budget and c_max (the scored
    candidate buffer). `rows` [bs] selects the state rows (default 0..bs-1).

    1. ρ (Eq. 6) per query head; a KV head bypasses when the group mean of ρ > ε
       [ours: GQA aggregation]; bypassed heads select nothing.
    2-3. C0, C1 from the tables (Eqs. 7-9).
    4. Exact scale·q.k on C1 only (at most c_max per head; if |C1| > c_max, the
       c_max with the largest Φ_ver + Φ_sla are scored [ours]); rank by the max over
       the group's query heads [ours, as AsyncSpade's kernel]; C2 = Top-k.
    Weights for Eq. (10): softmax over C2 of each query head's logits, mean over the
    group [ours]; normalized over C2 so Σ Φ -> 0.5/(1-r) (Eq. 15).
    """
    bs, Hq, D = q.shape
    n_max, Hkv = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    dev = q.device
    dt = torch.promote_types(compute_dtype(q), compute_dtype(keys))
    rows = torch.arange(bs, device=dev) if rows is None else rows
    sv, ss = state.ver[rows].to(dt), state.sla[rows].to(dt)
    rho = head_sparsity(q, keys, n, state.kbar[rows], state.sigma_hat2[rows], scale, knobs)
    bypass = rho.reshape(bs, Hkv, G).mean(-1) > knobs.eps
    ver, sla, valid = table_views(sv, ss, n, n_max, knobs.n_sink)
    _, c1 = candidates(ver, sla, valid, knobs.a)
    c1 = c1 & ~bypass[..., None]
    # C1 into a fixed buffer of c_max positions
    cm = min(c_max, n_max)
    prio = torch.where(c1, ver + sla, _NEG_INF)
    pv, cpos = torch.topk(prio, cm, dim=-1)  # [bs, Hkv, cm]
    cok = torch.isfinite(pv)
    # gather K[b, cpos[b,h,c], h]: index the flattened (position, head) axis
    flat = keys.to(dt).reshape(bs, n_max * Hkv, D)
    fidx = cpos * Hkv + torch.arange(Hkv, device=dev)[None, :, None]  # [bs, Hkv, cm]
    kc = torch.gather(flat, 1, fidx.reshape(bs, Hkv * cm, 1).expand(-1, -1, D)).reshape(bs, Hkv, cm, D)
    lg = torch.einsum("bhgd,bhcd->bhgc", q.to(dt).reshape(bs, Hkv, G, D), kc) * scale  # [bs, Hkv, G, cm]
    rank = lg.amax(dim=2).masked_fill(~cok, _NEG_INF)
    n_c1 = cok.sum(-1)
    k = min(k_max, cm)
    count = torch.minimum(budget.to(torch.int64)[:, None], n_c1).clamp(max=k)  # [bs, Hkv]
    top = torch.topk(rank, k, dim=-1, sorted=True).indices  # candidate slots
    keep = torch.arange(k, device=dev)[None, None, :] < count[..., None]
    pos = torch.gather(cpos, -1, top)
    lsel = torch.gather(lg, -1, top[:, :, None, :].expand(-1, -1, G, -1)).masked_fill(~keep[:, :, None, :], _NEG_INF)
    wsel = torch.softmax(lsel, dim=-1).nan_to_num(0.0).mean(dim=2)  # [bs, Hkv, k]
    big = torch.iinfo(torch.int64).max
    order = torch.sort(torch.where(keep, pos, big), dim=-1)
    pos = torch.where(keep, order.values, 0)
    wsel = torch.where(keep, torch.gather(wsel, -1, order.indices), 0.0)
    if k < k_max:
        pos = torch.nn.functional.pad(pos, (0, k_max - k))
        wsel = torch.nn.functional.pad(wsel, (0, k_max - k))
    denom = (n.to(torch.int64) - knobs.n_sink).clamp(min=1)[:, None].to(torch.float32)
    frac = n_c1.to(torch.float32) / denom
    return LfpsStep(pos.to(torch.int32), count.to(torch.int32), bypass, frac, wsel, n_c1)


def update_tables(state: LfpsState, res: LfpsStep, n: torch.Tensor, knobs: LfpsKnobs = LfpsKnobs(),
                  rows: Optional[torch.Tensor] = None) -> None:
    """Eq. (10) in place, for the heads that neither bypassed nor selected nothing
    (|C2| = 0 would make 1/(2|C2|) infinite: skipped [ours]):
        Φ_ver(i) <- r Φ_ver(i) + w_i - 1/(2|C2|)
        sla[o]   <- r sla[o] + w_{t-o} - 1/(2|C2|),  t = n-1 (the relative form of
                    Φ_sla(i) <- r Φ_sla(i-1) + w_i - 1/(2|C2|))
    with w_i = 1/(2|C2|) off C2, so only C2 entries move beyond the decay.
    A skipped head keeps both tables as they are; in the relative-offset storage the
    slash diagonals thereby stay aligned with the growing sequence [ours: in the
    paper's position form a skipped step would leave Φ_sla unshifted, i.e. every
    diagonal one offset off after each bypassed step].
    """
    bs = res.counts.shape[0]
    dev = res.counts.device
    rows = torch.arange(bs, device=dev) if rows is None else rows
    ver, sla = state.ver[rows], state.sla[rows]
    M = ver.shape[-1]
    cnt = res.counts.to(torch.int64)
    active = (~res.bypass) & (cnt > 0)  # [bs, Hkv]
    K = res.positions.shape[-1]
    keep = torch.arange(K, device=dev)[None, None, :] < cnt[..., None]
    c = 0.5 / cnt.clamp(min=1).to(ver.dtype)
    inc = torch.where(keep, res.weights.to(ver.dtype) - c[..., None], 0.0)
    p = res.positions.to(torch.int64)
    new_ver = (knobs.r * ver).scatter_add(-1, torch.where(keep, p, 0).clamp(max=M - 1), inc)
    o = n.to(torch.int64)[:, None, None] - 1 - p
    o_ok = keep & (o >= 0) & (o < M)
    new_sla = (knobs.r * sla).scatter_add(-1, torch.where(o_ok, o, 0), torch.where(o_ok, inc, 0.0))
    act = active[..., None]
    state.ver[rows] = torch.where(act, new_ver, ver)
    state.sla[rows] = torch.where(act, new_sla, sla)
