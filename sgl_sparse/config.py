"""Validated configuration at the two edges: the server (flags + config file) and the request.

Everything that enters from outside goes through a pydantic model here, and every
error message names the offending field, the value and what is allowed.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

POLICY_NAMES = ("full", "streaming", "sadas", "sfi", "quest", "asyncspade", "lfps")
# Policies whose selection depends on the current (or a predicted) query: served
# through per-request query stores (sgl_sparse/query_store.py); on CUDA their decode
# selection runs inside SGLang's decode CUDA graphs (sgl_sparse/query_device.py).
QUERY_AWARE = ("quest", "asyncspade", "lfps")

# The resolved server config travels to SGLang's scheduler processes through the
# environment: they are spawned after argument parsing and inherit it, and it also
# works for `sglang.Engine(...)` users who never touch the CLI.
ENV_CONFIG = "SGLSPARSE_CONFIG_JSON"

# Where the request's policy lives inside SamplingParams.custom_params.
REQUEST_KEY = "sparse"
REQUEST_FIELD_PREFIX = f"custom_params.{REQUEST_KEY}"


class _Strict(BaseModel):
    # strict: a JSON string "12" or a bool must not silently become an int window.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FullPolicy(_Strict):
    """Dense attention over the whole KV cache: identical to SGLang's stock backends."""

    policy: Literal["full"] = "full"


class StreamingPolicy(_Strict):
    """StreamingLLM: the first `sink` tokens plus the last `window` tokens."""

    policy: Literal["streaming"] = "streaming"
    window: int = Field(1024, ge=1, le=1 << 24, description="recent tokens attended")
    sink: int = Field(4, ge=0, le=1 << 16, description="first tokens always attended")


class SadasPolicy(_Strict):
    """SADAS: sliding window until the first `</think>`, full attention after (latched)."""

    policy: Literal["sadas"] = "sadas"
    window: int = Field(2048, ge=1, le=1 << 24, description="window while thinking")
    sink: int = Field(4, ge=0, le=1 << 16, description="sink tokens kept in window mode [ours]")


class SfiPolicy(_Strict):
    """Slow-Fast Inference (ALGORITHMS.md §1): sink + Selector-chosen memory + recent
    window on fast steps; a dense slow step refreshes the memory on sentence
    boundaries and at least every `t_max` steps. Defaults marked [ours] are this
    project's choices, not the paper's numbers."""

    policy: Literal["sfi"] = "sfi"
    budget: int = Field(2048, ge=1, le=1 << 20, description="K: selected tokens per KV head [ours]")
    recent: int = Field(256, ge=0, le=1 << 20, description="recent tokens always attended (paper)")
    sink: int = Field(4, ge=0, le=1 << 16, description="first tokens always attended [ours]")
    t_max: int = Field(64, ge=0, le=1 << 20,
                       description="refresh budget: slow step after t_max fast steps in a row [ours]")
    sentence_triggers: bool = Field(True, description="slow step after a sentence-ending token")
    min_saving: float = Field(
        0.0, ge=0, lt=1, description="fast steps attend sparsely only from the length at which sink + budget "
        "+ recent skip at least this share of the sequence; until then the request decodes densely (through "
        "the stock kernel) and runs no Selector [ours: 0, the paper's rule, sparse as soon as the budget stops "
        "covering the sequence: H200, e4m3, every row with a compact slot, stock in the same call, sparse "
        "from 2308 keys ran 1.12x stock at 2048 x 64 (97% of the keys read; 0.98x kept dense), 1.46x per step at "
        "3072 x 64, 1.84x at 4096 x 64; bench/README.md, session 51. A value above 0 keeps short requests "
        "on the stock kernel]")
    refresh_groups: int = Field(
        2, ge=1, le=1 << 16, description="requests admitted together are dealt round-robin into this "
        "many refresh phases, evenly spaced over the t_max + 1 steps of a refresh period (the first "
        "interval shortened, never longer than t_max), so that a step carries the budget refreshes of "
        "one group instead of every request's [ours: 2. A step holding one group's slow (dense) "
        "requests beside the others' fast ones waits for them in the decode kernel, so more groups "
        "trade throughput for a shorter slowest step: H200, 8192 x 32, e4m3, one refresh in 32 steps, "
        "stock in the same call, the server's p99 decode step over stock's mean step 1.31x with 1 group "
        "(every request refreshing on the same step), 0.91x with 2, 0.70x with 4, for 2.269x, 2.244x and "
        "2.194x stock throughput; bench/README.md, session 58]")
    w_prefill: int = Field(32, ge=1, le=256,
                           description="queries in the first slow step's evidence window [ours]")
    prompt_evidence: Literal["first", "every"] = Field(
        "first", description="the prompt's last w_prefill - 1 queries are evidence at the first slow step "
        "only (ALGORITHMS.md) or at every slow step [ours: a later refresh keeps what the prompt's last "
        "queries attend to, at w_prefill queries' cost and without the stored-logits shortcut]")
    beta: float = Field(0.5, gt=0, le=16, description="evidence power-mean exponent [ours]")
    alpha: float = Field(1.0, ge=0, le=100, description="prior: recency decay strength [ours]")
    kappa: float = Field(2.0, gt=0, le=100, description="prior: recency decay shape [ours]")
    zeta: float = Field(0.5, ge=0, le=100, description="prior: tail-brake exponent [ours]")
    clip: float = Field(0.02, ge=0, le=1, description="fusion weight clip c (paper's best)")
    nms_gamma: float = Field(0.5, ge=0, le=10, description="Soft-NMS strength (paper's best)")
    nms_radius: int = Field(2, ge=0, le=64, description="Soft-NMS radius [ours]")
    excl_eta: float = Field(0.35, ge=0, le=10, description="cross-head exclusivity strength (paper's best)")
    excl_tau: float = Field(1.0, gt=0, le=100, description="cross-head exclusivity temperature [ours]")
    eps: float = Field(1e-12, gt=0, le=1e-3, description="log-score / tail-brake epsilon")


