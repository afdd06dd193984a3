"""lfps's scored fraction per finished request (``sglang_sparse_lfps_scored_fraction``):
positions scored exactly (|C1|) over the positions past the sinks, summed over the
request's sparse steps, layers and KV heads -- the LFPS paper's Table 4, served.

The sums live on the device (``LfpsStore.scored [slots, Hkv, 2]`` fp64), added by
the selection's own kernel (``kernels/lfps_tables.lfps_select_out``) or, on the
torch path, beside the table update (``query_serving``). At a request's release
(``SparseState.release``, the scheduler thread) its slot's sums are copied to the
host and zeroed, enqueued on the *forward* stream: after every forward that added to
them (SGLang's overlap scheduler releases a finished request while the next forward,
which may still hold its row, runs on a stream of its own), before any later
forward's admission can reuse the slot (its ops come after in that stream). The copy
is observed once it has completed (``device_reads.DeviceReads``): the scheduler never
synchronizes, and an idle server still reports its last requests.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from sgl_sparse.device_reads import DeviceReads
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.selector.core import to_device


class ScoredFractionReads:
    """For a server with lfps slots; its reads are no-ops without metrics."""

    def __init__(self, state):
        self.state = state
        self.store = state.query_stores[PolicyId.LFPS]
        self._reads = DeviceReads(self._observe, "sgl_sparse-lfps-scored")
        self._forward_stream: Optional[torch.cuda.Stream] = None
        self._later: list[int] = []  # released while the forward stream was capturing

    def note_forward(self, in_capture: bool) -> None:
        """A forward begins on the current stream: the stream the sums are added on,
        and so the one their reads are ordered on. Reads held back during a capture
        are enqueued now, before this forward's admissions."""
        if in_capture:
            return
        if self.state.device.type == "cuda":
            self._forward_stream = torch.cuda.current_stream()
        if self._later:
            slots, self._later = self._later, []
            self.read(slots)

    def read(self, slots: list[int]) -> None:
        """The released lfps requests' slots: their sums read, zeroed and observed."""
        if not slots or self.state.metrics is None:
            return
        read = self._read_sums(slots)
        if read is not None:
            self._reads.put(*read)

    def warm(self) -> None:
        """At start-up (CUDA, with metrics): one read of each batch size class, waited
        for, so that a release during serving finds the read's kernels loaded and its
        pinned host blocks cached (a first pinned allocation or kernel load can wait
        for the device: a GPU test's first read took over 0.1 s while its forward
        stream was busy, session 34). Reads the unused slot 0's zero sums."""
        if not self.store.scored.is_cuda or self.state.metrics is None:
            return
        n = 1
        while True:
            read = self._read_sums([0] * n)
            if read is None:  # a capture is running: nothing to warm now
                self._later.clear()
                return
            read[1].synchronize()
            if n >= self.store.cfg.slots:
                break
            n = min(2 * n, self.store.cfg.slots)

    def wait_idle(self, timeout: float) -> bool:
        """Every read so far observed within ``timeout`` seconds (tests)."""
        return self._reads.wait_idle(timeout)

    def _read_sums(self, slots: list[int]) -> Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]]:
        """(host sums [len(slots), 2], the copy's event or None on CPU); None: held
        back while the forward stream captures a graph."""
        scored = self.store.scored
        on_cuda = scored.is_cuda
        stream = self._forward_stream if on_cuda else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if on_cuda and torch.cuda.is_current_stream_capturing():
                self._later.extend(slots)  # not part of a graph: after the capture
                return None
            idx = to_device(torch.tensor(slots, dtype=torch.int64), scored.device)
            sums = scored[idx].sum(1)
            scored.index_fill_(0, idx, 0.0)  # the slot's next request starts from 0
            return DeviceReads.to_host(sums)

    def _observe(self, sums: torch.Tensor) -> None:
        """scored / eligible per request (none for a request no step selected for:
        nothing eligible)."""
        for scored, eligible in sums.tolist():
            if eligible > 0:
                self.state.metrics.on_lfps_scored(scored / eligible)
