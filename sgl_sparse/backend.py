"""The `sgl_sparse` attention backend.

Data path, top to bottom:
  request metadata  -> admission.rows_for_batch (host, when a request enters a batch)
  policy state      -> SparseState rows, indexed by req_pool_idx (device)
  per-step decision -> decision.plan_decode (device, once per decode step)
  SFI refresh       -> selector.refresh (device work enqueued before a step, for
                       requests whose previous step was slow)
  kernel            -> CPU: reference.decode_attention (the oracle);
                       CUDA: rows whose plan is dense this step through SGLang's
                       FlashInfer decode (the stock path), the others through the
                       two-segment Triton kernel, one launch for all of them;
                       prefill/extend through FlashInfer
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from sgl_sparse import compat, compile_watch, graph_variants, reference, store_budget
from sgl_sparse.config import config_from_env
from sgl_sparse.decision import DecodePlan, plan_decode
from sgl_sparse.balanced_launches import BalancedLaunchCount
from sgl_sparse.lfps_scored import ScoredFractionReads
from sgl_sparse.policies.base import QUERY_AWARE_IDS, PolicyId
from sgl_sparse.query_serving import QueryAwareRuntime
from sgl_sparse.selector.refresh import refresh
from sgl_sparse.state import SparseState

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class SparseAttnBackend(AttentionBackend):
    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        _check_supported(model_runner)

        # One state per request pool, shared by every backend instance built on
        # it (SGLang may build several, e.g. per decode stream); the scheduler-side
        # hooks find it through the pool.
        self.state = getattr(self.req_to_token_pool, "sgl_sparse_state", None)
        if self.state is None:
            self.state = SparseState(
                self.req_to_token_pool.req_to_token.shape[0], self.device, config_from_env()
            )
            self.req_to_token_pool.sgl_sparse_state = self.state
            attn_tp_rank, attn_tp_size, pp_rank = compat.attention_parallel(model_runner)
            # Every rank of a TP group runs the same batch: count it once, where SGLang
            # exports its own scheduler metrics (attention-TP rank 0 of the first stage).
            if self.state.config.metrics and attn_tp_rank == 0 and pp_rank == 0:
                from sgl_sparse.metrics import SchedulerMetrics

                self.state.metrics = SchedulerMetrics(self.state.config.model_name, tp_ranks=attn_tp_size)
        self.config = self.state.config
        self.think_ids = self.state.think_ids
        self.plan: Optional[DecodePlan] = None
        # KV heads of this rank, as the pool stores them.
        self._num_kv_heads = self.token_to_kv_pool.get_key_buffer(0).shape[1]
        self._layer0 = getattr(self.token_to_kv_pool, "start_layer", 0) or 0
        self._scaling: Optional[float] = None  # the layers' softmax scale, seen at the first forward
        self._prompt_q_plan = None  # where this extend's SFI prompt queries go
        if self.device.type == "cuda":
            compile_watch.install()  # before the warm-ups, so their compiles are logged too
        if self.state.metrics is not None:
            compile_watch.add_listener(self.state.metrics.on_kernel_compile)
        if self.state.compact is None and "sfi" not in self.config.unavailable:
            _setup_sfi(self.state, model_runner, self.token_to_kv_pool)
        if not self.state.query_stores:
            _setup_query_stores(self.state, model_runner, self.token_to_kv_pool)
        _check_store_memory(self.state, model_runner)
        self.qa = QueryAwareRuntime(self.state) if self.state.query_stores else None
        # lfps's scored fraction per finished request, read at its release (lfps_scored.py)
        self.lfps_scored = ScoredFractionReads(self.state) if PolicyId.LFPS in self.state.query_stores else None
        if self.lfps_scored is not None:
            self.state.on_lfps_released = self.lfps_scored.read
            self.lfps_scored.warm()
        qa_device = self.qa.device if self.qa is not None else None
        if qa_device is not None and qa_device.wants_high_priority_main:
            compat.capture_graphs_at_high_priority()
        if qa_device is not None and qa_device.wants_join_after_forward:
            qa_device.join_after_forward = compat.add_capture_tail_hook(
                model_runner, lambda *_: qa_device.join_pending())

        # CUDA: SGLang's own FlashInfer backend for prefill/extend and for the
        # decode rows routed to it. CPU: everything on the reference path.
        self.dense: Optional[AttentionBackend] = None
        if self.device.type == "cuda":
            from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

            from sgl_sparse.kernels.two_segment_decode import FP8_KV_DTYPES

            self.dense = ATTENTION_BACKENDS["flashinfer"](model_runner)
            kv = self.token_to_kv_pool.get_key_buffer(0)
            _check_kv_dtype(kv.dtype, model_runner.dtype, torch.cuda.get_device_capability(self.device))
            # the decode kernel's split heuristic targets more programs over fp8 (programs_per_sm)
            self._kv_fp8 = kv.dtype in FP8_KV_DTYPES
            # Segment A of every request is read in place from the pool for now
            # (sink tokens): an empty one-slot compact buffer stands in.
            self._no_compact = kv.new_zeros((1, kv.shape[1], 1, kv.shape[2]))
            self._max_kv_len = self.req_to_token_pool.req_to_token.shape[1]
            # Per decode slot: 1 = the kernel serves it, 0 = FlashInfer. Fixed
            # address, so captured graphs read each step's routing.
            self._row_mask = torch.zeros(
                self.req_to_token_pool.req_to_token.shape[0], dtype=torch.int32, device=self.device
            )
            self._row_mask_host: Optional[list[int]] = None  # what _row_mask holds now
            # The decode kernel's one-launch merge: arrival counters, zero between
            # launches, shared by the layers (one stream) and by graph replays.
            from sgl_sparse.kernels import make_split_counters

            self._split_counters = make_split_counters(
                self.req_to_token_pool.req_to_token.shape[0], self._num_kv_heads, self.device
            )
        # Steps that may hold an SFI slow step among fast ones balance the kernel's
        # splits (compact.balance_splits; graph_variants.KERNEL_BALANCED), and so do
        # all-slow steps where that gives their rows more programs (_dense_step_balances)
        # and batches of dense and sparse rows joined on the kernel (graph_variants.joins):
        # the last on servers without SFI slots too (full rows beside windowed ones).
        self.balance_splits = (self.dense is not None and self.config.compact.balance_splits
                               and _decode_switch("BALANCE_ENABLED"))
        # Decode CUDA graphs per batch size, one per set of attention paths a batch
        # needs (graph_variants.py): FlashInfer alone, our kernel alone, both, both
        # with the query-aware blocks.
        self.graph_variants: tuple[str, ...] = graph_variants.wanted(self)
        self._graph_variant: Optional[str] = None  # the variant being captured
        # The variant the runner replays for the batch set up last.
        self._step_variant = graph_variants.choose(self.graph_variants, False, graph_variants.MIXED)
        self._dense_graph_wrappers: dict[tuple[str, int], object] = {}
        # The paths this decode forward runs (graph_variants.DENSE / KERNEL / MIXED).
        self._route = graph_variants.MIXED
        self._row_splits: Optional[torch.Tensor] = None  # the decode kernel's balanced splits, per step
        self._balance_gate: Optional[torch.Tensor] = None  # the gate of those splits (kernels.step_balance), per step
        self._balance_step = False  # this decode forward balances the kernel's splits (KERNEL_BALANCED)
        # with metrics: the balanced forwards whose gate ran the balanced launch (balanced_launches.py)
        self.balanced_launches: Optional[BalancedLaunchCount] = None
        if self.balance_splits and self.state.metrics is not None and _decode_switch("BALANCE_GATE"):
            self.balanced_launches = BalancedLaunchCount(self.state.metrics, self.device)
            self.balanced_launches.warm()
        logger.info(
            "sgl_sparse backend: device=%s dense=%s default_policy=%s think_ids=%s",
            self.device, type(self.dense).__name__ if self.dense else "reference",
            self.config.default_policy, self.think_ids,
        )

    # ---- per-forward metadata ----------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self._prepare(forward_batch, eager=True)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self._prepare(forward_batch, eager=False, in_capture=in_capture)

    def _prepare(self, forward_batch: ForwardBatch, eager: bool, in_capture: bool = False):
        """Host-side, once per forward: state admissions, SFI refreshes, then
        FlashInfer's plan. Decode forwards time it: when a decode step's GPU work is
        short, this host time decides whether the GPU waits."""
        metrics = self.state.metrics
        if metrics is None or not forward_batch.forward_mode.is_decode():
            return self._prepare_forward(forward_batch, eager, in_capture)
        t0 = time.perf_counter()
        self._prepare_forward(forward_batch, eager, in_capture)
        metrics.prepare_duration.labels(metrics.model_name).observe(time.perf_counter() - t0)

    def _prepare_forward(self, forward_batch: ForwardBatch, eager: bool, in_capture: bool):
        admitted = self.state.admit_queued()
        if admitted[0]:
            compile_watch.mark_serving()
        mode = forward_batch.forward_mode
        self._prompt_q_plan = None
        self._route = graph_variants.MIXED
        if self.state.compact is not None:
            if mode.is_decode():
                self._refresh_selections()
            elif mode.is_extend():
                self._plan_prompt_queries(forward_batch, admitted)
        if self.lfps_scored is not None:
            self.lfps_scored.note_forward(in_capture)
        if self.qa is not None:
            self._plan_query_aware(forward_batch, admitted, graphed=not eager)
        if self.dense is None:
            if self.state.metrics is not None and mode.is_decode():
                self.state.metrics.on_decode_path("reference")
            return
        if forward_batch.forward_mode.is_decode_or_idle():
            forward_batch = self._route_decode_rows(forward_batch, eager, in_capture)
        if self._route == graph_variants.KERNEL:
            return  # no row for FlashInfer: no plan (and, in a graph, no launch)
        if eager:
            self.dense.init_forward_metadata(forward_batch)
            return
        variant = None
        if self.graph_variants and forward_batch.forward_mode.is_decode_or_idle():
            variant = self._graph_variant if in_capture else self._step_variant
        if variant is not None and not in_capture:
            # Plan into the FlashInfer wrappers of the variant the runner replays.
            self.use_dense_graph_wrappers(forward_batch.batch_size, variant)
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if variant is not None and in_capture:  # a capture of graph_variants' hook
            self.keep_dense_graph_wrappers(forward_batch.batch_size, variant)

    def step_graph_variant(self) -> str:
        """The decode graph variant of the forward whose metadata was set up last
        (graph_variants.choose). The runner asks after that set-up, so both agree."""
        return self._step_variant

    # FlashInfer makes new decode wrappers (each with its own plan buffers) at every
    # capture of a batch size and plans into the latest at replay; with several variants
    # per size each graph keeps its own: kept after its capture, put back before its
    # replay's plan.
    def keep_dense_graph_wrappers(self, bs: int, variant: str) -> None:
        self._dense_graph_wrappers[(variant, bs)] = compat.dense_decode_graph_wrappers(self.dense, bs)

    def use_dense_graph_wrappers(self, bs: int, variant: str) -> None:
        wrappers = self._dense_graph_wrappers.get((variant, bs))
        if wrappers is not None:
            compat.set_dense_decode_graph_wrappers(self.dense, bs, wrappers)

    @contextlib.contextmanager
    def capturing_graph_variant(self, variant: str):
        """Within: decode graph captures are of the given variant (a `qa_<policy>` one
        holds that policy's query-aware blocks alone)."""
        self._graph_variant = variant
        device = self.qa.device if self.qa is not None else None
        if device is not None:
            device.only = graph_variants.qa_policies(variant)
        try:
            yield
        finally:
            self._graph_variant = None
            if device is not None:
                device.only = None

    def _refresh_selections(self) -> None:
        pending, later = self.state.take_refresh()
        if not pending or self._scaling is None:
            return
        pool = self.token_to_kv_pool
        metrics = self.state.metrics  # Selector latency: CUDA events, read once complete
        with metrics.time_selector(self.device, len(pending)) if metrics else contextlib.nullcontext():
            refresh(
                self.state, sorted(pending), max(pending.values()),
                lambda layer: pool.get_key_buffer(layer + self._layer0),
                lambda layer: pool.get_value_buffer(layer + self._layer0),
                self.req_to_token_pool.req_to_token, self._scaling,
                use_kernels=self.dense is not None, later=later,
            )

    def _plan_prompt_queries(self, forward_batch: ForwardBatch, admitted) -> None:
        """SFI requests of this extend keep the last w_prefill - 1 queries of the
        chunk: with the first decode step's query they are the first Selector's
        evidence window (a later chunk of the same prompt overwrites them)."""
        rows, inits = admitted
        want = {r: i for r, i in zip(rows, inits) if i.policy == PolicyId.SFI and i.slot >= 0}
        if not want:
            return
        store = self.state.compact
        order = forward_batch.req_pool_indices.tolist()  # one sync, SFI prefills only
        lens = forward_batch.extend_seq_lens_cpu
        lens = lens.tolist() if hasattr(lens, "tolist") else list(lens)
        src, dst_slot, dst_j, count_rows, counts = [], [], [], [], []
        start = 0
        for r, ext in zip(order, lens):
            init = want.get(int(r))
            if init is not None:
                m = min(init.spec.w_prefill - 1, ext, store.q_prompt.shape[2])
                for j in range(m):
                    src.append(start + ext - 1 - j)
                    dst_slot.append(init.slot)
                    dst_j.append(j)
                count_rows.append(int(r))
                counts.append(m)
            start += ext
        dev = self.device
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        self.state.prompt_q[as_t(count_rows)] = torch.tensor(counts, dtype=torch.int32, device=dev)
        if src:
            self._prompt_q_plan = (as_t(src), as_t(dst_slot), as_t(dst_j))

    def _plan_query_aware(self, forward_batch: ForwardBatch, admitted, graphed: bool = False) -> None:
        """Host-side groups of this forward's quest/asyncspade/lfps rows (on CUDA,
        quest and asyncspade run on the device path: whenever the batch has such
        rows, and in every forward that may be a decode CUDA-graph capture or
        replay, `graphed`)."""
        mode = forward_batch.forward_mode
        self.qa.groups, self.qa.extend_rows = [], []
        self.qa.device_active = False
        if mode.is_decode():
            rows = self.state.take_step_rows()
            if not self.state.has_active(QUERY_AWARE_IDS):
                self.qa.plan_idle_step(graphed)  # the common case: no host work
                return
            if rows is None or len(rows) != forward_batch.batch_size:
                rows = forward_batch.req_pool_indices.tolist()
            self.qa.plan_step(rows, _host_list(forward_batch.seq_lens_cpu, forward_batch.seq_lens), self.device,
                              graphed=graphed)
        elif mode.is_extend() and any(i.policy in QUERY_AWARE_IDS for i in admitted[1]):
            self.qa.plan_extend(
                forward_batch.req_pool_indices.tolist(),
                _host_list(forward_batch.seq_lens_cpu, forward_batch.seq_lens),
                _host_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens),
                admitted,
            )

    def _record_for_sfi(self, layer, forward_batch, q, k) -> None:
        """Extend: key norms of the new keys and the SFI prompt queries."""
        store = self.state.compact
        if store is None:
            return
        li = layer.layer_id - self._layer0
        store.save_key_norms(li, forward_batch.out_cache_loc, k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim))
        if self._prompt_q_plan is not None:
            src, slot, j = self._prompt_q_plan
            q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            store.q_prompt[li][slot, j] = q3[src].to(store.q_prompt.dtype)

    def _route_decode_rows(self, forward_batch: ForwardBatch, eager: bool, in_capture: bool) -> ForwardBatch:
        """Split a decode batch between FlashInfer and the two-segment kernel.

        Rows whose plan is dense this step (`full`, a window covering the
        sequence, SADAS after the host saw `</think>`; see
        SparseState.set_step_rows) go through FlashInfer exactly as in the stock
        backend; the others through our kernel. FlashInfer is planned with one key
        for the kernel's rows, so it reads almost nothing for them, and the kernel
        skips FlashInfer's rows: both launches have fixed grids, so this holds
        inside CUDA graphs too. A batch whose rows all take one path runs that path
        alone (`self._route`, graph_variants.py): in a graph, the variant captured
        without the other. A batch of both kinds with no query-aware row runs all
        of them on the kernel, balanced (graph_variants.joins; compact.balance_splits
        on). A SADAS row that latches on the device before the host
        sees it stays on the kernel for that step, attending everything.
        """
        bs = forward_batch.batch_size
        mask = self.state.take_step_kernel_rows()  # host, one entry per real request
        if mask is None:  # no routing known for this batch: the kernel serves all
            mask = [1] * bs
        if in_capture:
            variant = self._graph_variant or graph_variants.MIXED
        else:
            # query-aware rows: both paths, whatever their routing (a row whose
            # selection is pending is dense this step but its queries are recorded),
            # but in a graph whose rows all take the kernel: its kernel-only twin
            qa_policies = self.state.step_query_aware_policies()
            qa = bool(qa_policies)
            # rows of both kinds: one launch of the kernel serves them all
            # (graph_variants.joins), balanced (dense rows among sparse ones, as an SFI
            # slow step's: the device gate picks the grid). Only where the balanced
            # launch exists: a plain grid would wait on the longest dense row. With
            # query-aware rows, only into a captured balanced twin (QA_JOIN).
            joined = (self.balance_splits and graph_variants.joins(mask) and self.state.step_rows_tracked()
                      and (not qa or (not eager and graph_variants.qa_joins(self.graph_variants, qa_policies))))
            if joined:
                mask = [1] * len(mask)
            route = graph_variants.route_of(mask)
            balance = self.balance_splits and (joined or self.state.step_balance() or self._dense_step_balances(bs))
            if eager:
                variant = route if graph_variants.ROUTE_ENABLED and not qa else graph_variants.MIXED
                if variant == graph_variants.KERNEL and balance:
                    variant = graph_variants.KERNEL_BALANCED
            else:
                variant = self._step_variant = graph_variants.choose(self.graph_variants, qa, route, balance,
                                                                     qa_policies)
        if not in_capture and self.state.metrics is not None and forward_batch.forward_mode.is_decode():
            self.state.metrics.on_decode_path(variant)
        if self.balanced_launches is not None:
            self.balanced_launches.note_forward(graph_variants.is_balanced(variant), in_capture)
        # KERNEL_BALANCED (or a query-aware balanced twin): the kernel alone, its splits
        # balanced (init_forward_metadata_in_graph).
        self._balance_step = graph_variants.is_balanced(variant)
        route = self._route = (graph_variants.KERNEL if graph_variants.is_kernel_only(variant) else
                               graph_variants.MIXED if graph_variants.is_qa(variant) else
                               graph_variants.KERNEL if self._balance_step else variant)
        # CUDA-graph padding rows (state row 0, `full`, one key) go with the real rows:
        # to FlashInfer, or to the kernel when FlashInfer does not run.
        pad = 1 if route == graph_variants.KERNEL else 0
        mask = (mask + [pad] * bs)[:bs]
        host = torch.tensor(mask, dtype=torch.int32)
        if mask != self._row_mask_host:  # steady decode repeats the routing: no copy
            self._row_mask[:bs].copy_(host.pin_memory() if self._row_mask.is_cuda else host, non_blocking=True)
            self._row_mask_host = mask
        if route != graph_variants.MIXED or 1 not in mask:  # 2 = FlashInfer attends, the kernel only records
            return forward_batch
        routed = copy.copy(forward_batch)
        routed.seq_lens = forward_batch.seq_lens.clone()
        routed.seq_lens[:bs] = torch.where(self._row_mask[:bs] == 1, 1, forward_batch.seq_lens[:bs])
        if forward_batch.seq_lens_cpu is not None:
            routed.seq_lens_cpu = forward_batch.seq_lens_cpu.clone()
            routed.seq_lens_cpu[:bs] = torch.where(host == 1, 1, forward_batch.seq_lens_cpu[:bs])
            routed.seq_lens_sum = int(routed.seq_lens_cpu[:bs].sum())
        return routed

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self._row_splits = self._balance_gate = None
        if forward_batch.forward_mode.is_decode():
            self.plan = plan_decode(
                self.state,
                forward_batch.req_pool_indices,
                forward_batch.input_ids,
                forward_batch.seq_lens,
                self.think_ids,
                num_kv_heads=self._num_kv_heads,
            )
            self._row_splits = self._balanced_row_splits(self.plan)
        else:
            self.plan = None

    def _dense_step_balances(self, bs: int) -> bool:
        """A step whose kernel rows are all SFI slow steps (dense, alike) balances only
        where that takes more programs than the plain launch (long rows over fp8)."""
        keys = self.state.step_dense_keys()
        if keys <= 0:
            return False
        from sgl_sparse.kernels import dense_step_balances
        from sgl_sparse.kernels._utils import device_num_sms

        return dense_step_balances(bs, keys, self._num_kv_heads, self._max_kv_len, device_num_sms(self.device),
                                   self._kv_fp8)

    def _one_grid(self, bs: int) -> bool:
        """The gated pair as one launch at this batch size (kernels.one_grid)."""
        from sgl_sparse.kernels import one_grid
        from sgl_sparse.kernels._utils import device_num_sms

        return one_grid(bs, self._num_kv_heads, self._max_kv_len, device_num_sms(self.device), kv_fp8=self._kv_fp8)

    def _balanced_row_splits(self, plan: DecodePlan) -> Optional[torch.Tensor]:
        """The decode kernel's splits per request, once per step for every layer, in a
        step that balances them (graph variant KERNEL_BALANCED, where kernels.balances
        allows it): a dense row among sparse ones (an SFI slow step) spread over more
        programs instead of holding the step."""
        if self.dense is None or not self._balance_step:
            return None
        from sgl_sparse.kernels._utils import device_num_sms
        from sgl_sparse.kernels.balance_step import step_balance

        # the shares and the gate in one launch (kernels.step_row_splits and balance_gate
        # as torch ops were ~45 graph nodes a step, every step of natural sfi)
        count = self.balanced_launches.counter() if self.balanced_launches is not None else None
        splits, self._balance_gate = step_balance(plan.a_len_per_head, plan.b_start, plan.b_end, self._row_mask,
                                                  self._num_kv_heads, self._max_kv_len,
                                                  device_num_sms(self.device), self._kv_fp8, count=count)
        return splits

    # ---- CUDA graphs --------------------------------------------------------------
    # Decode graphs capture plan_decode (in_graph) and the kernel; every tensor
    # they read is the runner's static input buffer or allocated during capture,
    # so a replay recomputes each request's plan from the current inputs.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.dense is None:
            raise RuntimeError("sgl_sparse: CUDA graphs need a CUDA device")
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value() if self.dense else 1

    def on_after_cuda_graph_warmup(self):
        if self.dense is not None:
            self.dense.on_after_cuda_graph_warmup()

    # ---- forward -------------------------------------------------------------------
    def _save_kv(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            # CUDA: with FlashInfer's scales, as the rows it serves store theirs (an fp8
            # cache holds k / k_scale); CPU: none, as the stock torch_native backend.
            scales = compat.kv_write_scales(self.dense, layer) if self.dense is not None else ()
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v, *scales
            )

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        # Prefill/extend is dense for every policy.
        self._scaling = layer.scaling
        if self.dense is not None:
            o = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        else:
            self._save_kv(layer, forward_batch, k, v, save_kv_cache)
            o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
            reference.extend_attention(
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                forward_batch.extend_prefix_lens,
                forward_batch.extend_seq_lens,
                scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
        if save_kv_cache and k is not None:
            self._record_for_sfi(layer, forward_batch, q, k)
        if self.qa is not None and self.qa.extend_rows:
            self.qa.on_extend(
                layer.layer_id - self._layer0, q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token, _stored_key_scaling(layer),
                v_scale=compat.kv_read_scales(layer)[1],
            )
        return o

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        self._scaling = layer.scaling
        if self.dense is not None:
            return self._forward_decode_cuda(q, k, v, layer, forward_batch, save_kv_cache)
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        store, li = self.state.compact, layer.layer_id - self._layer0
        if store is not None:
            if save_kv_cache and k is not None:
                store.save_key_norms(li, forward_batch.out_cache_loc,
                                     k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim))
            dest = self.plan.q_save_slot
            dest = torch.where(dest >= 0, dest, store.scratch_slot).long()
            store.q[li].index_copy_(0, dest, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim))
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o3 = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        plan = self._layer_plan(layer, forward_batch, q3)
        reference.decode_attention(
            q3, o3,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            plan,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            **_segment_a(store, li),
        )
        self._finish_query_aware(layer, forward_batch, plan, q3, o3)
        return o

    # ---- quest / asyncspade / lfps (sgl_sparse/query_serving.py) --------------------
    def _captures_query_aware(self) -> bool:
        """Whether this forward runs the query-aware blocks: always, but in a capture
        of a decode graph variant without them."""
        return self._graph_variant is None or graph_variants.is_qa(self._graph_variant)

    def _layer_plan(self, layer, forward_batch, q3) -> DecodePlan:
        """The step's plan, with this layer's indexed segment A when the batch has
        query-aware rows."""
        if self.qa is None or not self.qa.active() or not self._captures_query_aware():
            return self.plan
        return self.qa.select(
            layer.layer_id - self._layer0, self.plan, q3,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices, forward_batch.seq_lens, _stored_key_scaling(layer),
        )

    def _finish_query_aware(self, layer, forward_batch, plan, q3, o3) -> None:
        if self.qa is None or not self.qa.active() or not self._captures_query_aware():
            return
        self.qa.finish(
            layer.layer_id - self._layer0, plan, q3, o3,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices, forward_batch.seq_lens, _stored_key_scaling(layer),
        )

    def _forward_decode_cuda(self, q, k, v, layer, forward_batch, save_kv_cache):
        from sgl_sparse.kernels import two_segment_decode

        # FlashInfer writes the KV and the rows routed to it; then the kernel
        # overwrites the rows routed to it. A route of one path runs that one only.
        route = self._route
        bs = self.plan.b_end.shape[0]
        if route == graph_variants.KERNEL:
            self._save_kv(layer, forward_batch, k, v, save_kv_cache)
            o = q.new_empty((bs, layer.tp_q_head_num * layer.v_head_dim))
        else:
            o = self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if route == graph_variants.DENSE:
                return o
        q3 = q.reshape(bs, layer.tp_q_head_num, layer.qk_head_dim)
        # quest/asyncspade/lfps rows: this layer's indexed segment A (a_pos).
        plan = self._layer_plan(layer, forward_batch, q3)
        store, li = self.state.compact, layer.layer_id - self._layer0
        sfi_args = {}
        if store is not None:
            sfi_args = dict(key_norms=store.knorm[li], q_save=store.q[li], q_save_slot=plan.q_save_slot)
            if store.logits is not None:
                # Slow rows (dense, q_save_slot >= 0) keep their logits for the
                # Selector: the keys this step reads anyway are not read again.
                sfi_args["logits_out"] = store.logits[li]
        k_scale, v_scale = compat.kv_read_scales(layer)  # an fp8 cache's (None: unscaled)
        launches = [dict(balance=self._row_splits is not None, row_splits=self._row_splits)]
        if self._balance_gate is not None:
            # the plain partition too, the device choosing one of the two a step
            # (kernels.BALANCE_GATE): rows all alike run the plain grid; in one launch
            # with the balanced one where kernels.one_grid says so
            if self._one_grid(bs):
                launches = [dict(launches[0], gate=(self._balance_gate, None))]
            else:
                launches = [dict(balance=False, gate=(self._balance_gate, False)),
                            dict(launches[0], gate=(self._balance_gate, True))]
        seg_a = _segment_a(store, li)
        if seg_a["compact_k"] is None:  # slot lists, or no store: the kernel reads no compact buffer
            a_k = a_v = self._no_compact
        else:
            a_k, a_v = seg_a["compact_k"], seg_a["compact_v"]
        for launch in launches:
            two_segment_decode(
                q3,
                a_k,
                a_v,
                plan.a_slot, plan.a_len_per_head,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                plan.b_start, plan.b_end,
                layer.scaling,
                max_kv_len=self._max_kv_len,
                out=o.view(bs, layer.tp_q_head_num, layer.v_head_dim),
                row_mask=self._row_mask[:bs],
                split_counters=self._split_counters,
                k_scale=k_scale,
                v_scale=v_scale,
                **launch,
                **plan.indexed_lists(),
                **sfi_args,
                a_slot_lists=seg_a["compact_lists"],
            )
        self._finish_query_aware(layer, forward_batch, plan, q3, o.view(bs, layer.tp_q_head_num, layer.v_head_dim))
        return o

    def support_triton(self):
        return self.dense is not None