QUEST_PAGE = 16  # tokens per page, as in the Quest paper


class QuestPolicy(_Strict):
    """Quest (baseline): per-page min/max key bounds; each step, every KV head keeps
    the budget/16 pages whose upper bound of q.k is largest (plus sink and recent)."""

    policy: Literal["quest"] = "quest"
    budget: int = Field(2048, ge=QUEST_PAGE, le=1 << 20, multiple_of=QUEST_PAGE,
                        description="selected tokens per KV head: budget/16 pages of 16")
    sink: int = Field(4, ge=0, le=1 << 16, description="first tokens always attended [ours]")
    recent: int = Field(64, ge=1, le=1 << 20, description="last tokens always attended [ours]")
    min_saving: float = Field(
        0.0, ge=0, lt=1, description="indexed steps only from the length at which sink + budget + recent "
        "skip at least this share of the sequence; until then the request decodes densely [ours: 0, the "
        "paper's rule; quest at 2048 x 64, H200, e4m3: 1.09x stock sparse, 0.95x kept dense by 0.5; bench/README.md, "
        "session 51]")


class AsyncSpadePolicy(_Strict):
    """AsyncSpade (ALGORITHMS.md §4): the next query is predicted from the last
    `window` queries; the Top-`budget` keys it scores highest are attended at the
    next step (plus sink and recent). The first decode step is dense."""

    policy: Literal["asyncspade"] = "asyncspade"
    window: int = Field(4, ge=1, le=32,
                        description="W: past queries the next query is regressed from [ours; the paper's figure uses 4]")
    budget: int = Field(2048, ge=1, le=1 << 20, description="K: selected tokens per KV head (paper's 2k setting)")
    ridge: float = Field(1e-2, gt=0, le=100,
                         description="ridge eps, relative to the mean squared query norm [ours]")
    sink: int = Field(4, ge=0, le=1 << 16, description="first tokens always attended [ours]")
    recent: int = Field(64, ge=1, le=1 << 20, description="last tokens always attended [ours]")
    min_saving: float = Field(
        0.0, ge=0, lt=1, description="indexed steps only from the length at which sink + budget + recent "
        "skip at least this share of the sequence; until then the request decodes densely [ours: 0, the "
        "paper's rule; quest at 2048 x 64, H200, e4m3: 1.09x stock sparse, 0.95x kept dense by 0.5; bench/README.md, "
        "session 51]")


