"""Shared setup for the kernel tests.

* ``TRITON_INTERPRET`` (no CUDA) is set by ``tests/conftest.py``, which pytest
  loads before this file and before any kernel module is imported.
* ``gpu`` marks GPU-sized tests; they are skipped when CUDA is unavailable.
"""

import os

import pytest


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