def _segment_a(store, layer: int) -> dict:
    """The compact store's segment A of `layer` as reference.decode_attention takes it:
    the packed K and V, or the pool-slot lists (`compact.selections`); None for what the
    store does not keep (or no store)."""
    packed = store is not None and not store.slot_lists
    return dict(compact_k=store.k[layer] if packed else None, compact_v=store.v[layer] if packed else None,
                compact_lists=store.lists[layer] if store is not None and store.slot_lists else None)


def _stored_key_scaling(layer) -> float:
    """The layer's softmax scale for logits of the keys as the pool stores them: an fp8
    cache holds k / k_scale, so its k_scale is folded in (1 otherwise). The query-aware
    selections score the stored keys with it: lfps's tables need the true logits;
    quest's and asyncspade's rankings are the same either way."""
    k_scale, _ = compat.kv_read_scales(layer)
    return layer.scaling * (1.0 if k_scale is None else k_scale)


def _rank_q_heads(model_runner) -> int:
    """This rank's query heads: the model's over the attention-TP size (the pool's
    KV-head dimension is already the rank's)."""
    _, tp, _ = compat.attention_parallel(model_runner)
    return model_runner.model_config.num_attention_heads // tp


def _setup_sfi(state: SparseState, model_runner, kv_pool) -> None:
    """SFI's trigger table and compact buffers, once per request pool."""
    from sgl_sparse.tokens import sentence_trigger_ids

    cfg = state.config
    mc = model_runner.model_config
    state.set_trigger_table(sentence_trigger_ids(cfg, mc.vocab_size))
    if cfg.compact.slots == 0:
        return
    kv = kv_pool.get_key_buffer(getattr(kv_pool, "start_layer", 0) or 0)
    state.compact = store_budget.build_compact(cfg, _store_shape(model_runner, kv_pool), pool_size=kv.shape[0],
                                               device=kv.device)
    logger.info("sgl_sparse: SFI compact buffers: %d slots x %d tokens (selections: %s), %.2f GiB",
                cfg.compact.slots, cfg.compact.capacity, cfg.compact.selections, state.compact.nbytes() / 2**30)
    layer0 = getattr(kv_pool, "start_layer", 0) or 0
    scales = compat.kv_key_scales(model_runner.model, layer0, kv_pool.layer_num)
    if any(s is not None and s != 1.0 for s in scales):  # a scaled fp8 cache: the refresh's evidence needs them
        state.compact.k_scales = torch.tensor([1.0 if s is None else s for s in scales], dtype=torch.float32,
                                              device=kv.device)
    if kv.is_cuda:
        from sgl_sparse.selector.graphs import RefreshGraphs
        from sgl_sparse.selector.refresh import warm_up_kernels

        if cfg.compact.refresh_graphs:
            state.compact.refresh_graphs = RefreshGraphs(kv.device)
            if state.metrics is not None:
                state.compact.refresh_graphs.on_capture = state.metrics.on_refresh_graph_capture

        warm_up_kernels(state.compact, kv, kv_pool.get_value_buffer(layer0),
                        model_runner.req_to_token_pool.req_to_token, [cfg.policies.sfi])