class LfpsPolicy(_Strict):
    """LFPS (ALGORITHMS.md §3): candidates from vertical/slash score tables learned
    from past attention, exact q.k on the candidates, Top-`budget`; a head whose
    attention is estimated to sit on the sink outputs the mean prefill value."""

    policy: Literal["lfps"] = "lfps"
    s: int = Field(32, ge=1, le=256, description="prefill queries that initialize the tables (paper)")
    a: float = Field(0.2, gt=0, le=10, description="threshold scale; the paper uses 0.2 or 0.3")
    r: float = Field(0.95, gt=0, lt=1, description="table decay (paper)")
    eps: float = Field(0.85, gt=0, le=1, description="sink-bypass threshold on the head sparsity (paper)")
    budget: int = Field(2048, ge=1, le=1 << 20, description="k: Top-k of the candidates per KV head [ours]")
    sink: int = Field(4, ge=0, le=1 << 16, description="first tokens always attended (paper: 4)")
    local: int = Field(6, ge=1, le=1 << 16,
                       description="keys before the current one in w_local, also always attended (paper: 6)")
    min_saving: float = Field(
        0.0, ge=0, lt=1, description="indexed steps only from the length at which sink + budget + local + 1 "
        "skip at least this share of the sequence; until then the request decodes densely [ours: 0, the "
        "paper's rule; quest at 2048 x 64, H200, e4m3: 1.09x stock sparse, 0.95x kept dense by 0.5; bench/README.md, "
        "session 51]")


RequestPolicy = Annotated[
    Union[FullPolicy, StreamingPolicy, SadasPolicy, SfiPolicy, QuestPolicy, AsyncSpadePolicy, LfpsPolicy],
    Field(discriminator="policy"),
]
_POLICY_MODELS: dict[str, type[_Strict]] = {
    "full": FullPolicy,
    "streaming": StreamingPolicy,
    "sadas": SadasPolicy,
    "sfi": SfiPolicy,
    "quest": QuestPolicy,
    "asyncspade": AsyncSpadePolicy,
    "lfps": LfpsPolicy,
}


class PolicyDefaults(_Strict):
    """Server-wide defaults per policy; a request overrides any subset of them."""

    streaming: StreamingPolicy = StreamingPolicy()
    sadas: SadasPolicy = SadasPolicy()
    sfi: SfiPolicy = SfiPolicy()
    quest: QuestPolicy = QuestPolicy()
    asyncspade: AsyncSpadePolicy = AsyncSpadePolicy()
    lfps: LfpsPolicy = LfpsPolicy()


