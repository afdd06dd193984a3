"""SGLang general plugin: registers the backend, its CLI flags and request hooks.

SGLang calls ``register()`` (through ``sgl_sparse_entry.load``) in the launching
process before argument parsing, and again in every scheduler process (one per
TP/DP rank), where the backend is constructed. The detokenizer process never
touches attention or request metadata and loads no plugins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from sgl_sparse import BACKEND_NAME, compat
from sgl_sparse.config import (
    ENV_CONFIG,
    POLICY_NAMES,
    QUERY_AWARE,
    REQUEST_KEY,
    SparseConfigError,
    SparseServerConfig,
    config_from_env,
    export_to_env,
    load_server_config,
    parse_request_policy,
)

# --kv-cache-dtype values the backend reads: the model's own floating dtype, and fp8,
# for every policy: the decode kernel widens the cache's keys and values as it reads
# them; full goes through FlashInfer, which reads fp8 itself; the selections read the
# stored keys with the layer's k_scale folded into their scale (SFI's evidence, lfps's
# tables; quest's and asyncspade's rankings are the same either way).
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32", *FP8_KV_CACHE_DTYPES)

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_backend)

    hooks = [
        ("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args, HookType.AFTER),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", from_cli_args, HookType.BEFORE),
        (compat.SERVER_ARGS_RESOLVED_TARGET, server_args_input, HookType.BEFORE),
        (compat.SERVER_ARGS_RESOLVED_TARGET, server_args_resolved, HookType.AFTER),
        ("sglang.srt.sampling.sampling_params.SamplingParams.verify", verify_sampling_params, HookType.AFTER),
        ("sglang.srt.managers.schedule_batch.Req.__init__", namespace_sparse_kv, HookType.AFTER),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", on_new_forward_batch, HookType.AFTER),
        (compat.REQ_POOL_FREE_TARGET, release_rows, HookType.BEFORE),
        ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.clear", release_all_rows, HookType.AFTER),
        ("sglang.srt.managers.scheduler.Scheduler.get_internal_state", report_internal_state, HookType.AFTER),
        # After release_rows: on 0.5.17 both hook free(), and the last registered runs first.
        ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", summarize_request, HookType.BEFORE),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
         compact_request_info, HookType.BEFORE),
    ]
    from sgl_sparse import graph_variants, store_budget

    hooks += [
        (compat.KV_BUDGET_TARGET, store_budget.reserve_for_stores, HookType.AFTER),
        (compat.CAPTURE_ONE_SHAPE_TARGET, graph_variants.capture_one_shape, HookType.AROUND),
        (compat.RESOLVE_VARIANT_TARGET, graph_variants.resolve_variant, HookType.AROUND),
    ]
    if compat.SUPPORT_TRITON_TARGET:
        hooks.append((compat.SUPPORT_TRITON_TARGET, support_triton, HookType.AROUND))
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kind)


def create_backend(runner):
    from sgl_sparse.backend import SparseAttnBackend

    return SparseAttnBackend(runner)


def configure(config_path: Optional[str] = None, default_policy: Optional[str] = None) -> SparseServerConfig:
    """For `sglang.Engine(...)` users: the equivalent of the two CLI flags."""
    cfg = load_server_config(config_path, default_policy)
    export_to_env(cfg)
    return cfg


# ---- server arguments -------------------------------------------------------------
def add_cli_args(_result, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sgl_sparse", "Sparse decode (--attention-backend sgl_sparse)")
    group.add_argument(
        "--sparse-default-policy", type=str, choices=POLICY_NAMES, default=None,
        help="Policy for requests that name none in custom_params.sparse (default: full).",
    )
    group.add_argument(
        "--sparse-config", type=str, default=None, metavar="PATH",
        help="YAML/JSON file with the server's sparse config: default_policy, per-policy "
             "defaults (policies.streaming.window, ...), think token names/ids.",
    )


def _uses_backend(server_args) -> bool:
    """ServerArgs or the parsed argparse namespace."""
    return BACKEND_NAME in (
        getattr(server_args, "attention_backend", None),
        getattr(server_args, "decode_attention_backend", None),
    )


def from_cli_args(_cls, args: argparse.Namespace):
    path = getattr(args, "sparse_config", None)
    policy = getattr(args, "sparse_default_policy", None)
    if not _uses_backend(args):
        if path or policy:
            _die("--sparse-config/--sparse-default-policy need --attention-backend sgl_sparse")
        return None
    try:
        configure(path, policy)
    except SparseConfigError as e:
        _die(str(e))
    return None


def server_args_input(server_args) -> None:
    """Before SGLang resolves the record: which prefill CUDA graphs sgl_sparse runs.

    SGLang's breakable prefill graph (the CUDA default) runs attention eagerly
    between its captured segments, with the attention metadata set up outside them,
    so the extend path's host work (admissions, SFI prompt-query plans, query-aware
    store writes) runs per forward as without graphs: validated on an H100 (greedy
    tokens identical to stock for `full`, covering `sfi` and `quest` budgets and
    windows; bench/README.md, "Session 12"). It is left as SGLang resolves it. A
    `full` prefill graph would capture attention itself, with this forward's plans
    baked in: turned off, with a warning. SGLANG_SPARSE_PREFILL_CUDA_GRAPHS=0 runs
    prefill eagerly whatever was asked. Decode CUDA graphs are unaffected."""
    device = getattr(server_args, "device", None)
    # A resolved record (0.5.23 re-enters resolve_once in child processes) is sealed.
    if not _uses_backend(server_args) or device == "cpu" or getattr(server_args, "_resolution_finished", False):
        return
    if device is None:  # resolved later from the host
        import torch

        if not torch.cuda.is_available():
            return
    if not compat.prefill_cuda_graphs_enabled(server_args):
        return
    from sgl_sparse.kernels._utils import env_switch

    if not env_switch("PREFILL_CUDA_GRAPHS", True):
        compat.disable_prefill_cuda_graphs(server_args)
        logger.warning("sgl_sparse: SGLANG_SPARSE_PREFILL_CUDA_GRAPHS=0: prefill runs eagerly "
                       "(as with --disable-prefill-cuda-graph). Decode CUDA graphs are unaffected.")
        return
    backend = compat.prefill_cuda_graph_backend(server_args)
    if backend == "full":
        compat.disable_prefill_cuda_graphs(server_args)
        logger.warning("sgl_sparse: --cuda-graph-backend-prefill full captures attention itself, which "
                       "sgl_sparse's per-forward extend plans cannot run in; prefill runs eagerly. The "
                       "breakable prefill graph (the CUDA default) is supported. Decode CUDA graphs are unaffected.")


def server_args_resolved(_result, server_args) -> None:
    if not _uses_backend(server_args):
        return
    if getattr(server_args, "speculative_algorithm", None):
        raise ValueError("--attention-backend sgl_sparse does not support --speculative-algorithm yet")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
    if kv_dtype not in KV_CACHE_DTYPES:
        # An fp4/mxfp8 pool (packed values plus block scales) would be read as garbage,
        # not refused.
        _die(f"--kv-cache-dtype {kv_dtype}: --attention-backend sgl_sparse reads the KV cache in the "
             f"model's dtype or fp8; other quantized KV caches are not supported yet (use one of: "
             f"{', '.join(KV_CACHE_DTYPES)})")
    from sgl_sparse.tokens import resolve_think_ids

    cfg = resolve_think_ids(
        config_from_env(),
        server_args.tokenizer_path or server_args.model_path,
        getattr(server_args, "trust_remote_code", False),
    )
    device = getattr(server_args, "device", None) or "cuda"
    model_name = getattr(server_args, "served_model_name", None) or server_args.model_path
    cfg = cfg.model_copy(update={
        "device": device,
        "metrics": bool(getattr(server_args, "enable_metrics", False)),
        "model_name": str(model_name),
        "tokenizer_path": server_args.tokenizer_path or server_args.model_path,
        "trust_remote_code": bool(getattr(server_args, "trust_remote_code", False)),
    })
    cfg = with_unavailable(cfg, decode_graphs=device != "cpu" and compat.decode_cuda_graphs_enabled(server_args))
    _check_cache_device(cfg, server_args, device)
    why = cfg.unavailable_reason(cfg.default_policy)
    if why:
        raise ValueError(f"--sparse-default-policy {cfg.default_policy}: unavailable: {why}")
    export_to_env(cfg)


def _check_cache_device(cfg: SparseServerConfig, server_args, device: str) -> None:
    """asyncspade's cache GPU (query_aware.asyncspade.cache_device) against the flags,
    before any process starts: one serving GPU, a GPU server (the one place these are
    checked). Whether the GPU exists and reaches the serving one is checked where CUDA
    is (query_store.cache_device_for)."""
    aspd = cfg.query_aware.asyncspade
    if aspd.cache_device is None or aspd.slots == 0 or "asyncspade" in cfg.unavailable:
        return
    field = f"--sparse-config: query_aware.asyncspade.cache_device {aspd.cache_device!r}"
    tp, pp = int(getattr(server_args, "tp_size", 1) or 1), int(getattr(server_args, "pp_size", 1) or 1)
    if tp * pp > 1:
        _die(f"{field}: one cache GPU serves one serving GPU, and --tp-size {tp} --pp-size {pp} spread the model "
             f"over {tp * pp}; unset it")
    if device == "cpu":
        _die(f"{field}: the selection's cache GPU needs a GPU server; this one runs with --device cpu")


def with_unavailable(cfg: SparseServerConfig, *, decode_graphs: bool) -> SparseServerConfig:
    """`cfg` with what this server cannot offer marked unavailable, with why: the
    query-aware policies not opted into decode CUDA graphs. One place for the server
    and `memory_plan`, so the plan builds exactly the stores the server will."""
    off = _off_in_cuda_graphs(cfg) if decode_graphs else {}
    return cfg.model_copy(update={"unavailable": {**cfg.unavailable, **off}})


def _off_in_cuda_graphs(cfg: SparseServerConfig) -> dict[str, str]:
    """Query-aware policies a server with decode CUDA graphs on does not offer, with why.

    Their selections run on the device path (query_device.py), captured -- and then
    at every decode step, so only where the config asks for it (`cuda_graphs`)."""
    off = {}
    for p in QUERY_AWARE:
        if not getattr(cfg.query_aware, p).cuda_graphs:
            off[p] = (f"with decode CUDA graphs on, it needs query_aware.{p}.cuda_graphs: true in "
                      f"--sparse-config (its selection then runs at every decode step), or --disable-cuda-graph")
    return off


def support_triton(original, backend: str, *args, **kwargs) -> bool:
    if backend == BACKEND_NAME:
        return config_from_env().device not in (None, "cpu")
    return original(backend, *args, **kwargs)


def _die(msg: str) -> None:
    print(f"sglang serve: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ---- requests -----------------------------------------------------------------------
def verify_sampling_params(_result, sampling_params, *args, **kwargs) -> None:
    """Runs in the tokenizer manager: a ValueError here is an HTTP 400 for this request."""
    if ENV_CONFIG not in os.environ:
        return  # this server does not run sgl_sparse
    params = sampling_params.custom_params
    if not isinstance(params, dict):  # None: the server's default policy
        return
    cfg = config_from_env()
    try:
        spec = parse_request_policy(params.get(REQUEST_KEY), cfg)
    except SparseConfigError as e:
        if cfg.metrics:
            from sgl_sparse.metrics import count_rejected

            count_rejected(e.reason, cfg.model_name)
        raise
    # Hand the scheduler the complete, validated policy (server defaults filled in).
    params[REQUEST_KEY] = spec.model_dump()


def namespace_sparse_kv(_result, req, *args, **kwargs) -> None:
    """Keep KV decoded under a sparse policy out of prefix reuse by other policies.

    Tokens generated while attention skipped part of the context have different
    KV than dense decoding would give; the radix cache keys prefixes by
    `extra_key`, so each exact sparse policy gets its own namespace. The price:
    a sparse request does not reuse prefixes cached by `full` requests.
    """
    if ENV_CONFIG not in os.environ:
        return
    from sgl_sparse.admission import request_spec

    spec = request_spec(req, config_from_env())
    if spec is None or spec.policy == "full":
        return
    tag = "sgl_sparse:" + ",".join(f"{k}={v}" for k, v in spec.model_dump().items())
    req.extra_key = (req.extra_key or "") + tag


def on_new_forward_batch(forward_batch, _cls, batch, model_runner, *args, **kwargs):
    """Host-side facts about the batch, handed to the backend through the state.

    Extend: the requests' initial state rows. Decode: which slots need the sparse
    kernel. They go through the state (host only) rather than onto the
    ForwardBatch, which SGLang may copy; the backend consumes them in its next
    metadata init, i.e. in this batch's forward, on the forward's own stream.
    """
    from sgl_sparse.admission import rows_for_batch

    state = getattr(model_runner.req_to_token_pool, "sgl_sparse_state", None)
    if batch is None or state is None:  # this model runner does not use sgl_sparse
        return None
    if state.metrics is not None:  # decode step period, compact-buffer gauges (host only)
        state.metrics.on_forward(batch.forward_mode.is_decode(), state.compact, state.compact_slots_in_use())
    if batch.forward_mode.is_decode():
        state.set_step_rows(
            [compat.req_pool_idx(r) for r in batch.reqs],
            batch.seq_lens_cpu.tolist(),
            [r.output_ids for r in batch.reqs],
        )
    elif not batch.forward_mode.is_decode_or_idle():
        state.enqueue(*rows_for_batch(batch.reqs, state.config, state.think_ids))
    return None


def release_rows(pool, *args, **kwargs) -> None:
    state = getattr(pool, "sgl_sparse_state", None)
    if state is not None:
        state.release(compat.freed_rows((pool, *args), kwargs))
        if state.metrics is not None:
            state.metrics.observe_compact(state.compact, state.compact_slots_in_use())
    return None


def summarize_request(pool, req=None, *args, **kwargs) -> None:
    """A finished request's policy, slow-step ratio, retention and TPOT, taken
    while its row is live: into meta_info (sgl_sparse/request_info.py) and metrics."""
    state = getattr(pool, "sgl_sparse_state", None)
    if state is not None and req is not None:
        from sgl_sparse.request_info import on_request_freed

        on_request_freed(state, req)
    return None


def compact_request_info(_manager, recv_obj=None, *args, **kwargs) -> None:
    if ENV_CONFIG in os.environ and recv_obj is not None:
        from sgl_sparse.request_info import compact_batch_output

        compact_batch_output(recv_obj)
    return None


def release_all_rows(_result, pool, *args, **kwargs) -> None:
    state = getattr(pool, "sgl_sparse_state", None)
    if state is not None:
        state.release_all()


def report_internal_state(result, scheduler, *args, **kwargs):
    """`/get_server_info` -> internal_states[i]["sgl_sparse"]: live per-request rows.

    Lets operators (and the leak tests) see that every request's state is released
    when it finishes or is aborted.
    """
    pool = getattr(scheduler, "req_to_token_pool", None)
    state = getattr(pool, "sgl_sparse_state", None)
    info = getattr(result, "internal_state", None)
    if state is not None and isinstance(info, dict):
        info["sgl_sparse"] = {
            "active_requests": state.active_count(),
            "active_by_policy": state.active_by_policy(),
            "compact_slots_in_use": state.compact_slots_in_use(),
            "query_slots_in_use": state.query_slots_in_use(),
            "query_prompts_pending": state.prompts_pending(),
        }
    return result
