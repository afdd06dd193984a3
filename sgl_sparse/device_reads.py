"""Metric values still on their way from the device: a device-to-host copy enqueued
without a synchronize, observed once its event has completed.

The scheduler thread must never wait on the GPU, and a value must not wait for the
next forward either: an idle server's last requests would never be observed (session
34: a benchmark row read none of its lfps requests' scored fractions, the first
forward after them came with the next row). So a daemon thread waits on each copy's
event -- a blocking-sync event: it sleeps instead of spinning a core next to the
scheduler -- and observes the host tensor; CPU tensors are observed at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)


class DeviceReads:
    """``put(host, done)``: call ``observe(host)`` once ``done`` (recorded after the
    copy into ``host``) has completed; ``done=None``: now."""

    def __init__(self, observe: Callable[[torch.Tensor], None], name: str):
        self._observe = observe
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._pending = 0  # put and not yet observed (wait_idle)

    @staticmethod
    def event() -> torch.cuda.Event:
        """The event to record after a copy handed to :meth:`put`."""
        return torch.cuda.Event(blocking=True)

    def put(self, host: torch.Tensor, done: Optional[torch.cuda.Event]) -> None:
        if done is None:
            self._observe_safely(host)
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((host, done))

    def wait_idle(self, timeout: float) -> bool:
        """Whether every value put so far was observed within ``timeout`` seconds (tests)."""
        import time

        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        while True:
            host, done = self._queue.get()
            done.synchronize()  # releases the GIL; a blocking-sync event sleeps
            self._observe_safely(host)
            with self._lock:
                self._pending -= 1

    def _observe_safely(self, host: torch.Tensor) -> None:
        # A metric must never take the scheduler (or this thread) down.
        try:
            self._observe(host)
        except Exception:  # noqa: BLE001
            logger.exception("sgl_sparse: observing %s failed", self._name)
