"""Synthetic long-range tasks shared by training, eval and fidelity (all token ids).

The task: multi-key associative recall embedded in sentence-structured filler.
Facts ``the code of k123 is v045 v201 .`` are scattered through filler sentences
(ending in '.', '?', '!' or a newline, so SFI's sentence triggers fire as on prose);
at the end a question asks for one key's code. The answer (two value tokens) is
only recoverable by attending back to that key's fact, placed at a controlled
depth. Two variants:

* ``plain``: ``question : the code of k123 is`` -> ``v045 v201 <eos>``
* ``think``: ``question : what is the code of k123 ? <think>`` -> a fixed-form think
  block that does *not* restate the code, ``</think>``, then
  ``the code of k123 is v045 v201 <eos>``:
  the answer after ``</think>`` needs the fact from before the think block
  (the case SADAS latches to full attention for).

Everything is generated in token ids from a fixed word-level vocabulary
(``VOCAB``), so lengths are exact in the model's tokens. ``build_tokenizer``
writes the matching Hugging Face fast tokenizer. Deterministic: an example is a
pure function of (length, depth, variant, seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

# ---------------------------------------------------------------- vocabulary
PAD, EOS, UNK, THINK, END_THINK = "<pad>", "<eos>", "<unk>", "<think>", "</think>"
SPECIALS = (PAD, EOS, UNK)
PUNCT = (".", "?", "!", "\n", ",", ":")
SENTENCE_ENDS = (".", "?", "!", "\n")  # what SFI's trigger set matches
N_KEYS = 512
N_VALUES = 256
VALUE_LEN = 2  # value tokens per code

_DET = "the a my our your their this that every some".split()
_ADJ = ("old quiet red green blue small large bright dark cold warm young wise slow fast "
        "heavy light strange gentle busy").split()
_NOUN = ("farmer river mill child teacher dog cat bird tree city road house garden boat "
         "market window door letter song story lamp bridge hill forest cloud stone field "
         "train clock table book").split()
_VERB = ("sees carries finds keeps paints builds follows watches opens closes reads writes "
         "remembers crosses visits").split()
_PREP = "near under over beside behind inside across".split()
_ADV = "today slowly again quickly often yesterday".split()
_INTERJ = "yes no why oh well indeed".split()
# Words of the fact / question / think templates (kept out of the filler lists so a
# fact is unambiguous: "code" and "is" never occur in filler).
_TEMPLATE = ("code of is what question answer i need look back at facts found it "
             "recall").split()

KEYS = tuple(f"k{i:03d}" for i in range(N_KEYS))
VALUES = tuple(f"v{i:03d}" for i in range(N_VALUES))


def _vocab_list() -> list[str]:
    words: list[str] = []
    for w in [*SPECIALS, THINK, END_THINK, *PUNCT, *_DET, *_ADJ, *_NOUN, *_VERB, *_PREP,
              *_ADV, *_INTERJ, *_TEMPLATE, *KEYS, *VALUES]:
        if w not in words:
            words.append(w)
    return words


VOCAB: tuple[str, ...] = tuple(_vocab_list())
ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
KEY_IDS = tuple(ID[k] for k in KEYS)
VALUE_IDS = tuple(ID[v] for v in VALUES)
TRIGGER_IDS = frozenset(ID[p] for p in SENTENCE_ENDS)


def ids(text: str) -> list[int]:
    """Space-separated words -> ids ('\\n' is written as the word NL here)."""
    return [ID["\n" if w == "NL" else w] for w in text.split()]


def decode(token_ids: Sequence[int]) -> str:
    return " ".join(VOCAB[i] for i in token_ids)


# ------------------------------------------------------------------ templates
def fact_tokens(key: int, value: Sequence[int]) -> list[int]:
    return ids("the code of") + [key] + ids("is") + list(value) + ids(".")


def answer_prefix(key: int) -> list[int]:
    """What directly precedes the value tokens, in the fact and in every answer:
    "the code of KEY is". The answer position then repeats the fact's 5-token
    context, so recall is an induction-head copy (match the context, copy what
    followed it), the circuit small transformers learn fastest; with the key
    4 or 14 tokens back instead, the tiny model never left the plateau (CPU and
    H100 runs, README)."""
    return ids("the code of") + [key] + ids("is")


def question_tokens(key: int, variant: str) -> list[int]:
    if variant == "plain":
        return ids("question :") + answer_prefix(key)
    return ids("question : what is the code of") + [key] + ids("?") + [ID[THINK]]


def completion_tokens(key: int, value: Sequence[int], variant: str) -> list[int]:
    """What the model must generate after the question (the eval's exact match
    is on the value tokens; the think body is fixed-form and never names the code,
    and after ``</think>`` the answer restates the key: "the code of KEY is V1 V2")."""
    tail = list(value) + [ID[EOS]]
    if variant == "plain":
        return tail
    think = ids("i need the code of") + [key] + ids(". i look back at the facts . i found it .")
    return think + [ID[END_THINK]] + answer_prefix(key) + tail


# --------------------------------------------------------------------- filler
MAX_SENTENCE = 14


def _sentence(rng: random.Random) -> list[str]:
    """One filler sentence of 1..MAX_SENTENCE words, ending in a sentence end."""
    kind = rng.random()
    end = rng.choice((".", ".", ".", "?", "!", "\n"))
    if kind < 0.04:
        return ["\n"]
    if kind < 0.10:
        return [rng.choice(_INTERJ), end if end != "\n" else "!"]
    if kind < 0.16:
        return [rng.choice(_INTERJ), rng.choice(_ADV), end]
    s = [rng.choice(_DET)] + ([rng.choice(_ADJ)] if rng.random() < 0.6 else []) + [rng.choice(_NOUN)]
    s.append(rng.choice(_VERB))
    if rng.random() < 0.8:
        s += [rng.choice(_DET)] + ([rng.choice(_ADJ)] if rng.random() < 0.5 else []) + [rng.choice(_NOUN)]
    if rng.random() < 0.4:
        s += [rng.choice(_PREP), rng.choice(_DET), rng.choice(_NOUN)]
    if rng.random() < 0.3:
        s.append(rng.choice(_ADV))
    if rng.random() < 0.15:
        s = s[:3] + [","] + s[3:]
    return s[: MAX_SENTENCE - 1] + [end]


@lru_cache(maxsize=4)
def sentence_pool(seed: int = 0, size: int = 8192) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Filler sentences (as ids) bucketed by length (lengths 1, 2 and 3 are always
    present, so any remainder can be filled exactly with whole sentences)."""
    rng = random.Random(f"pool-{seed}")
    seen: set[tuple[int, ...]] = set()
    buckets: dict[int, list[tuple[int, ...]]] = {}
    for _ in range(size):
        s = tuple(ID[w] for w in _sentence(rng))
        if s not in seen:
            seen.add(s)
            buckets.setdefault(len(s), []).append(s)
    assert all(buckets.get(n) for n in (1, 2, 3)), sorted(buckets)
    return {n: tuple(b) for n, b in sorted(buckets.items())}


