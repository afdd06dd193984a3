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
slot. The host work is per refresh, not per layer: the rows' tensors are
gathered once for a chunk of layers (selector.rows), and the evidence, the
Selector, the Top-K and the packing each launch once per chunk of layers
(_MAX_SELECT_ELEMS_KERNELS: 16 layers at 32768 x 8 with 8 KV heads), the
per-layer KV pools reached through one address table (kernels.LayerPools); the
evidence that reads the keys keeps each row's logits, so it takes as many
layers a launch as _MAX_LOGIT_ELEMS allows (bench/kernels/count_refresh_ops.py
counts the launches and ops).

Rows whose slow step was not their first (`later`, known on the host; never a row
with prompt_evidence "every", whose window keeps the prompt's queries) have a
one-query window: they are refreshed apart with w = 1 (the first slow step's
window of up to w_prefill queries would cost them w times the logits). On the
kernel path, when the store keeps the slow step's logits (CompactStore.logits,
written by the slow step's dense attention) and the rows fit them, their evidence
comes from those logits (kernels.stored_evidence): the keys are not read again.
"""

from __future__ import annotations

import functools
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
from sgl_sparse.selector.rows import group_rows

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
                        qpos: torch.Tensor, scaling: float, chunk: int = 1 << 14,
                        k_scale: float | None = None) -> torch.Tensor:
    """q [r, w, Hq, D], keys k_pool[tok] with tok [r, N] -> fp32 logits [r, Hkv, G, w, N],
    -inf where the key is after the query (causal) -- the plain-torch path. An fp8
    pool holds k / k_scale."""
    r, w, hq, d = q.shape
    n = tok.shape[1]
    hkv = k_pool.shape[1]
    qf = q.float().view(r, w, hkv, hq // hkv, d)
    out = torch.empty(r, hkv, hq // hkv, w, n, dtype=torch.float32, device=q.device)
    for s in range(0, n, chunk):
        k = k_pool[tok[:, s: s + chunk]].float()  # [r, c, Hkv, D]
        out[..., s: s + chunk] = torch.einsum("rwhgd,rchd->rhgwc", qf, k)
    out *= scaling * (1.0 if k_scale is None else k_scale)
    pos = torch.arange(n, device=q.device)
    future = pos[None, None, :] > qpos[:, :, None]  # [r, w, N]
    return out.masked_fill(future[:, None, None], float("-inf"))


def _pack_torch(store, layer: int, k_pool, v_pool, tok_sel, slots) -> None:
    """tok_sel [r, Hkv, cap] pool slots -> the store's slots of `layer`: the slots
    themselves (slot lists) or their K/V rows (rows past the length are junk)."""
    if store.slot_lists:
        store.lists[layer][slots] = tok_sel.to(torch.int32)
        return
    head = torch.arange(k_pool.shape[1], device=k_pool.device)[None, :, None]
    store.k[layer][slots] = k_pool[tok_sel, head]
    store.v[layer][slots] = v_pool[tok_sel, head]


def _pack_kernels(store, k_pools, v_pools, first: int, req_to_token, ridx, pos, sel_len, sink, do_pack,
                  slot, a_len) -> None:
    """The Top-K's positions into the store's slots of layers [first, first + len(k_pools)),
    one launch (k_pools, v_pools: those layers' kernels.LayerPools)."""
    from sgl_sparse.kernels import list_compact_layers, pack_compact_layers

    last = first + len(k_pools)
    if store.slot_lists:
        list_compact_layers(k_pools, req_to_token, ridx, pos, sel_len, sink, do_pack, store.lists[first:last],
                            slot, a_len)
    else:
        pack_compact_layers(k_pools, v_pools, req_to_token, ridx, pos, sel_len, sink, do_pack,
                            store.k[first:last], store.v[first:last], slot, a_len)


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
    if use_kernels:
        n_bound = _padded_bound(n_bound, req_to_token.shape[1], store.logit_len if stored else None)
    pools = _layer_pools(store, k_buffer, v_buffer, store.num_layers) if use_kernels else None
    for part, w, from_logits in (([r for r in rows if r in later], 1, stored),
                                 ([r for r in rows if r not in later], None, False)):
        _refresh_part(state, part, n_bound, k_buffer, v_buffer, req_to_token, scaling, pools, w, from_logits)


def _refresh_part(state, rows, n_bound, k_buffer, v_buffer, req_to_token, scaling, pools: "_Pools | None",
                  w: int | None, stored: bool) -> None:
    """`rows` with one evidence window (w None: the specs' window), from the store's
    refresh graphs where it has them (kernel path only), else eagerly."""
    if not rows:
        return
    store = state.compact
    specs = [state.row_init(r).spec for r in rows]
    if w is None:  # the slow step's query + saved prompt queries (buffer-bounded)
        w = min(max(s.w_prefill for s in specs), 1 + store.q_prompt.shape[2])

    def launch(ridx: torch.Tensor, specs_: Sequence, n: int) -> None:
        _refresh_rows(state, ridx, specs_, n, k_buffer, v_buffer, req_to_token, scaling, pools, w, stored)

    graphs = store.refresh_graphs
    if pools is None or graphs is None or not graphs.enabled:
        launch(to_device(torch.tensor(rows, dtype=torch.int32), store.device), specs, n_bound)
        return
    # What a launch bakes in besides the shape: the loop bounds from the specs and
    # the pools' address table.
    key = (w, stored, max(s.budget for s in specs), max(s.nms_radius for s in specs), pools.key)
    limit = min(req_to_token.shape[1], store.logit_len) if stored else req_to_token.shape[1]
    graphs.run(rows, specs, n_bound, limit, key, launch)


def _padded_bound(n: int, width: int, limit: int | None) -> int:
    """The refresh's bound on positions rounded up to a multiple of 16, within the
    req_to_token row and the stored logits. Triton compiles one binary per class of
    an integer argument (1, divisible by 16, other) and the bound is one, as are the
    strides of the [rows, Hkv, n] tensors it sizes: rounded, every refresh stays in
    the class the start-up warm-up compiled instead of compiling (or loading from
    Triton's cache) mid-decode the first time the length is odd. The kernels mask
    each row past its range, and the bound may already exceed the slow step's length
    by the overlap lag: the selections are the same. `limit` (the stored logits'
    length, where the refresh reads them) is at least min(n, width), so the bound
    never shrinks below the positions the refresh must see."""
    return min(-(-n // 16) * 16, width, *(() if limit is None else (limit,)))


class _Pools:
    """Every layer's K and V pools as address tables (kernels.LayerPools): the
    packing runs once per refresh for all layers instead of once per layer.

    Keeps every layer's pool tensor referenced (``k_all``, ``v_all``) for as long as
    it is cached: see :func:`_layer_pools`."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        from sgl_sparse.kernels import LayerPools

        self.k_all, self.v_all = k, v
        self.k = LayerPools.of(k, _address_table(tuple(t.data_ptr() for t in k), k[0].device))
        self.v = LayerPools.of(v, _address_table(tuple(t.data_ptr() for t in v), v[0].device))
        self.key = (len(k), _pool_key(k[0]), _pool_key(v[0]))


def _pool_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _layer_pools(owner, k_buffer: Callable[[int], torch.Tensor], v_buffer: Callable[[int], torch.Tensor],
                 layers: int) -> _Pools:
    """The refresh's LayerPools pair, built once for the life of the KV pools and
    cached on `owner` (the compact store, as `pools_cache`).

    A refresh used to fetch all 2 x layers buffers (SGLang's get_key_buffer /
    get_value_buffer) and re-check their addresses, shapes and strides each time.
    Now layer 0's K and V are fetched and compared (address, shape, strides, dtype,
    device, and the layer count) with the cached pair's; anything else rebuilds it.
    Why layer 0 is enough: SGLang allocates every layer's buffers together, once per
    pool, and the cached pair holds a reference to each layer's tensor, so while it
    is cached none of those addresses can be handed to a new tensor. A reallocated
    pool therefore has a new layer-0 address (or shape, dtype, ...), and so does a
    getter that returns a fresh tensor on each call (e.g. a dequantizing read: then
    every refresh rebuilds, as before). Not detected: a getter that replaces some
    layer's tensor but not layer 0's, which SGLang's pools never do. Nor are the
    other layers' getters called on every refresh any more: SGLang's also wait for a
    layer-wise KV load in flight (hierarchical cache), which writes the slots of
    requests being prefilled, never those of the decoding rows a refresh reads.
    The cost: the last pools' memory stays referenced until the next refresh sees
    new ones or the store is freed. One entry per store: a store serves one model's
    pools.
    """
    k0, v0 = k_buffer(0), v_buffer(0)
    key = (layers, _pool_key(k0), _pool_key(v0))
    cached = owner.pools_cache
    if cached is None or cached.key != key:
        owner.pools_cache = cached = None  # drop the old references before the new tensors are fetched
        owner.pools_cache = cached = _Pools([k0] + [k_buffer(i) for i in range(1, layers)],
                                            [v0] + [v_buffer(i) for i in range(1, layers)])
    return cached


@functools.lru_cache(maxsize=8)
def _address_table(addrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The pools' addresses on their device, copied there once: SGLang's pools live
    as long as the server (the key is the content, so a stale entry cannot lie)."""
    return to_device(torch.tensor(addrs, dtype=torch.int64), device)


def _refresh_rows(state, ridx: torch.Tensor, specs, n_bound, k_buffer, v_buffer, req_to_token, scaling,
                  pools: "_Pools | None", w: int, stored: bool) -> None:
    """Rows `ridx` (int32 device indices) in groups whose fp32 logits fit _MAX_LOGIT_ELEMS."""
    store = state.compact
    hkv, hq = store.num_kv_heads, store.q.shape[2]
    per_row = hkv * (hq // hkv) * w * max(n_bound, 1)
    # Stored logits: none materialized, the Selector's [r, H, N] tensors bound the group.
    step = max(1, (_MAX_SELECT_ELEMS_KERNELS // (hkv * max(n_bound, 1))) if stored else (_MAX_LOGIT_ELEMS // per_row))
    for i in range(0, ridx.shape[0], step):
        _refresh_group(state, ridx[i: i + step], specs[i: i + step], n_bound, w, k_buffer, v_buffer,
                       req_to_token, scaling, pools, stored)


def _refresh_group(state, ridx_r, specs, n_bound, w, k_buffer, v_buffer, req_to_token,
                   scaling, pools: "_Pools | None", stored: bool = False) -> None:
    store = state.compact
    use_kernels = pools is not None
    r, dev = ridx_r.shape[0], ridx_r.device
    n = min(n_bound, req_to_token.shape[1])
    hkv = store.num_kv_heads
    # The Selector after the evidence runs on several layers at once (a batch of
    # layers x requests): few, large launches instead of ~40 small ones per layer.
    per_layer = r * hkv * max(n, 1)
    chunk = min(store.num_layers,
                max(1, (_MAX_SELECT_ELEMS_KERNELS if use_kernels else _MAX_SELECT_ELEMS) // per_layer))
    g = group_rows(state, ridx_r, specs, chunk, w, window=not stored)
    k_max = max(s.budget for s in specs)
    k_min = min(s.budget for s in specs)
    tok = req_to_token[g.ridx[:r], :n].long()
    lo, hi = g.lo[:r], g.hi[:r]
    # Compact layout per KV head: positions [0, lo) (the sink) then the selected ones,
    # min(budget, |A_t|) of them in every layer and head.
    sel_len = lo + torch.minimum(g.budget[:r], (hi - lo).clamp(min=0))
    if use_kernels:
        from sgl_sparse.kernels import gather_key_norms, selector_scores, stored_evidence, window_evidence
        from sgl_sparse.kernels.topk_range import topk_range

        do_pack = torch.ones(r, dtype=torch.bool, device=dev)
        a_len = torch.empty(r, hkv, dtype=torch.int32, device=dev)  # pack_compact's output, unused here
    else:  # the torch path's masks
        allowed = candidate_mask(lo, hi, n)
        qmask = torch.arange(w, device=dev)[None, :] < g.nq[:r, None]
    # All layers' window queries at once: [layers, r, w, Hq, D].
    if not stored:
        slots = g.slot[:r]
        qwin_all = torch.cat([store.q[:, slots, None], store.q_prompt[:, slots, : w - 1]], dim=2)
        # window_evidence keeps each row's [Hkv, G * w, N] fp32 logits: layers per launch
        # within _MAX_LOGIT_ELEMS (the group's rows already fit it for one layer).
        ev_layers = max(1, _MAX_LOGIT_ELEMS // (r * hkv * (store.q.shape[2] // hkv) * w * max(n, 1)))
    for first in range(0, store.num_layers, chunk):
        layers = range(first, min(first + chunk, store.num_layers))
        nl = len(layers)
        m = nl * r  # the chunk's (layer, request) rows, layer-major
        lo_l, hi_l, knobs_l = g.lo[:m], g.hi[:m], g.knobs.first(m)
        u = torch.empty(m, hkv, n, dtype=torch.float32, device=dev)
        if stored:  # w = 1 from the slow step's logits, every layer at once: no key read
            stored_evidence(store.logits[first: first + nl].flatten(0, 1), g.logit_row[:m], lo_l, hi_l,
                            knobs_l.beta, n, out=u)
        elif use_kernels:  # the keys read in place, as many layers a launch as their logits allow
            for e0 in range(0, nl, ev_layers):
                e1 = min(e0 + ev_layers, nl)
                me = (e1 - e0) * r
                window_evidence(qwin_all[first + e0: first + e1].flatten(0, 1), pools.k.layers(first + e0, first + e1),
                                req_to_token, g.ridx[:me], g.qpos[:me], lo_l[:me], hi_l[:me], g.nq[:me],
                                knobs_l.beta[:me], n, scaling, out=u[e0 * r: e1 * r],
                                k_scales=_k_scales(store, first + e0, first + e1))
        else:
            for li, layer in enumerate(layers):
                k_scale = None if store.k_scales is None else float(store.k_scales[layer])
                logits = window_logits_torch(qwin_all[layer], k_buffer(layer), tok, g.qpos[:r], scaling,
                                             k_scale=k_scale)
                u[li * r: (li + 1) * r] = evidence_power_mean(logits, allowed, qmask, knobs_l.beta[:r])
        if use_kernels:
            norms = gather_key_norms(store.knorm[first: first + nl], tok)
            s = selector_scores(u, norms, lo_l, hi_l, knobs_l)
            # Step 6 as top_k_positions(use_kernel=True) runs it, its int32 output as
            # the packing reads it (after the sink prefix), for every layer at once.
            # The block-walking kernel at every length: the refresh's padded lengths
            # (one per bucket) would each compile a register-row variant mid-decode.
            pos, _ = topk_range(s, lo_l, hi_l, g.budget[:m], max(1, k_max), one_block=False)
            del s
            _pack_kernels(store, pools.k.layers(first, first + nl), pools.v.layers(first, first + nl), first,
                          req_to_token, g.ridx[:r], pos, sel_len[:, None].expand(-1, hkv), lo, do_pack, g.slot[:r],
                          a_len)
            continue
        norms = store.knorm[first: first + nl][:, tok].permute(0, 1, 3, 2).reshape(m, hkv, n)
        s = refined_scores_from_evidence(u, norms, lo_l, hi_l, knobs_l)
        pos, _ = top_k_positions(s, lo_l, hi_l, g.budget[:m], k_max, k_min, use_kernel=False)
        del s
        sel_pos = compact_positions(pos.view(nl, r, hkv, k_max), lo, sel_len, store.capacity)
        slots_l = g.slot[:r].long()
        for li, layer in enumerate(layers):
            tok_sel = torch.gather(tok[:, None, :].expand(-1, hkv, -1), 2, sel_pos[li])
            _pack_torch(store, layer, k_buffer(layer), v_buffer(layer), tok_sel, slots_l)
    state.sel_count[g.ridx[:r]] = sel_len
    # index_fill_, not `[...] = True`: on CUDA a Python scalar written through an index
    # is a pageable host->device copy, which waits for the stream (the H100 profile of
    # a refresh: 3.7 ms of host time blocked here).
    state.sel_ready.index_fill_(0, g.ridx[:r].long(), True)


def _k_scales(store, start: int, stop: int) -> torch.Tensor | None:
    """Layers [start, stop)'s key scales over an fp8 pool (None: unscaled)."""
    return None if store.k_scales is None else store.k_scales[start:stop]


def compact_positions(pos: torch.Tensor, sink: torch.Tensor, sel_len: torch.Tensor, cap: int) -> torch.Tensor:
    """Top-K positions [layers, r, Hkv, k] -> the compact rows' positions [layers, r, Hkv, cap]:
    [0, sink) then the selected ones up to sel_len, 0 after (what pack_compact_layers
    reads from its sink prefix and `pos` directly)."""
    k_max = pos.shape[-1]
    j = torch.arange(cap, device=pos.device)
    sink4, len4 = sink.long()[None, :, None, None], sel_len.long()[None, :, None, None]
    picked = torch.gather(pos, 3, (j - sink4).clamp(0, k_max - 1).expand(*pos.shape[:3], -1))
    return torch.where(j < sink4, j, torch.where(j < len4, picked, 0))


# (rows, keys) of the start-up warm-up. Triton compiles one binary per class of its
# integer arguments (equal to 1, divisible by 16, other), tensor strides included: the
# refresh's row counts, and what its bound on positions sizes (rounded to 16 by
# _padded_bound: the bound, the strides, stored_evidence's block count, 1 below 2049
# positions and more above). Warming one row of 64 keys left the others to compile (or
# load from Triton's cache) while the first SFI requests decode: a likely cause of
# sfi-pinned's slow first batch at 32768 x 8 (bench/README, session 12: 1320 against
# ~2070 tok/s for the next two), not yet confirmed on a GPU. The bounds are clamped
# to the req_to_token row.
_WARM_SHAPES = ((1, 64), (2, 64), (1, 4160), (2, 4160))


def warm_up_kernels(store, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                    specs: Sequence, scaling: float = 1.0) -> None:
    """Compile the refresh kernels at start-up for the variants `specs` (e.g. the
    server's default SFI policy) use: the first slow step's window and w = 1, the
    Selector's scores (one binary for every Soft-NMS radius), the Top-K, each for the
    argument classes of _WARM_SHAPES (tests/kernels/test_warm_up_classes.py checks
    that a refresh launches nothing else).
    Otherwise the first SFI requests would wait for Triton in the middle of decoding.
    Nothing is written: the packing is masked off.
    """
    for rows, n in _WARM_SHAPES:
        _warm_up(store, k_pool, v_pool, req_to_token, specs, scaling, rows, min(n, req_to_token.shape[1]))
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)


def _warm_up(store, k_pool, v_pool, req_to_token, specs, scaling: float, rows: int, n: int) -> None:
    from sgl_sparse.kernels import (
        LayerPools,
        gather_key_norms,
        selector_scores,
        selector_stats,
        stored_evidence,
        window_evidence,
    )
    from sgl_sparse.kernels._split import AUTO_SPLIT
    from sgl_sparse.kernels.topk_range import LAUNCH_SHAPES, topk_range

    dev = store.device
    hkv, hq, d = store.num_kv_heads, store.q.shape[2], store.q.shape[3]
    full = lambda v: torch.full((rows,), v, dtype=torch.int32, device=dev)  # noqa: E731
    ridx, lo, hi, zero = full(0), full(0), full(n), full(0)
    # The evidence and the packing as the refresh launches them: through the layers' address table.
    k_pools, v_pools = LayerPools.of([k_pool]), LayerPools.of([v_pool])
    for spec in specs:
        knobs = SelectorKnobs.from_specs([spec] * rows, dev, torch.float32)
        for w in sorted({1, min(spec.w_prefill, 1 + store.q_prompt.shape[2])}):
            q = torch.zeros(rows, w, hq, d, dtype=store.q.dtype, device=dev)
            qpos = torch.full((rows, w), n - 1, dtype=torch.int64, device=dev)
            u = window_evidence(q, k_pools, req_to_token, ridx, qpos, lo, hi, full(w), knobs.beta.float(), n,
                                scaling, k_scales=_k_scales(store, 0, 1))
            norms = torch.ones_like(u)
            # the Soft-NMS radius is read on the device: this binary serves every radius
            selector_scores(u, norms, lo.long(), hi.long(), knobs)
        if store.logits is not None and store.logit_len >= n:
            stored_evidence(store.logits[0], zero, lo, hi, knobs.beta.float(), n)
    # The key norms in the refresh's layout, as it gathers them per chunk of layers: the
    # first chunk's slice, and a later one (its offset may not be 16-byte aligned).
    tok = req_to_token[ridx.long(), :n].long()
    for first in range(min(2, store.knorm.shape[0])):
        gather_key_norms(store.knorm[first: first + 1], tok)
    # Unless SGL_SPARSE_SPLIT_ROWS=0, long rows with few programs split each (row, head)
    # over several programs (kernels/_split.py): those launches too, whatever the
    # split count (a grid size, not a compiled constant).
    split_options = (1, 2) if AUTO_SPLIT else (1,)
    if specs and AUTO_SPLIT:
        selector_stats(torch.zeros(rows, hkv, n, dtype=torch.float32, device=dev),
                       torch.ones(rows, hkv, n, device=dev), lo, hi, knobs, splits=2)
    # The Top-K (top_k_positions' kernel): every launch shape its grid size may pick.
    for block_n, num_warps in LAUNCH_SHAPES:
        for splits in split_options:
            topk_range(torch.zeros(rows, hkv, n, dtype=torch.float32, device=dev), lo, hi, full(1), 1,
                       block_n=block_n, num_warps=num_warps, splits=splits)
    sel = torch.zeros(rows, hkv, 1, dtype=torch.int32, device=dev)
    _pack_kernels(store, k_pools, v_pools, 0, req_to_token, ridx, sel,
                  zero[:, None].expand(rows, hkv), zero, torch.zeros(rows, dtype=torch.bool, device=dev), zero,
                  torch.empty(rows, hkv, dtype=torch.int32, device=dev))
