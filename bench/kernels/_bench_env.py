"""What every kernel benchmark does first: pick the device and import the kernels.

On a machine without CUDA the benchmarks only run with ``--smoke`` (small
shapes under the Triton interpreter, to check the script itself); the
interpreter has to be switched on before the kernels are imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Optional

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def use_cuda_or_exit(smoke: bool) -> Optional[bool]:
    """True: CUDA; False: the CPU interpreter (``--smoke``); None: neither is
    possible (the caller returns 2 after the message printed here)."""
    import torch

    if torch.cuda.is_available() and not smoke:
        return True
    if not smoke:
        print("No CUDA device: use --smoke to exercise this script on the CPU interpreter.", file=sys.stderr)
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def import_kernels(submodule: str = "") -> ModuleType:
    """The installed ``sgl_sparse.kernels`` (or one of its submodules), else this
    checkout's ``kernels``."""
    suffix = f".{submodule}" if submodule else ""
    try:
        return importlib.import_module("sgl_sparse.kernels" + suffix)
    except ImportError:
        sys.path.insert(0, _REPO_ROOT)
        return importlib.import_module("kernels" + suffix)
