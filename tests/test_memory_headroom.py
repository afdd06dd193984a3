"""The warning when the sparse stores crowd SGLang's activation share
(backend.stores_headroom_warning, compat.memory_split).

SGLang sizes its KV pool so that (1 - --mem-fraction-static) of the memory free before
the model loaded stays free for activations and CUDA graphs; the backend allocates its
stores after that, out of this share. On an H200 (bench/README "Session 26") 32 slots
of quest, asyncspade and lfps at 33792 positions took 24.9 of the 25.9 GiB left at
--mem-fraction-static 0.8, and the decode-graph capture then ran out of memory inside
SGLang with nothing pointing at the stores. Checked here, in a subprocess with the
installed SGLang: that its ModelRunner still keeps the two figures compat reads (drift
between releases fails here, not on a GPU), and what the warning says for that case.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server import server_env

pytestmark = pytest.mark.timeout(300)

SNIPPET = r"""
import inspect, json
from types import SimpleNamespace
from sglang.srt.model_executor import model_runner as mr
from sgl_sparse import compat
from sgl_sparse.backend import stores_headroom_warning

src = inspect.getsource(mr)
GiB = 2 ** 30
out = {
    "keeps_free_before_load": "self.pre_model_load_memory = " in src,
    "keeps_fraction": "self.mem_fraction_static = " in src,
    "split": compat.memory_split(SimpleNamespace(pre_model_load_memory=139.0, mem_fraction_static=0.8)),
    "split_missing": compat.memory_split(SimpleNamespace(mem_fraction_static=0.8)),
    # session 26's server: 24.9 GiB of stores, 139 GiB free before the load, 0.8
    "h200": stores_headroom_warning(int(24.9 * GiB), 139 * GiB, 0.8),
    "small": stores_headroom_warning(int(13.0 * GiB), 139 * GiB, 0.8),
    "no_room": stores_headroom_warning(int(30 * GiB), 30 * GiB, 0.5),
}
print("RESULT " + json.dumps(out))
"""


def test_stores_headroom_warning_on_the_installed_sglang():
    proc = subprocess.run([sys.executable, "-c", SNIPPET], env=server_env(), capture_output=True, text=True,
                          timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["keeps_free_before_load"] and out["keeps_fraction"], out
    assert out["split"] == [139 * 2 ** 30, 0.8] and out["split_missing"] is None
    msg = out["h200"]
    # 24.9 of 0.2 x 139 = 27.8 GiB: more than half; 0.8 - 24.9 / 139 = 0.62
    assert msg is not None and "24.90 GiB of the 27.80 GiB" in msg and "2.90 GiB left" in msg
    assert "--mem-fraction-static 0.62" in msg
    assert "query_aware.<policy>.slots / max_context" in msg and "compact.slots" in msg
    assert out["small"] is None  # 13 of 27.8 GiB: under half
    assert "a smaller --mem-fraction-static" in out["no_room"]  # 0.5 - 1.0 <= 0: no number to give
