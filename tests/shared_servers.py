"""Session-wide CPU SGLang servers, shared by the test modules that only send requests
(tests/conftest.py registers these fixtures).

A server start costs ~40-90 s on the 2-core CI machine and CI runs these modules once
per SGLang version, so one stock ``torch_native`` server and one ``sgl_sparse`` server
serve every module that needs that kind, instead of each module starting its own:

* ``stock_server``: tests/test_stock_server_cpu.py, and the reference greedy tokens of
  tests/test_server_e2e.py;
* ``sparse_server``: tests/test_server_e2e.py, tests/test_metrics_e2e.py (its Prometheus
  scrapes it) and tests/test_loadtest.py (locust's traffic).

Both serve the same tiny random Qwen3 (``tiny_qwen3``, seed 0) with the same small
prefill chunks (``SHARED_ARGS``), so a prompt is admitted over several extend chunks
(the plugin's state rows rewritten per chunk) and the two servers' greedy tokens are
comparable. The sparse one has ``--enable-metrics``.

What the sharing asks of the tests: every request a test sends has finished or been
aborted when the test ends (tests/test_loadtest.py and tests/test_server_e2e.py assert
that the server holds no sgl_sparse request state afterwards), and an assertion on the
server's metrics holds whatever traffic came before (Prometheus counters are
cumulative: lower bounds, ratios, gauges back to 0). A test needing a server with other
flags, another model or a fresh state starts its own (``tests.server.running_server``).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.server import launch_server
from tests.tiny_model import make_tiny_qwen3

# Small prefill chunks: prompts of a few hundred tokens are admitted over several extend
# chunks and requests queue; stock and sparse servers chunk the same way.
SHARED_ARGS = ["--chunked-prefill-size", "64"]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """The tiny random Qwen3 (seed 0) every shared server serves."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def stand_in_trace(tmp_path_factory):
    """Where the CPU stand-ins record each process of the stock server that loads them."""
    return tmp_path_factory.mktemp("trace") / "stand_in_loads.txt"


@pytest.fixture(scope="session")
def _shared_servers():
    """The shared servers started this session, stopped together at its end: SGLang
    drains and exits ~7 s after SIGTERM, and the servers do that side by side."""
    handles = []
    yield handles
    with cf.ThreadPoolExecutor(max(1, len(handles))) as ex:
        list(ex.map(lambda h: h.stop(), handles))


@pytest.fixture(scope="session")
def stock_server(_shared_servers, tiny_qwen3, stand_in_trace):
    env = {"SGL_SPARSE_STAND_IN_TRACE": str(stand_in_trace)}
    h = launch_server(tiny_qwen3, "torch_native", extra_args=SHARED_ARGS, env_extra=env)
    _shared_servers.append(h)
    print(f"\n[stock server] started in {h.startup_s:.1f}s, log {h.log_path}")
    return h


@pytest.fixture(scope="session")
def sparse_server(_shared_servers, tiny_qwen3):
    h = launch_server(tiny_qwen3, "sgl_sparse", extra_args=SHARED_ARGS + ["--enable-metrics"])
    _shared_servers.append(h)
    print(f"\n[sgl_sparse server] started in {h.startup_s:.1f}s, log {h.log_path}")
    return h
