"""Train a small Qwen3-architecture model from scratch on the long-range recall task.

    python bench/quality/train_tiny.py --out bench/quality/out/tiny-recall       # GPU, <= ~8 min on an H100
    python bench/quality/train_tiny.py --smoke --out /tmp/tiny-smoke             # CPU, tiny, < 2 min

Writes a normal Hugging Face checkpoint (config.json, model.safetensors,
generation_config.json, word-level fast tokenizer with <think>/</think>/<eos>)
that SGLang and transformers load, and a log (loss, exact-match per context
length) to --log (default bench/quality/train_log.txt; --smoke: <out>/train_log.txt).

The model is honest-to-goodness tiny and synthetic: it knows nothing but this task
(tasks.py). It is evidence about attention policies, not about a pretrained LLM.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # noqa: E402

HERE = Path(__file__).resolve().parent


@dataclass
class ModelShape:
    layers: int = 4
    hidden: int = 256
    intermediate: int = 768
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    # Large theta: the lowest RoPE frequencies barely turn within 32K tokens, so
    # content matching learned at <= 8K still works at 32K (eval extrapolates).
    rope_theta: float = 1_000_000.0
    max_positions: int = 40960
    # Tied input/output embeddings (as Qwen3-0.6B): copying a value token from the
    # context is then an (approximately) identity OV circuit; untied, the copy map
    # over 256 values must be learned from scratch through the heads' low rank.
    tie_embeddings: int = 1


@dataclass
class Stage:
    length: int  # tokens per training sequence
    batch: int
    steps: int
    time_share: float  # fraction of --time-budget this stage may use at most
    facts_lo: int = 16  # one fact per facts_lo..facts_hi tokens (log-uniform per sequence;
    facts_hi: int = 128  # eval prompts: one per 128)
    think: float = 0.25  # fraction of the questions in the think variant
    # fraction of the batch's rows that are pure key-value MQAR sequences
    # (tasks.make_kv_sequence: `K V K V ... K V` then every key again -> its value),
    # with kv_lo..kv_hi pairs: the bare induction copy, no templates or filler
    kv: float = 0.0
    kv_lo: int = 4
    kv_hi: int = 64
    # fraction of the questions in the think-long variant (tasks.THINK_LONG_BODY: a
    # 47-token think block), taken from the plain share; 0 = the sequences of before
    think_long: float = 0.0

    @property
    def kv_rows(self) -> int:
        """Pure key-value rows per batch: the first ones (make_batch; the log splits on it)."""
        return round(self.kv * self.batch)


# MQAR recipe (tasks.make_training_sequence): every fact asked by an inline question
# later in the sequence, so one sequence has dozens to hundreds of supervised
# recalls at all distances up to its length. Short sequences first, for many
# optimizer steps (the induction circuit forms after a plateau counted in steps),
# then long ones: recall at 32K needs attention sharp enough for 32K candidates,
# which only long training sequences ask for. Batches come from DataLoader workers.
GPU_STAGES = [Stage(256, 64, 8000, 0.34, 8, 32), Stage(1024, 16, 2000, 0.12, 16, 64),
              Stage(4096, 4, 1200, 0.13, 16, 128), Stage(16384, 1, 800, 0.14, 32, 128),
              Stage(32768, 1, 300, 0.12, 64, 128)]
# Named curricula (--recipe). "run3": the stages above (H100 run 3: copy level only).
# "run3-long": the same task with most of the budget on 256-token stage 0.
# "kv": a pure key-value MQAR warm-up (tasks.make_kv_sequence) at 256 tokens, then
# the sentence task with a quarter of each short batch still pure key-value rows.
RECIPES = {
    "run3": GPU_STAGES,
    "run3-long": [Stage(256, 64, 16000, 0.55, 8, 32), Stage(1024, 16, 1500, 0.09, 16, 64),
                  Stage(4096, 4, 600, 0.08, 16, 128), Stage(16384, 1, 300, 0.07, 32, 128),
                  Stage(32768, 1, 150, 0.06, 64, 128)],
    # "kv-easy": the recall circuit first on the easiest MQAR (4 pairs, 16 tokens, no
    # filler), then 2-16 pairs at 64 tokens, 8-64 at 256, then "kv"'s later stages. CPU
    # toy (README "Bug hunt"): formed at 4 pairs it transfers at once to 2-16 pairs at 64
    # tokens (acc 0.96 100 steps later), which trained directly stayed at 0.14 in 2000 steps.
    # Stage 0 gets a quarter of the budget: sweep run 1 made ~26 steps/s per process
    # (4 in parallel), so ~2600 steps in 100 s; the CPU toy formed in 700-1300.
    "kv-easy": [Stage(16, 64, 3000, 0.25, 8, 16, 0.25, 1.0, 4, 4),
                Stage(64, 64, 1000, 0.06, 8, 16, 0.25, 1.0, 2, 16),
                Stage(256, 64, 1000, 0.06, 8, 32, 0.25, 1.0, 8, 64),
                Stage(256, 64, 3000, 0.14, 8, 32, 0.25, 0.25, 8, 64),
                Stage(1024, 16, 1000, 0.06, 16, 64, 0.25, 0.25, 16, 128),
                Stage(4096, 4, 400, 0.05, 16, 128),
                Stage(16384, 1, 200, 0.05, 32, 128),
                Stage(32768, 1, 100, 0.05, 64, 128)],
    "kv": [Stage(256, 64, 4000, 0.2, 8, 32, 0.25, 1.0, 8, 64),
           Stage(256, 64, 8000, 0.3, 8, 32, 0.25, 0.25, 8, 64),
           Stage(1024, 16, 1500, 0.1, 16, 64, 0.25, 0.25, 16, 128),
           Stage(4096, 4, 600, 0.09, 16, 128),
           Stage(16384, 1, 300, 0.08, 32, 128),
           Stage(32768, 1, 150, 0.08, 64, 128)],
}
GPU_EVAL_LENGTHS = [256, 1024, 2048, 8192, 16384, 32768]
GPU_LR = 2e-3
# CPU smoke: the recipe at toy scale (2 layers, hidden 64; all of it fits in ~2 min on
# 2 shared cores).
SMOKE_SHAPE = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                         max_positions=4096)
SMOKE_STAGES = [Stage(96, 32, 900, 1.0, 8, 16)]
SMOKE_LR = 3e-3
SMOKE_EVAL_LENGTHS = [96, 192]


def parse_stage(text: str) -> Stage:
    """'len:batch:steps:time_share[:facts_lo[:facts_hi[:think[:kv[:kv_lo[:kv_hi[:think_long]]]]]]]'"""
    f = text.split(":")
    types = [int, int, int, float, int, int, float, float, int, int, float]
    return Stage(*(t(x) for t, x in zip(types, f)))


def make_model(shape: ModelShape, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = 64 * math.ceil(len(tasks.VOCAB) / 64)  # padded rows are never produced
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions, rope_theta=shape.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=bool(shape.tie_embeddings), use_sliding_window=False,
        sliding_window=None, max_window_layers=shape.layers, attention_bias=False,
        bos_token_id=tasks.ID[tasks.EOS], eos_token_id=tasks.ID[tasks.EOS],
        pad_token_id=tasks.ID[tasks.PAD],
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"  # flash kernels under bf16 on the GPU
    return model


def init_prev_token_heads(model, shape: ModelShape, freqs: Sequence[int] = (0, 1), norm_mult: float = 2.0) -> None:
    """Initialize layer 0's first KV group as previous-token heads (a plain weight
    init: the checkpoint is a standard Qwen3 one and every weight stays trainable).

    Recall is an induction copy, `K V ... K -> V`: a previous-token head writes K
    into V's position, then an induction head at the later K attends to it. In MQAR
    studies (Zoology) layer 0 is a short convolution that gives the previous token
    for free; Qwen3 has none, and the two-stage circuit is what the toys and H100
    runs 1-3 never formed. Here: every embedding gets one shared component c (so
    c . x > 0 for every token after the input RMSNorm; a shift common to all logits
    under the tied unembedding), kv head 0's key and its query heads' queries read
    only c (so after q/k RMSNorm they are constant vectors), placed on RoPE's highest
    frequencies with the key rotated one position ahead of the query: the logit is
    sum_i cos((delta + 1) w_i), largest for the previous token. norm_mult scales the
    q/k RMSNorm weights on those dims (shared by the layer's heads) for a sharper peak.
    """
    attn = model.model.layers[0].self_attn
    emb = model.model.embed_tokens.weight
    d, half = shape.head_dim, shape.head_dim // 2
    group = shape.heads // shape.kv_heads
    with torch.no_grad():
        g = torch.Generator().manual_seed(4321)
        c = torch.randn(emb.shape[1], generator=g)  # on the CPU (same c on every device)
        c_hat = (c / c.norm()).to(emb.device)  # H100 sweep run 1 crashed here: cuda vs cpu
        emb.add_((c_hat * emb.norm(dim=1).mean()).to(emb.dtype))
        inv = shape.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
        a, b = torch.zeros(d, device=emb.device), torch.zeros(d, device=emb.device)
        for i in freqs:
            a[i] = 1.0
            b[i], b[i + half] = math.cos(inv[i]), math.sin(inv[i])  # a rotated by +w_i
        scale = 0.02 * math.sqrt(emb.shape[1])
        attn.k_proj.weight[0:d] = scale * b[:, None] * c_hat[None, :]
        for h in range(group):
            attn.q_proj.weight[h * d:(h + 1) * d] = scale * a[:, None] * c_hat[None, :]
        for i in freqs:
            for j in (i, i + half):
                attn.q_norm.weight[j] = norm_mult
                attn.k_norm.weight[j] = norm_mult


def make_batch(stage: Stage, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and [B, L] supervision mask (position i supervised: predict ids[i]);
    a pure function of (stage, step, seed)."""
    rows, masks = [], []
    n_kv = stage.kv_rows
    for b in range(stage.batch):
        s = (seed * 1_000_003 + step) * 4096 + b
        if b < n_kv:
            seq, m = tasks.make_kv_sequence(stage.length, s, pairs=(stage.kv_lo, stage.kv_hi))
        else:
            seq, m = tasks.make_training_sequence(stage.length, s, facts_every=(stage.facts_lo, stage.facts_hi),
                                                  think=stage.think, think_long=stage.think_long)
        rows.append(seq)
        masks.append(m)
    return torch.tensor(rows), torch.tensor(masks)


class _Batches(torch.utils.data.Dataset):
    """Batch i of a stage (a pure function of the step), for DataLoader workers:
    generating the token ids in Python is slower than the tiny model's GPU step."""

    def __init__(self, stage: Stage, first_step: int, seed: int):
        self.stage, self.first, self.seed = stage, first_step, seed

    def __len__(self) -> int:
        return self.stage.steps

    def __getitem__(self, i: int):
        return make_batch(self.stage, self.first + i, self.seed)


def batches(stage: Stage, first_step: int, seed: int, workers: int):
    if workers <= 0:
        return (make_batch(stage, first_step + i, seed) for i in range(stage.steps))
    return iter(torch.utils.data.DataLoader(_Batches(stage, first_step, seed), batch_size=None, shuffle=False,
                                            num_workers=workers, prefetch_factor=4, pin_memory=torch.cuda.is_available(),
                                            persistent_workers=False))


def supervised_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits only where a token is supervised (lm_head on a few rows, not all)."""
    h = model.model(input_ids=ids[:, :-1]).last_hidden_state
    sel = mask[:, 1:]
    return model.lm_head(h[sel]), ids[:, 1:][sel]


@torch.no_grad()
def eval_accuracy(model, lengths: Sequence[int], n: int, device, amp: bool, seed: int = 12345,
                  variants: Sequence[str] = ("plain", "think")) -> dict:
    """Held-out exact match per prompt length on eval.py's prompts (tasks.make_example:
    one fact per 128 tokens, one question at the end, depths 0.1/0.5/0.9, the variants
    in turn): the completion up to its value token(s) argmax-correct under teacher
    forcing (== greedy decoding reproduces it; what follows the value is not scored,
    as in eval.py's tasks.answer_correct). Also the value-token accuracy alone per
    variant. The n prompts are split over the variants (plain and think only: the
    prompts of before; think-long when trained)."""
    model.eval()
    out = {}
    for length in lengths:
        hits, val_hits, var_hits = [], {v: [] for v in variants}, {v: [] for v in variants}
        for i in range(n):
            depth = (0.1, 0.5, 0.9)[i % 3]
            variant = variants[(i // 3) % len(variants)]
            ex = tasks.make_example(length, depth, variant, seed + i)
            ids = torch.tensor([ex.prompt + ex.completion], device=device)
            mask = torch.tensor([[False] * len(ex.prompt) + [True] * len(ex.completion)], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits, tgt = supervised_logits(model, ids, mask)
            ok = logits.argmax(-1) == tgt
            hits.append(bool(ok[:-1].all()))  # all but the final <eos>
            var_hits[variant].append(hits[-1])
            val_hits[variant].append(bool(ok[-1 - tasks.VALUE_LEN:-1].all()))  # the value token(s) before <eos>
        rate = lambda h: sum(h) / len(h) if h else float("nan")  # noqa: E731
        out[length] = {"exact": sum(hits) / n, **{f"value_{v}": rate(h) for v, h in val_hits.items()},
                       # exact match per variant, where more than plain and think are evaluated
                       **({f"exact_{v}": rate(h) for v, h in var_hits.items()} if len(variants) > 2 else {})}
    model.train()
    return out


def fmt_acc(acc: dict) -> str:
    def one(a: dict) -> str:
        vs = [k[len("value_"):] for k in a if k.startswith("value_")]
        value = " ".join(f"{v} {a['value_' + v]:.2f}" for v in vs)
        exact = " ".join(f"{v} {a['exact_' + v]:.2f}" for v in vs if "exact_" + v in a)
        return f"{a['exact']:.3f} (value {value}" + (f"; exact {exact})" if exact else ")")
    return ", ".join(f"{l}: {one(a)}" for l, a in acc.items())


def copy_baseline(ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the supervised value tokens of 1 / (distinct values seen in the
    unsupervised context before them): the answer accuracy of "copy one of the values
    in context" without knowing which key it belongs to. Recall must beat it."""
    vals = set(tasks.VALUE_IDS)
    out = []
    for row, m in zip(ids.tolist(), mask.tolist()):
        seen: set[int] = set()
        for t, sup in zip(row, m):
            if sup and t in vals:
                out.append(1.0 / max(1, len(seen)))
            elif not sup and t in vals:
                seen.add(t)
    return sum(out) / max(1, len(out))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def save_checkpoint(model, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.float32
    model.save_pretrained(out, safe_serialization=True)
    tasks.build_tokenizer(out, model.config.max_position_embeddings)
    ids = {"bos_token_id": tasks.ID[tasks.EOS], "eos_token_id": tasks.ID[tasks.EOS],
           "pad_token_id": tasks.ID[tasks.PAD]}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def train(out: Path, log_path: Path, shape: ModelShape, stages: list[Stage], eval_lengths: list[int],
          eval_n: int, seed: int, time_budget: float, peak_lr: float, device: torch.device,
          workers: int = 0, log_every: int = 50, eval_every: int = 0, qk_norm_lr_mult: float = 1.0,
          lm_weight: float = 0.0, qk_norm_init: float = 1.0, prev_token_init: bool = False) -> dict:
    random.seed(seed)
    torch.manual_seed(seed)
    amp = device.type == "cuda"
    model = make_model(shape, seed).to(device)
    if qk_norm_init != 1.0:
        # Qwen3's q/k RMSNorm weights start at 1: attention logits are then bounded by
        # sqrt(head_dim) (4 at head_dim 16, 8 at 64), too flat for a sharp previous-token
        # head; a larger start raises that bound (a plain weight value: the checkpoint is
        # a standard Qwen3 one)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "q_norm" in n or "k_norm" in n:
                    p.fill_(qk_norm_init)
    if prev_token_init:
        init_prev_token_heads(model, shape)
    # No weight decay on norms nor embeddings. Qwen3 RMS-normalizes q and k per head, so
    # an attention logit is at most |q_norm.weight| * |k_norm.weight| * sqrt(head_dim)
    # (8 at head_dim 64, init weights 1): too flat for a sharp previous-token head at
    # first and for picking 1 fact among 32K tokens at the end. Those two weight
    # vectors get qk_norm_lr_mult x the LR so the logit scale can grow as fast as needed.
    groups: dict[str, list] = {"decay": [], "plain": [], "qk": []}
    for n, p in model.named_parameters():
        groups["qk" if ("q_norm" in n or "k_norm" in n) else "decay" if (p.ndim >= 2 and "embed" not in n)
               else "plain"].append(p)
    opt = torch.optim.AdamW([{"params": groups["decay"], "weight_decay": 0.01, "mult": 1.0},
                             {"params": groups["plain"], "weight_decay": 0.0, "mult": 1.0},
                             {"params": groups["qk"], "weight_decay": 0.0, "mult": qk_norm_lr_mult}],
                            lr=peak_lr, betas=(0.9, 0.98))
    total = sum(s.steps for s in stages)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    n_params = sum(p.numel() for p in model.parameters())
    say(f"# train_tiny: seed {seed}, device {device}, params {n_params / 1e6:.2f}M, shape {asdict(shape)}")
    say(f"# stages {[asdict(s) for s in stages]}, time budget {time_budget:.0f}s")
    t_start = time.monotonic()
    step = 0
    history = []
    value_ids = torch.tensor(sorted(tasks.VALUE_IDS), device=device)
    kv_ids = torch.tensor(sorted(tasks.VALUE_IDS + tasks.KEY_IDS), device=device)

    def qk_scale() -> float:
        """Mean over layers of mean|q_norm.weight| * mean|k_norm.weight| (1 at init)."""
        with torch.no_grad():
            w = [p.abs().mean().item() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
        return sum(a * b for a, b in zip(w[0::2], w[1::2])) / max(1, len(w) // 2)

    # held-out prompts: plain and think as before, think-long too when any stage trains it
    eval_variants = tuple(tasks.VARIANTS) if any(s.think_long > 0 for s in stages) else ("plain", "think")

    def stage_lengths(stage: Stage) -> list[int]:
        return [l for l in eval_lengths if l <= max(stage.length * 2, eval_lengths[0])]

    for si, stage in enumerate(stages):
        t_stage, ema, vema = time.monotonic(), None, None
        end = step + stage.steps
        n_kv = stage.kv_rows
        for ids, mask in batches(stage, step, seed, workers):
            cpu_ids, cpu_mask = ids, mask
            if time.monotonic() - t_stage > stage.time_share * time_budget:
                say(f"! stage {si} (len {stage.length}) cut by its time share at step {step}/{end}")
                break
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = g["mult"] * lr_at(step, total, peak_lr, warmup=min(200, total // 10 + 1))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                if lm_weight > 0:
                    # plus next-token loss on the filler and templates (not on keys and
                    # values, which are random): predicting the next word of a sentence
                    # wants a previous-token head, half of the induction circuit
                    lm = ~mask & ~torch.isin(ids, kv_ids)
                    all_logits, all_tgt = supervised_logits(model, ids, mask | lm)
                    is_sup = mask[:, 1:][(mask | lm)[:, 1:]]
                    logits, tgt = all_logits[is_sup], all_tgt[is_sup]
                    # A batch of pure key-value rows without filler has no such tokens: a
                    # mean over none is NaN (it made the logged loss NaN), so sum / max(n, 1)
                    # (no host sync).
                    lm_loss = torch.nn.functional.cross_entropy(
                        all_logits[~is_sup].float(), all_tgt[~is_sup], reduction="sum") / (~is_sup).sum().clamp(min=1)
                else:
                    logits, tgt = supervised_logits(model, ids, mask)
            tok_loss = torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="none")
            loss = tok_loss.mean() + (lm_weight * lm_loss if lm_weight > 0 else 0.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % log_every == 0 or step == end:
                # The answer (value) tokens apart: the rest of the supervised tokens are
                # templates learned early, so the overall loss hides whether recall works
                # (chance on a value token: ln 256 = 5.55 nats).
                with torch.no_grad():
                    is_val = torch.isin(tgt, value_ids)
                    vl = tok_loss[is_val].mean().item()
                    hit = logits.argmax(-1) == tgt
                    va = hit[is_val].float().mean().item()
                    # the pure key-value rows (first n_kv of the batch) apart
                    kv_row = mask[:, 1:].nonzero()[:, 0] < n_kv
                    split = ""
                    if n_kv:
                        kva = hit[is_val & kv_row].float().mean().item()
                        sa = hit[is_val & ~kv_row].float().mean().item() if n_kv < stage.batch else float("nan")
                        split = f" (kv rows {kva:.3f}, sentence rows {sa:.3f})"
                    base = copy_baseline(cpu_ids[n_kv:], cpu_mask[n_kv:]) if n_kv < stage.batch else \
                        copy_baseline(cpu_ids, cpu_mask)
                lv = loss.item()
                ema = lv if ema is None else 0.8 * ema + 0.2 * lv
                vema = vl if vema is None else 0.8 * vema + 0.2 * vl
                say(f"step {step:5d} len {stage.length:5d} loss {lv:.4f} (ema {ema:.4f}) "
                    f"answer-token loss {vl:.3f} (ema {vema:.3f}) acc {va:.3f}{split} copy-baseline {base:.3f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} qk-norm {qk_scale():.2f} t {time.monotonic() - t_start:.0f}s")
            if eval_every and step % eval_every == 0 and step != end:
                acc = eval_accuracy(model, stage_lengths(stage), eval_n, device, amp, variants=eval_variants)
                say(f"  held-out at step {step}: exact match {fmt_acc(acc)}")
        step = end  # a cut stage skips ahead so the LR schedule stays aligned
        acc = eval_accuracy(model, stage_lengths(stage), eval_n, device, amp, variants=eval_variants)
        say(f"eval after stage {si} (len {stage.length}, step {step}, t {time.monotonic() - t_start:.0f}s): "
            f"exact match {fmt_acc(acc)}")
        history.append({"stage": si, "length": stage.length, "acc": acc})
    # the last stage's eval already covers every length (same prompts): not run twice
    final = acc if history and list(acc) == list(eval_lengths) else eval_accuracy(model, eval_lengths, eval_n, device, amp,
                                                                                  variants=eval_variants)
    wall = time.monotonic() - t_start
    say("final exact match (teacher-forced, completion up to the value) by prompt length: " + fmt_acc(final))
    say(f"# wall {wall:.0f}s")
    meta = {"seed": seed, "shape": asdict(shape), "stages": [asdict(s) for s in stages],
            "final_acc": final, "history": history, "wall_s": wall, "params": n_params}
    save_checkpoint(model.cpu(), out, meta)
    say(f"# saved {out}")
    log.close()
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "out" / "tiny-recall"))
    ap.add_argument("--log", default=None, help="default: bench/quality/train_log.txt (--smoke: <out>/train_log.txt)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short sequences, CPU, < 2 min")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for all stages (default 420, stages use 85%% of it, the rest is for the evals; smoke 100)")
    ap.add_argument("--lr", type=float, default=None, help=f"peak LR (default {GPU_LR}; smoke {SMOKE_LR})")
    ap.add_argument("--eval-n", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--stages", default=None,
                    help="curriculum override, 'len:batch:steps:time_share[:facts_lo[:facts_hi[:think[:kv[:kv_lo[:kv_hi]]]]]],...' "
                         "e.g. 256:64:3000:0.3:8:32:0.25:1.0:4:64,1024:16:2000:0.7:16:64:0.25:0.25 "
                         "(kv: fraction of pure key-value MQAR rows per batch)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                    help="named GPU curriculum (default: run3's stages); --stages overrides it")
    ap.add_argument("--think-long", type=float, default=None,
                    help="fraction of every stage's questions in the think-long variant (a 47-token think block, "
                         "tasks.THINK_LONG_BODY), taken from the plain share; default: the stages' own (0 in every recipe)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--shape", default=None, help="ModelShape overrides, e.g. 'heads=4,kv_heads=2,head_dim=32,rope_theta=1e6'")
    ap.add_argument("--eval-every", type=int, default=0, help="also evaluate held-out exact match every N steps")
    ap.add_argument("--eval-lengths", default=None, help="comma-separated prompt lengths for the evals")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--lm-weight", type=float, default=0.3,
                    help="weight of a next-token loss on filler/template tokens (keys and values excluded; "
                         "0 = loss on the questions' completions only)")
    ap.add_argument("--qk-norm-lr-mult", type=float, default=1.0, help="LR multiplier for the q/k RMSNorm weights")
    ap.add_argument("--prev-token-init", type=int, default=None,
                    help="1: initialize layer 0's first KV group as previous-token heads (init_prev_token_heads); "
                         "default: the recipe's")
    ap.add_argument("--qk-norm-init", type=float, default=1.0,
                    help="initial value of the q/k RMSNorm weights (attention logits are bounded by "
                         "init^2 * sqrt(head_dim) at the start)")
    ap.add_argument("--hidden", type=int, default=None, help="override the hidden size (intermediate = 3x)")
    ap.add_argument("--workers", type=int, default=None,
                    help="DataLoader processes generating batches (default: GPU min(12, cores - 2), CPU 0)")
    a = ap.parse_args()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.smoke else "cpu"))
    if a.smoke:
        shape, stages, lengths, n, budget, log_every = SMOKE_SHAPE, SMOKE_STAGES, SMOKE_EVAL_LENGTHS, 24, 100.0, 20
        torch.set_num_threads(1)  # 2 threads spin-wait badly on a shared 2-core machine
    else:
        shape, stages, lengths, n, budget, log_every = ModelShape(), GPU_STAGES, GPU_EVAL_LENGTHS, 30, 420.0, 100
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
    if a.recipe:
        stages = RECIPES[a.recipe]
    if a.stages:
        stages = [parse_stage(st) for st in a.stages.split(",")]
    if a.think_long is not None:
        stages = [Stage(**{**asdict(st), "think_long": a.think_long}) for st in stages]
    if a.layers or a.hidden:
        shape = ModelShape(**{**asdict(shape), **({"layers": a.layers} if a.layers else {}),
                              **({"hidden": a.hidden, "intermediate": 3 * a.hidden} if a.hidden else {})})
    if a.shape:
        kv = dict(item.split("=") for item in a.shape.split(","))
        shape = ModelShape(**{**asdict(shape), **{k: (float(v) if k == "rope_theta" else int(v)) for k, v in kv.items()}})
    if a.eval_lengths:
        lengths = [int(x) for x in a.eval_lengths.split(",")]
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    log = Path(a.log) if a.log else (out / "train_log.txt" if a.smoke else HERE / "train_log.txt")
    import os

    workers = a.workers if a.workers is not None else (
        max(0, min(12, (os.cpu_count() or 1) - 2)) if device.type == "cuda" else 0)
    train(out, log, shape, stages, lengths, a.eval_n or n, a.seed, a.time_budget or budget,
          a.lr or (SMOKE_LR if a.smoke else GPU_LR), device,
          workers=workers, log_every=a.log_every or log_every, eval_every=a.eval_every,
          qk_norm_lr_mult=a.qk_norm_lr_mult, lm_weight=a.lm_weight, qk_norm_init=a.qk_norm_init,
          prev_token_init=bool(a.prev_token_init))


if __name__ == "__main__":
    main()
