"""SFI's device storage, reserved once when the backend is built.

Per compact slot (one per concurrently sparse `sfi` request), per layer:
  * the sink + selected tokens per KV head, segment A of the two-segment fast step:
    their K/V packed contiguously (`k`, `v`: `[layers, slots, Hkv, capacity, D]`,
    `selections: packed`), or their KV-pool slots (`lists`: `[layers, slots, Hkv,
    capacity]` int32, `selections: slot_lists`), which the fast step reads in place
    as asyncspade's lists are: 4 bytes a token and head instead of 2 x head_dim
    elements, and the refresh writes no copy;
  * the query of the last slow step (`q`) and the prompt's last queries
    (`q_prompt`): the Selector's evidence window.
Optionally (`logit_len` > 0), per compact slot and layer: the base-2 logits of the
last slow step's query heads over positions [0, logit_len) (`logits`,
`[layers, slots, Hkv, G, logit_len]` fp32), written by the slow step's dense
attention and read by the Selector's evidence (kernels.stored_evidence).
Per KV-pool slot, per layer: the key norm of each KV head (`knorm`), computed once
when the key is written and read by the Selector's prior; a radix-cache prefix
hit reuses it with the KV it belongs to.

The query buffers have one extra slot at the end: rows that save nothing this
step write there, so a captured decode graph needs no data-dependent branch.

Over an fp8 KV cache (SGLang's --kv-cache-dtype fp8_*) the compact K/V hold pool
rows as they are (fp8, read with the layer's scales like the pool), the queries stay
in the model's dtype, and `k_scales` holds each layer's key scale for the Selector's
evidence over the pool's keys (None: unscaled, as SGLang leaves a model without
calibrated KV scales).
"""

from __future__ import annotations

import torch

#: How a slot keeps segment A (CompactBufferConfig.selections).
SELECTIONS = ("packed", "slot_lists")


class CompactStore:
    def __init__(self, *, slots: int, capacity: int, num_layers: int, num_kv_heads: int,
                 num_q_heads: int, head_dim: int, dtype: torch.dtype, pool_size: int,
                 prompt_queries: int, device: torch.device, logit_len: int = 0,
                 query_dtype: torch.dtype | None = None, selections: str = "packed"):
        assert selections in SELECTIONS, f"selections: one of {SELECTIONS}"
        self.slots, self.capacity, self.num_layers = slots, capacity, num_layers
        self.num_kv_heads, self.device = num_kv_heads, torch.device(device)
        query_dtype = query_dtype or dtype  # dtype: the KV pool's
        # Exactly one of (k, v) and lists: the other is None.
        self.k = self.v = self.lists = None
        if selections == "packed":
            self.k = torch.zeros(num_layers, slots, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
        else:
            self.lists = torch.zeros(num_layers, slots, num_kv_heads, capacity, dtype=torch.int32, device=device)
        self.q = torch.zeros(num_layers, slots + 1, num_q_heads, head_dim, dtype=query_dtype, device=device)
        self.q_prompt = torch.zeros(num_layers, slots + 1, max(prompt_queries, 1), num_q_heads, head_dim,
                                    dtype=query_dtype, device=device)
        self.k_scales: torch.Tensor | None = None  # fp32 [num_layers] on `device` (set by the backend)
        self.knorm = torch.zeros(num_layers, pool_size, num_kv_heads, dtype=torch.float32, device=device)
        self.scratch_slot = slots  # index of the write-only extra query slot
        # Uninitialized: a refresh reads only positions its slow step wrote.
        self.logits = (torch.empty(num_layers, slots, num_kv_heads, num_q_heads // num_kv_heads, logit_len,
                                   dtype=torch.float32, device=device) if logit_len > 0 and slots > 0 else None)
        # The refresh's LayerPools pair for the KV pools it last read
        # (selector.refresh._layer_pools): it lives and dies with this store.
        self.pools_cache = None
        # selector.graphs.RefreshGraphs when the refresh replays CUDA graphs (set by the backend).
        self.refresh_graphs = None

    @property
    def logit_len(self) -> int:
        """Positions covered by the stored slow-step logits (0: none kept)."""
        return 0 if self.logits is None else self.logits.shape[-1]

    @property
    def slot_lists(self) -> bool:
        """Segment A as pool-slot lists (`selections: slot_lists`), not packed K/V."""
        return self.lists is not None

    def selection_bytes(self) -> int:
        """Segment A's bytes over every slot and layer (packed K/V, or the lists)."""
        parts = [self.lists] if self.slot_lists else [self.k, self.v]
        return sum(t.numel() * t.element_size() for t in parts)

    def nbytes(self) -> int:
        parts = [self.q, self.q_prompt, self.knorm]
        if self.logits is not None:
            parts.append(self.logits)
        return self.selection_bytes() + sum(t.numel() * t.element_size() for t in parts)

    def save_key_norms(self, layer: int, loc: torch.Tensor, k: torch.Tensor) -> None:
        """k [tokens, Hkv, D] just written at pool slots `loc`."""
        self.knorm[layer].index_copy_(0, loc.long(), k.float().norm(dim=-1))
