"""Small host-side helpers shared by the kernels in this package.

Nothing in here touches tensor *data* on the host: everything is derived from
shapes, dtypes, devices or environment variables, so that the kernel launch
paths that use these helpers stay CUDA-graph capturable (no ``.item()``, no
``.tolist()``, no device->host copies).
"""

from __future__ import annotations

import functools
import os

import torch

# Quest pages: positions [16p, 16p + 16) of a request (quest_pages.py; also
# used by two_segment_decode's fused bounds update).
QUEST_PAGE_SIZE = 16

# Number of "SMs" we pretend to have when running on the CPU interpreter. Only
# used by the split heuristic; kept small so interpreter runs stay cheap.
CPU_FAKE_NUM_SMS = 4


def env_switch(name: str, default: bool) -> bool:
    """An on/off operator switch ``SGLANG_SPARSE_<name>`` (``SGL_SPARSE_<name>`` too).

    SGLang rewrites every ``SGL_*`` variable of its processes to ``SGLANG_*`` and
    warns that the old name is deprecated, so both spellings are honoured and the
    ``SGLANG_`` one wins: following that warning must not silently drop a switch.
    "0", "false", "no", "off" (any case) mean off; any other value means on.
    """
    found = _env(name)
    return default if found is None else found[1].strip().lower() not in ("0", "false", "no", "off")


def env_count(name: str, default: int, lo: int, hi: int) -> int:
    """An operator count ``SGLANG_SPARSE_<name>`` (``SGL_SPARSE_<name>`` too, as
    :func:`env_switch`), an integer in ``[lo, hi]``; anything else stops with an
    error naming the variable."""
    found = _env(name)
    if found is None:
        return default
    key, value = found
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"{key}: an integer in [{lo}, {hi}] (got {value!r})")
    return n


def env_value(name: str):
    """The raw value of ``SGLANG_SPARSE_<name>`` (``SGL_SPARSE_<name>`` too, as
    :func:`env_switch`), None where neither is set: for switches whose default
    depends on more than the variable."""
    found = _env(name)
    return None if found is None else found[1]


def _env(name: str):
    """``(key, value)`` of ``SGLANG_SPARSE_<name>``, else of ``SGL_SPARSE_<name>``, else None."""
    for key in (f"SGLANG_SPARSE_{name}", f"SGL_SPARSE_{name}"):
        value = os.environ.get(key)
        if value is not None:
            return key, value
    return None


def is_interpreter() -> bool:
    """True when Triton kernels run in the numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of ``device`` (cached; host-only query)."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_num_sms(idx)
    return CPU_FAKE_NUM_SMS


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def has_fp8_pair_conversions(device: torch.device) -> bool:
    """Whether compiled code on ``device`` has PTX's fp8-pair conversions
    (``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2``: sm_89 and later, e.g. L40 / H100 /
    H200). Not under the interpreter, nor on CPU (cached; host-only query)."""
    if device.type != "cuda" or is_interpreter():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(idx) >= (8, 9)


def needs_fp32_dot(dtype: torch.dtype) -> bool:
    """Work around a Triton interpreter bug (present in triton 3.6).

    The interpreter stores bf16 values as raw ``uint16`` bit patterns and its
    ``tl.dot`` calls ``np.matmul`` directly on those bits, producing garbage
    (~1e10). Compiled GPU code is unaffected. When interpreting bf16 we
    therefore up-cast dot operands to fp32 *after* every rounding step the GPU
    kernel performs (e.g. ``p.to(bf16)``), so the interpreter still reproduces
    the GPU numerics faithfully.
    """
    return is_interpreter() and dtype == torch.bfloat16


def needs_bf16_rtne(dtype: torch.dtype) -> bool:
    """Work around a Triton interpreter bug (present in triton 3.7).

    The interpreter converts fp32 to bf16 by truncating the mantissa (round
    toward zero), even with ``fp_downcast_rounding="rtne"``; compiled GPU code
    rounds to nearest even, as ``torch`` does. Kernels whose bf16 stores must
    match torch bit for bit round explicitly (``_round_bf16_rtne``) when this
    is true, so the interpreter reproduces the GPU numerics.
    """
    return is_interpreter() and dtype == torch.bfloat16


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it already has ``dtype`` (hot-path callers pass it so: no
    dispatch, no copy), else converted."""
    return t if t.dtype == dtype else t.to(dtype)
