"""Attention-output fidelity of sparse policies vs dense, on the trained model's own Q/K/V.

    python bench/quality/fidelity.py --model bench/quality/out/tiny-recall --lengths 2048,8192 \
        --budgets 64,256,1024 --out-json fid.json --out-md fid.md

Plain transformers/PyTorch: one dense forward pass over prompt + gold completion
records every layer's post-RoPE Q, K and V (a registered attention function, see
`record_qkv`, that computes exact fp32 causal attention in query chunks: memory
O(T x heads x D) for the recordings plus O(chunk x T) for the logits, so 32K fits).
At the decode positions that produce the answer's value tokens (the
queries that must reach the fact far back) each policy picks a set of key
positions per KV head (shared by its G query heads, as the serving kernels do),
and we compare attention restricted to that set with dense attention:

* rel_err: ||o_sparse - o_dense|| / ||o_dense|| over all query heads of a layer;
* overlap: |S ∩ top-|S| exact| / |S| (top by exact attention probability,
  averaged over the group's query heads): the LFPS/AsyncSpade "overlap ratio";
* mass: exact attention probability that falls inside S;
* retention: |S| / n;
* fact kept: fraction of KV heads whose S holds the queried fact's key and value
  positions (and the value's alone): what recall needs.

Each layer sees dense inputs (the error does not compound through layers): this
isolates the attention approximation; task accuracy under real sparse decoding is
eval.py's job. Policies (budget B tokens per KV head):
  full; streaming (sink 4 + last B); sfi (sink 4 + Selector top-B from
  sgl_sparse.selector.core on a window of w queries ending `lag` steps earlier,
  + `recent` last tokens); quest (pages of 16 tokens, per-page key min/max bound,
  top B/16 pages + the current page); oracle (exact top-B); think examples
  only: sfi-later (the server's SFI schedule replayed on the completion: the
  selection of the last slow step before the value, which in the think variant
  is the w = 1 refresh at the think block's last ".", see `sfi_later_factory`)
  and sfi-later-every (the same with prompt_evidence "every": that refresh's
  window also holds the prompt's last queries).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import tasks  # noqa: E402

SINK = 4
QUEST_PAGE = 16


# --------------------------------------------------------------- recording
@dataclass
class LayerQKV:
    q: torch.Tensor  # [Hq, T, D] post-norm, post-RoPE
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D]
    scaling: float


# fp32 logits per query chunk of the recording forward: 2^27 elements = 512 MiB
# (softmax's output doubles it), whatever the length.
MAX_CHUNK_LOGITS = 1 << 27


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     max_logits: int = MAX_CHUNK_LOGITS) -> torch.Tensor:
    """Exact causal GQA attention in fp32, q [Hq, T, D], k/v [Hkv, T, D] -> [T, Hq, D].

    Query chunks of c rows against the keys up to the chunk's end: memory
    O(Hq * c * T) with no [T, T] mask, where SDPA's fp32 math path materializes
    Hq x T x T (32 GiB at 32K; it OOMed on an 80 GB H100)."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    chunk = max(1, min(t, max_logits // max(1, hq * t)))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        qc = qf[:, s:e].reshape(hkv, g, e - s, d)
        logits = torch.einsum("hgcd,hnd->hgcn", qc, kf[:, :e]) * scaling
        future = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
        probs = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
        del logits
        out[s:e] = torch.einsum("hgcn,hnd->chgd", probs, vf[:, :e]).reshape(e - s, hq, d)
    return out


