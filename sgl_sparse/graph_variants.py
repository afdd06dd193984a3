"""Decode CUDA graphs per batch size, one per attention path a batch can need.

A decode step serves each row through SGLang's FlashInfer decode (`full`, windows that
cover the sequence, ...) or through our two-segment kernel (sparse rows), and with
`query_aware.<policy>.cuda_graphs: true` also runs the quest/asyncspade/lfps selection.
Without CUDA-graph conditional nodes (torch 2.11, graph_gate.py) whatever a graph holds
runs at every replay: the two-segment launch whose programs all exit (28 launches,
~0.07 ms a step at 2048 x 64, bench/README "2048 x 64 profiled"), FlashInfer's launch
and host-side plan for rows it does not serve, or ~25 near-empty query-aware launches
per layer (11-25% of a `full` batch's throughput, "Session 8").

SGLang's decode graph runner keys its graphs by a variant label beside the batch size
(its LoRA / no-LoRA pair, DSA's dense / sparse pair). These hooks add ours:

- `qa`: both paths and the query-aware blocks (a batch with a quest/asyncspade/lfps row);
- `qa_quest`, `qa_asyncspade`, `qa_lfps` (where more than one of them is captured):
  both paths and that policy's blocks alone, for a batch whose query-aware rows are
  all of it. `qa` holds every offered policy's blocks, which return at once for a
  policy without a row but still cost a launch and the gap after it each: on the H100
  at 32768 x 1, a quest batch replaying `qa` with asyncspade also offered ran 780
  kernels a step against stock's 383, 26% of its span idle (bench/README, "Session 18");
- `qa_kernel`, `qa_<policy>_kernel`: the same query-aware blocks with the two-segment
  kernel alone, for a batch whose rows the host routes all to it (every query-aware row
  indexed, no `full` row): no FlashInfer launch or plan. A `qa` graph's FlashInfer
  launch over its one-key rows took 13 us a layer on the H200 at 32768 x 8 (0.36 ms a
  lfps or asyncspade step, bench/README "Session 32"). A row the device still finds
  dense (the host's twin of its decision disagreeing) has B = [0, n): the kernel attends
  it all;
- `qa_kernel_balanced`, `qa_<policy>_kernel_balanced` (with `compact.balance_splits`;
  SGLANG_SPARSE_QA_JOIN=0 drops them): the kernel-only twins with the kernel's splits
  balanced, for a query-aware batch with rows for the stock kernel too (`full`,
  covering windows), joined on the kernel as `joins` does for batches without
  query-aware rows; also the twin a kernel-only query-aware batch that may hold an SFI
  slow step replays. A plain grid would wait on the dense rows (32768 x 8 over e4m3, 4
  of 8 rows dense: 6.76 ms plain against 3.16 balanced, kernel level, session 52).
  Served against the split in one call (session 56, H200, bf16, half `full` and half
  quest / asyncspade): 1.155x / 1.193x the split at 8192 x 32, 1.021x / 1.004x at
  32768 x 8, for 0.06 GB and no time more of graph capture. The step's shares count a
  query-aware row's segment B only: its A is selected within each layer, after them;
- `mixed`: both paths (rows of each kind). Unless SGLANG_SPARSE_MIXED_ONE_LAUNCH=0 a
  batch of both kinds without query-aware rows does not replay it: its stock-kernel
  rows join the kernel's (`joins`), and it replays `kernel` (`kernel_balanced`). Each
  half of a mixed step ran at a fraction of its bandwidth: at 3072 x 64 over e4m3
  (H200, session 52, `profile_decode`) FlashInfer took 3.93 ms a step for 32 rows
  against 5.37 for all 64, the kernel 2.37 ms for the other 32 against 2.51 for 64
  (both grids sized for the whole batch), and served the mix ran 0.87x stock where
  all `full` ran 0.99x and all `sfi` 1.48x; joined it serves at 1.24x (1.23x at
  8192 x 32, where split it ran 0.91x: session 53);
- `dense`: FlashInfer alone, the stock graph plus our plan launch (every row dense);
- `kernel`: the two-segment kernel alone, no FlashInfer launch and no FlashInfer plan
  on the host (every row sparse; CUDA-graph padding rows then go to the kernel too,
  which reads their one key as FlashInfer would: they are state row 0, always `full`).

Capture: every batch size once per variant, largest graph first so the later ones
reuse its memory pool (`SparseAttnBackend.capturing_graph_variant`). Replay: the
backend's metadata init of the forward takes the batch's routing (`set_step_rows`),
chooses the variant (`choose`), plans FlashInfer into that variant's wrappers or skips
it, and the runner's variant choice, which SGLang makes after that init, appends it
(`SparseAttnBackend.step_graph_variant`).

Switches: SGLANG_SPARSE_QA_GRAPH_VARIANTS=0 captures one graph with the query-aware
blocks for every batch (no `mixed` / `dense` / `kernel`); SGLANG_SPARSE_ROUTE_VARIANTS=0
drops `dense` and `kernel`, so both paths launch at every step (the behaviour before);
SGLANG_SPARSE_QA_POLICY_VARIANTS=0 drops the per-policy `qa_<policy>` graphs (every
query-aware batch replays `qa`, the behaviour before session 18);
SGLANG_SPARSE_QA_KERNEL_VARIANTS=0 drops the kernel-only twins of the query-aware ones
(both paths at every query-aware step, the behaviour before session 32);
SGLANG_SPARSE_QA_JOIN=0 drops their balanced twins (above; a query-aware batch with
`full` rows then runs both paths, split).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Optional, Sequence

from sgl_sparse.kernels._utils import env_switch
from sgl_sparse import compat
from sgl_sparse.policies.base import PolicyId

QA_ENABLED = env_switch("QA_GRAPH_VARIANTS", True)
ROUTE_ENABLED = env_switch("ROUTE_VARIANTS", True)
QA_POLICY_ENABLED = env_switch("QA_POLICY_VARIANTS", True)
QA_KERNEL_ENABLED = env_switch("QA_KERNEL_VARIANTS", True)
MIXED_ONE_LAUNCH = env_switch("MIXED_ONE_LAUNCH", True)
QA_JOIN = env_switch("QA_JOIN", True)

QA, MIXED, DENSE, KERNEL = "qa", "mixed", "dense", "kernel"
# KERNEL with the kernel's splits balanced across requests (a step that may hold an
# SFI slow step among fast ones: SparseState.step_balance); its own graph because
# the balanced launch has a larger grid, which costs where every row is alike.
KERNEL_BALANCED = "kernel_balanced"
_LABEL_PREFIX = "sgl_sparse_"
#: The variant label's position in capture_one_shape(size, forward, stream_idx,
#: variant_label, ...) after `forward` (both supported SGLang versions).
_LABEL_ARG = 1


def qa_of(policy: PolicyId) -> str:
    """The variant with `policy`'s query-aware blocks alone."""
    return f"{QA}_{policy.name.lower()}"


