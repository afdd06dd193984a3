"""Why does `asyncspade` lose recall at 8K+ where `quest` keeps it? A probe of the
decode step that must emit the value token (bench/quality/README.md "AsyncSpade
at the recall step").

For each eval prompt (tasks.make_example, the eval's lengths/depths/seeds), one dense
forward (fidelity.record_qkv) over prompt + gold completion records every layer's
post-RoPE Q/K. At the query position t whose next token is the answer's value (the
step consuming the restated KEY), per layer and KV head, on the server's candidate
range [sink, t + 1 - recent) with the server's ranking (max over the group's query
heads of scale q.k, queryaware.asyncspade.score_positions / select_topk):

  true    Top-B of the true query q_t (what a query-aware oracle with the server's
          ranking keeps; quest approximates this with page bounds of q_t)
  pred    Top-B of the server's predicted q̂_t: predict_next_query on the last
          window + 1 true queries q_{t-window-1} .. q_{t-1}, exactly what
          query_serving._predict computes at the end of step t - 1 (fidelity.asyncspade_window)
  last    Top-B of q_{t-1} (the naive "previous query" predictor)
  quest   fidelity.quest_policy's page selection with q_t (budget/16 pages)

and whether the fact's value position(s) (what the induction copy reads) and its key
position are in each set, the rank of the value position under each scorer, and the
true attention probability on the value (max over the group) to tell the heads that
do the recall. The same is reported for the steps *before* the value step (template
steps of the answer) as a control: how well the predictor tracks ordinary steps.

    python bench/quality/asyncspade_recall_probe.py --model /tmp/ckpt/tiny-recall \
        --length 8192 --n 2 --variants plain,think --budgets 256,1024,2048 \
        --out bench/results/asyncspade_recall_probe_cpu_run5.json   # + .md next to it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "quality")]

import fidelity  # noqa: E402
import tasks  # noqa: E402
from sgl_sparse.config import AsyncSpadePolicy  # noqa: E402
from sgl_sparse.queryaware import asyncspade as aspd  # noqa: E402

SPEC = AsyncSpadePolicy()
SINK = SPEC.sink


def _scores(q: torch.Tensor, L: fidelity.LayerQKV, t: int, recent: int) -> torch.Tensor:
    """The server's score of every key 0..t-1 (the keys that exist at step t - 1) for
    query q [Hq, D], -inf outside [sink, t + 1 - recent) -> [Hkv, t]."""
    keys = L.k[:, :t].permute(1, 0, 2)[None]
    dev = q.device
    return aspd.score_positions(q[None], keys, torch.tensor([t], device=dev), torch.tensor([SINK], device=dev),
                                torch.tensor([max(0, t + 1 - recent)], device=dev), L.scaling)[0]


def _rank(s: torch.Tensor, p: int) -> torch.Tensor:
    """[Hkv] 0-based rank of position p under scores s [Hkv, n] (0 = best)."""
    return (s > s[:, p:p + 1]).sum(-1)


def probe_step(L: fidelity.LayerQKV, t: int, fact: list[int], budgets: list[int], window: int,
               recent: int, ridge: float) -> dict:
    """Per KV head of one layer at query position t."""
    hkv = L.k.shape[0]
    win, count = fidelity.asyncspade_window(L, t, window)
    q_hat = aspd.predict_next_query(win, count, ridge)[0]
    s = {"true": _scores(L.q[:, t], L, t, recent), "pred": _scores(q_hat, L, t, recent),
         "last": _scores(L.q[:, t - 1], L, t, recent)}
    # the same predictor with a longer window (a knob, not the served default)
    win8, count8 = fidelity.asyncspade_window(L, t, 8)
    s["pred_w8"] = _scores(aspd.predict_next_query(win8, count8, ridge)[0], L, t, recent)
    # each true query of the served ring (q_{t-1} .. q_{t-window-1}): Q̂ is a convex
    # combination of q_{t-1} .. q_{t-window} (Eq. 4), so if none of them ranks the value
    # high, no weights can
    ring = {f"q_t-{i}": _scores(L.q[:, t - i], L, t, recent) for i in range(1, window + 2)}
    key_p, vals = fact[0], fact[1:]
    probs = fidelity.group_probs(L.q[:, t], L.k[:, : t + 1], L.scaling)  # [Hkv, G, t + 1]
    out = {"p_value": probs[:, :, vals].sum(-1).amax(1).tolist(),  # max over the group
           "rank": {k: _rank(v, vals[0]).tolist() for k, v in {**s, **ring}.items()}}
    for b in budgets:
        row = {}
        for k, v in s.items():
            # In the Top-B iff fewer than B candidates score strictly higher (ties aside)
            row[k] = {"value": (_rank(v, vals[0]) < b).tolist(), "key": (_rank(v, key_p) < b).tolist()}
        best = torch.stack([_rank(v, vals[0]) for v in list(ring.values())[:window]]).amin(0)
        row["window_any"] = {"value": (best < b).tolist()}
        qk = fidelity.quest_policy(L, t, b)  # [Hkv, t + 1]
        row["quest"] = {"value": qk[:, vals].all(-1).tolist(), "key": qk[:, key_p].tolist()}
        lo, hi = torch.tensor([SINK]), torch.tensor([max(0, t + 1 - recent)])
        keys = L.k[:, :t].permute(1, 0, 2)[None]
        bb = torch.tensor([b])
        row["overlap_pred_true"] = aspd.topk_overlap(q_hat[None], L.q[:, t][None], keys, torch.tensor([t]), lo, hi,
                                                     L.scaling, bb, b)[0].tolist()
        row["overlap_last_true"] = aspd.topk_overlap(L.q[:, t - 1][None], L.q[:, t][None], keys, torch.tensor([t]),
                                                     lo, hi, L.scaling, bb, b)[0].tolist()
        out[str(b)] = row
    assert len(out["p_value"]) == hkv
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--n", type=int, default=2, help="examples per (variant, depth): seeds seed..seed+n-1")
    ap.add_argument("--seed", type=int, default=1000, help="eval.py's default seed: the eval's own prompts")
    ap.add_argument("--variants", default="plain")
    ap.add_argument("--budgets", default="256,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    budgets = [int(x) for x in a.budgets.split(",")]
    model = fidelity.load_model(a.model)
    t0 = time.monotonic()
    recs = []
    for variant in a.variants.split(","):
        for depth in [float(d) for d in a.depths.split(",")]:
            for seed in range(a.n):
                ex = tasks.make_example(a.length, depth, variant, a.seed + seed)
                layers = fidelity.record_qkv(model, ex.prompt + ex.completion)
                t_val = fidelity.decode_positions(ex)[0]
                fact = [ex.fact_pos] + [ex.fact_pos + 1 + i for i in range(len(ex.answer))]
                # control: the answer's template steps before the value step that are
                # sparse for the server (its first decode step, len(prompt) - 1 + 1, is dense)
                controls = list(range(len(ex.prompt), t_val))
                rec = {"variant": variant, "depth": depth, "seed": a.seed + seed, "t": t_val, "fact": fact,
                       "prompt_len": len(ex.prompt), "value_step": [], "controls": {}}
                for L in layers:
                    rec["value_step"].append(probe_step(L, t_val, fact, budgets, SPEC.window, SPEC.recent, SPEC.ridge))
                for c in controls:
                    rec["controls"][c] = [probe_step(L, c, fact, budgets, SPEC.window, SPEC.recent, SPEC.ridge)
                                          for L in layers]
                recs.append(rec)
                print(f"{variant} depth {depth} seed {seed}: t {t_val} fact {fact} "
                      f"({time.monotonic() - t0:.0f}s)", flush=True)
    res = {"command": " ".join(sys.argv), "model": a.model, "length": a.length, "budgets": budgets,
           "knobs": {"window": SPEC.window, "recent": SPEC.recent, "ridge": SPEC.ridge, "sink": SINK},
           "examples": recs}
    Path(a.out).write_text(json.dumps(res))
    md = summary(res)
    Path(a.out).with_suffix(".md").write_text(md)
    print(md)


def summary(res: dict) -> str:
    """Markdown, per variant and budget, one row per layer: the fraction of (example,
    KV head) whose Top-B holds the fact's value position under each scorer; the same
    over the recall heads only (true attention probability on the value > 0.5); the
    median rank of the value there; mean overlap ratios (Eq. 1) at the value step and
    at the answer's earlier (template) steps."""
    lines = [f"command: `{res['command']}`", "",
             f"length {res['length']}, knobs {res['knobs']} (the server's AsyncSpadePolicy defaults)", "",
             "value in: the fact's value position is in the scorer's Top-B of [sink, t + 1 - recent) "
             "(true = q_t; pred = the served predictor, window 4; pred_w8 = window 8; last = q_{t-1}; "
             "any = the best single query of the 4 that pred combines; quest = quest's pages of q_t). "
             "Recall heads: true attention on the value > 0.5. Overlap: Eq. 1, |Top-B(q̂) ∩ Top-B(q_t)| / B.", ""]
    kinds = ("true", "pred", "pred_w8", "last", "window_any", "quest")
    rh = lambda s, h: s["p_value"][h] > 0.5
    for variant in dict.fromkeys(r["variant"] for r in res["examples"]):
        recs = [r for r in res["examples"] if r["variant"] == variant]
        n_layers = len(recs[0]["value_step"])
        lines += [f"## {variant}: {len(recs)} examples", ""]
        for b in res["budgets"]:
            lines += [f"### budget {b}", "",
                      "| layer | heads | value in: " + " / ".join(kinds) + " | recall heads | value in (recall heads): "
                      + " / ".join(kinds[:-1]) + " | median rank of value (recall heads): true / pred / q_t-1 .. q_t-5 "
                      "| overlap pred-true / last-true: value step | template steps |",
                      "|---|---|---|---|---|---|---|---|"]
            for li in range(n_layers):
                steps = [r["value_step"][li] for r in recs]
                heads = [(s, h) for s in steps for h in range(len(s["p_value"]))]
                frac = lambda kind, sel=None: _mean([s[str(b)][kind]["value"][h] for s, h in heads
                                                     if sel is None or sel(s, h)])
                n_rh = sum(rh(s, h) for s, h in heads)
                rk = [k for k in steps[0]["rank"] if k in ("true", "pred") or k.startswith("q_t-")]
                med = " / ".join(_median([s["rank"][k][h] for s, h in heads if rh(s, h)]) for k in rk)
                ov = lambda key, src: _mean([v for s in src for v in s[str(b)][key]])
                ctrl = [c[li] for r in recs for c in r["controls"].values()]
                lines.append(
                    f"| {li} | {len(heads)} | " + " / ".join(f"{frac(k):.2f}" for k in kinds) + f" | {n_rh} | "
                    + " / ".join(_fmt(frac(k, rh)) for k in kinds[:-1]) + f" | {med} | "
                    f"{ov('overlap_pred_true', steps):.2f} / {ov('overlap_last_true', steps):.2f} | "
                    f"{ov('overlap_pred_true', ctrl):.2f} / {ov('overlap_last_true', ctrl):.2f} |")
            lines.append("")
    return "\n".join(lines)


def _median(xs) -> str:
    xs = sorted(xs)
    return str(xs[len(xs) // 2]) if xs else "-"


def _mean(xs) -> float:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


if __name__ == "__main__":
    main()