class CompactBufferConfig(_Strict):
    """SFI's compact K/V buffers, reserved once at start-up out of SGLang's KV pool
    budget (the pool holds fewer tokens; sgl_sparse/store_budget.py).

    Bytes = slots x layers x KV heads x capacity x head_dim x 2 (K and V) x dtype
    size; e.g. Qwen3-1.7B, 16 slots, capacity 2052: 3.8 GB over bf16 (with
    `selections: slot_lists`, x 4 bytes instead of x head_dim x 2 x dtype size: 29 MB).
    An `sfi` request that
    finds no free slot is served dense (metric reason `no_compact_slot`).

    `slow_logits_context` > 0 also reserves, per slot and layer, the fp32 logits of
    the slow step's query for the first `slow_logits_context` positions: the slow
    step's dense attention stores them while it reads the keys, and the Selector's
    evidence (after the first slow step) reads those instead of every key again.
    Bytes = slots x layers x query heads x slow_logits_context x 4; e.g.
    Qwen3-1.7B, 16 slots, 32768: 0.94 GB. Longer requests, and a request's first
    slow step (its window holds prompt queries), re-read the keys.
    """

    slots: int = Field(16, ge=0, le=4096, description="concurrent sfi requests served sparse")
    capacity: int = Field(2052, ge=1, le=1 << 20, description="max sink + budget per request")
    # What a slot holds of its sink + selected tokens (sgl_sparse/compact.py): their K/V
    # copied ("packed", contiguous loads on fast steps), or their KV-pool slots
    # ("slot_lists": 4 bytes a token and KV head instead of 2 x head_dim elements --
    # Qwen3-1.7B, 16 slots, capacity 2052: 29 MB instead of 3.8 GB over bf16 -- the
    # refresh writes no copy, and fast steps gather the rows from the pool as
    # asyncspade's lists do). The attention is the same keys in the same order.
    selections: Literal["packed", "slot_lists"] = Field(
        "packed", description="segment A per slot: packed K/V copies, or KV-pool slot lists read in place")
    slow_logits_context: int = Field(
        0, ge=0, le=1 << 22, description="longest slow step whose logits are kept for the Selector (0: off)")
    # A Selector run's host work (~2.6 ms on the H100 whatever its rows) replayed from
    # CUDA graphs captured per (rows, length) bucket (sgl_sparse/selector/graphs.py):
    # on by default; off runs every refresh eagerly, as before session 15.
    refresh_graphs: bool = Field(True, description="replay the SFI refresh from CUDA graphs (GPU only)")
    # A decode step where an SFI row may be slow (dense) beside fast ones: the decode
    # kernel spreads that row over more programs (kernels.balanced_splits) instead of
    # one program per KV head reading its whole context while the rest of the GPU
    # waits. Its own decode graph per batch size (graph_variants.KERNEL_BALANCED),
    # replayed only for such steps: the larger grid costs 8-13% where every row is
    # alike (H100, bench/README "Session 15"). Also for a step whose rows are all SFI
    # slow steps where balancing gives them more programs (long rows over fp8:
    # kernels.dense_step_balances; e4m3, 28 layers: 131072 x 4 14.6 -> 10.3 ms,
    # 32768 x 8 7.6 -> 5.3).
    # And for a batch of dense rows (full, covering windows) and sparse ones joined on
    # the kernel (graph_variants.joins), with or without SFI slots.
    balance_splits: bool = Field(True, description="balance the decode kernel's splits on steps that may "
                                                   "hold an SFI slow step among fast ones, on all-slow "
                                                   "steps of long rows over an fp8 cache, and on batches "
                                                   "of dense and sparse rows joined on the kernel (GPU only)")


class QueryStoreConfig(_Strict):
    """Per-request storage of one query-aware policy, reserved once at start-up out of
    SGLang's KV pool budget (sgl_sparse/query_store.py, store_budget.py; README
    "Query-aware policies" gives the bytes).
    A request that finds no free slot (reason `no_store_slot`), or whose sequence
    grows past `max_context` (reason `context_exceeds_store`), is served dense."""

    slots: int = Field(8, ge=0, le=4096, description="concurrent requests of this policy served sparse")
    max_context: int = Field(32768, ge=QUEST_PAGE, le=1 << 22, description="longest sequence served sparse")
    capacity: int = Field(2052, ge=1, le=1 << 20, description="max sink + budget per request")
    # LFPS only: candidates scored exactly per KV head and step (a fixed buffer, so
    # that no shape depends on data); the paper's |C1| is a few % of the context.
    candidates: int = Field(8192, ge=1, le=1 << 22, description="LFPS: max |C1| scored per KV head")
    # With decode CUDA graphs on, the selection is captured into the decode graphs;
    # each batch size then also gets a graph with it (graph_variants.py), and batches
    # without such requests replay one without it (H100: `full` 0.96-0.99x stock beside
    # all three, bench/README "Session 8"). Opt-in still: the stores' memory, one more
    # graph per size and its capture time are paid by a server that may never see them.
    cuda_graphs: bool = Field(False, description="offer the policy with decode CUDA graphs on (its "
                                                 "selection captured, run at every decode step)")


