"""Locust load test for an SGLang server running ``--attention-backend sgl_sparse``.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:30000 \
        -u 32 -r 8 -t 10m --csv out/run --html out/run.html \
        --policy-mix full,streaming:window=2048,sadas:window=2048 \
        --max-error-rate 0.01 --max-tpot-p95-ms 60

Users stream from SGLang's OpenAI-compatible API (``/v1/chat/completions``,
``/v1/completions``) and its native ``/generate``, each request with a policy from
``--policy-mix`` in its metadata. Scenarios (locust tags; weights and selection
also by ``--scenarios`` / ``LOCUST_SCENARIOS``):

* ``qa``: long-context QA: long document, short answer;
* ``cot``: chain of thought: short prompt opening ``<think>``, long output;
* ``mixed``: the same prompt sent to every policy of the mix at once, so their
  TPOTs are measured on identical requests in the same decode batches;
* ``invalid``: bad metadata; the server must answer 400 (counted as expected
  rejections, never as failures);
* ``abort``: the client closes the stream after ``--abort-after-chunks`` chunks.

Per policy it reports TTFT, TPOT, end-to-end latency, tokens/s and errors, both as
locust entries (request types ``TTFT``/``TPOT``/``E2E``/``ABORT``/``REJECT``, named by
policy or invalid case: they land in ``--csv``/``--html``) and as an exact summary
table at exit (``--summary-json`` too). The exit code is 1 when ``--max-error-rate``
or the ``--max-tpot-p50-ms``/``--max-tpot-p95-ms``/``--max-ttft-p95-ms`` thresholds
are exceeded. See README.md, "Load tests (locust)".
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import gevent
import locust.stats as locust_stats
import requests
from gevent.pool import Group
from locust import HttpUser, TaskSet, between, events, tag, task
from locust.clients import HttpSession
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

# locust puts this directory on sys.path when it loads the file; `python -c` imports
# of the locustfile (and forked --processes workers) may not have it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparseload.mix import (  # noqa: E402
    DEFAULT_ENDPOINTS, DEFAULT_POLICY_MIX, DEFAULT_SCENARIOS, Deck, LengthRange, PolicyEntry,
    SpecError, Threshold, case_label, parse_endpoints, parse_invalid_cases, parse_length,
    parse_policy_mix, parse_scenarios, parse_threshold,
)
from sparseload.prompts import Prompt, PromptFactory, TokenRatio, filler  # noqa: E402
from sparseload.results import Results, check_thresholds, format_table  # noqa: E402
from sparseload.sse import GenOptions, StreamParser, build_request, error_of  # noqa: E402

log = logging.getLogger("sgl_sparse.loadtest")
# The stats logger prints locust's own tables: the summary goes out the same way.
console = logging.getLogger("locust.stats_logger")

REQUEST_FIELD = "custom_params.sparse"


@dataclass(frozen=True)
class RunConfig:
    mix: list[PolicyEntry]
    scenarios: dict[str, int]
    endpoints: list[str]
    invalid_cases: list[Any]
    qa_prompt: LengthRange
    qa_output: LengthRange
    cot_prompt: LengthRange
    cot_output: LengthRange
    mixed_prompt: LengthRange
    mixed_output: LengthRange
    abort_after_chunks: int
    gen: GenOptions
    timeout_s: float
    seed: Optional[int]
    wait_s: tuple[float, float]
    max_error_rate: Optional[float]
    tpot_p50: Threshold
    tpot_p95: Threshold
    ttft_p95: Threshold
    summary_json: Optional[str]

    @classmethod
    def from_options(cls, o: Any) -> "RunConfig":
        mix = parse_policy_mix(o.policy_mix)
        labels = [e.label for e in mix]
        lo, _, hi = str(o.wait_s).partition("-")
        try:
            wait = (float(lo), float(hi or lo))
        except ValueError:
            raise SpecError(f"--wait-s: expected S or LO-HI seconds, got {o.wait_s!r}") from None
        if o.abort_after_chunks < 1:
            raise SpecError(f"--abort-after-chunks: must be >= 1, got {o.abort_after_chunks}")
        if o.max_error_rate is not None and not 0 <= o.max_error_rate <= 1:
            raise SpecError(f"--max-error-rate: a fraction in [0, 1], got {o.max_error_rate}")
        return cls(
            mix=mix,
            scenarios=parse_scenarios(o.scenarios),
            endpoints=parse_endpoints(o.endpoints),
            invalid_cases=parse_invalid_cases(o.invalid_cases),
            qa_prompt=parse_length(o.qa_prompt_tokens, "--qa-prompt-tokens"),
            qa_output=parse_length(o.qa_output_tokens, "--qa-output-tokens"),
            cot_prompt=parse_length(o.cot_prompt_tokens, "--cot-prompt-tokens"),
            cot_output=parse_length(o.cot_output_tokens, "--cot-output-tokens"),
            mixed_prompt=parse_length(o.mixed_prompt_tokens, "--mixed-prompt-tokens"),
            mixed_output=parse_length(o.mixed_output_tokens, "--mixed-output-tokens"),
            abort_after_chunks=o.abort_after_chunks,
            gen=GenOptions(model=o.model, temperature=o.temperature, ignore_eos=not o.allow_eos),
            timeout_s=o.request_timeout,
            seed=o.seed,
            wait_s=wait,
            max_error_rate=o.max_error_rate,
            tpot_p50=parse_threshold(o.max_tpot_p50_ms, "--max-tpot-p50-ms", labels),
            tpot_p95=parse_threshold(o.max_tpot_p95_ms, "--max-tpot-p95-ms", labels),
            ttft_p95=parse_threshold(o.max_ttft_p95_ms, "--max-ttft-p95-ms", labels),
            summary_json=o.summary_json or None,
        )

    def longest_request(self) -> int:
        return max(self.qa_prompt.hi + self.qa_output.hi, self.cot_prompt.hi + self.cot_output.hi,
                   self.mixed_prompt.hi + self.mixed_output.hi)


# Process-wide state: one locust process runs many users (greenlets) and, with
# --processes, the master merges what every worker drained into its RESULTS.
CONFIG: Optional[RunConfig] = None
RESULTS = Results()
FACTORY = PromptFactory(TokenRatio())
_USER_IDS = itertools.count()
_CLOCK: dict[str, Optional[float]] = {"start": None, "stop": None}


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("sgl-sparse load test")
    g.add_argument("--policy-mix", default=DEFAULT_POLICY_MIX, env_var="LOCUST_POLICY_MIX",
                   help="Policies and weights: 'full,streaming:window=1024:sink=4@2,sfi:budget=2048' "
                        "(knobs go to custom_params.sparse as given; 'default' = no metadata), or JSON / @file. "
                        f"Default: {DEFAULT_POLICY_MIX}")
    g.add_argument("--scenarios", default=DEFAULT_SCENARIOS, env_var="LOCUST_SCENARIOS",
                   help=f"Scenario weights, left-out ones do not run (locust --tags/--exclude-tags filter too). "
                        f"Default: {DEFAULT_SCENARIOS}")
    g.add_argument("--endpoints", default=DEFAULT_ENDPOINTS, env_var="LOCUST_ENDPOINTS",
                   help=f"Endpoints used in turn: chat, completions, generate. Default: {DEFAULT_ENDPOINTS}")
    g.add_argument("--invalid-cases", default="", help="JSON list (or @file) of custom_params.sparse values "
                   "that must be rejected with 400. Default: bad policy, window -1, unknown knob, knob of wrong type")
    g.add_argument("--qa-prompt-tokens", default="4096", help="N or LO-HI (default 4096)")
    g.add_argument("--qa-output-tokens", default="32", help="N or LO-HI (default 32)")
    g.add_argument("--cot-prompt-tokens", default="256", help="N or LO-HI (default 256)")
    g.add_argument("--cot-output-tokens", default="1024", help="N or LO-HI (default 1024)")
    g.add_argument("--mixed-prompt-tokens", default="2048", help="N or LO-HI (default 2048)")
    g.add_argument("--mixed-output-tokens", default="256", help="N or LO-HI (default 256)")
    g.add_argument("--abort-after-chunks", type=int, default=3,
                   help="abort scenario: close the stream after this many token chunks (default 3)")
    g.add_argument("--model", default="default", help="'model' field of OpenAI requests (default: 'default')")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    g.add_argument("--allow-eos", action="store_true", default=False,
                   help="let requests stop at EOS (default: ignore_eos, exactly the requested output tokens)")
    g.add_argument("--chars-per-token", type=float, default=4.0,
                   help="initial text/token ratio when the server has no /v1/tokenize (then learned from usage)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="read timeout per request, s (default 600)")
    g.add_argument("--seed", type=int, default=None, help="seed for prompts and the per-user scenario/policy order")
    g.add_argument("--wait-s", default="0", help="think time between a user's requests: S or LO-HI seconds (default 0)")
    g.add_argument("--max-error-rate", type=float, default=None,
                   help="exit 1 if (unexpected errors / requests) exceeds this fraction; expected rejections and "
                        "client aborts are not errors")
    g.add_argument("--max-tpot-p50-ms", default=None, help="exit 1 if a policy's TPOT p50 exceeds MS (or LABEL=MS,...)")
    g.add_argument("--max-tpot-p95-ms", default=None, help="exit 1 if a policy's TPOT p95 exceeds MS (or LABEL=MS,...)")
    g.add_argument("--max-ttft-p95-ms", default=None, help="exit 1 if a policy's TTFT p95 exceeds MS (or LABEL=MS,...)")
    g.add_argument("--summary-json", default="", help="write the per-policy summary (exact percentiles) here")


def _configure(environment: Environment) -> RunConfig:
    global CONFIG
    try:
        CONFIG = RunConfig.from_options(environment.parsed_options)
    except SpecError as e:
        log.error("%s", e)
        sys.exit(2)
    SparseUser.wait_time = between(*CONFIG.wait_s)
    return CONFIG


@events.init.add_listener
def _on_init(environment: Environment, runner: Any = None, **_kw: Any) -> None:
    if environment.parsed_options is not None:
        _configure(environment)  # fail fast on a bad spec, before any user starts
    # gevent's loop caches "now" and only refreshes it when it runs; locust arms its
    # --run-time timer right after this event, before the loop has run since the
    # imports and the locustfile's load. On a busy load generator those take seconds,
    # and the timer fired that much early (CI: a 4 s run stopped after 0.18 s, before
    # any request).
    gevent.get_hub().loop.update_now()


@events.report_to_master.add_listener
def _to_master(client_id: str, data: dict[str, Any]) -> None:
    data["sgl_sparse"] = RESULTS.drain()


@events.worker_report.add_listener
def _from_worker(client_id: str, data: dict[str, Any]) -> None:
    RESULTS.merge(data.get("sgl_sparse") or {})


@events.reset_stats.add_listener
def _on_reset_stats() -> None:
    # --reset-stats (after spawning) drops the ramp-up from locust's stats: same here.
    RESULTS.clear()
    _CLOCK["start"] = time.time()


def _calibrate(host: str, cfg: RunConfig) -> None:
    """Measure chars/token of the filler on the server's own tokenizer."""
    sample = filler(random.Random(0), 8000)
    try:
        r = requests.post(host.rstrip("/") + "/v1/tokenize", json={"model": cfg.gen.model, "prompt": sample},
                          timeout=60)
        r.raise_for_status()
        body = r.json()
        FACTORY.ratio.set_calibrated(len(sample), int(body["count"]))
        max_len = body.get("max_model_len")
    except (requests.RequestException, ValueError, KeyError, TypeError) as e:
        log.warning("no /v1/tokenize on %s (%s): prompt lengths start at %.2f chars/token and follow the "
                    "prompt_tokens the server reports", host, e, FACTORY.ratio.value)
        return
    log.info("server tokenizer: %.2f chars/token on the filler text; max_model_len %s", FACTORY.ratio.value, max_len)
    if isinstance(max_len, int) and cfg.longest_request() > max_len:
        log.warning("prompt + output lengths up to %d tokens exceed the server's max_model_len %d: "
                    "those requests will fail", cfg.longest_request(), max_len)


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kw: Any) -> None:
    # Workers get the master's custom arguments with the spawn message: re-read them.
    cfg = _configure(environment)
    RESULTS.clear()  # a new test (web UI) starts from zero, like locust's own stats
    _CLOCK["start"], _CLOCK["stop"] = time.time(), None
    if not isinstance(environment.runner, MasterRunner) and environment.host:
        _calibrate(environment.host, cfg)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    _CLOCK["stop"] = time.time()
    if getattr(environment.parsed_options, "csv_prefix", None) and not isinstance(environment.runner, WorkerRunner):
        # locust rewrites its --csv files from a greenlet once per CSV_STATS_INTERVAL_SEC
        # and not again at exit: without one more turn, requests that finished in the
        # last second (e.g. during --stop-timeout) would be missing from the files.
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.2)


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kw: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or CONFIG is None or _CLOCK["start"] is None:
        return
    duration = (_CLOCK["stop"] or time.time()) - _CLOCK["start"]
    labels = [e.label for e in CONFIG.mix]
    summary = RESULTS.summary(duration, order=labels)
    violations = check_thresholds(summary, labels, max_error_rate=CONFIG.max_error_rate,
                                  tpot_p50=CONFIG.tpot_p50, tpot_p95=CONFIG.tpot_p95, ttft_p95=CONFIG.ttft_p95)
    summary["violations"] = violations
    console.info("sgl-sparse per-policy summary (exact percentiles over all scenarios)")
    for line in format_table(summary).splitlines():
        console.info(line)
    for v in violations:
        console.info("THRESHOLD EXCEEDED: %s", v)
    if CONFIG.summary_json:
        path = Path(CONFIG.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    runner = environment.runner
    if violations:
        environment.process_exit_code = 1
    elif CONFIG.max_error_rate is not None and runner is not None and not runner.exceptions:
        # Failures within the allowed rate must not trip locust's "any failure -> 1";
        # exceptions raised by this file's own code still do.
        environment.process_exit_code = 0


def _fire(env: Environment, kind: str, name: str, ms: float, length: int = 0) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=length,
                            exception=None, context={})


