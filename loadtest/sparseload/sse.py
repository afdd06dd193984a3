"""Request bodies and server-sent-event parsing for SGLang's streaming endpoints.

Timing is taken per streamed chunk as it arrives (``feed`` gets the arrival time):

* TTFT: request sent -> first chunk that carries generated tokens;
* TPOT: (t_last - t_first) / (tokens - 1) with ``tokens`` the server's count
  (``usage.completion_tokens`` / ``meta_info.completion_tokens``), so it stays
  right when a chunk carries several tokens or a token decodes to no text.

Where SGLang puts what (0.5.17 .. 0.5.23):

* ``/v1/completions``, ``/v1/chat/completions``: the policy goes in the top-level
  ``custom_params`` field (what the OpenAI SDK's ``extra_body`` sends); with
  ``stream_options.include_usage`` the last chunk before ``[DONE]`` has ``usage``,
  and ``continuous_usage_stats`` (an SGLang/vLLM extension) puts the running count
  on every chunk, so that tokens are seen arriving even when they decode to no text
  (chat streams send no chunk for those; completions streams send an empty one).
  Bad metadata is an HTTP 400 before the stream starts (SGLang runs the generator
  to its first chunk before it sends the 200).
* ``/generate``: ``sampling_params.custom_params``; each event carries
  ``meta_info`` with token counts. The 200 and headers go out before the request is
  validated, so bad metadata arrives as the stream's first event,
  ``{"error": {"code": 400, "message": ...}}``, followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from .mix import ENDPOINTS
from .prompts import Prompt

DONE = "[DONE]"


@dataclass(frozen=True)
class GenOptions:
    model: str = "default"
    temperature: float = 0.0
    # Generate exactly max_tokens: output lengths (and so TPOT samples) do not
    # depend on when a model happens to stop.
    ignore_eos: bool = True


def build_request(
    endpoint: str, prompt: Prompt, max_tokens: int, sparse: Optional[Any], opts: GenOptions
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a streaming request; ``sparse`` None sends no metadata."""
    custom = {"custom_params": {"sparse": sparse}} if sparse is not None else {}
    if endpoint == "generate":
        sampling = {"max_new_tokens": max_tokens, "temperature": opts.temperature,
                    "ignore_eos": opts.ignore_eos, **custom}
        return ENDPOINTS[endpoint], {"text": prompt.text, "sampling_params": sampling, "stream": True}
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": max_tokens,
        "temperature": opts.temperature,
        "ignore_eos": opts.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **custom,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.chat_user}]
    elif endpoint == "completions":
        body["prompt"] = prompt.text
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    return ENDPOINTS[endpoint], body


def error_of(payload: Any) -> Optional[tuple[Optional[int], str]]:
    """(code, message) if a JSON body/event is one of SGLang's error shapes."""
    if not isinstance(payload, dict):
        return None
    err = payload.get("error")
    if isinstance(err, dict):
        code = err.get("code")
        return (code if isinstance(code, int) else None), str(err.get("message", err))
    if isinstance(err, str):
        return None, err
    if payload.get("object") == "error":
        code = payload.get("code")
        return (code if isinstance(code, int) else None), str(payload.get("message", payload))
    return None


@dataclass
class StreamParser:
    """Consumes one response's SSE lines; the caller times and reads the socket."""

    endpoint: str
    t_sent: float
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    token_chunks: int = 0
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error_code: Optional[int] = None
    error_message: Optional[str] = None
    done: bool = False
    protocol_errors: list[str] = field(default_factory=list)
    _seen_tokens: int = 0  # the running count of generated tokens seen so far

    def feed(self, line: bytes | str, now: float) -> None:
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            return  # blank separators, SSE comments, event:/id: fields
        data = line[len("data:"):].strip()
        if data == DONE:
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.protocol_errors.append(f"undecodable event: {data[:120]!r}")
            return
        err = error_of(event)
        if err is not None:
            if self.error_message is None:
                self.error_code, self.error_message = err
            return
        if self.endpoint == "generate":
            self._native(event, now)
        else:
            self._openai(event, now)

    def _tokens_arrived(self, now: float) -> None:
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.token_chunks += 1

    def _native(self, event: dict[str, Any], now: float) -> None:
        meta = event.get("meta_info") or {}
        n = meta.get("completion_tokens")
        if isinstance(n, int):
            if n > self._seen_tokens:
                self._seen_tokens = n
                self._tokens_arrived(now)
            self.completion_tokens = n
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        fr = meta.get("finish_reason")
        if fr:
            self.finish_reason = fr.get("type") if isinstance(fr, dict) else str(fr)
            if isinstance(fr, dict) and fr.get("type") == "abort" and self.error_message is None:
                self.error_message = str(fr.get("message") or "aborted by the server")
                code = fr.get("status_code")
                self.error_code = code if isinstance(code, int) else None

    def _openai(self, event: dict[str, Any], now: float) -> None:
        usage = event.get("usage")
        counted = None
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                counted = usage["completion_tokens"]
                self.completion_tokens = counted
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        choices = event.get("choices") or ()
        text = ""
        for choice in choices:
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            else:
                text += choice.get("text") or ""
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if not choices:
            return  # the usage-only summary after the last token: not an arrival
        if counted is not None:
            if counted > self._seen_tokens:  # running count (continuous_usage_stats)
                self._seen_tokens = counted
                self._tokens_arrived(now)
        elif text:  # a server without running counts: visible text marks arrivals
            self._tokens_arrived(now)

    # ---- results ----------------------------------------------------------------
    def ttft_ms(self) -> Optional[float]:
        return None if self.t_first is None else (self.t_first - self.t_sent) * 1e3

    def tpot_ms(self) -> Optional[float]:
        n = self.completion_tokens
        if self.t_first is None or self.t_last is None or not n or n < 2:
            return None
        return (self.t_last - self.t_first) * 1e3 / (n - 1)

    def problem(self, expected_tokens: Optional[int]) -> Optional[str]:
        """Why a stream that should have completed did not, as a bounded failure
        reason (the stats group failures by message), or None if it is fine."""
        if self.error_message is not None:
            return f"in-stream error {self.error_code}: {self.error_message[:160]}"
        if self.protocol_errors:
            return self.protocol_errors[0]
        if not self.done:
            return "stream ended without [DONE]"
        if self.completion_tokens is None:
            return "no token count (usage / meta_info) in the stream"
        if self.t_first is None:
            return "no generated tokens in the stream"
        if self.finish_reason not in ("length", "stop"):
            return f"finish_reason {self.finish_reason!r}"
        if expected_tokens is not None and self.completion_tokens != expected_tokens:
            return f"completion_tokens {self.completion_tokens} != max_tokens {expected_tokens} (ignore_eos)"
        return None
