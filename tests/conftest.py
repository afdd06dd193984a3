import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests import the package from the checkout only when it is not installed.
try:
    import sgl_sparse  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)

# Without CUDA, Triton kernels run in the numpy interpreter, which must be chosen
# before any kernel module is imported (@triton.jit decides at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The sglang_independent mark (tests run under one SGLang version in CI) and its guard.
from tests.ci_legs import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_call,  # noqa: E402,F401
                           pytest_runtest_setup, pytest_runtest_teardown)
# The CPU SGLang servers the test modules share (one start per kind and session).
from tests.shared_servers import (_shared_servers, sparse_server, stand_in_trace, stock_server,  # noqa: E402,F401
                                  tiny_qwen3)


@pytest.fixture
def fresh_compile_watch(monkeypatch):
    """sgl_sparse.compile_watch as in a process that just started: Triton's compile hooks
    empty, nothing installed, counted or serving; everything restored after the test."""
    from triton import knobs

    from sgl_sparse import compile_watch

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    for name, value in (("_installed", False), ("_serving", False), ("compiles", 0), ("compiles_after_serving", 0),
                        ("_started", {}), ("_listeners", [])):
        monkeypatch.setattr(compile_watch, name, value)
    return compile_watch