#: A query-aware variant's kernel-only twin: its name and this suffix.
KERNEL_ONLY_SUFFIX = "_" + KERNEL


def kernel_only(variant: str) -> str:
    """The kernel-only twin of a query-aware variant."""
    return variant + KERNEL_ONLY_SUFFIX


#: A kernel-only query-aware variant's balanced twin: its name and this suffix.
BALANCED_SUFFIX = "_balanced"


def balanced_twin(variant: str) -> str:
    """The balanced twin of a kernel-only query-aware variant."""
    return variant + BALANCED_SUFFIX


def is_kernel_only(variant: Optional[str]) -> bool:
    """Whether `variant` is a query-aware variant's kernel-only twin (or its balanced twin)."""
    return is_qa(variant) and (variant.endswith(KERNEL_ONLY_SUFFIX)
                               or variant.endswith(KERNEL_ONLY_SUFFIX + BALANCED_SUFFIX))


def is_balanced(variant: Optional[str]) -> bool:
    """Whether `variant` runs the kernel alone with its splits balanced: KERNEL_BALANCED
    or a query-aware variant's balanced twin."""
    return variant == KERNEL_BALANCED or (is_kernel_only(variant) and variant.endswith(BALANCED_SUFFIX))


def is_qa(variant: Optional[str]) -> bool:
    """Whether `variant` holds query-aware blocks (`qa` or a `qa_<policy>`)."""
    return variant is not None and (variant == QA or variant.startswith(QA + "_"))


def qa_policies(variant: Optional[str]) -> Optional[frozenset[PolicyId]]:
    """The query-aware policies whose blocks a capture of `variant` holds; None: every
    offered one (`qa`, or no variant at all: eager forwards, one unlabelled graph)."""
    if variant is None or not is_qa(variant):
        return None
    if variant.endswith(BALANCED_SUFFIX):
        variant = variant[: -len(BALANCED_SUFFIX)]
    if variant.endswith(KERNEL_ONLY_SUFFIX):
        variant = variant[: -len(KERNEL_ONLY_SUFFIX)]
    if variant == QA:
        return None
    return frozenset({PolicyId[variant[len(QA) + 1:].upper()]})


def route_of(mask: Sequence[int]) -> str:
    """The attention paths a decode batch needs, from its per-row routing (0 =
    FlashInfer serves the row, 1 = the two-segment kernel, 2 = FlashInfer attends
    and the kernel records SFI's key norms)."""
    if not any(mask):
        return DENSE
    if all(m == 1 for m in mask):
        return KERNEL
    return MIXED


def joins(mask: Sequence[int], enabled: Optional[bool] = None) -> bool:
    """Whether a decode batch with this routing runs every row on the two-segment
    kernel (MIXED_ONE_LAUNCH): it has kernel rows (1) and rows for the stock kernel (0,
    2). Their device plan attends the whole sequence (B = [0, n), A empty), which the
    kernel reads as FlashInfer would, to rounding. A batch with no kernel row stays on
    FlashInfer: the stock backend's exact output where every row is dense."""
    if not (MIXED_ONE_LAUNCH if enabled is None else enabled):
        return False
    return 1 in mask and any(m != 1 for m in mask)


