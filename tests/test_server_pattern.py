"""bench/gpu/server_pattern.sh, sourced by stop_stale_servers.sh and e2e_watchdog.sh:
its default names SGLang's server processes and nothing else. Not marked
sglang_independent although it loads no SGLang: it names SGLang's processes, which
tests/test_ci_layout.py's static check keeps out of marked modules."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def test_the_default_server_pattern_names_sglangs_processes_only():
    """server_pattern.sh's default (both scripts source it): SGLang's launcher and its
    `sglang::` children, not the benchmark that starts them nor other Pythons."""
    names = ["python3 -m sglang.launch_server --model-path /root/model --port 30000", "sglang::scheduler",
             "sglang::detokenizer", "python3 bench/gpu/server_compare.py --model /root/model",
             "python3 -m pytest -q tests", "python3 -m sglang_router.launch"]
    script = ('. "$1"; shift; for n in "$@"; do [[ $n =~ $SERVER_PATTERN ]] && echo y || echo n; done')
    env = {k: v for k, v in os.environ.items() if k != "SERVER_PATTERN"}
    out = subprocess.run(["bash", "-c", script, "_", str(GPU / "server_pattern.sh"), *names], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["y", "y", "y", "n", "n", "n"], out