def record_qkv(model, ids: Sequence[int], max_logits: int = MAX_CHUNK_LOGITS) -> list[LayerQKV]:
    """One dense forward over `ids`; returns every layer's Q/K/V (float32, on the model's device).

    The registered attention function records Q/K/V and computes the layer's
    attention itself (`causal_attention`): a custom attention name also makes
    transformers build no mask (one unpadded causal sequence needs none)."""
    from transformers import AttentionInterface

    store: dict[int, LayerQKV] = {}

    def recording(module, query, key, value, attention_mask, **kw):
        assert query.shape[0] == 1 and attention_mask is None, "one unpadded causal sequence"
        scaling = float(kw.get("scaling") or module.scaling)
        L = LayerQKV(query[0].float(), key[0].float(), value[0].float(), scaling)
        store[module.layer_idx] = L
        out = causal_attention(L.q, L.k, L.v, scaling, max_logits)
        return out[None].to(query.dtype), None

    AttentionInterface.register("sgl_sparse_record", recording)
    old = model.config._attn_implementation
    model.config._attn_implementation = "sgl_sparse_record"
    try:
        with torch.no_grad():
            # No KV cache and only the last position's logits: at 32K the cache and
            # the [T, vocab] logits would be dead weight.
            model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=False, logits_to_keep=1)
    finally:
        model.config._attn_implementation = old
    return [store[i] for i in sorted(store)]