class AsyncSpadeStoreConfig(QueryStoreConfig):
    # [ours] AsyncSpade scores every key of the context each step: on one GPU that pass
    # reads half the KV cache's bytes and bounds its TPOT (bench/README, "Session 17").
    # int8 copies with a per-(position, KV head) scale halve those bytes (and are read
    # contiguously); the Top-K then ranks approximate scores (kernels/index_keys.py).
    # int4: 4-bit codes of the keys divided by per-channel powers of two taken from the
    # prompt, about half int8's bytes again.
    index_keys: Literal["kv", "int8", "int4"] = Field(
        "kv", description="keys the scoring pass reads: the KV cache's ('kv'), or copies kept per slot: "
                          "'int8' (slots x layers x KV heads x max_context x (head_dim + 4) bytes more) or "
                          "'int4' (x (head_dim / 2 + 4) bytes, channels smoothed by the prompt's keys)")
    # [ours] A layer's Top-K over 64 rows of 32K scores (8 slots x 8 KV heads) leaves
    # most of the GPU idle and is latency-bound (126 us a layer on the H200, session
    # 20's profile: the side stream's largest cost). A layer's selection is for the
    # next step, so the Top-Ks of several layers can run as one launch over all their
    # rows, after the last one's scoring; their scores are kept until then. H200,
    # session 21: 74 -> 41 us a layer at 14 layers a launch (37 at 28); end to end at
    # 32768 x 8 (28 layers) 14 gave 1.251x stock against 1.233x per layer, and the
    # first group overlaps the later layers, where 28 would all run after the last.
    topk_layers: int = Field(14, ge=1, le=1024,
                             description="layers whose next-step Top-K runs as one launch (decode on a GPU; "
                                         "their scores are kept: topk_layers x slots x KV heads x max_context x "
                                         "4 bytes more)")
    # [ours] The scoring pass's programs per SM, on its side stream beside the main
    # stream's layers; each walks a share of the rows for the whole launch. Session 21
    # measured 2 a SM ahead of 4 (1.272x stock against 1.251x), but then a program took
    # 249 registers and only 2 fit an SM, so 4 a SM ran in two waves. With ~96 registers
    # (session 22, H200, 32768 x 8, same run): 4 a SM 1.396x stock, 2 a SM 1.321x; the
    # pass alone 74 us a layer (3.7 TB/s) against 112-123 before.
    score_programs_per_sm: int = Field(4, ge=1, le=16,
                                       description="programs of the scoring pass per SM (decode on a GPU; "
                                                   "fewer leave room for the main stream's kernels beside it)")
    # [ours] Persistent programs (above) hold every SM's registers for the whole pass
    # (~70 us a layer), so the main stream's kernels forked beside it wait until it
    # ends: session 24's profile had the two streams busy 3.04 and 2.93 ms a step and
    # overlapping for 0.43. Short programs of B blocks of 128 positions each (64 when
    # scoring the KV cache's keys) leave SMs free every few microseconds, and the main
    # stream, captured at a higher priority (query_device.ASPD_HIGH_PRIORITY_MAIN), takes
    # them first. H200, 32768 x 8, 4-bit copies, end to end (session 25): B = 4 1.862-
    # 1.865x stock in two runs, B = 2 1.801x, B = 8 1.776x, persistent 1.762x; the
    # streams overlap 2.66 ms a step instead of 0.43. Without the priority B = 4 loses
    # (1.585x against persistent's 1.610x): the scheduler then hands freed SMs to the
    # scoring's next programs. int8 and KV keys: not measured with it.
    score_blocks_per_program: int = Field(4, ge=0, le=4096,
                                          description="B > 0: one scoring program per B blocks of positions, "
                                                      "short enough for the main stream's kernels to run beside "
                                                      "them; 0: persistent programs (score_programs_per_sm), "
                                                      "which hold the SMs for the whole pass")
    # ALGORITHMS.md §4 (b): the paper runs the selection on a "cache rank", a GPU of its
    # own. On the serving GPU the side stream's scoring and Top-K read HBM beside the
    # main stream's step, which also reads HBM: at 32768 x 8 they hid at most 31% of
    # each other (bench/README "Session 25"), and asyncspade stayed above quest. Here
    # the side stream runs on another GPU of the same host: its copies of the keys,
    # scores and Top-K scratch live there, and its kernels read the step's queries and
    # keys and write the selections in the serving GPU's memory over NVLink (peer
    # access). Attention tensor parallel 1 only (one cache GPU per serving GPU).
    cache_device: Optional[str] = Field(
        None, pattern=r"^cuda:[0-9]+$",
        description="[ours] 'cuda:N': run the next-step selection (scoring, Top-K) on this GPU, beside the one "
                    "serving (peer access between them required; attention TP 1); its copies, scores and "
                    "Top-K scratch are allocated there, not from the serving GPU's memory. Unset: the serving GPU")