def _close(resp: Any) -> None:
    # A connection error leaves a response without a socket (raw is None).
    if getattr(resp, "raw", None) is not None:
        resp.close()


def _http_error(resp: Any) -> str:
    if resp.status_code == 0:
        return f"connection error: {getattr(resp, 'error', None)}"[:200]
    try:
        err = error_of(resp.json())
    except ValueError:
        err = None
    msg = err[1] if err else (resp.text or "")
    return f"HTTP {resp.status_code}: {msg[:160]}"


class SparseScenarios(TaskSet):
    """One instance per user. Scenario, policy, endpoint and invalid case each come
    from a per-user Deck, so that every cycle holds them in the configured proportions."""

    def on_start(self) -> None:
        assert CONFIG is not None
        # --processes workers count users from 0 each: the worker index keeps their
        # seeded prompts apart (identical prompts would turn into radix-cache hits).
        worker = getattr(self.user.environment.runner, "worker_index", 0)
        uid = next(_USER_IDS)
        self.rng = random.Random(None if CONFIG.seed is None else f"{CONFIG.seed}:{worker}:{uid}")
        weights = CONFIG.scenarios
        # self.tasks: what survived locust's --tags/--exclude-tags filtering
        runnable = []
        for t in self.tasks:
            w = weights.get(getattr(t, "__name__", ""), 0)
            if w > 0:
                runnable.append((t, w))
        if not runnable:
            raise SpecError("no scenario left: --scenarios weights and --tags/--exclude-tags exclude all of "
                            + ", ".join(weights))
        self.scenario_deck = Deck(runnable, self.rng)
        self.policy_deck = Deck([(e, e.weight) for e in CONFIG.mix], self.rng)
        self.endpoint_deck = Deck([(e, 1) for e in CONFIG.endpoints], self.rng)
        self.invalid_deck = Deck([(c, 1) for c in CONFIG.invalid_cases], self.rng)
        self.fanout: list[HttpSession] = []

    def get_next_task(self) -> Any:
        return self.scenario_deck.draw()

    def _sessions(self, n: int) -> list[HttpSession]:
        # The mixed scenario's concurrent requests each get their own connection
        # pool (a requests.Session is not meant to be shared between greenlets).
        while len(self.fanout) < n - 1:
            s = HttpSession(base_url=self.user.host, request_event=self.user.environment.events.request, user=self.user)
            s.trust_env = False
            self.fanout.append(s)
        return [self.client, *self.fanout[: n - 1]]

    def on_stop(self) -> None:
        for s in self.fanout:
            s.close()

    # ---- scenarios ------------------------------------------------------------------
    @tag("qa")
    @task
    def qa(self) -> None:
        assert CONFIG is not None
        prompt = FACTORY.long_context_qa(self.rng, CONFIG.qa_prompt.draw(self.rng))
        self._stream(self.client, prompt, CONFIG.qa_output.draw(self.rng), self.policy_deck.draw(),
                     self.endpoint_deck.draw())

    @tag("cot")
    @task
    def cot(self) -> None:
        assert CONFIG is not None
        prompt = FACTORY.chain_of_thought(self.rng, CONFIG.cot_prompt.draw(self.rng))
        self._stream(self.client, prompt, CONFIG.cot_output.draw(self.rng), self.policy_deck.draw(),
                     self.endpoint_deck.draw())

    @tag("mixed")
    @task
    def mixed(self) -> None:
        assert CONFIG is not None
        prompt = FACTORY.chain_of_thought(self.rng, CONFIG.mixed_prompt.draw(self.rng), scenario="mixed")
        n_out, endpoint = CONFIG.mixed_output.draw(self.rng), self.endpoint_deck.draw()
        group = Group()
        try:
            for entry, session in zip(CONFIG.mix, self._sessions(len(CONFIG.mix))):
                group.spawn(self._stream, session, prompt, n_out, entry, endpoint)
            group.join(raise_error=True)
        finally:
            group.kill()  # the user was stopped mid-task: do not leave orphan streams

    @tag("abort")
    @task
    def abort(self) -> None:
        assert CONFIG is not None
        # Long enough that the server is still generating when the client hangs up.
        n_out = max(CONFIG.cot_output.hi, 4 * CONFIG.abort_after_chunks)
        prompt = FACTORY.chain_of_thought(self.rng, CONFIG.cot_prompt.draw(self.rng), scenario="abort")
        self._stream(self.client, prompt, n_out, self.policy_deck.draw(), self.endpoint_deck.draw(),
                     abort_after=CONFIG.abort_after_chunks)

    @tag("invalid")
    @task
    def invalid(self) -> None:
        assert CONFIG is not None
        case = self.invalid_deck.draw()
        label = case_label(case)
        endpoint = self.endpoint_deck.draw()
        prompt = FACTORY.chain_of_thought(self.rng, 32, scenario="invalid")
        path, body = build_request(endpoint, prompt, 8, case, CONFIG.gen)
        env = self.user.environment
        t0 = time.perf_counter()
        with self.client.post(path, json=body, stream=True, name=f"{path} [invalid {label}]",
                              catch_response=True, timeout=(10, CONFIG.timeout_s)) as resp:
            how: Optional[str] = None
            try:
                if resp.status_code == 400:
                    text = resp.text
                    how = "HTTP 400" if REQUEST_FIELD in text else None
                    what = f"HTTP 400 not naming {REQUEST_FIELD}: {text[:160]}"
                elif resp.status_code == 200:
                    parser = StreamParser(endpoint, t0)
                    for line in resp.iter_lines(chunk_size=None):
                        parser.feed(line, time.perf_counter())
                        if parser.error_message is not None or parser.token_chunks:
                            break
                    if parser.error_code == 400 and REQUEST_FIELD in (parser.error_message or ""):
                        how = "in-stream 400"
                    what = ("accepted: generated tokens" if parser.token_chunks else
                            f"in-stream {parser.error_code}: {(parser.error_message or 'no error event')[:160]}")
                else:
                    what = _http_error(resp)
            except (requests.RequestException, OSError) as e:
                what = f"{type(e).__name__}: {e}"[:200]
            finally:
                _close(resp)
            ms = (time.perf_counter() - t0) * 1e3
            if how is not None:
                resp.success()
                RESULTS.rejected(label, how)
                _fire(env, "REJECT", label, ms)
            else:
                resp.failure(f"invalid metadata not rejected with 400: {what}")
                RESULTS.accepted_invalid(label, what)

    # ---- one streamed request -------------------------------------------------------
    def _stream(self, session: HttpSession, prompt: Prompt, max_tokens: int, entry: PolicyEntry,
                endpoint: str, abort_after: Optional[int] = None) -> None:
        assert CONFIG is not None
        path, body = build_request(endpoint, prompt, max_tokens, entry.sparse, CONFIG.gen)
        env = self.user.environment
        scenario, label = prompt.scenario, entry.label
        t0 = time.perf_counter()
        parser = StreamParser(endpoint, t0)
        aborted, reason = False, None
        with session.post(path, json=body, stream=True, name=f"{path} [{label}]", catch_response=True,
                          timeout=(10, CONFIG.timeout_s)) as resp:
            try:
                if resp.status_code != 200:
                    reason = _http_error(resp)
                else:
                    # chunk_size=None: hand over each HTTP chunk as it arrives (a
                    # fixed size would hold back a token's event until more follow).
                    for line in resp.iter_lines(chunk_size=None):
                        parser.feed(line, time.perf_counter())
                        if abort_after is not None and parser.token_chunks >= abort_after \
                                and parser.error_message is None and not parser.done:
                            aborted = True
                            break
                    if not aborted:
                        reason = parser.problem(max_tokens if CONFIG.gen.ignore_eos else None)
            except (requests.RequestException, OSError) as e:
                reason = f"{type(e).__name__}: {e}"[:200]
            finally:
                if aborted or reason is not None:
                    _close(resp)  # drops the connection: the server sees the client go away
            t_end = time.perf_counter()
            if reason is not None:
                resp.failure(reason)
                RESULTS.failed(label, scenario, reason)
                return
            resp.success()
        e2e_ms = (t_end - t0) * 1e3
        if aborted:
            RESULTS.aborted(label, scenario, parser.completion_tokens or parser.token_chunks)
            _fire(env, "ABORT", label, e2e_ms, parser.token_chunks)
            return
        n = parser.completion_tokens or 0
        FACTORY.ratio.observe(len(prompt.chat_user if endpoint == "chat" else prompt.text), parser.prompt_tokens)
        ttft, tpot = parser.ttft_ms(), parser.tpot_ms()
        assert ttft is not None  # problem() ensured tokens arrived
        RESULTS.completed(label, scenario, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e_ms,
                          prompt_tokens=parser.prompt_tokens, output_tokens=n)
        _fire(env, "TTFT", label, ttft, parser.prompt_tokens or 0)
        if tpot is not None:
            _fire(env, "TPOT", label, tpot, n)
        _fire(env, "E2E", label, e2e_ms, n)


class SparseUser(HttpUser):
    """A closed-loop client: one scenario after another (think time: --wait-s)."""

    tasks = [SparseScenarios]
    wait_time = between(0, 0)
