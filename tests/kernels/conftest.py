"""Shared setup for the kernel tests.

* Without CUDA, Triton kernels can only run in the numpy interpreter, and
  ``TRITON_INTERPRET`` must be set *before* the kernel modules are imported
  (``@triton.jit`` decides interpreted vs compiled at decoration time).
* The kernels live in ``kernels/`` at the repo root until they are packaged
  as ``sgl_sparse.kernels``; make the repo root importable for the fallback.
* ``gpu`` marks GPU-sized tests; they are skipped when CUDA is unavailable.
"""

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: GPU-sized test (4K-128K contexts); skipped without CUDA")
    # Emitted thousands of times by the triton 3.6 interpreter (see below).
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _check_interpreter_numpy():
    # The triton 3.6 interpreter turns loop bounds loaded from memory into
    # Python ints with int(array_of_shape_1); numpy >= 2.4 made that an error.
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        import numpy as np

        major, minor = (int(x) for x in np.__version__.split(".")[:2])
        if (major, minor) >= (2, 4):
            pytest.fail(f"the Triton interpreter needs numpy < 2.4 (found {np.__version__})")
    yield
