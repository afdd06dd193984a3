"""Does the CPU server's asyncspade attend, at the value step, what the offline model
of it (fidelity.py / asyncspade_recall_probe.py) says? (bench/quality/README.md
"AsyncSpade at the recall step".)

A real CPU `sgl_sparse` server (tests.server, the test-only CPU stand-ins) is started
with a probe-only `sitecustomize` on its PYTHONPATH (written to a temp dir here, not
part of the package) that wraps query_serving.QueryAwareRuntime.select/_predict and
records, for asyncspade rows, each layer's served segment A (a_pos / a_len), b_start,
the ring's push count and the step's query. eval.py's prompts (seed 1000) are sent one
at a time, greedy, under each policy (exact match and retention per policy). Then,
per asyncspade prompt, at the step that emits the value (seq_len t + 1): the served
set of every layer and KV head vs the offline one (plain transformers Q/K of the same
tokens, predict_next_query on the last window + 1 true queries, score_positions,
select_topk, prepend_sink: the server's own math), and whether the fact's value
position is in each. The torch (CPU) serving path only: on CUDA the server runs
query_device.py, checked against this path by tests/test_query_device.py.

    python bench/quality/asyncspade_served_check.py --model /tmp/ckpt/tiny-recall --length 8192 --n 2 \
        --out bench/results/asyncspade_served_check_cpu_run5.txt
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "quality")]

import eval as qe  # noqa: E402
import fidelity  # noqa: E402
import tasks  # noqa: E402
from sgl_sparse.config import AsyncSpadePolicy  # noqa: E402
from sgl_sparse.query_serving import prepend_sink  # noqa: E402
from sgl_sparse.queryaware import asyncspade as aspd  # noqa: E402
from tests.server import running_server  # noqa: E402

SITECUSTOMIZE = r'''
import os, sys, importlib.abc, importlib.util
DUMP = os.environ.get("ASPD_DUMP")

def _patch(mod):
    import torch
    from sgl_sparse.policies.base import PolicyId
    R, rec = mod.QueryAwareRuntime, []
    path = f"{DUMP}.{os.getpid()}.pt"
    orig_select = R.select

    def select(self, li, plan, q3, k_cache, req_to_token, req_pool_indices, seq_lens, scale):
        out = orig_select(self, li, plan, q3, k_cache, req_to_token, req_pool_indices, seq_lens, scale)
        for g in self.groups:
            if g.policy == PolicyId.ASYNCSPADE:
                b = g.batch_idx
                rec.append({"li": li, "n": seq_lens[b].tolist(), "indexed": plan.indexed()[b].tolist(),
                            "b_start": plan.b_start[b].tolist(), "a_pos": out.a_pos[b].clone(),
                            "a_len": out.a_len_per_head[b].clone(), "q": q3[b].float().clone(),
                            "ring_total": self.stores[PolicyId.ASYNCSPADE].total[li, g.slots].tolist()})
                torch.save(rec, path)
        return out

    R.select = select

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sgl_sparse.query_serving":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(m):
            run(m)
            _patch(m)

        spec.loader.exec_module = exec_module
        return spec

if DUMP:
    sys.meta_path.insert(0, _Finder())
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--n", type=int, default=2, help="prompts per depth (0.1, 0.5, 0.9), plain variant")
    ap.add_argument("--policies", default="asyncspade,quest,full")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec_d = AsyncSpadePolicy()
    exs = qe.examples_for(a.length, [0.1, 0.5, 0.9], ["plain"], a.n, 1000)
    tmp = Path(tempfile.mkdtemp(prefix="aspd_check_"))
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    dump = str(tmp / "dump")
    args = ["--enable-metrics", "--max-total-tokens", str(2 * a.length + 512), "--max-prefill-tokens", "8192",
            "--chunked-prefill-size", "8192", "--context-length", str(a.length + 1024)]
    lines = [f"command: {' '.join(sys.argv)}", ""]
    served: dict[int, tuple[list[int], bool, list]] = {}
    t0 = time.monotonic()
    with running_server(a.model, "sgl_sparse", extra_args=args, timeout=600,
                        env_extra={"PYTHONPATH": str(tmp), "ASPD_DUMP": dump},
                        log_path=str(tmp / "server.log")) as h:
        for pol in a.policies.split(","):
            spec = qe.PolicySpec.parse(pol)
            before = qe.scrape(h.url)
            hits = []
            for i, ex in enumerate(exs):
                out = qe.generate(h.url, ex.prompt, spec, len(ex.completion) + 4).json()["output_ids"]
                ok = tasks.answer_correct(ex, out)
                hits.append(ok)
                if spec.name == "asyncspade":
                    time.sleep(0.5)
                    recs = [r for f in glob.glob(dump + ".*.pt") for r in torch.load(f)]
                    served[i] = (out, ok, recs)
            time.sleep(1.0)
            after = qe.scrape(h.url)
            att, cac = (qe._diff(after, before, c, spec.name) for c in ("attended_tokens", "cached_tokens"))
            lines.append(f"{pol}: exact match {sum(hits)}/{len(hits)}, retention {att / max(cac, 1):.3f} "
                         f"({time.monotonic() - t0:.0f} s)")
            print(lines[-1], flush=True)
    lines.append("")
    model = fidelity.load_model(a.model)
    prev = 0
    agree = []
    for i, ex in enumerate(exs):
        if i not in served:
            continue
        out, ok, recs = served[i]
        mine, prev = recs[prev:], len(recs)
        t = fidelity.decode_positions(ex)[0]
        vals = [ex.fact_pos + 1 + j for j in range(len(ex.answer))]
        seq = ex.prompt + out
        prefix_ok = seq[: t + 1] == (ex.prompt + ex.completion)[: t + 1]
        layers = fidelity.record_qkv(model, seq[: t + 1])
        at = {r["li"]: r for r in mine if r["n"] == [t + 1]}
        lines.append(f"prompt {i} (depth {ex.depth:.2f}, value at {vals}): exact match {ok}; the served tokens "
                     f"up to the value step are the gold ones: {prefix_ok}; value step t = {t}")
        for li, L in enumerate(layers):
            r = at.get(li)
            if r is None:
                lines.append(f"  layer {li}: no served record at seq_len {t + 1}")
                continue
            win, cnt = fidelity.asyncspade_window(L, t, spec_d.window)
            q_hat = aspd.predict_next_query(win, cnt, spec_d.ridge)
            keys = L.k[:, :t].permute(1, 0, 2)[None]
            nb = t + 1 - spec_d.recent
            scores = aspd.score_positions(q_hat, keys, torch.tensor([t]), torch.tensor([spec_d.sink]),
                                          torch.tensor([nb]), L.scaling)
            pos, c = aspd.select_topk(scores, torch.tensor([spec_d.budget]), spec_d.budget)
            ap_, al = prepend_sink(pos, c, torch.tensor([spec_d.sink]), torch.tensor([nb]), r["a_pos"].shape[-1])
            qcos = torch.nn.functional.cosine_similarity(r["q"][0].reshape(-1), L.q[:, t].reshape(-1), dim=0).item()
            heads = []
            for hh in range(L.k.shape[0]):
                srv = set(r["a_pos"][0, hh, : r["a_len"][0, hh]].tolist())
                off = set(ap_[0, hh, : al[0, hh]].tolist())
                jac = len(srv & off) / max(1, len(srv | off))
                agree.append(jac)
                heads.append(f"head {hh}: |A| served {len(srv)} offline {len(off)}, Jaccard {jac:.3f}, value in "
                             f"served {all(v in srv for v in vals)} / offline {all(v in off for v in vals)}")
            lines.append(f"  layer {li}: indexed {r['indexed'][0]}, b_start {r['b_start'][0]}, queries pushed "
                         f"{r['ring_total'][0]}, cos(served q_t, offline q_t) {qcos:.4f}; " + "; ".join(heads))
    lines += ["", f"served vs offline segment A at the value step: Jaccard min {min(agree):.3f}, "
              f"mean {sum(agree) / len(agree):.3f} over {len(agree)} (prompt, layer, KV head)"]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
