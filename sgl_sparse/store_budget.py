"""The sparse stores, built once per request pool, and their bytes taken out of the
KV pool's budget.

`--mem-fraction-static` is the share of the device's free memory SGLang gives to static
allocations: the weights, then the KV pool, sized to fill the rest of the share. The
remaining (1 - fraction) is kept for activations and CUDA graphs. sgl_sparse's stores
(SFI's compact buffers, the query-aware policies' stores) are static as well: allocated
once, when the backend is built, right after the pool. Left out of the pool's budget
they come out of the activations' share, and a large config then fails later, inside
SGLang's decode-graph capture, with CUDA out of memory (bench/README "Session 28": 24.9
GiB of stores against the 27.8 GiB that 0.8 left on an H200). So the pool's budget is
reduced by their bytes (`reserve_for_stores`, an AFTER hook on SGLang's budget
profiling, compat.KV_BUDGET_TARGET), and the pool holds fewer tokens instead.

The bytes are those of the same stores built on the meta device: the planning cannot
drift from the allocation. One part scales with the pool: SFI's key norms, one fp32 per
pool slot, KV head and layer; the budget is split between the pool's cells and them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sgl_sparse import compat
from sgl_sparse.compact import CompactStore
from sgl_sparse.config import SparseServerConfig
from sgl_sparse.policies.base import QUERY_AWARE_IDS, PolicyId

logger = logging.getLogger(__name__)

GiB = float(1 << 30)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= (1 << 30) else f"{n / (1 << 20):.1f} MiB"


#: The stores' pool-independent bytes this process took out of the KV pool's budget
#: (SFI's key norms, per pool slot, come on top; 0: none: the hook did not run, or there
#: was nothing to reserve). The backend checks the stores it builds against it, and
#: where it is 0 warns when they crowd the activations' share instead
#: (backend.stores_headroom_warning).
reserved_bytes = 0


@dataclass(frozen=True)
class StoreShape:
    """What the stores' sizes depend on, for this rank (its layers, its heads)."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype  # the KV pool's (--kv-cache-dtype)
    context_len: int  # positions a request may hold (SGLang's req_to_token width)
    # The model's, where the pool is fp8 (None: the pool's): quest's page bounds,
    # asyncspade's query ring and SFI's saved queries are kept in it; SFI's compact
    # K/V copy pool rows.
    model_dtype: Optional[torch.dtype] = None

    @property
    def query_dtype(self) -> torch.dtype:
        """The dtype of the stores read beside the queries (quest's bounds, asyncspade's ring,
        SFI's saved queries)."""
        return self.model_dtype or self.dtype

    def kv_cell_bytes(self) -> int:
        """One token's K and V over this rank's layers and heads: SGLang's pool cell."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * 2 * self.head_dim * elem


def build_compact(cfg: SparseServerConfig, shape: StoreShape, *, pool_size: int,
                  device: torch.device) -> Optional[CompactStore]:
    """SFI's compact buffers (None: `compact.slots: 0`, or sfi unavailable)."""
    if cfg.compact.slots == 0 or "sfi" in cfg.unavailable:
        return None
    try:
        return CompactStore(
            slots=cfg.compact.slots, capacity=cfg.compact.capacity, num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads, num_q_heads=shape.num_q_heads, head_dim=shape.head_dim,
            dtype=shape.dtype, pool_size=pool_size, prompt_queries=cfg.policies.sfi.w_prefill - 1, device=device,
            logit_len=min(cfg.compact.slow_logits_context, shape.context_len), query_dtype=shape.query_dtype,
            selections=cfg.compact.selections,
        )
    except torch.OutOfMemoryError:
        raise ValueError(
            f"sgl_sparse: no memory left for SFI's compact buffers ({cfg.compact.slots} slots x "
            f"capacity {cfg.compact.capacity}): lower --mem-fraction-static, or compact.slots / "
            f"compact.capacity in --sparse-config (compact.slots: 0 serves 'sfi' dense)"
        ) from None


