"""What every kernel benchmark does first: pick the device, import the kernels, time launches.

On a machine without CUDA the benchmarks only run with ``--smoke`` (small
shapes under the Triton interpreter, to check the script itself); the
interpreter has to be switched on before the kernels are imported.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from types import ModuleType
from typing import Optional

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def use_cuda_or_exit(smoke: bool) -> Optional[bool]:
    """True: CUDA; False: the CPU interpreter (``--smoke``); None: neither is
    possible (the caller returns 2 after the message printed here)."""
    import torch

    if torch.cuda.is_available() and not smoke:
        return True
    if not smoke:
        print("No CUDA device: use --smoke to exercise this script on the CPU interpreter.", file=sys.stderr)
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def import_kernels(submodule: str = "") -> ModuleType:
    """The installed ``sgl_sparse.kernels`` (or one of its submodules), else this
    checkout's ``kernels``."""
    suffix = f".{submodule}" if submodule else ""
    try:
        return importlib.import_module("sgl_sparse.kernels" + suffix)
    except ImportError:
        sys.path.insert(0, _REPO_ROOT)
        return importlib.import_module("kernels" + suffix)


class Timer:
    """Median µs of a launch: eager (``triton.testing.do_bench``; on the CPU
    interpreter one call: no measurement there, only the script's run, and each call
    costs CI seconds) and under CUDA-graph replay
    (``do_bench_cudagraph``, L2 not flushed; None on the CPU, when off, or when capture fails:
    the eager time still stands)."""

    def __init__(self, use_cuda: bool, warmup: int, rep: int, graphs: bool = True):
        self.use_cuda, self.warmup, self.rep, self.graphs = use_cuda, warmup, rep, graphs

    def eager_us(self, fn) -> float:
        import triton

        if self.use_cuda:
            return 1e3 * triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")
        return self.checked_run(fn)

    def checked_run(self, fn) -> float:
        """One call of ``fn`` (the run a script then checks), its wall time in µs."""
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)

    def again(self, fn, checked_us: float) -> tuple[float, Optional[float]]:
        """(eager_us, graph_us) of ``fn`` after its checked run took ``checked_us``. On
        the CPU interpreter that run's figure, no second call: each one costs CI
        interpreter seconds, and the figure means nothing there."""
        if not self.use_cuda:
            return checked_us, None
        return self.eager_us(fn), self.graph_us(fn)

    def graph_us(self, fn) -> Optional[float]:
        import triton

        if not self.use_cuda or not self.graphs:
            return None
        try:
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=self.rep, return_mode="median")
        except Exception as e:  # noqa: BLE001 - eager timing still stands
            print(f"  [graph timing failed: {type(e).__name__}: {e}]", file=sys.stderr)
            return None


def graph_replay_ms(fn, reps: int = 20, warm_replays: int = 0, capture_stream=None) -> float:
    """Median ms of one CUDA-graph replay of ``fn``: run three times on a side stream
    (compiles, warms), captured once, then ``warm_replays`` untimed replays and
    ``reps`` timed ones (CUDA events around each). A caller that also captures work
    on streams of its own forks and joins them inside ``fn``. ``capture_stream``: the
    stream to capture on (its priority becomes the captured kernels' priority:
    PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority)."""
    import statistics

    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=capture_stream):
        fn()
    for _ in range(warm_replays):
        g.replay()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def add_common_args(ap) -> None:
    """The flags every kernel benchmark takes."""
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU interpreter")
    ap.add_argument("--cases", default="", help="comma-separated case-name prefixes (default: all)")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")


def start(args, title: str):
    """(use_cuda, device, SM count, environment dict, Timer) for a benchmark run, the
    environment printed under ``title``; None when neither CUDA nor ``--smoke``."""
    import json
    import platform

    import torch

    use_cuda = use_cuda_or_exit(args.smoke)
    if use_cuda is None:
        return None
    import triton

    dev = torch.device("cuda" if use_cuda else "cpu")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if use_cuda else 4
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if use_cuda else "cpu (triton interpreter)", "num_sms": num_sms}
    print(f"# {title}\n" + json.dumps(env))
    return use_cuda, dev, num_sms, env, Timer(use_cuda, args.warmup, args.rep, graphs=True)


@contextlib.contextmanager
def module_constant(module: ModuleType, name: str, value):
    """``module.name`` set to ``value`` inside the block (a knob the launcher reads at
    each launch, for an A/B in one run), restored after."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def decode_stage1_variants(K) -> list:
    """Registers, spills and shared memory of each compiled variant of the decode's
    stage-1 kernel (by its constexpr flags): a variant that needs more registers
    keeps fewer programs per SM resident (session 38: the balanced variant's 142
    against 128 cost 1.5x). Empty on the interpreter or where this Triton keeps its
    cache elsewhere. (Until session 38 it looked under the JITFunction's ``fn``, the
    plain Python function, and found nothing.)"""
    import importlib

    fn = importlib.import_module(K.two_segment_decode.__module__)._two_segment_decode_stage1
    flags = ("DIRECT", "FUSED_MERGE", "BALANCE", "SPLIT_MAJOR", "SAVE_LOGITS", "SAVE_Q", "STORE_KNORM",
             "HAS_ROW_MASK")
    rows = []
    for caches in getattr(fn, "device_caches", {}).values():
        for kernel in caches[0].values():
            consts = {}
            try:
                names = fn.arg_names
                for key, val in kernel.src.constants.items():
                    name = names[key[0]] if isinstance(key, tuple) else key
                    consts[name if isinstance(name, str) else str(name)] = val
            except Exception:  # the layout of a compiled kernel's source differs across Triton versions
                pass
            meta = getattr(kernel, "metadata", None)
            rows.append({"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                         "shared": getattr(meta, "shared", None), "maxnreg": getattr(meta, "maxnreg", None),
                         **{f: consts.get(f) for f in flags}})
    return rows
