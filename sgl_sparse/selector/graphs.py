"""The SFI refresh replayed from CUDA graphs.

A Selector run is ~12 Triton launches and a few dozen small torch ops: on the H100
~2.6 ms of host time whatever its rows (bench/README, session 14), which the GPU
waits for when the run is small. That fixed cost is what spreading the refreshes
(`refresh_groups`) and natural triggers (a few requests at a time, on any step) pay
per run. Captured once per shape, a run is one host->device copy of its rows and
one graph launch.

The shape of a run: its rows padded to a bucket (1, 2, 3, 4, 6, 8, 12, 16, ...: at
most 1.5x) by repeating the last row, and its bound on positions rounded up to
LENGTH_BUCKET x the same sequence (1024, 2048, 3072, 4096, 6144, 8192, ...) within
`limit` (the req_to_token row, the stored logits),
plus whatever host values the launch bakes in (the caller's `key`: the window, the
largest budget and Soft-NMS radius, the pools). A repeated row computes exactly what
the row computes and writes it to the same places, and the kernels mask every row
to its own positions, so the padded run's result is the run's
(tests/kernels/test_refresh_graphs.py).

A shape's first run is eager, padded as its replays will be: it serves that refresh
and compiles whatever Triton needs for it; the graph is captured right after, on a
side stream (recording only: nothing runs twice). All graphs share one memory pool:
they replay one at a time on the stream that prepares the decode steps, and none
keeps a value from one replay to the next but its index buffer (allocated outside
the pool). If a capture fails the graphs are switched off for the life of the
server, with a warning; the eager path stays correct.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

# The smallest length bucket; the others are it x 2, 3, 4, 6, 8, 12, ... (two per
# doubling, at most 1.5x the bound rounded up to 1024). Multiples of 1024 (sessions
# 15-16) gave a server a new shape -- an eager run plus a capture, on a live step --
# every 1024 positions a request grew, and 128 length buckets at 128K. Padding is
# exact but not free: the graphed refresh's device time at 2x / 4x the requests'
# length was +18% / +48% at 8192 x 32 and +20% / +66% at 32768 x 8 (H100,
# bench_selector.py --length-pad, bench/README "Session 16"), so up to 1.5x costs
# about +10% of a refresh: with one slow step in 32, ~0.5% of a decode step at
# 8192 x 32 (derived from those numbers, not measured end to end).
LENGTH_BUCKET = 1024
# Graphs kept (least recently replayed dropped first). A key is a (rows, length)
# bucket pair: a server with 32 slots at 128K meets at most 10 row buckets x 14
# length buckets, plus its windows and budgets.
MAX_GRAPHS = 256

Launch = Callable[[torch.Tensor, Sequence, int], None]


def _two_per_doubling(r: int) -> int:
    """r rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and their
    1.5x): at most 1.5x r."""
    if r <= 2:
        return max(r, 1)
    p = 1 << (r - 1).bit_length()  # next power of two >= r
    return p * 3 // 4 if r <= p * 3 // 4 else p


def row_bucket(r: int) -> int:
    """Rows rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: at most 1.5x the rows,
    two buckets per doubling."""
    return _two_per_doubling(r)


def length_bucket(n: int, limit: int) -> int:
    """The bound on positions rounded up to LENGTH_BUCKET x (1, 2, 3, 4, 6, 8, ...),
    within `limit`: at most 1.5x the bound rounded up to LENGTH_BUCKET."""
    return min(LENGTH_BUCKET * _two_per_doubling(-(-max(n, 1) // LENGTH_BUCKET)), limit)


def padded(rows: Sequence[int], specs: Sequence, r: int) -> tuple[list[int], list]:
    """`rows` and their `specs` padded to `r` entries by repeating the last."""
    extra = r - len(rows)
    return list(rows) + [rows[-1]] * extra, list(specs) + [specs[-1]] * extra


class _Graph:
    __slots__ = ("graph", "ridx")

    def __init__(self, graph: torch.cuda.CUDAGraph, ridx: torch.Tensor):
        self.graph, self.ridx = graph, ridx


class RefreshGraphs:
    """One SFI store's refresh graphs (CompactStore.refresh_graphs)."""

    def __init__(self, device: torch.device, max_graphs: int = MAX_GRAPHS):
        self.device = device
        self.max_graphs = max_graphs
        self.enabled = True
        self.captures = 0  # graphs captured over the store's life (a capture costs ~ an eager run)
        self.on_capture: Callable[[], None] | None = None  # after each capture (the server's metrics)
        self.replays = 0
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._pool = None
        self._stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, rows: Sequence[int], specs: Sequence, n: int, limit: int, key: Hashable, launch: Launch) -> None:
        """Run `launch(ridx, specs, n)` for `rows` (ridx: their int32 device indices)
        at the padded shape, from its graph when one is captured."""
        r = row_bucket(len(rows))
        n = length_bucket(n, limit)
        rows, specs = padded(rows, specs, r)
        full_key = (r, n, key)
        host = torch.tensor(rows, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()  # an asynchronous copy: the host does not wait for the GPU
        entry = self._graphs.get(full_key)
        if entry is not None:
            self._graphs.move_to_end(full_key)
            entry.ridx.copy_(host, non_blocking=True)
            entry.graph.replay()
            self.replays += 1
            return
        ridx = torch.empty(r, dtype=torch.int32, device=self.device)
        ridx.copy_(host, non_blocking=True)
        launch(ridx, specs, n)  # eager: this refresh, and Triton's compiles for its shape
        if self.enabled:
            self._capture(full_key, ridx, specs, n, launch)

    def _capture(self, key: Hashable, ridx: torch.Tensor, specs: Sequence, n: int, launch: Launch) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        side, main = self._stream, torch.cuda.current_stream(self.device)
        side.wait_stream(main)  # the eager run's ridx copy and work come first
        try:
            with torch.cuda.stream(side):
                # thread_local: SGLang's other threads may use CUDA meanwhile.
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    launch(ridx, specs, n)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any failure: stay on the eager path
            self.enabled = False
            logger.warning("sgl_sparse: SFI refresh CUDA graphs off (capture failed: %s); "
                           "refreshes run eagerly", exc)
            return
        finally:
            main.wait_stream(side)
        self.captures += 1
        if self.on_capture is not None:
            self.on_capture()
        self._graphs[key] = _Graph(graph, ridx)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        # A capture holds the step that needs it (host time, like an eager run): logged
        # so that a slow step in serving can be matched to one (bench/gpu/run_all.sh).
        logger.info("sgl_sparse: SFI refresh graph captured: %d rows, %d positions (%.1f ms host; %d kept, "
                    "%d captured)", ridx.shape[0], n, 1e3 * (time.perf_counter() - t0), len(self._graphs),
                    self.captures)