def build_query_stores(cfg: SparseServerConfig, shape: StoreShape, device: torch.device) -> dict[PolicyId, Any]:
    """The stores of the query-aware policies with slots that this server offers."""
    from sgl_sparse import query_store

    dims = dict(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, device=device)
    stores = {}
    for pid in QUERY_AWARE_IDS:
        name = pid.name.lower()
        scfg = getattr(cfg.query_aware, name)
        if scfg.slots == 0 or name in cfg.unavailable:
            continue
        try:
            if pid == PolicyId.QUEST:
                stores[pid] = query_store.QuestStore(scfg, dtype=shape.query_dtype, **dims)
            elif pid == PolicyId.ASYNCSPADE:
                cache = scfg.cache_device and query_store.cache_device_for(scfg.cache_device, device)
                stores[pid] = query_store.AsyncSpadeStore(scfg, window=cfg.policies.asyncspade.window,
                                                          num_q_heads=shape.num_q_heads, dtype=shape.query_dtype,
                                                          cache_device=cache, **dims)
            else:
                stores[pid] = query_store.LfpsStore(scfg, num_q_heads=shape.num_q_heads, **dims)
        except torch.OutOfMemoryError:
            raise ValueError(
                f"sgl_sparse: no memory left for {name}'s store ({scfg.slots} slots x max_context "
                f"{scfg.max_context}): lower --mem-fraction-static, or query_aware.{name}.slots / "
                f".max_context in --sparse-config (slots: 0 serves '{name}' dense)"
            ) from None
    return stores


def planned_bytes(cfg: SparseServerConfig, shape: StoreShape) -> tuple[dict[str, int], int]:
    """({store: bytes that do not depend on the pool}, bytes per pool slot): the stores
    `build_compact` and `build_query_stores` allocate, built on the meta device."""
    from sgl_sparse import query_store

    meta = torch.device("meta")
    fixed = {pid.name.lower(): query_store.nbytes(s) for pid, s in build_query_stores(cfg, shape, meta).items()}
    per_slot = 0
    compact = build_compact(cfg, shape, pool_size=0, device=meta)
    if compact is not None:
        fixed["sfi"] = compact.nbytes()
        per_slot = compact.knorm.shape[0] * compact.knorm.shape[2] * compact.knorm.element_size()
    return fixed, per_slot


def cache_device_bytes(cfg: SparseServerConfig, shape: StoreShape) -> dict[str, int]:
    """{cache GPU: bytes} of what asyncspade allocates on its cache GPU
    (``query_aware.asyncspade.cache_device``), planned on the meta device; empty
    without one."""
    from sgl_sparse import query_store

    store = build_query_stores(cfg, shape, torch.device("meta")).get(PolicyId.ASYNCSPADE)
    if store is None or not store.remote:
        return {}
    return {store.cfg.cache_device: query_store.nbytes(store, store.cache_tensors())}


def pool_budget(budget: int, fixed: int, per_slot: int, cell: int) -> int:
    """What is left of `budget` bytes for the pool's cells once the stores are in:
    B' + per_slot * B' / cell = budget - fixed."""
    return int((budget - fixed) * cell // (cell + per_slot))


def reserve(budget: int, cfg: SparseServerConfig, shape: StoreShape) -> tuple[int, int, str]:
    """(what is left of the KV pool's `budget` bytes once the stores are in, the stores'
    pool-independent bytes, a line that says so; `budget`, 0 and "" without stores).
    Raises, naming the fields, when the stores do not fit."""
    fixed, per_slot = planned_bytes(cfg, shape)
    if not fixed:
        return budget, 0, ""
    total = sum(fixed.values())
    left = pool_budget(budget, total, per_slot, shape.kv_cell_bytes())
    parts = ", ".join(f"{k} {_size(v)}" for k, v in fixed.items())
    if left <= 0:
        raise ValueError(
            f"sgl_sparse: the sparse stores ({parts}) need more than the {_size(budget)} that "
            f"--mem-fraction-static leaves for the KV pool: raise --mem-fraction-static, or lower "
            f"query_aware.<policy>.slots / max_context and compact.slots / capacity in --sparse-config")
    key_norms = ", and SFI's key norms per pool slot" if per_slot else ""
    return left, total, (f"sgl_sparse: {_size(budget - left)} of the KV pool's {_size(budget)} go to the sparse "
                         f"stores ({parts}{key_norms}), allocated when the backend is built; the pool gets the rest")


def reserve_for_stores(result: int, configurator: Any, *args, **kwargs) -> Optional[int]:
    """AFTER hook on SGLang's KV budget (compat.KV_BUDGET_TARGET, bytes): the budget
    less the sparse stores' bytes, on servers with this backend."""
    global reserved_bytes
    from sgl_sparse.config import config_from_env
    from sgl_sparse.plugin import _uses_backend

    if (not isinstance(result, int) or not _uses_backend(configurator.server_args)
            or getattr(configurator, "is_draft_worker", False)):
        return None
    left, reserved_bytes, line = reserve(result, config_from_env(), compat.kv_budget_shape(configurator))
    if not line:
        return None
    logger.info(line)
    return left
