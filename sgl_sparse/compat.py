"""Every difference between the supported SGLang releases lives here.

Supported: sglang 0.5.17 (what the lent H100 image can run, torch 2.11) and the
newest 0.5.x (0.5.23 at the time of writing). Both already use the
``init_forward_metadata_out_graph`` / ``_in_graph`` backend contract, so the
backend class itself has no version branches; what moved is request bookkeeping.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Optional

try:
    SGLANG_VERSION = version("sglang")
except PackageNotFoundError:  # source checkout without metadata
    SGLANG_VERSION = "0"


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


SGLANG_AT_LEAST_0_5_23 = _vtuple(SGLANG_VERSION) >= (0, 5, 23)


def req_pool_idx(req: Any) -> Optional[int]:
    """0.5.23 moved KV bookkeeping of a Req into ``req.kv``."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return req.req_pool_idx


# Where ServerArgs is complete (tokenizer path, device resolved): 0.5.17 resolves in
# the dataclass `__post_init__`; 0.5.23 builds the record unresolved and fills it in
# `resolve_once()`, called by every launcher before processes are spawned.
SERVER_ARGS_RESOLVED_TARGET = (
    "sglang.srt.server_args.ServerArgs.resolve_once"
    if SGLANG_AT_LEAST_0_5_23
    else "sglang.srt.server_args.ServerArgs.__post_init__"
)


# 0.5.17 decides whether SGLang's own Triton helpers (e.g. the req_to_token writer)
# may run from the attention backend's *name* only; 0.5.23 also asks the platform,
# so a CPU server never reaches Triton. On 0.5.17 the plugin answers for its name.
SUPPORT_TRITON_TARGET = None if SGLANG_AT_LEAST_0_5_23 else "sglang.srt.utils.common.support_triton"


# ReqToTokenPool method through which a finished/aborted/retracted request's row
# goes back to the free list: 0.5.17 `free(req)`; 0.5.23 `free(req)` calls
# `free_rows(indices)`, which beam search also uses directly.
REQ_POOL_FREE_TARGET = (
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free_rows"
    if SGLANG_AT_LEAST_0_5_23
    else "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free"
)


def freed_rows(args: tuple, kwargs: dict) -> list[int]:
    """Rows released by a call to REQ_POOL_FREE_TARGET (args[0] is the pool)."""
    if SGLANG_AT_LEAST_0_5_23:
        rows = kwargs.get("indices", args[1] if len(args) > 1 else [])
        return [int(r) for r in rows]
    req = kwargs.get("req", args[1] if len(args) > 1 else None)
    idx = req_pool_idx(req) if req is not None else None
    return [] if idx is None else [int(idx)]


# SGLang's KV pool budget in bytes, profiled once per scheduler process before the pool
# is sized: both releases compute it in this KVCacheConfigurator method (free memory
# less the activations' share); store_budget.reserve_for_stores takes the sparse stores
# out of it.
KV_BUDGET_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"


def kv_budget_shape(configurator: Any):
    """The stores' StoreShape for the pool that `configurator` (KVCacheConfigurator, both
    releases) is sizing: this rank's layers (``layer_info.num_effective_layers``, the
    pool's ``layer_num``) and KV heads (the model's over the attention-TP size, as the
    pool's ``head_num``), the pool's dtype and the model's, and the request rows' width
    (``context_len``; req_to_token adds a few positions)."""
    from sgl_sparse.store_budget import StoreShape

    mc = configurator.model_config
    _, tp, _ = attention_parallel()
    return StoreShape(
        num_layers=int(configurator.layer_info.num_effective_layers),
        num_kv_heads=int(mc.get_num_kv_heads(tp)),
        num_q_heads=int(mc.num_attention_heads) // tp,
        head_dim=int(mc.head_dim),
        dtype=configurator.kv_cache_dtype,
        context_len=int(mc.context_len),
        model_dtype=mc.dtype,
    )


