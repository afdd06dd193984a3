"""A refresh group's per-row tensors, gathered once per refresh for every layer.

The Selector and the packing run on (layer, request) pairs, layer-major: row
``l * r + i`` is request ``i`` in the chunk's layer ``l``. Their per-row inputs
(candidate range, budget, knobs, the row of the stored logits) are built here
already repeated for a chunk of layers, from the requests' device indices, so no
layer and no chunk issues its own gathers, `.repeat`s or dtype conversions; a
request's own values are the first ``r`` entries (views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from sgl_sparse.selector.core import SelectorKnobs

if TYPE_CHECKING:
    from sgl_sparse.state import SparseState


@dataclass
class GroupRows:
    """``[layers * r]`` tensors (layer-major); int32 unless said."""

    ridx: torch.Tensor  # request rows (req_pool_idx)
    slot: torch.Tensor  # compact slots
    lo: torch.Tensor  # candidate range A = [lo, hi): lo = min(sink, saved_n) is also the kept sink
    hi: torch.Tensor
    budget: torch.Tensor
    logit_row: torch.Tensor | None  # row of CompactStore.logits[l0:l1].flatten(0, 1): l * slots + slot
    knobs: SelectorKnobs
    nq: torch.Tensor | None  # valid window queries (window path only)
    qpos: torch.Tensor | None  # int64 [layers * r, w]: the window queries' positions (window path only)


def group_rows(state: "SparseState", ridx_r: torch.Tensor, specs: Sequence, layers: int, w: int,
               window: bool = True) -> GroupRows:
    """The tensors of the rows `ridx_r` (int32 [r] on the state's device) for
    `layers` stacked layers; `window`: also the evidence window's (nq, qpos); else
    the rows of the stored logits (`logit_row`). Device ops only (no host->device
    copy): a refresh graph captures them (selector.graphs)."""
    r, dev = ridx_r.shape[0], ridx_r.device
    ridx = ridx_r.repeat(layers)
    slot = state.slot[ridx]
    saved_n = state.saved_n[ridx]
    lo = torch.minimum(state.sink[ridx], saved_n)
    hi = torch.maximum(saved_n - state.window[ridx], lo)
    nq = qpos = logit_row = None
    if not window:
        # Row l * r + i of the chunk reads layer l's logits of request i's slot.
        layer = torch.arange(layers * r, dtype=torch.int32, device=dev).div(r, rounding_mode="floor")
        logit_row = layer * state.compact.slots + slot
    else:
        # Window column 0: the slow step's query (position saved_n - 1); column i >= 1:
        # the prompt's i-th last query, if saved, at position prompt_n - 1 - i (prompt_n:
        # the length at the first slow step, = saved_n there; later slow steps see the
        # prompt's queries only with prompt_evidence "every").
        cols = torch.arange(w, device=dev)
        nq = 1 + torch.clamp(state.prompt_q[ridx], max=w - 1)
        prompt_n = state.prompt_n[ridx]
        prompt_n = torch.where(prompt_n > 0, prompt_n, saved_n)
        qpos = torch.where(cols[None, :] == 0, saved_n[:, None] - 1, prompt_n[:, None] - 1 - cols[None, :]).long()
    return GroupRows(ridx=ridx, slot=slot, lo=lo, hi=hi, budget=state.budget[ridx], logit_row=logit_row,
                     knobs=SelectorKnobs.from_table(state.sfi_knobs, ridx, max(s.nms_radius for s in specs)),
                     nq=nq, qpos=qpos)