def _store_shape(model_runner, kv_pool) -> store_budget.StoreShape:
    """The stores' shape for this rank, from the pool SGLang built."""
    kv = kv_pool.get_key_buffer(getattr(kv_pool, "start_layer", 0) or 0)
    return store_budget.StoreShape(
        num_layers=kv_pool.layer_num, num_kv_heads=kv.shape[1], num_q_heads=_rank_q_heads(model_runner),
        head_dim=kv.shape[2], dtype=kv.dtype, context_len=model_runner.req_to_token_pool.req_to_token.shape[1],
        model_dtype=model_runner.dtype)


def _setup_query_stores(state: SparseState, model_runner, kv_pool) -> None:
    """Stores of the query-aware policies with slots, once per request pool."""
    from sgl_sparse import query_store

    kv = kv_pool.get_key_buffer(getattr(kv_pool, "start_layer", 0) or 0)
    state.query_stores.update(store_budget.build_query_stores(state.config, _store_shape(model_runner, kv_pool),
                                                              kv.device))
    for pid, store in state.query_stores.items():
        name, scfg = pid.name.lower(), store.cfg
        logger.info("sgl_sparse: %s store: %d slots x %d tokens, %.3f GiB", name, scfg.slots,
                    scfg.max_context, query_store.nbytes(store) / 2**30)
        if getattr(store, "remote", False):
            logger.info("sgl_sparse: %s selection on %s: %.3f GiB there", name, store.cache_device,
                        query_store.nbytes(store, store.cache_tensors()) / 2**30)
        if state.metrics is not None:
            state.metrics.set_query_store(name, query_store.nbytes(store))
    if kv.is_cuda:
        from sgl_sparse.query_serving import warm_up_extend_kernels

        warm_up_extend_kernels(state.query_stores, kv, model_runner.req_to_token_pool.req_to_token)


