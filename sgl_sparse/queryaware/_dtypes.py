"""The dtype the query-aware math computes in, shared by its policies."""

from __future__ import annotations

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for fp8/half/bf16/fp32 inputs (the serving dtypes; fp8: an fp8 KV cache's
    keys or values, which torch does not promote), float64 kept (tests)."""
    if x.dtype in _FP8:
        return torch.float32
    return torch.promote_types(x.dtype, torch.float32)