class QueryAwareConfig(_Strict):
    quest: QueryStoreConfig = QueryStoreConfig()
    asyncspade: AsyncSpadeStoreConfig = AsyncSpadeStoreConfig()
    lfps: QueryStoreConfig = QueryStoreConfig()


class SparseServerConfig(_Strict):
    default_policy: Literal["full", "streaming", "sadas", "sfi", "quest", "asyncspade", "lfps"] = "full"
    policies: PolicyDefaults = PolicyDefaults()
    compact: CompactBufferConfig = CompactBufferConfig()
    query_aware: QueryAwareConfig = QueryAwareConfig()
    # SFI's trigger set: vocabulary ids whose decoded text ends with one of these.
    trigger_suffixes: tuple[str, ...] = (".", "?", "!", ";", "\n", "。", "？", "！", "；")
    # Or the ids themselves, one per line ('#' comments): for servers whose tokenizer
    # cannot be loaded by the plugin (e.g. --skip-tokenizer-init).
    trigger_ids_path: Optional[str] = None
    # Control tokens for SADAS. Looked up in the tokenizer at start-up; ids may be
    # given directly for tokenizers that spell them differently.
    think_start_token: str = "<think>"
    think_end_token: str = "</think>"
    think_start_id: Optional[int] = Field(None, ge=0)
    think_end_id: Optional[int] = Field(None, ge=0)
    # Filled at start-up, not by users: policies this server cannot run, with why,
    # and the device the server runs on.
    unavailable: dict[str, str] = Field(default_factory=dict)
    device: Optional[str] = None
    metrics: bool = False  # --enable-metrics
    model_name: str = ""  # the `model_name` label of the metrics
    tokenizer_path: Optional[str] = None  # for SFI's trigger set, built per scheduler
    trust_remote_code: bool = False

    def defaults_for(self, name: str) -> dict[str, Any]:
        model = getattr(self.policies, name, None)
        return model.model_dump() if model is not None else {"policy": name}

    def unavailable_reason(self, name: str) -> Optional[str]:
        if name == "sadas" and (self.think_start_id is None or self.think_end_id is None):
            return "the tokenizer has no single-id think tokens (set think_start_id/think_end_id)"
        return self.unavailable.get(name)


class SparseConfigError(ValueError):
    """A bad flag, config file or request field. The message names the field;
    `reason` is a bounded label for metrics (the field, or 'unknown_field'/'type')."""

    def __init__(self, message: str, reason: str = "other"):
        super().__init__(message)
        self.reason = reason


def _reason(err: ValidationError) -> str:
    e = err.errors()[0]
    if e["type"] == "extra_forbidden":
        return "unknown_field"
    return str(e["loc"][-1]) if e["loc"] else "other"


def format_validation_error(err: ValidationError, prefix: str) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{field}: {msg} (got {e.get('input')!r})")
    return "; ".join(parts)


def _check_policy_name(raw: Mapping[str, Any], prefix: str, server: SparseServerConfig) -> str:
    name = raw.get("policy")
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise SparseConfigError(
            f"{prefix}.policy: must be one of {', '.join(POLICY_NAMES)} (got {name!r})", "policy"
        )
    why = server.unavailable_reason(name)
    if why:
        available = [p for p in POLICY_NAMES if not server.unavailable_reason(p)]
        raise SparseConfigError(
            f"{prefix}.policy: {name!r} is not available on this server: {why} "
            f"(available: {', '.join(available)})", "policy"
        )
    return name