# ---------------------------------------------------------- exact attention
def group_probs(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [Hq, D] one position, k [Hkv, n, D] -> probs [Hkv, G, n]."""
    hkv = k.shape[0]
    qg = q.view(hkv, -1, q.shape[-1])
    return torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) * scaling, dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention output [Hkv, G, D] of one query over keys `keep` [Hkv, n] (None: all)."""
    hkv = k.shape[0]
    qg = q.view(hkv, -1, q.shape[-1])
    logits = torch.einsum("hgd,hnd->hgn", qg, k) * scaling
    if keep is not None:
        logits = logits.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("hgn,hnd->hgd", torch.softmax(logits, dim=-1), v)


# ------------------------------------------------------------------ policies
# A policy maps (layer Q/K/V, decode position t, budget) -> keep mask [Hkv, n], n = t + 1.
Policy = Callable[[LayerQKV, int, int], torch.Tensor]


def full_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    return torch.ones(L.k.shape[0], t + 1, dtype=torch.bool, device=L.k.device)


def streaming_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    n = t + 1
    keep = torch.zeros(L.k.shape[0], n, dtype=torch.bool, device=L.k.device)
    keep[:, :SINK] = True
    keep[:, max(0, n - budget):] = True
    return keep


def oracle_policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
    p = group_probs(L.q[:, t], L.k[:, : t + 1], L.scaling).mean(1)  # [Hkv, n]
    return _topk_mask(p, budget)


def _topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.zeros_like(score, dtype=torch.bool)
    k = min(k, score.shape[-1])
    keep.scatter_(1, torch.topk(score, k, dim=-1).indices, True)
    return keep


def quest_policy(L: LayerQKV, t: int, budget: int, page: int = QUEST_PAGE) -> torch.Tensor:
    """Quest: per page, the upper bound sum_d max(q_d min_d, q_d max_d) of q.k; top
    ceil(budget/page) pages per KV head (bound maxed over the group's query heads),
    the page holding the current token always in."""
    n = t + 1
    k = L.k[:, :n]
    hkv, _, d = k.shape
    n_pages = math.ceil(n / page)
    padded = torch.nn.functional.pad(k, (0, 0, 0, n_pages * page - n))
    pk = padded.view(hkv, n_pages, page, d)
    valid = (torch.arange(n_pages * page, device=k.device) < n).view(1, n_pages, page, 1)
    kmin = pk.masked_fill(~valid, float("inf")).amin(2)
    kmax = pk.masked_fill(~valid, float("-inf")).amax(2)
    qg = L.q[:, t].view(hkv, -1, d)  # [Hkv, G, D]
    bound = torch.maximum(qg[:, :, None, :] * kmin[:, None], qg[:, :, None, :] * kmax[:, None]).sum(-1)
    score = bound.amax(1)  # [Hkv, pages]
    score[:, -1] = float("inf")
    sel = _topk_mask(score, max(1, math.ceil(budget / page)))
    return sel.repeat_interleave(page, dim=1)[:, :n]


def _sfi_keep(L: LayerQKV, t: int, budget: int, recent: int, qpos: Sequence[int], n0: int) -> torch.Tensor:
    """What an SFI fast step at t attends: sink + the `recent` last tokens of the
    t + 1 + the Selector's top-`budget` of A = [sink, n0 - recent), chosen at a
    slow step whose sequence length was n0, from the queries at `qpos` (its
    evidence window; all < n0). The server's `covers` rule makes t dense."""
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.selector.core import SelectorKnobs, select

    n = t + 1
    hkv, dev = L.k.shape[0], L.k.device
    if SINK + budget + recent >= n:
        return full_policy(L, t, budget)
    keep = torch.zeros(hkv, n, dtype=torch.bool, device=dev)
    keep[:, :SINK] = True
    keep[:, max(0, n - recent):] = True
    lo, hi = SINK, n0 - recent
    if hi <= lo:
        return keep
    qp = torch.as_tensor(list(qpos), device=dev)
    qw = L.q[:, qp].view(hkv, -1, len(qp), L.q.shape[-1])  # [Hkv, G, w, D]
    logits = torch.einsum("hgwd,hnd->hgwn", qw, L.k[:, :n0]) * L.scaling
    future = torch.arange(n0, device=dev)[None, :] > qp[:, None]
    logits = logits.masked_fill(future[None, None], float("-inf"))[None]
    spec = SfiPolicy(budget=budget, recent=recent, sink=SINK)
    knobs = SelectorKnobs.from_specs([spec], dev, torch.float32)
    norms = L.k[:, :n0].norm(dim=-1)[None]
    pos, count = select(logits, norms, torch.tensor([lo], device=dev), torch.tensor([hi], device=dev),
                        torch.ones(1, len(qp), dtype=torch.bool, device=dev),
                        torch.tensor([budget], device=dev), knobs, budget)
    keep.scatter_(1, pos[0, :, : int(count[0])], True)
    return keep


def _selector_importable() -> bool:
    try:
        import sgl_sparse.selector.core  # noqa: F401
    except ImportError:
        return False
    return True


def sfi_policy_factory(recent: int, window: int, lag: int) -> Optional[Policy]:
    """SFI fast step at t with the selection of a slow step at t - lag, made by the
    project's Selector (sgl_sparse.selector.core.select) from the last `window`
    queries up to that step; None if sgl_sparse is not importable."""
    if not _selector_importable():
        return None

    def policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
        n0 = max(0, t - lag) + 1
        return _sfi_keep(L, t, budget, recent, range(max(0, n0 - window), n0), n0)

    return policy


def sfi_slow_steps(ex: tasks.Example, upto: int, t_max: Optional[int] = None) -> list[int]:
    """Query positions p <= upto of the decode steps the server makes slow for `ex`,
    replaying sgl_sparse.policies.sfi.HostMirror on the gold completion: the step at
    p consumes token seq[p] (its K/V and query are at p; sequence length p + 1) and
    is slow iff it is the first decode step (p = len(prompt)), seq[p] ends a
    sentence (tasks.TRIGGER_IDS = the server's trigger set on this vocabulary), or
    the t_max steps before it were all fast."""
    from sgl_sparse.config import SfiPolicy

    t_max = SfiPolicy().t_max if t_max is None else t_max
    seq = ex.prompt + ex.completion
    since, out = t_max, []  # a request starts with since_slow = t_max
    for p in range(len(ex.prompt), upto + 1):
        slow = seq[p] in tasks.TRIGGER_IDS or since >= t_max
        since = 0 if slow else since + 1
        if slow:
            out.append(p)
    return out


def sfi_later_factory(recent: int, w_prefill: int,
                      keep_prompt: bool = False) -> Optional[Callable[[tasks.Example], Policy]]:
    """`sfi-later`: what the server's SFI attends at t, from the selection of the
    last slow step p < t (`sfi_slow_steps`): a later slow step (p > len(prompt),
    e.g. right after a think block's ".") refreshes the selection from its own
    query alone (w = 1, selector/refresh.py's `later` rows), with A = [sink, p + 1 -
    recent); the first decode step's window is its query plus the prompt's last
    w_prefill - 1 queries. `keep_prompt` (`sfi-later-every`, the server's
    prompt_evidence "every"): a later slow step's window is its query plus those
    same prompt queries. Built per example (the slow steps depend on its tokens)."""
    if not _selector_importable():
        return None

    def for_example(ex: tasks.Example) -> Policy:
        def policy(L: LayerQKV, t: int, budget: int) -> torch.Tensor:
            slow = sfi_slow_steps(ex, t)
            if not slow or slow[-1] == t:  # the prefill and slow steps attend densely
                return full_policy(L, t, budget)
            p, first = slow[-1], len(ex.prompt)
            prompt_q = list(range(max(0, first + 1 - w_prefill), first))  # the prompt's last w_prefill - 1
            window = prompt_q + [p] if p == first or keep_prompt else [p]
            return _sfi_keep(L, t, budget, recent, window, p + 1)

        return policy

    return for_example


# ------------------------------------------------------------------ metrics
def step_metrics(L: LayerQKV, t: int, keep: torch.Tensor, fact: Sequence[int] = ()) -> dict[str, float]:
    """Metrics of one query; `fact`: the queried fact's key position then its value
    positions (tasks.Example.fact_pos, + 1 ...): fact_kept = fraction of KV heads whose
    set holds all of them, value_kept = the same for the value tokens alone (the
    induction copy reads the value's key, which carries the preceding KEY)."""
    q, k, v = L.q[:, t], L.k[:, : t + 1], L.v[:, : t + 1]
    dense = attend(q, k, v, L.scaling)
    sparse = attend(q, k, v, L.scaling, keep)
    err = ((sparse - dense).norm() / dense.norm().clamp(min=1e-30)).item()
    p = group_probs(q, k, L.scaling).mean(1)  # [Hkv, n]
    sizes = keep.sum(-1)
    overlaps = []
    for h in range(keep.shape[0]):
        m = int(sizes[h])
        top = torch.topk(p[h], m).indices
        overlaps.append(keep[h, top].float().mean().item())
    out = {"rel_err": err, "overlap": sum(overlaps) / len(overlaps),
           "mass": (p * keep).sum(-1).mean().item(), "retention": (sizes.float().mean() / (t + 1)).item()}
    if fact:
        f = keep[:, list(fact)]
        out["fact_kept"] = f.all(-1).float().mean().item()
        out["value_kept"] = f[:, 1:].all(-1).float().mean().item()
    return out


def decode_positions(ex: tasks.Example, which: str = "answer") -> list[int]:
    """Query positions whose next token is an answer value token ('answer'), or
    every completion position ('completion')."""
    seq = ex.prompt + ex.completion
    start = len(ex.prompt) - 1
    pos = range(start, len(seq) - 1)
    if which == "completion":
        return list(pos)
    vals = set(ex.answer)
    first = [p for p in pos if seq[p + 1] in vals]
    return first[: len(ex.answer)]


def evaluate(model, lengths: Sequence[int], budgets: Sequence[int], n_examples: int = 2,
             variants: Sequence[str] = ("plain", "think"), sfi_recent: int = 256, sfi_window: int = 32,
             sfi_lag: int = 1, seed: int = 777, depth: float = 0.25, which: str = "answer") -> dict:
    """Mean metrics per (length, variant, policy, budget) over examples x positions x
    layers; example i has variant variants[i % len(variants)]. Think examples also
    get `sfi-later` (plain completions have no sentence end before the value, so
    their last slow step is the first decode step)."""
    policies: dict[str, Optional[Policy]] = {
        "full": full_policy, "streaming": streaming_policy, "quest": quest_policy,
        "sfi": sfi_policy_factory(sfi_recent, sfi_window, sfi_lag), "oracle": oracle_policy,
    }
    # The first slow step's window is the server's w_prefill queries: sfi_window here.
    later = sfi_later_factory(sfi_recent, sfi_window)
    later_every = sfi_later_factory(sfi_recent, sfi_window, keep_prompt=True)
    rows = []
    for length in lengths:
        acc: dict[tuple[str, str, int], list[dict]] = {}
        for i in range(n_examples):
            ex = tasks.make_example(length, depth, variants[i % len(variants)], seed + i)
            pols = dict(policies)
            if ex.variant == "think":
                pols["sfi-later"] = later(ex) if later is not None else None
                pols["sfi-later-every"] = later_every(ex) if later_every is not None else None
            fact = [ex.fact_pos + j for j in range(1 + tasks.VALUE_LEN)]
            layers = record_qkv(model, ex.prompt + ex.completion)
            for t in decode_positions(ex, which):
                for L in layers:
                    for name, pol in pols.items():
                        if pol is None:
                            continue
                        for b in ([0] if name == "full" else budgets):
                            acc.setdefault((ex.variant, name, b), []).append(step_metrics(L, t, pol(L, t, b), fact))
            del layers
        for (variant, name, b), ms in sorted(acc.items(), key=lambda kv: variants.index(kv[0][0])):
            row = {"length": length, "variant": variant, "policy": name,
                   "budget": b if name != "full" else None, "samples": len(ms)}
            for key in ms[0]:
                vals = [m[key] for m in ms]
                row[key] = sum(vals) / len(vals)
                if key == "rel_err":
                    row["rel_err_max"] = max(vals)
            rows.append(row)
    missing = [n for n, p in policies.items() if p is None] + (["sfi-later", "sfi-later-every"] if later is None else [])
    return {"rows": rows, "not_available": {n: "sgl_sparse.selector.core not importable" for n in missing},
            "settings": {"sink": SINK, "quest_page": QUEST_PAGE, "sfi_recent": sfi_recent,
                         "sfi_window": sfi_window, "sfi_lag": sfi_lag, "depth": depth, "positions": which,
                         "n_examples": n_examples, "variants": list(variants)}}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Attention fidelity per layer at the answer's decode positions (dense inputs per layer; "
        f"sink {s['sink']}, sfi recent {s['sfi_recent']} / window {s['sfi_window']} queries / lag {s['sfi_lag']}, "
        f"quest pages {s['quest_page']}; fact at depth {s['depth']}; {s['n_examples']} examples per length, "
        f"variants {', '.join(s['variants'])} in turn). sfi-later: the selection of the server's last slow "
        f"step before the value (think: the w = 1 refresh at the think block's last `.`). "
        f"Fact kept: fraction of KV heads whose set holds the fact's key and value / the value.", "",
        "| length | variant | policy | budget | retention | rel. error (mean / max) | top-k overlap "
        "| attn. mass kept | fact kept (K+V / V) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b = "-" if r["budget"] is None else r["budget"]
        lines.append(f"| {r['length']} | {r['variant']} | {r['policy']} | {b} | {r['retention']:.3f} | "
                     f"{r['rel_err']:.4f} / {r['rel_err_max']:.4f} | {r['overlap']:.3f} | {r['mass']:.3f} | "
                     f"{r['fact_kept']:.3f} / {r['value_kept']:.3f} |")
    for n, why in result["not_available"].items():
        lines.append(f"| all | all | {n} | - | not available: {why} | | | | |")
    return "\n".join(lines) + "\n"


def load_model(path: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--budgets", default="64,256,1024")
    ap.add_argument("--n", type=int, default=2, help="examples per length (variants in turn)")
    ap.add_argument("--variants", default="plain,think",
                    help="comma list; think examples also get sfi-later (README)")
    ap.add_argument("--depth", type=float, default=0.25)
    ap.add_argument("--sfi-recent", type=int, default=256)
    ap.add_argument("--sfi-window", type=int, default=32)
    ap.add_argument("--sfi-lag", type=int, default=1)
    ap.add_argument("--positions", choices=("answer", "completion"), default="answer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-json")
    ap.add_argument("--out-md")
    a = ap.parse_args()
    model = load_model(a.model, a.device)
    res = evaluate(model, [int(x) for x in a.lengths.split(",")], [int(x) for x in a.budgets.split(",")],
                   a.n, variants=a.variants.split(","), sfi_recent=a.sfi_recent, sfi_window=a.sfi_window,
                   sfi_lag=a.sfi_lag, depth=a.depth, which=a.positions)
    res["model"] = a.model
    md = markdown(res)
    report.emit(res, md, a.out_json, a.out_md)


if __name__ == "__main__":
    main()
