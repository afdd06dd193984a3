"""eval.py's task accuracy through a real CPU `sgl_sparse` server (tests.server:
SGLang's CPU engine with the test-only CPU kernel stand-ins), for toy checkpoints
trained on the CPU (`train_tiny.py --smoke ...`, bench/quality/README.md "CPU
reproduction"). Run from the repo root:

    python bench/quality/eval_cpu.py --model /tmp/toy-recall --lengths 256,512 --depths 0.1,0.5 --n 4 \
        --policies full,sfi:budget=64:recent=32:beta=1.0 --out bench/results/quality_eval_cpu_toy_runN.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "quality")]

import eval as quality_eval  # noqa: E402
from tests.server import running_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="256,512")
    ap.add_argument("--depths", default="0.1,0.5")
    ap.add_argument("--n", type=int, default=4, help="examples per (variant, depth) cell")
    ap.add_argument("--policies", default="full")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dump-failures", type=int, default=6)
    ap.add_argument("--out", required=True, help="JSON; the markdown table goes next to it (.md)")
    a = ap.parse_args()
    t0 = time.monotonic()
    with running_server(a.model, "sgl_sparse", extra_args=["--enable-metrics"], log_path=a.out + ".server.log") as h:
        res = quality_eval.evaluate(h.url, a.policies.split(","), [int(x) for x in a.lengths.split(",")],
                                    [float(d) for d in a.depths.split(",")], n=a.n, concurrency=a.concurrency,
                                    dump_failures=a.dump_failures)
    res["model"] = a.model
    res["command"] = " ".join(sys.argv)
    Path(a.out).write_text(json.dumps(res, indent=1))
    md = quality_eval.markdown(res)
    Path(a.out).with_suffix(".md").write_text(md)
    print(md)
    print(f"wall {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
