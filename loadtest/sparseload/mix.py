"""Command-line specs of the load test: policy mix, scenarios, lengths, thresholds.

The client never validates policy names or knobs: the server does (HTTP 400), so a
policy added to the server (e.g. ``sfi:budget=2048:recent=256``) is load-tested by
changing ``--policy-mix`` only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Iterable, Mapping, Optional, Sequence, TypeVar

SCENARIOS: tuple[str, ...] = ("qa", "cot", "mixed", "invalid", "abort")
DEFAULT_SCENARIOS = "qa=3,cot=3,mixed=2,invalid=1,abort=1"
DEFAULT_POLICY_MIX = "full,streaming,sadas"
# A label that sends no custom_params at all: the server's --sparse-default-policy.
SERVER_DEFAULT = "default"

ENDPOINTS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}
DEFAULT_ENDPOINTS = "chat,completions,generate"

# Metadata the server must answer with 400. One case per rejection reason the
# plugin distinguishes (policy, a knob's range, unknown field, type).
DEFAULT_INVALID_CASES: tuple[dict[str, Any], ...] = (
    {"policy": "nope"},
    {"policy": "streaming", "window": -1},
    {"policy": "streaming", "windw": 64},
    {"policy": "sadas", "window": "64"},
)


class SpecError(ValueError):
    """A malformed command-line spec; the message names the option and the value."""


@dataclass(frozen=True)
class PolicyEntry:
    label: str  # stats name: unique, stable across runs, e.g. "streaming:window=64:sink=4"
    sparse: Optional[Any]  # custom_params.sparse, or None for the server's default policy
    weight: int = 1


def _scalar(text: str) -> Any:
    """A knob value: int, float, true/false, else the string (the server judges it)."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return text


def label_for(sparse: Optional[Any]) -> str:
    if sparse is None:
        return SERVER_DEFAULT
    if isinstance(sparse, str):
        return sparse
    if isinstance(sparse, Mapping) and isinstance(sparse.get("policy"), str):
        knobs = [f"{k}={v}" for k, v in sparse.items() if k != "policy"]
        return ":".join([sparse["policy"], *knobs])
    return json.dumps(sparse, separators=(",", ":"), sort_keys=True)


def case_label(sparse: Any) -> str:
    """Stats name of an invalid-metadata case: its compact JSON, so that a knob of
    the wrong type ("64") stays distinguishable from a bad value (64)."""
    return json.dumps(sparse, separators=(",", ":"))


def _read_maybe_file(spec: str) -> str:
    if spec.startswith("@"):
        try:
            return Path(spec[1:]).read_text()
        except OSError as e:
            raise SpecError(f"cannot read {spec[1:]}: {e}") from e
    return spec


def _weight(text: str, where: str) -> int:
    try:
        w = int(text)
    except ValueError:
        raise SpecError(f"{where}: weight must be an integer >= 0, got {text!r}") from None
    if w < 0:
        raise SpecError(f"{where}: weight must be an integer >= 0, got {w}")
    return w


def parse_policy_mix(spec: str) -> list[PolicyEntry]:
    """``full,streaming:window=64:sink=4@2,sfi:budget=2048`` or JSON (inline or ``@file``).

    Compact form: entries separated by commas; ``policy[:knob=value...][@weight]``;
    ``default`` sends no metadata (the server's default policy). JSON form: a list of
    ``{"sparse": {...} | "name" | null, "weight": n, "label": "..."}`` or of bare
    ``custom_params.sparse`` values.
    """
    text = _read_maybe_file(spec.strip()).strip()
    entries: list[PolicyEntry] = []
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"--policy-mix: invalid JSON: {e}") from e
        for i, item in enumerate(raw):
            if isinstance(item, Mapping) and ("sparse" in item or "weight" in item or "label" in item):
                sparse = item.get("sparse")
                weight = _weight(str(item.get("weight", 1)), f"--policy-mix[{i}]")
                label = str(item.get("label") or label_for(sparse))
            else:
                sparse, weight, label = item, 1, label_for(item)
            entries.append(PolicyEntry(label, sparse, weight))
    else:
        for part in filter(None, (p.strip() for p in text.split(","))):
            body, _, w = part.partition("@")
            weight = _weight(w, f"--policy-mix {part!r}") if w else 1
            name, *knobs = body.split(":")
            if not name:
                raise SpecError(f"--policy-mix {part!r}: missing policy name")
            fields: Optional[dict[str, Any]] = None if name == SERVER_DEFAULT else {"policy": name}
            for knob in knobs:
                key, eq, value = knob.partition("=")
                if not eq or not key or fields is None:
                    raise SpecError(f"--policy-mix {part!r}: expected policy:knob=value, got {knob!r}")
                fields[key] = _scalar(value)
            entries.append(PolicyEntry(body, fields, weight))
    entries = [e for e in entries if e.weight > 0]
    if not entries:
        raise SpecError(f"--policy-mix {spec!r}: no policy with weight > 0")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise SpecError(f"--policy-mix: duplicate labels {sorted({x for x in labels if labels.count(x) > 1})}")
    return entries