def parse_request_policy(
    raw: Any, server: SparseServerConfig, prefix: str = REQUEST_FIELD_PREFIX
) -> RequestPolicy:
    """Request metadata -> a complete, validated policy (server defaults filled in)."""
    if raw is None:
        raw = {"policy": server.default_policy}
    if isinstance(raw, str):  # shorthand: {"sparse": "streaming"}
        raw = {"policy": raw}
    if not isinstance(raw, Mapping):
        raise SparseConfigError(
            f"{prefix}: must be an object like {{\"policy\": \"streaming\", \"window\": 1024}} "
            f"(got {type(raw).__name__})", "type"
        )
    raw = dict(raw)
    raw.setdefault("policy", server.default_policy)
    name = _check_policy_name(raw, prefix, server)
    merged = {**server.defaults_for(name), **raw}
    try:
        spec = _POLICY_MODELS[name].model_validate(merged)
    except ValidationError as e:
        raise SparseConfigError(format_validation_error(e, prefix), _reason(e)) from None
    if isinstance(spec, SfiPolicy) and spec.w_prefill > server.policies.sfi.w_prefill:
        raise SparseConfigError(
            f"{prefix}.w_prefill: {spec.w_prefill} exceeds this server's policies.sfi.w_prefill "
            f"{server.policies.sfi.w_prefill} (the query buffers are sized by it)", "w_prefill",
        )
    if isinstance(spec, SfiPolicy) and spec.sink + spec.budget > server.compact.capacity:
        raise SparseConfigError(
            f"{prefix}.budget: sink + budget = {spec.sink + spec.budget} exceeds this server's "
            f"compact buffer capacity {server.compact.capacity} (compact.capacity in --sparse-config)",
            "budget",
        )
    if spec.policy in QUERY_AWARE:
        _check_query_store(spec, server, prefix)
    return spec


def _check_query_store(spec, server: SparseServerConfig, prefix: str) -> None:
    """Knobs bounded by the storage the server reserved for the policy."""
    store: QueryStoreConfig = getattr(server.query_aware, spec.policy)
    if spec.sink + spec.budget > store.capacity:
        raise SparseConfigError(
            f"{prefix}.budget: sink + budget = {spec.sink + spec.budget} exceeds this server's "
            f"query_aware.{spec.policy}.capacity {store.capacity} (in --sparse-config)", "budget",
        )
    if isinstance(spec, AsyncSpadePolicy) and spec.window > server.policies.asyncspade.window:
        raise SparseConfigError(
            f"{prefix}.window: {spec.window} exceeds this server's policies.asyncspade.window "
            f"{server.policies.asyncspade.window} (the query windows are sized by it)", "window",
        )


def load_server_config(
    path: Optional[str] = None, default_policy: Optional[str] = None
) -> SparseServerConfig:
    """--sparse-config file (YAML or JSON) plus --sparse-default-policy -> config."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise SparseConfigError(f"--sparse-config: file not found: {path!r}")
        try:
            loaded = yaml.safe_load(p.read_text())  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise SparseConfigError(f"--sparse-config: {path!r} is not valid YAML/JSON: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SparseConfigError(
                f"--sparse-config: top level of {path!r} must be a mapping (got {type(loaded).__name__})"
            )
        data = loaded
    if default_policy is not None:
        data = {**data, "default_policy": default_policy}
    try:
        # Config files are written by hand: accept YAML's lax scalars (non-strict).
        return SparseServerConfig.model_validate(data, strict=False)
    except ValidationError as e:
        where = f"--sparse-config {path}" if path else "--sparse-default-policy"
        raise SparseConfigError(f"{where}: {format_validation_error(e, '')}") from None


def export_to_env(cfg: SparseServerConfig) -> None:
    os.environ[ENV_CONFIG] = cfg.model_dump_json()


def config_from_env() -> SparseServerConfig:
    """The resolved server config; parsed once per distinct value (hot path: every request)."""
    raw = os.environ.get(ENV_CONFIG)
    return _parse_config(raw) if raw else SparseServerConfig()


@functools.lru_cache(maxsize=8)
def _parse_config(raw: str) -> SparseServerConfig:
    return SparseServerConfig.model_validate(json.loads(raw), strict=False)  # frozen: safe to share
