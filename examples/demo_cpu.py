#!/usr/bin/env python3
"""Demo on a CPU: a real SGLang server with `--attention-backend sgl_sparse` serving
requests that each choose their own policy, side by side in one batch.

    python examples/demo_cpu.py

Builds a tiny random Qwen3-architecture model (with <think> tokens) in a temp dir,
starts the server (SGLANG_USE_CPU_ENGINE=1, test-only CPU stand-ins on PYTHONPATH),
and prints each policy's greedy continuation of the same prompt.
"""

import concurrent.futures as cf
import os
import sys
import tempfile

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.server import running_server  # noqa: E402
from tests.tiny_model import make_tiny_qwen3  # noqa: E402

POLICIES = [
    None,  # server default: full
    {"policy": "streaming", "window": 4096},  # window covers everything: same as full
    {"policy": "streaming", "window": 16, "sink": 4},
    {"policy": "sadas", "window": 16},
    {"policy": "streaming", "window": 0},  # invalid: HTTP 400, others unaffected
]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen3(os.path.join(tmp, "tiny-qwen3"))
        print("starting SGLang with --attention-backend sgl_sparse ...", flush=True)
        with running_server(model, "sgl_sparse") as server:
            prompt = "the long report says that " * 40 + "<think> so the answer is"

            def ask(sparse):
                sp = {"max_new_tokens": 24, "temperature": 0}
                if sparse is not None:
                    sp["custom_params"] = {"sparse": sparse}
                return requests.post(server.url + "/generate", json={"text": prompt, "sampling_params": sp}, timeout=300)

            with cf.ThreadPoolExecutor(len(POLICIES)) as ex:
                for sparse, r in zip(POLICIES, ex.map(ask, POLICIES)):
                    body = r.json()
                    shown = body.get("text") if r.status_code == 200 else body["error"]["message"]
                    print(f"{str(sparse or 'default (full)'):50s} HTTP {r.status_code}: {shown!r}")


if __name__ == "__main__":
    main()
