"""After a slow step: run the Selector and repack the compact buffers.

Called by the backend on the host while preparing a decode step, for the requests
whose slow step (decided on device, replayed on the host by HostMirror) has
completed or is in flight before it on the stream. Everything it enqueues is
device work ordered after that slow step and before the next step's attention;
no value is read back to the host. Shapes come from host-known bounds (the
requests' current lengths, the knobs); the device state (the slow step's length,
the saved queries) sets the masks.

Per layer: the evidence window's logits over the whole prefix (the slow step's
query and, for the first slow step, the prompt's last queries), the Selector
(selector.core), then sink + Top-K positions gathered into the request's compact
slot.

Rows whose slow step was not their first (`later`, known on the host; never a row
with prompt_evidence "every", whose window keeps the prompt's queries) have a
one-query window: they are refreshed apart with w = 1 (the first slow step's
window of up to w_prefill queries would cost them w times the logits). On the
kernel path, when the store keeps the slow step's logits (CompactStore.logits,
written by the slow step's dense attention) and the rows fit them, their evidence
comes from those logits (kernels.stored_evidence): the keys are not read again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Sequence

import torch

from sgl_sparse.selector.core import (
    SelectorKnobs,
    candidate_mask,
    evidence_power_mean,
    refined_scores_from_evidence,
    to_device,
    top_k_positions,
)

if TYPE_CHECKING:
    from sgl_sparse.state import SparseState

# Rows are processed in groups whose fp32 logits stay under this many elements
# (the torch path materializes them; the kernel path only its evidence), and the
# Selector runs on as many layers at once as keep its [layers x r, H, N] tensors
# under _MAX_SELECT_ELEMS: the torch path's temporaries are a few times that, the
# kernels' are three such tensors (evidence, norms, scores) and top-k's.
_MAX_LOGIT_ELEMS = 1 << 26  # 256 MiB
_MAX_SELECT_ELEMS = 1 << 24  # 64 MiB per fp32 tensor
_MAX_SELECT_ELEMS_KERNELS = 1 << 25


def window_logits_torch(q: torch.Tensor, k_pool: torch.Tensor, tok: torch.Tensor,
                        qpos: torch.Tensor, scaling: float, chunk: int = 1 << 14) -> torch.Tensor:
    """q [r, w, Hq, D], keys k_pool[tok] with tok [r, N] -> fp32 logits [r, Hkv, G, w, N],
    -inf where the key is after the query (causal) -- the plain-torch path."""
    r, w, hq, d = q.shape
    n = tok.shape[1]
    hkv = k_pool.shape[1]
    qf = q.float().view(r, w, hkv, hq // hkv, d)
    out = torch.empty(r, hkv, hq // hkv, w, n, dtype=torch.float32, device=q.device)
    for s in range(0, n, chunk):
        k = k_pool[tok[:, s: s + chunk]].float()  # [r, c, Hkv, D]
        out[..., s: s + chunk] = torch.einsum("rwhgd,rchd->rhgwc", qf, k)
    out *= scaling
    pos = torch.arange(n, device=q.device)
    future = pos[None, None, :] > qpos[:, :, None]  # [r, w, N]
    return out.masked_fill(future[:, None, None], float("-inf"))


def _pack_torch(k_pool, v_pool, tok_sel, a_k, a_v, slots) -> None:
    """tok_sel [r, Hkv, cap] pool slots -> a_k/a_v[slots] (rows past the length are junk)."""
    head = torch.arange(k_pool.shape[1], device=k_pool.device)[None, :, None]
    a_k[slots] = k_pool[tok_sel, head]
    a_v[slots] = v_pool[tok_sel, head]


def refresh(
    state: "SparseState",
    rows: Sequence[int],
    n_bound: int,
    k_buffer: Callable[[int], torch.Tensor],
    v_buffer: Callable[[int], torch.Tensor],
    req_to_token: torch.Tensor,
    scaling: float,
    use_kernels: bool = False,
    later: Collection[int] = (),
) -> None:
    """Refresh the compact buffers of `rows` (SFI requests after a slow step).

    `later`: rows whose slow step was not their first decode step (the device
    has dropped their prompt queries); the others may have a longer window.
    """
    store = state.compact
    if not rows or store is None:
        return
    stored = use_kernels and 0 < min(n_bound, req_to_token.shape[1]) <= store.logit_len
    one = [r for r in rows if r in later]
    _refresh_rows(state, one, n_bound, k_buffer, v_buffer, req_to_token, scaling, use_kernels, 1, stored)
    _refresh_rows(state, [r for r in rows if r not in later], n_bound, k_buffer, v_buffer, req_to_token,
                  scaling, use_kernels, None, False)


def _refresh_rows(state, rows, n_bound, k_buffer, v_buffer, req_to_token, scaling, use_kernels,
                  w: int | None, stored: bool) -> None:
    """`rows` in groups whose fp32 logits fit _MAX_LOGIT_ELEMS; w None: the specs' window."""
    store = state.compact
    if not rows:
        return
    specs = [state.row_init(r).spec for r in rows]
    dev = store.k.device
    # Window columns: the slow step's query + saved prompt queries (buffer-bounded).
    if w is None:
        w = min(max(s.w_prefill for s in specs), 1 + store.q_prompt.shape[2])
    hkv, hq = store.k.shape[2], store.q.shape[2]
    per_row = hkv * (hq // hkv) * w * max(n_bound, 1)
    # Stored logits: none materialized, the Selector's [r, H, N] tensors bound the group.
    step = max(1, (_MAX_SELECT_ELEMS_KERNELS // (hkv * max(n_bound, 1))) if stored else (_MAX_LOGIT_ELEMS // per_row))
    for i in range(0, len(rows), step):
        _refresh_group(state, list(rows[i: i + step]), specs[i: i + step], n_bound, w, dev,
                       k_buffer, v_buffer, req_to_token, scaling, use_kernels, stored)


def _refresh_group(state, rows, specs, n_bound, w, dev, k_buffer, v_buffer, req_to_token,
                   scaling, use_kernels, stored=False) -> None:
    store = state.compact
    r = len(rows)
    ridx = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    slots = state.slot[ridx].long()
    sink, recent, budget = state.sink[ridx], state.window[ridx], state.budget[ridx]
    saved_n = state.saved_n[ridx]
    n = min(n_bound, req_to_token.shape[1])
    lo = torch.minimum(sink, saved_n)
    hi = torch.maximum(saved_n - recent, lo)
    # Window column 0: the slow step's query (position saved_n - 1); column i >= 1:
    # the prompt's i-th last query, if saved, at position prompt_n - 1 - i (prompt_n:
    # the length at the first slow step, = saved_n there; later slow steps see the
    # prompt's queries only with prompt_evidence "every").
    cols = torch.arange(w, device=dev)
    nq = 1 + torch.clamp(state.prompt_q[ridx], max=w - 1)
    prompt_n = torch.where(state.prompt_n[ridx] > 0, state.prompt_n[ridx], saved_n)
    qpos = torch.where(cols[None, :] == 0, saved_n[:, None] - 1, prompt_n[:, None] - 1 - cols[None, :]).long()
    knobs = SelectorKnobs.from_specs(specs, dev, torch.float32)
    k_max = max(s.budget for s in specs)
    k_min = min(s.budget for s in specs)
    hkv, cap = store.k.shape[2], store.capacity
    tok = req_to_token[ridx, :n].long()
    # Compact layout per KV head: positions [0, sink) then the selected ones.
    j = torch.arange(cap, device=dev)[None, None, :]
    sink_eff = lo.long()[:, None, None]
    if use_kernels:  # the kernels' int32 arguments (they derive the masks themselves)
        from sgl_sparse.kernels import pack_compact, selector_scores, stored_evidence, window_evidence

        nq32, beta32, lo32, hi32 = nq.int(), knobs.beta.float(), lo.int(), hi.int()
        ones = torch.ones(r, dtype=torch.bool, device=dev)
        ridx32, slots32 = ridx.int(), slots.int()
    else:  # the torch path's masks
        allowed = candidate_mask(lo, hi, n)
        qmask = cols[None, :] < nq[:, None]
    # All layers' window queries at once: [layers, r, w, Hq, D].
    if not stored:
        qwin_all = torch.cat([store.q[:, slots, None], store.q_prompt[:, slots, : w - 1]], dim=2)
    # The Selector after the evidence runs on several layers at once (a batch of
    # layers x requests): few, large launches instead of ~40 small ones per layer.
    per_layer = r * hkv * max(n, 1)
    chunk = max(1, (_MAX_SELECT_ELEMS_KERNELS if use_kernels else _MAX_SELECT_ELEMS) // per_layer)
    for first in range(0, store.num_layers, chunk):
        layers = range(first, min(first + chunk, store.num_layers))
        nl = len(layers)
        u = torch.empty(nl * r, hkv, n, dtype=torch.float32, device=dev)  # layer-major
        for li, layer in enumerate(layers):
            if stored:  # w = 1 from the slow step's logits: no key read
                stored_evidence(store.logits[layer], slots32, lo32, hi32, beta32, n, out=u[li * r: (li + 1) * r])
            elif use_kernels:
                window_evidence(qwin_all[layer], k_buffer(layer), req_to_token, ridx32, qpos, lo32, hi32,
                                nq32, beta32, n, scaling, out=u[li * r: (li + 1) * r])
            else:
                logits = window_logits_torch(qwin_all[layer], k_buffer(layer), tok, qpos, scaling)
                u[li * r: (li + 1) * r] = evidence_power_mean(logits, allowed, qmask, knobs.beta)
        norms = store.knorm[first: first + nl][:, tok].permute(0, 1, 3, 2).reshape(nl * r, hkv, n)
        lo_l, hi_l, knobs_l = lo.repeat(nl), hi.repeat(nl), knobs.repeat(nl)
        if use_kernels:
            s = selector_scores(u, norms, lo_l, hi_l, knobs_l)
        else:
            s = refined_scores_from_evidence(u, norms, lo_l, hi_l, knobs_l)
        pos, count = top_k_positions(s, lo_l, hi_l, budget.repeat(nl), k_max, k_min, use_kernel=use_kernels)
        del s
        count = count[:r]  # the same for every layer: min(budget, |A_t|)
        sel_len = sink_eff[:, :, 0] + count[:, None]  # [r, 1]
        # sink positions, then the selected ones, for every layer of the chunk
        pos = pos.view(nl, r, hkv, k_max)
        sink4, len4 = sink_eff[None], sel_len[None, :, :, None]
        from_sel = torch.gather(pos, 3, (j[None] - sink4).clamp(0, k_max - 1).expand(nl, r, hkv, -1))
        sel_pos = torch.where(j[None] < sink4, j[None], torch.where(j[None] < len4, from_sel, 0))
        if use_kernels:
            sel_pos = sel_pos.int()
            sel_len_h = sel_len.expand(-1, hkv).int().contiguous()
            a_len = torch.empty(r, hkv, dtype=torch.int32, device=dev)
        for li, layer in enumerate(layers):
            if use_kernels:
                pack_compact(k_buffer(layer), v_buffer(layer), req_to_token, ridx32, sel_pos[li], sel_len_h, ones,
                             store.k[layer], store.v[layer], slots32, a_len)
            else:
                tok_sel = torch.gather(tok[:, None, :].expand(-1, hkv, -1), 2, sel_pos[li])
                _pack_torch(k_buffer(layer), v_buffer(layer), tok_sel, store.k[layer], store.v[layer], slots)
    state.sel_count[ridx] = sel_len[:, 0].int()
    state.sel_ready[ridx] = True


def warm_up_kernels(store, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                    specs: Sequence, scaling: float = 1.0) -> None:
    """Compile the refresh kernels at start-up for the variants `specs` (e.g. the
    server's default SFI policy) use: the first slow step's window and w = 1, the
    Soft-NMS radius, the Top-K. Otherwise the first SFI requests would wait seconds for
    Triton in the middle of decoding. Nothing is written: the packing is masked off.
    """
    from sgl_sparse.kernels import pack_compact, selector_scores, selector_stats, stored_evidence, window_evidence
    from sgl_sparse.kernels._split import AUTO_SPLIT
    from sgl_sparse.kernels.topk_range import LAUNCH_SHAPES, topk_range

    dev = store.k.device
    hkv, hq, d, n = store.k.shape[2], store.q.shape[2], store.k.shape[4], 64
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    ridx, lo, hi = i32(0), i32(0), i32(n)
    for spec in specs:
        knobs = SelectorKnobs.from_specs([spec], dev, torch.float32)
        for w in sorted({1, min(spec.w_prefill, 1 + store.q_prompt.shape[2])}):
            q = torch.zeros(1, w, hq, d, dtype=store.q.dtype, device=dev)
            qpos = torch.full((1, w), n - 1, dtype=torch.int64, device=dev)
            u = window_evidence(q, k_pool, req_to_token, ridx, qpos, lo, hi, i32(w), knobs.beta.float(), n, scaling)
            norms = torch.ones_like(u)
            selector_scores(u, norms, lo.long(), hi.long(), knobs)
        if store.logits is not None and store.logit_len >= n:
            stored_evidence(store.logits[0], i32(0), lo, hi, knobs.beta.float(), n)
    # Unless SGL_SPARSE_SPLIT_ROWS=0, long rows with few programs split each (row, head)
    # over several programs (kernels/_split.py): those launches too, whatever the
    # split count (a grid size, not a compiled constant).
    split_options = (1, 2) if AUTO_SPLIT else (1,)
    if specs and AUTO_SPLIT:
        selector_stats(torch.zeros(1, hkv, n, dtype=torch.float32, device=dev), torch.ones(1, hkv, n, device=dev),
                       lo, hi, knobs, splits=2)
    # The Top-K (top_k_positions' kernel): every launch shape its grid size may pick.
    for block_n, num_warps in LAUNCH_SHAPES:
        for splits in split_options:
            topk_range(torch.zeros(1, hkv, n, dtype=torch.float32, device=dev), lo, hi, i32(1), 1,
                       block_n=block_n, num_warps=num_warps, splits=splits)
    sel = torch.zeros(1, hkv, store.capacity, dtype=torch.int32, device=dev)
    pack_compact(k_pool, v_pool, req_to_token, ridx, sel, torch.zeros(1, hkv, dtype=torch.int32, device=dev),
                 torch.zeros(1, dtype=torch.bool, device=dev), store.k[0], store.v[0], i32(0),
                 torch.empty(1, hkv, dtype=torch.int32, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
