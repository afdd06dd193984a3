"""Test-only stand-in for ``torchvision`` (see tests/cpu_stand_ins/README.md).

PyPI's torchvision wheels are CUDA builds that cannot be loaded next to the
CPU-only torch 2.13.0 we test with, yet SGLang imports ``torchvision``
(``torchvision.transforms``, ``torchvision.io.decode_jpeg``, ...) from
multimodal code at import time.  This package provides just the module tree so
those imports succeed; calling anything raises ``NotImplementedError``.
"""

from . import io, transforms  # noqa: F401
from ._stub import module_getattr

__version__ = "0.0.0+sgl-sparse-cpu-stand-in"
IS_SGL_SPARSE_STAND_IN = True

__getattr__ = module_getattr("", {})