def wanted(backend: Any, route: bool = ROUTE_ENABLED, qa: bool = QA_ENABLED,
           balance: Optional[bool] = None, qa_kernel: bool = QA_KERNEL_ENABLED,
           qa_join: Optional[bool] = None) -> tuple[str, ...]:
    """The variants `backend` (a SparseAttnBackend) captures per batch size, largest
    graph first; () for one unlabelled graph per size."""
    if backend.dense is None or not compat.has_dense_decode_graph_wrappers(backend.dense):
        return ()
    if balance is None:
        balance = bool(getattr(backend, "balance_splits", False))
    qa_store = getattr(backend, "qa", None)
    device = qa_store.device if qa_store is not None else None
    out = [QA] if device is not None else []
    if device is not None and qa and QA_POLICY_ENABLED and len(device.policies) > 1:
        out += [qa_of(p) for p in device.policies]
    if out and qa and route and qa_kernel:
        twins = [kernel_only(v) for v in out]
        out += twins
        if balance and (QA_JOIN if qa_join is None else qa_join):
            out += [balanced_twin(v) for v in twins]
    if not out or qa:
        out.append(MIXED)
    if route:
        out += [DENSE, KERNEL]
        if balance:
            out.append(KERNEL_BALANCED)
    return tuple(out) if len(out) > 1 else ()


def choose(captured: Sequence[str], query_aware: bool, route: str, balance: bool = False,
           policies: AbstractSet[PolicyId] = frozenset()) -> str:
    """The captured variant a batch replays: when it holds a query-aware row, the
    graph with those rows' policy alone (`policies`: the batch's query-aware ones) if
    captured, else the one with them all (or, when that graph is all there is, it),
    its kernel-only twin where the batch's route is KERNEL and the twin is captured
    (that twin's balanced one where the batch wants `balance` and it is captured);
    otherwise the graph of its route when
    captured (KERNEL_BALANCED for a kernel-only batch that wants `balance`, when
    captured), else the one with both paths (MIXED when nothing is captured: one
    unlabelled graph per size, with both paths)."""
    if not captured:
        return MIXED
    if query_aware:
        pick = None
        if len(policies) == 1 and qa_of(next(iter(policies))) in captured:
            pick = qa_of(next(iter(policies)))
        elif QA in captured:
            pick = QA
        if pick is not None:
            if route != KERNEL or kernel_only(pick) not in captured:
                return pick
            twin = balanced_twin(kernel_only(pick))
            return twin if balance and twin in captured else kernel_only(pick)
    if route == KERNEL and balance and KERNEL_BALANCED in captured:
        return KERNEL_BALANCED
    if route in captured:
        return route
    return MIXED if MIXED in captured else QA


def qa_joins(captured: Sequence[str], policies: AbstractSet[PolicyId]) -> bool:
    """Whether a query-aware batch (its rows' query-aware `policies`) can run every row
    on the kernel, balanced: the balanced twin it would replay is captured (QA_JOIN)."""
    v = choose(captured, True, KERNEL, True, policies)
    return is_kernel_only(v) and is_balanced(v)


def label(base: Optional[str], variant: str) -> str:
    """SGLang's own variant label (LoRA's, or None) with ours appended."""
    ours = _LABEL_PREFIX + variant
    return ours if base is None else f"{base}+{ours}"


def _sparse_backend(runner: Any) -> Any:
    """The runner's SparseAttnBackend when it captures variants; None for every other
    runner (speculative draft runners, other backends)."""
    if type(runner).__name__ != "DecodeCudaGraphRunner":
        return None
    backend = getattr(runner, "attn_backend", None)
    return backend if getattr(backend, "graph_variants", ()) else None


def capture_one_shape(original, runner, size, forward, *args, **kwargs):
    """AROUND hook of DecodeCudaGraphRunner.capture_one_shape: every variant."""
    backend = _sparse_backend(runner)
    if backend is None:
        return original(runner, size, forward, *args, **kwargs)
    args, positional = list(args), len(args) > _LABEL_ARG
    base = args[_LABEL_ARG] if positional else kwargs.pop("variant_label", None)
    for variant in backend.graph_variants:
        if positional:
            args[_LABEL_ARG] = label(base, variant)
        else:
            kwargs["variant_label"] = label(base, variant)
        with backend.capturing_graph_variant(variant):
            original(runner, size, forward, *args, **kwargs)
    return None


def resolve_variant(original, runner, forward_batch, *args, **kwargs):
    """AROUND hook of DecodeCudaGraphRunner._resolve_lora_variant: the variant of
    this batch, in every graph key the runner makes (can_run_graph, replay)."""
    base = original(runner, forward_batch, *args, **kwargs)
    backend = _sparse_backend(runner)
    if backend is None:
        return base
    return label(base, backend.step_graph_variant())
