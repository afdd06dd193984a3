"""Prompts generated locally, with lengths controlled in the server's tokens.

No dataset download: documents are sentence-structured filler with numbers (so a
question has a checkable answer somewhere in the context), and every prompt starts
with a random request tag so that the radix cache never turns one request's prefill
into another's prefix hit.

Length control: the client has no tokenizer (it must work against any model), so
it sizes text by characters and converts with a chars-per-token ratio measured on
the server: ``/v1/tokenize`` on a filler sample at start-up, else learned from the
``prompt_tokens`` the server reports (usage / meta_info) as responses arrive.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

_SUBJECTS = (
    "the river", "the city", "the tree", "the model", "the cache", "the bird", "the user",
    "the system", "the list", "the story", "the dog", "the cat", "the fish", "the world",
)
_VERBS = ("has", "had", "is", "was", "counts", "lists", "reports", "holds", "names", "finds")
_OBJECTS = (
    "one red token", "two blue words", "three green names", "four true answers",
    "five long lists", "six short stories", "seven full caches", "eight sparse keys",
    "nine dense values", "ten new questions",
)
_TAILS = (
    "on day {n}", "at time {n}", "in list {n}", "for user {n}", "with number {n}",
    "near city {n}", "by model {n}", "after query {n}",
)

THINK_OPEN = "<think>"
_QA_HEAD = "\nRead the document and answer the question.\nDocument:\n"
_QA_FACT = "The access code for vault {key} is {code}."
_QA_QUESTION = "Question: what is the access code for vault {key}? Answer with the number only."
_QA_ANSWER = "\nAnswer:"
_COT_TASK = (
    "A warehouse holds {a} crates. Every day {b} crates arrive and {c} leave. "
    "How many crates are there after {d} days? Reason step by step, check each "
    "step, then give the final number."
)
_COT_NOTES = "Notes:\n"
_TAG = "Request"


def vocabulary() -> list[str]:
    """Every word the generated prompts can contain, besides numbers 0..9999 and
    punctuation (for benchmark tokenizers that should encode them as single tokens)."""
    text = " ".join([*_SUBJECTS, *_VERBS, *_OBJECTS, *_TAILS, _QA_HEAD, _QA_FACT, _QA_QUESTION,
                     _QA_ANSWER, _COT_TASK, _COT_NOTES, _TAG])
    words = set(re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", text)))
    return sorted(words | {w.capitalize() for w in words})


def _sentence(rng: random.Random) -> str:
    tail = rng.choice(_TAILS).format(n=rng.randint(0, 9999))
    text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {tail}."
    return text[0].upper() + text[1:]


def filler(rng: random.Random, chars: int) -> str:
    """Sentences until at least ``chars`` characters, four to a line: the length
    overshoots by at most one sentence (~10 tokens)."""
    lines: list[list[str]] = [[]]
    size = 0
    while size < chars:
        if len(lines[-1]) == 4:
            lines.append([])
        sentence = _sentence(rng)
        lines[-1].append(sentence)
        size += len(sentence) + 1
    return "\n".join(" ".join(line) for line in lines)


@dataclass(frozen=True)
class Prompt:
    """One request's input in the three shapes the endpoints take."""

    scenario: str
    text: str  # raw prompt for /v1/completions and /generate
    chat_user: str  # the user message for /v1/chat/completions
    target_tokens: int


class TokenRatio:
    """Characters per server token of the filler text.

    ``calibrated`` from /v1/tokenize is exact for this text and fixed; otherwise each
    observed (chars, prompt_tokens) pair moves an exponential average.
    """

    def __init__(self, chars_per_token: float = 4.0, alpha: float = 0.2):
        self.value = chars_per_token
        self.calibrated = False
        self._alpha = alpha

    def set_calibrated(self, chars: int, tokens: int) -> None:
        if tokens > 0:
            self.value = chars / tokens
            self.calibrated = True

    def observe(self, chars: int, tokens: Optional[int]) -> None:
        # Short prompts are dominated by template/special tokens: they say little.
        if self.calibrated or not tokens or tokens < 128:
            return
        self.value += self._alpha * (chars / tokens - self.value)

    def chars_for(self, tokens: int) -> int:
        return max(1, int(tokens * self.value))


class PromptFactory:
    def __init__(self, ratio: TokenRatio):
        self.ratio = ratio

    def _tag(self, rng: random.Random) -> str:
        # Decimal groups: plain words and numbers survive any tokenizer (a word-level
        # benchmark tokenizer would turn a hex id into <unk>, and the tag with it).
        return _TAG + " " + " ".join(str(rng.randint(0, 9999)) for _ in range(3)) + "."

    def long_context_qa(self, rng: random.Random, tokens: int) -> Prompt:
        """A long document with key/value facts; the question asks for one of them."""
        key, code = rng.randint(100, 999), rng.randint(1000, 9999)
        fact = _QA_FACT.format(key=key, code=code)
        question = _QA_QUESTION.format(key=key)
        head = self._tag(rng) + _QA_HEAD
        body_chars = max(0, self.ratio.chars_for(tokens) - len(head) - len(fact) - len(question) - 12)
        lines = filler(rng, body_chars).split("\n")
        lines.insert(rng.randrange(len(lines) + 1), fact)
        doc = "\n".join(lines)
        user = f"{head}{doc}\n\n{question}"
        return Prompt("qa", text=user + _QA_ANSWER, chat_user=user, target_tokens=tokens)

    def chain_of_thought(self, rng: random.Random, tokens: int, scenario: str = "cot") -> Prompt:
        """A word problem asking for step-by-step reasoning; the raw prompt opens a
        ``<think>`` block so that SADAS decodes in its thinking (window) mode on any
        model whose tokenizer has the think tokens. Chat requests rely on the
        model's template (e.g. Qwen3 opens the think block itself)."""
        a, b, c, d = rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 9), rng.randint(3, 30)
        task = _COT_TASK.format(a=a, b=b, c=c, d=d)
        head = self._tag(rng) + "\n"
        notes_chars = self.ratio.chars_for(tokens) - len(head) - len(task) - 16
        notes = (_COT_NOTES + filler(rng, notes_chars) + "\n") if notes_chars > 64 else ""
        user = f"{head}{notes}{task}"
        return Prompt(scenario, text=f"{user}\n{THINK_OPEN}\n", chat_user=user, target_tokens=tokens)