def attention_parallel(model_runner: Any = None) -> tuple[int, int, int]:
    """(attention TP rank, attention TP size, pipeline rank) of this scheduler process.

    Both releases publish them in ``runtime_context.get_parallel()``; neither
    ModelRunner has a ``tp_size`` of its own (0.5.17 keeps a ParallelState in
    ``.ps``). With DP attention the attention TP group is tp_size / dp_size ranks:
    that group splits the heads, and its rank 0 is where SGLang exports scheduler
    metrics. Before publication (a model runner built by hand, e.g. in unit tests)
    the runner's own attributes, else one rank."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(p.attn_tp_rank), int(p.attn_tp_size), int(p.pp_rank)
    except Exception:  # unpublished: each release raises its own error type
        ps = getattr(model_runner, "ps", model_runner)
        return (int(getattr(ps, "tp_rank", 0) or 0), int(getattr(ps, "tp_size", 1) or 1),
                int(getattr(ps, "pp_rank", 0) or 0))


def memory_split(model_runner: Any) -> Optional[tuple[int, float]]:
    """(bytes free on the device before SGLang loaded the model, --mem-fraction-static):
    SGLang sizes its KV pool so that (1 - fraction) of the former stays free for
    activations and CUDA graphs. Both releases keep them on the ModelRunner
    (``pre_model_load_memory`` in GB, as ``get_available_gpu_memory`` returns it);
    None where they are missing."""
    free_gb = getattr(model_runner, "pre_model_load_memory", None)
    fraction = getattr(model_runner, "mem_fraction_static", None)
    if not isinstance(free_gb, (int, float)) or not isinstance(fraction, (int, float)) or free_gb <= 0:
        return None
    return int(free_gb * (1 << 30)), float(fraction)


def token_ids(req: Any) -> tuple[Any, Any]:
    """(prompt ids, generated ids) of a Req; lists in 0.5.17, array('q') in 0.5.23."""
    return req.origin_input_ids, req.output_ids


def _graph_backend(server_args: Any, phase: str) -> Any:
    """The CUDA-graph backend of `phase` ("decode" / "prefill") as resolved on the
    record, else None. 0.5.17 resolves every spelling (--disable-cuda-graph,
    --cuda-graph-backend-decode disabled, ...) into ``cuda_graph_config``; 0.5.23
    may leave the record with the raw fields (then the per-phase backend flag)."""
    cfg = getattr(server_args, "cuda_graph_config", None)
    entry = cfg.get(phase) if isinstance(cfg, dict) else getattr(cfg, phase, None)
    backend = entry.get("backend") if isinstance(entry, dict) else getattr(entry, "backend", None)
    if backend is None:
        backend = getattr(server_args, f"cuda_graph_backend_{phase}", None)
    return None if backend is None else str(getattr(backend, "value", backend))


def _graphs_on(server_args: Any, phase: str) -> bool:
    """The phase's backend if the record names one, else the raw legacy booleans (in
    SGLang's precedence order; both releases default to graphs on, prefill's being
    the breakable graph on CUDA)."""
    backend = _graph_backend(server_args, phase)
    if backend is not None:
        return backend != "disabled"
    return not (getattr(server_args, "disable_cuda_graph", False)
                or getattr(server_args, f"disable_{phase}_cuda_graph", False))


def decode_cuda_graphs_enabled(server_args: Any) -> bool:
    """Whether decode forwards replay CUDA graphs."""
    return _graphs_on(server_args, "decode")


def prefill_cuda_graphs_enabled(server_args: Any) -> bool:
    """Whether the record has prefill CUDA graphs on: an unresolved one asks for them
    (both releases default to the breakable graph on CUDA), a resolved one runs them."""
    return _graphs_on(server_args, "prefill")


def prefill_cuda_graph_backend(server_args: Any) -> str | None:
    """The prefill CUDA-graph backend the record names ("breakable", "full", ...),
    None while SGLang has yet to pick its default."""
    return _graph_backend(server_args, "prefill")


def disable_prefill_cuda_graphs(server_args: Any) -> None:
    """Turn prefill CUDA graphs off on a record *before* SGLang resolves it (0.5.23
    seals the record once resolved), in each input that resolution reads: an explicit
    config's prefill backend, the per-phase backend flag (it outranks the boolean),
    and the boolean."""
    cfg = getattr(server_args, "cuda_graph_config", None)
    if isinstance(cfg, dict) and isinstance(cfg.get("prefill"), dict) and "backend" in cfg["prefill"]:
        cfg["prefill"]["backend"] = "disabled"
    elif getattr(getattr(cfg, "prefill", None), "backend", None) is not None:
        cfg.prefill.backend = "disabled"
    if getattr(server_args, "cuda_graph_backend_prefill", None) is not None:
        server_args.cuda_graph_backend_prefill = "disabled"
    server_args.disable_prefill_cuda_graph = True


# ---- decode CUDA-graph variants (sgl_sparse/graph_variants.py) ----------------------
# Both releases: DecodeCudaGraphRunner.capture_one_shape(size, forward, stream_idx,
# variant_label, ...) and _resolve_lora_variant(forward_batch) key the graphs; the
# FlashInfer backend keeps each batch size's captured decode wrappers in
# decode_cuda_graph_metadata[bs] and plans into them before a replay.
DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
CAPTURE_ONE_SHAPE_TARGET = DECODE_GRAPH_RUNNER + ".capture_one_shape"
RESOLVE_VARIANT_TARGET = DECODE_GRAPH_RUNNER + "._resolve_lora_variant"


def has_dense_decode_graph_wrappers(dense: Any) -> bool:
    return isinstance(getattr(dense, "decode_cuda_graph_metadata", None), dict)


def dense_decode_graph_wrappers(dense: Any, bs: int) -> Any:
    return dense.decode_cuda_graph_metadata[bs]


def set_dense_decode_graph_wrappers(dense: Any, bs: int, wrappers: Any) -> None:
    dense.decode_cuda_graph_metadata[bs] = wrappers


# ---- the decode graphs' capture stream (query_device's side streams) -------------
# Both releases: GroupCoordinator.graph_capture(graph_capture_context=None,
# stream=None) makes a default-priority Stream when given none; DecodeCudaGraphRunner
# captures on it. PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority,
# so each captured kernel keeps its capturing stream's priority at replay.


def capture_graphs_at_high_priority() -> bool:
    """Make the stream SGLang captures its CUDA graphs on (when it passes none) the
    device's highest-priority stream. A default-priority stream is the lowest one,
    so a side stream cannot rank below it: the main stream has to rank above. Idempotent;
    False where the target is missing (then nothing changes)."""
    import torch

    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator
    except ImportError:
        return False
    orig = GroupCoordinator.graph_capture
    if getattr(orig, "_sgl_sparse_high_priority", False):
        return True

    def graph_capture(self, graph_capture_context=None, stream=None):
        if graph_capture_context is None and stream is None and torch.cuda.is_available():
            # PyTorch maps a priority past the device's range to its highest
            stream = torch.cuda.Stream(priority=-64)
        return orig(self, graph_capture_context, stream)

    graph_capture._sgl_sparse_high_priority = True  # type: ignore[attr-defined]
    graph_capture.__wrapped__ = orig  # type: ignore[attr-defined]
    GroupCoordinator.graph_capture = graph_capture
    return True


# ---- work joined at the end of a captured decode forward (query_device's side streams) --
# Both releases: ModelRunner.__init__ sets capture_tail_hooks = [], and
# DecodeCudaGraphRunner's run_once calls each hook(runner, out, forward_batch,
# num_tokens) right after model.forward, inside the capture (SGLang's speculative
# workers use it).


def add_capture_tail_hook(model_runner: Any, hook: Callable[..., None]) -> bool:
    """Run `hook` at the end of every captured decode forward of `model_runner`, after
    the LM head and inside the graph. False where the release has no such list (then
    nothing is added)."""
    hooks = getattr(model_runner, "capture_tail_hooks", None)
    if not isinstance(hooks, list):
        return False
    hooks.append(hook)
    return True


def kv_read_scales(layer: Any) -> tuple[Optional[float], Optional[float]]:
    """The layer's KV-cache dequantization scales as host floats (None: unscaled), what
    SGLang's FlashInfer decode passes as ``k_scale`` / ``v_scale`` (the ``_float``
    copies: reading the tensors would sync the host inside graph capture)."""
    return getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)


def kv_key_scales(model: Any, layer0: int, num_layers: int) -> list[Optional[float]]:
    """Each of this rank's attention layers' key scale (``k_scale_float``; None:
    unscaled), by layer id from ``layer0``: for work that reads several layers' keys
    outside their forward (SFI's refresh). SGLang sets them when the weights load
    (``BaseKVCacheMethod.process_weights_after_loading``), before the attention
    backend is built. Layers found on no module stay None."""
    scales: list[Optional[float]] = [None] * num_layers
    for module in model.modules():
        layer_id = getattr(module, "layer_id", None)
        if isinstance(layer_id, int) and hasattr(module, "k_scale_float") and hasattr(module, "tp_k_head_num"):
            if 0 <= layer_id - layer0 < num_layers:
                scales[layer_id - layer0] = module.k_scale_float
    return scales


def kv_write_scales(dense: Any, layer: Any) -> tuple[Any, Any]:
    """The scales SGLang's FlashInfer backend writes the layer's new keys and values
    with (``set_kv_buffer(..., k_scale, v_scale)``), so that rows our kernel serves
    store their KV exactly as the rows FlashInfer serves do."""
    own = getattr(dense, "_kv_write_scales", None)
    if own is not None:
        return own(layer)
    return getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
