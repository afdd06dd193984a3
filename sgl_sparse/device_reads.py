"""Metric values still on their way from the device (a device-to-host copy, a pair of
timing events) enqueued without a synchronize, observed once their event has completed.

The scheduler thread must never wait on the GPU, and a value must not wait for the
next forward either: an idle server's last requests would never be observed (session
34: a benchmark row read none of its lfps requests' scored fractions, the first
forward after them came with the next row). So a daemon thread waits on each copy's
event -- a blocking-sync event: it sleeps instead of spinning a core next to the
scheduler -- and observes the value; a value with no event is observed at once.
Users: lfps's scored fraction (lfps_scored.py), the Selector's refresh
duration (metrics.time_selector).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)


class DeviceReads:
    """``put(value, done)``: call ``observe(value)`` once ``done`` (recorded after the
    work ``value`` depends on) has completed; ``done=None``: now."""

    def __init__(self, observe: Callable[[Any], None], name: str):
        self._observe = observe
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._pending = 0  # put and not yet observed (wait_idle)

    @staticmethod
    def event(timing: bool = False) -> torch.cuda.Event:
        """An event for :meth:`put` (``timing``: for ``elapsed_time``)."""
        return torch.cuda.Event(enable_timing=timing, blocking=True)

    @staticmethod
    def to_host(t: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """``t`` copied to the host, for :meth:`put`: on CUDA a copy into pinned memory
        enqueued on the current stream without a synchronize, and the event it
        completes at; elsewhere a copy now and None."""
        if not t.is_cuda:
            return t.clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = DeviceReads.event()
        done.record()
        return host, done

    def put(self, value: Any, done: Optional[torch.cuda.Event]) -> None:
        if done is None:
            self._observe_safely(value)
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((value, done))

    def wait_idle(self, timeout: float) -> bool:
        """Whether every value put so far was observed within ``timeout`` seconds (tests)."""
        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        while True:
            value, done = self._queue.get()
            done.synchronize()  # releases the GIL; a blocking-sync event sleeps
            self._observe_safely(value)
            with self._lock:
                self._pending -= 1

    def _observe_safely(self, value: Any) -> None:
        # A metric must never take the scheduler (or this thread) down.
        try:
            self._observe(value)
        except Exception:  # noqa: BLE001
            logger.exception("sgl_sparse: observing %s failed", self._name)