def parse_invalid_cases(spec: str) -> list[Any]:
    """A JSON list of ``custom_params.sparse`` values the server must reject (inline or ``@file``)."""
    if not spec.strip():
        return list(DEFAULT_INVALID_CASES)
    try:
        cases = json.loads(_read_maybe_file(spec.strip()))
    except json.JSONDecodeError as e:
        raise SpecError(f"--invalid-cases: invalid JSON: {e}") from e
    if not isinstance(cases, list) or not cases:
        raise SpecError("--invalid-cases: expected a non-empty JSON list")
    return cases


def parse_scenarios(spec: str) -> dict[str, int]:
    """``qa=3,cot=1`` -> weights; scenarios left out get weight 0 (not run)."""
    weights = dict.fromkeys(SCENARIOS, 0)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, w = part.partition("=")
        if name not in weights:
            raise SpecError(f"--scenarios: unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
        weights[name] = _weight(w, f"--scenarios {part!r}") if eq else 1
    if not any(weights.values()):
        raise SpecError(f"--scenarios {spec!r}: no scenario with weight > 0")
    return weights


def parse_endpoints(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [n for n in names if n not in ENDPOINTS]
    if bad or not names:
        raise SpecError(f"--endpoints {spec!r}: choose from {', '.join(ENDPOINTS)}")
    return names


@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


def parse_length(spec: str, option: str) -> LengthRange:
    """``512`` or ``256-1024`` (uniform) tokens."""
    lo_s, dash, hi_s = str(spec).strip().partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if dash else lo
    except ValueError:
        raise SpecError(f"{option}: expected N or LO-HI tokens, got {spec!r}") from None
    if lo < 1 or hi < lo:
        raise SpecError(f"{option}: expected 1 <= LO <= HI, got {spec!r}")
    return LengthRange(lo, hi)


@dataclass(frozen=True)
class Threshold:
    """A limit in ms for every policy (``default``) with per-label overrides."""

    default: Optional[float]
    per_label: Mapping[str, float]

    def for_label(self, label: str) -> Optional[float]:
        return self.per_label.get(label, self.default)

    def __bool__(self) -> bool:
        return self.default is not None or bool(self.per_label)


def parse_threshold(spec: Optional[str], option: str, labels: Iterable[str] = ()) -> Threshold:
    """``40`` (all policies) or ``40,streaming:window=64=25`` (label=ms; labels may
    contain '=' so the value is what follows the last one)."""
    if spec is None or not str(spec).strip():
        return Threshold(None, {})
    known = set(labels)
    default: Optional[float] = None
    per: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        label, eq, value = part.rpartition("=")
        try:
            ms = float(value)
        except ValueError:
            raise SpecError(f"{option}: expected MS or LABEL=MS, got {part!r}") from None
        if not eq:
            default = ms
        elif known and label not in known:
            raise SpecError(f"{option}: {label!r} is not a label of --policy-mix ({', '.join(sorted(known))})")
        else:
            per[label] = ms
    return Threshold(default, per)


T = TypeVar("T")


class Deck(Generic[T]):
    """Weighted choice without long-run drift: every ``sum(weights)`` draws hold each
    item exactly ``weight`` times, in a shuffled order.

    A short CI run then still sees every scenario and policy in its configured
    proportion (plain random choice can miss a weight-1 scenario entirely).
    """

    def __init__(self, items: Sequence[tuple[T, int]], rng: random.Random):
        self._cards = [item for item, w in items for _ in range(w)]
        if not self._cards:
            raise ValueError("Deck needs at least one item with weight > 0")
        self._rng = rng
        self._left: list[T] = []

    def draw(self) -> T:
        if not self._left:
            self._left = list(self._cards)
            self._rng.shuffle(self._left)
        return self._left.pop()