@lru_cache(maxsize=4)
def _all_sentences(pool_seed: int) -> tuple[tuple[int, ...], ...]:
    return tuple(s for b in sentence_pool(pool_seed).values() for s in b)


def filler(rng: random.Random, n_tokens: int, pool_seed: int = 0) -> list[list[int]]:
    """Whole sentences totalling exactly n_tokens."""
    pool = sentence_pool(pool_seed)
    all_sentences = _all_sentences(pool_seed)
    out: list[list[int]] = []
    rem = n_tokens
    while rem > 0:
        if rem in pool and (rem <= 3 or rng.random() < 0.5):
            s = rng.choice(pool[rem])
        else:
            s = rng.choice(all_sentences)
            if len(s) > rem:
                continue
        out.append(list(s))
        rem -= len(s)
    return out


# ------------------------------------------------------------------- examples
@dataclass
class Example:
    """One sequence. ``prompt`` is what is sent; ``completion`` what the model must
    produce after it; ``answer`` the value tokens scored by exact match.
    ``loss_mask[i]`` marks positions i of ``prompt + completion`` whose token is
    supervised (training predicts token i from tokens < i)."""

    prompt: list[int]
    completion: list[int]
    answer: list[int]
    variant: str
    fact_pos: int  # token index of the queried fact's key in the prompt
    loss_mask: list[bool] = field(default_factory=list)

    @property
    def depth(self) -> float:
        """Where the fact is, as a fraction of the prompt (0 = start)."""
        return self.fact_pos / max(1, len(self.prompt))

    @property
    def distance(self) -> int:
        """Tokens between the fact and the end of the prompt."""
        return len(self.prompt) - self.fact_pos