def stores_headroom_warning(stores: int, free_before_load: int, fraction: float) -> Optional[str]:
    """A warning when the sparse stores (allocated after SGLang sized its KV pool, so out
    of the (1 - fraction) share it keeps free for activations and CUDA graphs) take more
    than half of that share: the decode-graph capture that follows may then run out of
    memory in SGLang's own code, where nothing points at the stores. Says the fraction
    that takes the stores out of the pool's share instead."""
    reserve = free_before_load * (1.0 - fraction)
    if stores <= 0.5 * reserve:
        return None
    suggested = int((fraction - stores / free_before_load) * 100) / 100
    fix = (f"--mem-fraction-static {suggested:.2f} (the stores taken out of the KV pool's share)"
           if suggested > 0 else "a smaller --mem-fraction-static")
    return (f"sgl_sparse: the sparse stores take {stores / 2**30:.2f} GiB of the {reserve / 2**30:.2f} GiB that "
            f"--mem-fraction-static {fraction:g} leaves outside SGLang's KV pool for activations and CUDA "
            f"graphs ({max(reserve - stores, 0) / 2**30:.2f} GiB left). If start-up then fails with CUDA out "
            f"of memory, set {fix}, or lower query_aware.<policy>.slots / max_context and compact.slots / "
            f"capacity in --sparse-config")


