"""Per-request device storage of the query-aware policies, reserved once when the
backend is built (one store per policy, sized by `query_aware.<policy>` in the
server config; README "Query-aware policies" gives the byte formulas).

Layouts (slot = one live request of the policy; layers of this rank):
  quest       kmin, kmax   [layers, slots, Hkv, max_pages, D]  model dtype (the KV
                           pool's, or the model's over an fp8 pool)
                           elementwise min / max of the keys of each page of 16
                           consecutive positions of the request
  asyncspade  ring         [layers, slots, W + 1, Hq, D]       model dtype
                           the last W + 1 queries (W regressors + the target Q_t;
                           queryaware.asyncspade's ring convention)
              total        [layers, slots] int64               queries pushed
              sel_pos      [layers, slots, Hkv, capacity] int32
              sel_count    [layers, slots, Hkv] int32
                           the selection for the next step (sink positions first,
                           then the Top-K, ascending, all < that step's b_start)
              sel_slot     [layers, slots, Hkv, capacity] int32
                           the same as pool slots (req_to_token applied), written
                           beside sel_pos by the device path, which the decode reads
                           in place (only with ASPD_LISTS_IN_PLACE)
              one extra slot (`scratch_slot`, the last) takes the writes of the
              batch rows that are not asyncspade's: the CUDA-graph path
              (query_device.py) writes every row, masked by where it writes
              with `index_keys: int8 | int4` [ours], what its scoring pass reads
              (kernels/index_keys.py; filled by that pass, not at prefill):
              kq           [layers, slots, Hkv, max_context, D] int8
                           (int4: [..., D / 2], two codes a byte)
              kscale       [layers, slots, Hkv, max_context] fp32
              filled       [layers, slots, 2] int32  how far kq is valid,
                                                     zeroed when a request takes the slot
              ksmooth      [layers, slots, Hkv, D] fp32 (int4 only): the channels'
                           powers of two, from the prompt's keys at each extend chunk
              htop         [G, slots, Hkv, 64] int32 (G = topk_layers): the top-digit
                           histograms of the scores the scoring pass writes, added by it,
                           read and zeroed by the group's Top-K (topk_range's h_top;
                           query_device.TOPK_HIST_FROM_SCORES); zero between steps
              with `topk_layers: G > 1` [ours]: the scores of a group's layers,
              kept from each layer's scoring to the group's one Top-K launch
              (overwritten every step, never read across steps):
              scores       [G, slots, Hkv, max_context] fp32
              with `cache_device` [ours] (another GPU runs the selection): kq,
              kscale, filled, ksmooth, htop and scores (also at G = 1) live there,
              with the Top-K's own output and scratch (allocated here, not per call:
              the decode graphs are captured on the serving GPU):
              topk_out     [G * slots, Hkv, min(capacity, max_context)] int32
              topk_scratch [G * slots, Hkv, max_context] fp32
              the ring and the selections stay on the serving GPU (tensors() there,
              cache_tensors() on the cache GPU)
  lfps        ver, sla     [layers, slots, Hkv, max_context] fp32  score tables, stored
                                                 divided by tscale
              tscale       [layers, slots, Hkv] fp32      the tables' scale (true value =
                                                 stored * scale): Eq. (10)'s decay on the
                                                 device path multiplies it by r instead of
                                                 the tables (kernels/lfps_tables.lfps_finish);
                                                 1 after the prompt's init, and always on
                                                 the torch path (no kernels: CPU)
              shift        [layers, slots, Hkv, 2] fp32   the rows' means of Φ_ver and Φ_sla
                                                 at their last step, stored units: the
                                                 power sums' shift of the next step's
                                                 table statistics (kernels/lfps_tables.
                                                 STATS_POWER_SUMS: only then allocated);
                                                 any value is correct (a reused slot's
                                                 only moves the rounding)
              kbar, vbar   [layers, slots, Hkv, D] fp32   mean prefill key / value
              sigma_hat2   [layers, slots, Hq] fp32       sigma^2 / |q|^2 (Eq. 5)
              scored       [slots, Hkv, 2] fp64  |C1| scored and n - sink, summed over
                                                 the request's selected steps and layers
                                                 (the scored fraction, Table 4's shape);
                                                 read and zeroed at its release (with
                                                 --enable-metrics: lfps_scored.py)
A slot is owned by one request from admission to release (SparseState); its
contents are rewritten at the request's extend chunks before any decode step reads
them, so a reused slot never leaks its previous owner's data into a selection.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from sgl_sparse.config import QUEST_PAGE, AsyncSpadeStoreConfig, QueryStoreConfig
from sgl_sparse.kernels._utils import env_switch

#: asyncspade's decode reads each layer's selections in the store (its pool slots,
#: `sel_slot`) instead of a per-layer copy into the step's rows (gather_selection,
#: 0.18 ms a step at 32768 x 8 on an H200, session 29): one launch a layer fewer, the
#: decode reading the lists through a row map (two_segment_decode's `a_lists`). H200,
#: 32768 x 8, int4 copies, served: inter-token 4.691 -> 4.523 ms, stock 8.955 in the
#: same run (0.524x -> 0.505x; bench/README "Session 41"). SGLANG_SPARSE_ASPD_LISTS_IN_PLACE=0:
#: the copy.
ASPD_LISTS_IN_PLACE = env_switch("ASPD_LISTS_IN_PLACE", True)


class QuestStore:
    def __init__(self, cfg: QueryStoreConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.max_pages = -(-cfg.max_context // QUEST_PAGE)
        shape = (num_layers, cfg.slots, num_kv_heads, self.max_pages, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kmin, self.kmax


class AsyncSpadeStore:
    def __init__(self, cfg: AsyncSpadeStoreConfig, *, window: int, num_layers: int, num_kv_heads: int,
                 num_q_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 cache_device: Optional[torch.device] = None):
        """``cache_device``: where the selection's own tensors go when
        ``cfg.cache_device`` is set (default: that GPU; planning passes the meta
        device). The prediction's ring and the selections the decode reads stay on
        ``device``."""
        self.cfg = cfg
        #: the selection runs on another GPU (cfg.cache_device): its tensors are not the serving GPU's
        self.remote = cfg.cache_device is not None
        if cache_device is None:
            cache_device = torch.device(cfg.cache_device) if self.remote else device
        self.cache_device = torch.device(cache_device)
        self.scratch_slot = cfg.slots
        self.rows = cfg.slots + 1
        self.ring = torch.zeros(num_layers, self.rows, window + 1, num_q_heads, head_dim, dtype=dtype, device=device)
        self.total = torch.zeros(num_layers, self.rows, dtype=torch.int64, device=device)
        self.sel_pos = torch.zeros(num_layers, self.rows, num_kv_heads, cfg.capacity, dtype=torch.int32, device=device)
        self.sel_count = torch.zeros(num_layers, self.rows, num_kv_heads, dtype=torch.int32, device=device)
        self.sel_slot = torch.zeros_like(self.sel_pos) if ASPD_LISTS_IN_PLACE else None
        if cfg.index_keys == "int4" and (head_dim < 64 or head_dim & (head_dim - 1)):
            raise ValueError(f"sgl_sparse: query_aware.asyncspade.index_keys: 'int4' needs a head_dim that is a power of two "
                             f">= 64 (its scoring dots take D/2 channels each), this model's is {head_dim}")
        self.index_keys = cfg.index_keys != "kv"
        self.index_bits = 4 if cfg.index_keys == "int4" else 8
        side = self.cache_device
        self.kq = self.kscale = self.filled = self.ksmooth = None
        if self.index_keys:
            width = head_dim // 2 if self.index_bits == 4 else head_dim  # two 4-bit codes a byte
            self.kq = torch.zeros(num_layers, cfg.slots, num_kv_heads, cfg.max_context, width, dtype=torch.int8,
                                  device=side)
            self.kscale = torch.zeros(num_layers, cfg.slots, num_kv_heads, cfg.max_context, dtype=torch.float32,
                                      device=side)
            self.filled = torch.zeros(num_layers, cfg.slots, 2, dtype=torch.int32, device=side)
        if self.index_bits == 4 and self.index_keys:
            self.ksmooth = torch.ones(num_layers, cfg.slots, num_kv_heads, head_dim, dtype=torch.float32,
                                      device=side)
        # layers per Top-K launch (query_device._aspd_next), at most all of them
        self.topk_layers = max(1, min(cfg.topk_layers, num_layers))
        self.scores = None
        if self.topk_layers > 1 or self.remote:
            self.scores = torch.empty(self.topk_layers, cfg.slots, num_kv_heads, cfg.max_context,
                                      dtype=torch.float32, device=side)
        # zeros: the scoring pass adds to them, the Top-K leaves them zeroed after reading
        self.htop = None
        if self.index_keys:
            self.htop = torch.zeros(self.topk_layers, cfg.slots, num_kv_heads, 64, dtype=torch.int32, device=side)
        # On another GPU the Top-K's output and scratch are allocated here, not per call:
        # a decode graph is captured on the serving GPU, and its private pool serves that
        # GPU's allocations only (another GPU's would be freed back to its cache after
        # the capture, and emptied with it).
        self.topk_out = self.topk_scratch = None
        if self.remote:
            rows = self.topk_layers * cfg.slots
            self.topk_out = torch.zeros(rows, num_kv_heads, max(1, min(cfg.capacity, cfg.max_context)),
                                        dtype=torch.int32, device=side)
            self.topk_scratch = torch.empty(rows, num_kv_heads, cfg.max_context, dtype=torch.float32, device=side)

    @contextlib.contextmanager
    def cache_writes(self, device: torch.device) -> Iterator[None]:
        """Around host-issued writes to the selection's tensors (a slot's copies reset
        and smoothing at extend) when they live on the cache GPU: there they run on
        that GPU's current stream, which no stream of the serving GPU orders. It waits
        for the serving GPU's current stream first (which joined the last decode's
        selection), and that stream for it after (which the next decode's selection
        forks from)."""
        if not self.remote or self.cache_device.type != "cuda":
            yield
            return
        main, side = torch.cuda.current_stream(device), torch.cuda.current_stream(self.cache_device)
        side.wait_stream(main)
        yield
        main.wait_stream(side)

    def _selection_tensors(self) -> tuple[torch.Tensor, ...]:
        index = (self.kq, self.kscale, self.filled) if self.index_keys else ()
        index += (self.ksmooth,) if self.ksmooth is not None else ()
        scores = (self.scores,) if self.scores is not None else ()
        htop = (self.htop,) if self.htop is not None else ()
        topk = (self.topk_out, self.topk_scratch) if self.remote else ()
        return *index, *scores, *htop, *topk

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors on the serving GPU (what its memory budget pays for)."""
        lists = (self.sel_slot,) if self.sel_slot is not None else ()
        own = (self.ring, self.total, self.sel_pos, self.sel_count, *lists)
        return own if self.remote else (*own, *self._selection_tensors())

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors on the cache GPU (cfg.cache_device; none without one)."""
        return self._selection_tensors() if self.remote else ()


def cache_device_for(name: str, device: torch.device) -> torch.device:
    """asyncspade's cache GPU (``query_aware.asyncspade.cache_device``) beside the
    serving ``device``, checked: another GPU of this host that can read and write the
    serving GPU's memory (peer access), which is then enabled. On the meta device
    (planning) the meta device."""
    if device.type == "meta":
        return device
    field = "query_aware.asyncspade.cache_device"
    if device.type != "cuda":
        raise ValueError(f"sgl_sparse: {field}: {name!r} needs a GPU server; this one runs on {device}")
    cache = torch.device(name)
    count = torch.cuda.device_count()
    if cache.index >= count:
        raise ValueError(f"sgl_sparse: {field}: {name!r}, but this process sees {count} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES decides which)")
    serving = device.index if device.index is not None else torch.cuda.current_device()
    if cache.index == serving:
        raise ValueError(f"sgl_sparse: {field}: {name!r} is the serving GPU itself; name another one")
    if not (torch.cuda.can_device_access_peer(cache.index, serving)
            and torch.cuda.can_device_access_peer(serving, cache.index)):
        raise ValueError(f"sgl_sparse: {field}: {name!r} has no peer access to cuda:{serving} (NVLink or PCIe "
                         f"peer-to-peer), which its kernels need to read the step's keys and write the selections")
    # PyTorch enables a GPU's access to another's memory at its first copy from it
    # (at::cuda::get_p2p_access(src, dst)): the cache GPU's kernels load and store the
    # serving GPU's tensors directly
    torch.zeros(1, device=cache).to(torch.device("cuda", serving))
    return cache


class LfpsStore:
    def __init__(self, cfg: QueryStoreConfig, *, num_layers: int, num_kv_heads: int, num_q_heads: int,
                 head_dim: int, device: torch.device):
        self.cfg = cfg
        f32 = dict(dtype=torch.float32, device=device)
        self.ver = torch.zeros(num_layers, cfg.slots, num_kv_heads, cfg.max_context, **f32)
        self.sla = torch.zeros_like(self.ver)
        self.kbar = torch.zeros(num_layers, cfg.slots, num_kv_heads, head_dim, **f32)
        self.vbar = torch.zeros_like(self.kbar)
        self.sigma_hat2 = torch.zeros(num_layers, cfg.slots, num_q_heads, **f32)
        self.tscale = torch.ones(num_layers, cfg.slots, num_kv_heads, **f32)
        # the table statistics' shift, where their power sums are on (kernels/lfps_tables)
        from sgl_sparse.kernels import lfps_tables

        self.shift = None
        if lfps_tables.STATS_POWER_SUMS:
            self.shift = torch.zeros(num_layers, cfg.slots, num_kv_heads, 2, **f32)
        # fp64: summed over a request's steps, layers and heads, fp32 would drop units
        self.scored = torch.zeros(cfg.slots, num_kv_heads, 2, dtype=torch.float64, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ver, self.sla, self.kbar, self.vbar, self.sigma_hat2, self.tscale, self.scored,
                *(() if self.shift is None else (self.shift,)))

    def true_tables(self, li: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's (Φ_ver, Φ_sla) of layer li as the algorithm defines them (stored * scale)."""
        scale = self.tscale[li, slot][:, None]
        return self.ver[li, slot] * scale, self.sla[li, slot] * scale

    def layer(self, li: int):
        from sgl_sparse.queryaware.lfps import LfpsState

        return LfpsState(ver=self.ver[li], sla=self.sla[li], kbar=self.kbar[li], vbar=self.vbar[li],
                         sigma_hat2=self.sigma_hat2[li])


def nbytes(store, tensors: Optional[tuple[torch.Tensor, ...]] = None) -> int:
    """Bytes of ``tensors`` (default: the store's on the serving GPU)."""
    return sum(t.numel() * t.element_size() for t in (store.tensors() if tensors is None else tensors))


def slot_nbytes(store: Optional[object]) -> int:
    if store is None:
        return 0
    return nbytes(store) // max(getattr(store, "rows", store.cfg.slots), 1)