def n_facts_for(length: int, every: int = 128) -> int:
    return max(4, min(N_KEYS // 2, length // every))


def make_example(length: int, depth: Optional[float], variant: str, seed: int,
                 *, inline_questions: int = 0, facts_every: int = 128,
                 inline_think: float = 0.5, pool_seed: int = 0) -> Example:
    """An example whose prompt is exactly ``length`` tokens.

    ``depth`` in [0, 1]: the queried fact starts at about depth * length (None:
    uniform at random). ``inline_questions`` > 0 (training) adds up to that many earlier
    question/answer pairs about other facts, each after its fact, all supervised
    (``inline_think``: the fraction of them in the think variant).
    """
    if variant not in ("plain", "think"):
        raise ValueError(f"variant must be 'plain' or 'think' (got {variant!r})")
    rng = random.Random(f"{seed}-{length}-{depth}-{variant}-{inline_questions}")
    n_facts = n_facts_for(length, facts_every)
    keys = rng.sample(KEY_IDS, n_facts)
    vals = [[rng.choice(VALUE_IDS) for _ in range(VALUE_LEN)] for _ in keys]
    target = 0  # keys[0] is the one asked at the end
    q_final = question_tokens(keys[target], variant)
    # Events: (fraction of the filler, tokens, supervised flags). Facts are unsupervised
    # (their values are random); inline Q/A supervise the completion only.
    events: list[tuple[float, list[int], list[bool]]] = []
    fracs = [rng.random() for _ in keys]
    if depth is not None:
        fracs[target] = min(max(depth, 0.0), 1.0)
    for k, v, f in zip(keys, vals, fracs):
        t = fact_tokens(k, v)
        events.append((f, t, [False] * len(t)))
    for j in rng.sample(range(1, n_facts), min(inline_questions, n_facts - 1)):
        v = "think" if rng.random() < inline_think else "plain"
        q, c = question_tokens(keys[j], v), completion_tokens(keys[j], vals[j], v)
        c = c[:-1] + ids(".")  # inline answers end a sentence, not the sequence
        f = fracs[j] + rng.random() * (1.0 - fracs[j])
        events.append((f, q + c, [False] * len(q) + [True] * len(c)))
    n_fill = length - len(q_final) - sum(len(t) for _, t, _ in events)
    while n_fill < 0 and len(events) > n_facts:  # inline questions that do not fit are dropped
        n_fill += len(events.pop()[1])
    if n_fill < 0:
        raise ValueError(f"length {length} too short for {n_facts} facts and the questions")
    sentences = filler(rng, n_fill, pool_seed)
    # Insert each event at the sentence boundary nearest its fraction of the filler.
    bounds = [0]
    for s in sentences:
        bounds.append(bounds[-1] + len(s))
    at: dict[int, list[int]] = {}
    for e, (f, _, _) in enumerate(events):
        at.setdefault(_nearest(bounds, f * n_fill), []).append(e)
    prompt: list[int] = []
    mask: list[bool] = []
    fact_pos = -1
    for i in range(len(sentences) + 1):
        for e in sorted(at.get(i, []), key=lambda e: events[e][0]):
            if e == target:
                fact_pos = len(prompt) + 3  # the key token inside "the code of KEY"
            prompt += events[e][1]
            mask += events[e][2]
        if i < len(sentences):
            prompt += sentences[i]
            mask += [False] * len(sentences[i])
    prompt += q_final
    mask += [False] * len(q_final)
    completion = completion_tokens(keys[target], vals[target], variant)
    assert len(prompt) == length and fact_pos >= 0
    return Example(prompt, completion, list(vals[target]), variant, fact_pos,
                   mask + [True] * len(completion))


def _nearest(bounds: list[int], x: float) -> int:
    """Index of the boundary nearest x (bounds ascending), by bisection."""
    import bisect

    i = bisect.bisect_left(bounds, x)
    if i == 0:
        return 0
    if i == len(bounds):
        return len(bounds) - 1
    return i if bounds[i] - x < x - bounds[i - 1] else i - 1


def answer_correct(ex: Example, output_ids: Sequence[int]) -> bool:
    """Exact match: the value tokens, right after the prompt (plain) or right after
    "the code of KEY is" following the first generated ``</think>`` (think)."""
    out = list(output_ids)
    if ex.variant == "think":
        if ID[END_THINK] not in out:
            return False
        out = out[out.index(ID[END_THINK]) + 1:]
        prefix = answer_prefix(ex.prompt[ex.fact_pos])
        if out[: len(prefix)] != prefix:
            return False
        out = out[len(prefix):]
    return out[: len(ex.answer)] == ex.answer


# ------------------------------------------------------------------ tokenizer
def build_tokenizer(out_dir: str | Path, model_max_length: int = 40960):
    """Word-level HF fast tokenizer over VOCAB (ids identical to ``ID``), saved to
    ``out_dir``. '\\n' is its own token (an SFI trigger); <think>/</think> are
    single ids (SADAS) and not 'special', so they survive detokenization."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(ID), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
    ])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    return fast