def _check_store_memory(state: SparseState, model_runner) -> None:
    """The stores against what store_budget set aside for them in the KV pool's budget;
    where its hook did not run, on CUDA, a warning when they crowd the activations'
    share."""
    from sgl_sparse import query_store

    stores = sum(query_store.nbytes(s) for s in state.query_stores.values())
    if state.compact is not None:
        stores += state.compact.nbytes()
    if stores == 0:
        return
    reserved = store_budget.reserved_bytes
    if reserved:  # taken out of the KV pool's budget (store_budget): the activations' share is whole
        if state.compact is not None:  # its key norms follow the pool, not the plan
            stores -= state.compact.knorm.numel() * state.compact.knorm.element_size()
        if abs(stores - reserved) > max(1 << 20, reserved // 1000):  # a plan that drifted from the stores
            logger.warning("sgl_sparse: the sparse stores took %.3f GiB where the KV pool's budget set aside "
                           "%.3f GiB for them%s", stores / 2**30, reserved / 2**30,
                           ": the difference comes out of the activations' share" if stores > reserved else "")
        return
    split = compat.memory_split(model_runner)
    if split is None or state.device.type != "cuda":
        return
    msg = stores_headroom_warning(stores, *split)
    if msg is not None:
        logger.warning(msg)


def _decode_switch(name: str) -> bool:
    """A switch of the decode kernel's module (BALANCE_ENABLED, BALANCE_GATE), read
    when asked: imported late (Triton), set by tests."""
    import importlib

    return bool(getattr(importlib.import_module("sgl_sparse.kernels.two_segment_decode"), name))


def _host_list(cpu: Optional[torch.Tensor], dev: torch.Tensor) -> list[int]:
    """A batch field on the host: SGLang's CPU copy when it has one."""
    src = cpu if cpu is not None else dev
    return [int(x) for x in (src.tolist() if hasattr(src, "tolist") else src)]


def _check_kv_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype,
                    capability: Optional[Tuple[int, int]] = None) -> None:
    """The KV pool's dtype: the model's, or fp8 (the decode kernel widens it as it reads;
    FlashInfer reads it itself; the selections fold the layer's k_scale in). e4m3 only
    on a GPU of compute ``capability`` 8.9 or later: Triton compiles its e4m3 type
    (``fp8e4nv``) for those alone, so on an A100 our kernels would fail at their first
    launch instead."""
    from sgl_sparse.kernels.two_segment_decode import FP8_KV_DTYPES

    if kv_dtype != model_dtype and kv_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"--attention-backend sgl_sparse: KV cache dtype {kv_dtype} must be the model's "
                         f"({model_dtype}) or fp8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2)")
    if kv_dtype == torch.float8_e4m3fn and capability is not None and tuple(capability) < (8, 9):
        raise ValueError(f"--attention-backend sgl_sparse: --kv-cache-dtype fp8_e4m3 needs a GPU of compute "
                         f"capability 8.9 or later (L40, H100, H200: Triton's e4m3); this one is "
                         f"{capability[0]}.{capability[1]}: use --kv-cache-dtype fp8_e5m2")


def _check_supported(model_runner) -> None:
    """Refuse, at start-up and by name, what the backend does not implement."""
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError("--attention-backend sgl_sparse: MLA models are not supported yet")
    if getattr(model_runner, "is_hybrid_swa", False) or getattr(model_runner, "sliding_window_size", None):
        raise ValueError(
            "--attention-backend sgl_sparse: models with sliding-window layers are not supported yet"
        )
    if getattr(model_runner.model_config, "is_encoder_decoder", False):
        raise ValueError("--attention-backend sgl_sparse: encoder-decoder models are not supported")
