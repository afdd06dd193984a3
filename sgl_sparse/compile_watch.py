"""Triton compiles of this package's kernels, logged with the specialization they were for.

Triton compiles one binary per kernel, constexpr values and class of each integer
argument (1, divisible by 16, other) and pointer alignment. The start-up warm-ups
(selector/refresh.warm_up_kernels, the decode-graph capture) are meant to compile every
class serving meets; a class they missed compiles in the middle of a decode step and
stalls the whole batch for as long as the compile takes (hundreds of ms, or tens when
Triton's disk cache has it). This watch makes each such stall visible in the server log:
every compile of a kernel under `sgl_sparse` is logged with its duration and argument
classes, at INFO while the server starts and at WARNING once it serves requests.

It uses Triton's `knobs.runtime.jit_cache_hook` / `jit_post_compile_hook` (called only
when a kernel is not in the process's in-memory cache, so nothing runs per launch) and
keeps any hooks installed before it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

_PACKAGE = "sgl_sparse"
_lock = threading.Lock()
_installed = False
_serving = False
_started: dict[tuple[int, str], float] = {}  # (thread, kernel repr) -> compile start
_listeners: list[Callable[[bool], None]] = []  # called with `serving` after each compile of ours
compiles = 0  # of our kernels, since the process started
compiles_after_serving = 0


def install() -> bool:
    """Install the hooks once per process; False where Triton has no such knobs."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, _before_compile)
        runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, _after_compile)
        _installed = True
        return True


def add_listener(fn: Callable[[bool], None]) -> None:
    """`fn(serving)` after each compile of our kernels (e.g. the Prometheus counter)."""
    if fn not in _listeners:
        _listeners.append(fn)


def mark_serving() -> None:
    """From now on a compile is a stall on a live batch: log it as a warning."""
    global _serving
    _serving = True


def _chain(previous: Optional[Callable[..., Any]], ours: Callable[..., Any]) -> Callable[..., Any]:
    # Triton skips the compile when the cache hook returns a truthy value: the earlier
    # hook keeps that say, ours never asks for it.
    if previous is None:
        return ours

    def hook(**kwargs: Any) -> Any:
        ours(**kwargs)
        return previous(**kwargs)

    return hook


def _ours(fn: Any) -> bool:
    return str(getattr(fn, "module", "")).startswith(_PACKAGE)


def _before_compile(*, fn: Any, repr: str, **_: Any) -> None:
    if _ours(fn):
        _started[(threading.get_ident(), repr)] = time.perf_counter()
    return None


def describe(compile: dict, fallback: str = "") -> str:
    """The arguments' classes of one compile: `name:type/16` where an integer is
    divisible by 16 (a pointer 16-byte aligned), `name=value` for a constant (a
    constexpr, or an integer argument equal to 1)."""
    try:
        consts = compile.get("constants") or {}
        attrs = (compile.get("configs") or [{}])[0] or {}
        parts = []
        for i, (name, ty) in enumerate(compile["signature"].items()):
            if ty == "constexpr":
                parts.append(f"{name}={consts.get((i,))!r}")
            else:
                div = any(a[0] == "tt.divisibility" for a in attrs.get((i,), ()))
                parts.append(f"{name}:{ty}{'/16' if div else ''}")
        return ", ".join(parts)
    except (AttributeError, KeyError, IndexError, TypeError):  # another Triton's layout
        return fallback


def _after_compile(*, fn: Any, repr: str, compile: Optional[dict] = None, is_manual_warmup: bool = False,
                   **_: Any) -> None:
    global compiles, compiles_after_serving
    if not _ours(fn):
        return None
    compiles += 1
    t0 = _started.pop((threading.get_ident(), repr), None)
    ms = (time.perf_counter() - t0) * 1e3 if t0 is not None else float("nan")
    serving = _serving and not is_manual_warmup
    for listener in list(_listeners):
        listener(serving)
    if serving:
        compiles_after_serving += 1
        logger.warning("sgl_sparse: Triton compiled %s.%s while serving (%.0f ms, the batch waited): %s",
                       fn.module, fn.name, ms, describe(compile or {}, repr))
    else:
        logger.info("sgl_sparse: Triton compiled %s.%s (%.0f ms): %s", fn.module, fn.name, ms,
                    describe(compile or {}, repr))
    return None
