"""How many balanced decode forwards ran the balanced launch, read without a synchronize.

With ``SGLANG_SPARSE_BALANCE_GATE`` (the default) a forward on the balanced graph
(``sglang_sparse_decode_forwards_total{path="kernel_balanced"}``: natural SFI triggers
replay it every step) launches the plain partition beside the balanced one, and a
device flag a step (``kernels.step_balance``: does a request's share differ from the
heuristic's splits?) lets one of them run. Which one is known on the device only: the
launch computing the flag adds it to a counter here, and every ``READ_EVERY`` balanced
forwards the counter is copied to the host on the forward stream and observed once
the copy completes (``device_reads.py``), into
``sglang_sparse_balanced_launches_total``. The forwards whose flag was 0 ran the plain
launch. The last (< READ_EVERY) forwards of an idle server are observed with the next
read. A graph capture's eager warm-up runs add to a scratch counter (the capture records
the add its replays run).
"""

from __future__ import annotations

import torch

from sgl_sparse.device_reads import DeviceReads

#: balanced forwards between two reads of the counter (a copy and an event each)
READ_EVERY = 16


class BalancedLaunchCount:
    """The device counter of the steps whose gate ran the balanced launch, and its reads."""

    def __init__(self, metrics, device: torch.device):
        self._metrics = metrics
        # fixed address: the captured steps add to it at every replay
        self.total = torch.zeros(1, dtype=torch.int64, device=device)
        self._scratch = torch.zeros(1, dtype=torch.int64, device=device)  # a capture's warm-up's adds
        self._forwards = 0  # balanced forwards seen on the host since the last read
        self._capturing = False  # forwards are being captured (their warm-ups run eagerly)
        self._seen = 0  # the count observed so far (the reads' thread only)
        self._reads = DeviceReads(self._observe, "sgl_sparse-balanced-launches")

    def counter(self) -> torch.Tensor:
        """Inside the step (captured with it): the counter the step's gate launch
        (``kernels.step_balance``) adds its gate to, 1 where the balanced launch runs.
        A capture's eager warm-up (not a served forward) gets a scratch counter instead:
        the same binary as the capture's launch, compiled before the capture."""
        if self._capturing and not (self.total.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._scratch
        return self.total

    def note_forward(self, balanced: bool, in_capture: bool) -> None:
        """The host, once a decode forward (not while capturing: that forward is not run)."""
        self._capturing = in_capture
        if in_capture or not balanced:
            return
        self._forwards += 1
        if self._forwards >= READ_EVERY:
            self._forwards = 0
            self.read()

    def read(self) -> None:
        """Copy the counter on the current (forward) stream; observed once copied."""
        self._reads.put(*DeviceReads.to_host(self.total))

    def warm(self) -> None:
        """At start-up: one read waited for, so that serving's first one finds its
        pinned block cached (a first pinned allocation can wait for the device)."""
        self.read()
        self._reads.wait_idle(5.0)

    def wait_idle(self, timeout: float) -> bool:
        """Every read so far observed within ``timeout`` seconds (tests)."""
        return self._reads.wait_idle(timeout)

    def _observe(self, host: torch.Tensor) -> None:
        count = int(host[0])
        delta, self._seen = count - self._seen, count
        if delta > 0:
            self._metrics.on_balanced_launches(delta)
