"""Several layers' KV pools as one launch argument.

SGLang keeps each layer's K (and V) pool as its own tensor, so a kernel that
reads "layer l's keys" would otherwise be launched once per layer (28 host-side
launches per refresh on a 28-layer model). All layers' pools share one shape,
strides and dtype; only their addresses differ. A ``LayerPools`` is one pool
(which carries the dtype and strides into the launch) plus an int64 table of
every layer's address on the pools' device; a kernel loads entry ``l`` and casts
it to a pointer (``load_layer_pool``) to read layer ``l``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["LayerPools", "load_layer_pool"]

# Triton assumes a pointer argument is 16-byte aligned when it is (its launch
# checks); an address loaded from the table is told so by `load_layer_pool`.
_ALIGN = 16


@dataclass(frozen=True)
class LayerPools:
    """``pool``: one layer's ``[tokens, Hkv, D]`` pool; ``ptrs``: int64 ``[layers]``
    addresses of pools of the same shape, strides and dtype, on their device."""

    pool: torch.Tensor
    ptrs: torch.Tensor

    @classmethod
    def of(cls, pools: Sequence[torch.Tensor], ptrs: torch.Tensor | None = None) -> "LayerPools":
        """Checks that ``pools`` can share one launch; ``ptrs``: their addresses
        already on the device (e.g. a cached table), else copied there now."""
        first = pools[0]
        addrs = [p.data_ptr() for p in pools]
        for p in pools:
            assert p.shape == first.shape and p.stride() == first.stride(), "pools differ in shape or strides"
            assert p.dtype == first.dtype and p.device == first.device, "pools differ in dtype or device"
        assert all(a % _ALIGN == 0 for a in addrs), f"a pool is not {_ALIGN}-byte aligned"
        if ptrs is None:
            ptrs = torch.tensor(addrs, dtype=torch.int64).to(first.device)
        assert ptrs.dtype == torch.int64 and ptrs.shape == (len(pools),) and ptrs.device == first.device
        return cls(first, ptrs)

    @classmethod
    def one(cls, pool: torch.Tensor) -> "LayerPools":
        """A single pool for a launch with the table off (``LAYERED`` false): never read."""
        return cls(pool, pool)

    def __len__(self) -> int:
        return self.ptrs.shape[0]

    def layers(self, start: int, stop: int) -> "LayerPools":
        """The pools of layers [start, stop) (a view of the table, 8 bytes a layer in:
        the kernels reading a table do not specialize on its alignment)."""
        return LayerPools(self.pool, self.ptrs[start:stop])


@triton.jit
def load_layer_pool(POOL, PTRS, layer, LAYERED: tl.constexpr):
    """Layer ``layer``'s pool from the address table ``PTRS`` (``LAYERED``), else ``POOL`` itself."""
    if LAYERED:
        p = tl.load(PTRS + layer).to(tl.pointer_type(POOL.dtype.element_ty))
        return tl.multiple_of(p, 16)  # checked on the host: LayerPools.of
    else:
        return POOL
