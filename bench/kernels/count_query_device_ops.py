"""Ops per decode layer of query_device (quest + asyncspade + lfps on the device path), on CPU.

Counts the aten ops (each one a GPU kernel or more on CUDA, except views) and the
Triton launches of QueryAwareRuntime.select + finish at bs = 8 with quest,
asyncspade and lfps rows, 4 slots per store (tests/test_query_device.py's twin):
  first  the first layer of a forward (per-forward work + per-layer work)
  other  any further layer of the same forward (the per-layer work only)
Guarded by tests/test_query_device.py::test_ops_per_layer_stay_few (last
measured: first 155 ops, other 0 ops, 16 Triton launches on every layer, of
which lfps 7 launches (kernels/lfps_tables.py); other <= 2, first <= 160,
launches == 16; 157 / 2 / 16 with the slots' queries gathered; 162 / 12 / 15 with quest's and asyncspade's a_pos / a_len /
store write-backs as torch ops; with lfps's table work in torch ops: 326 / 159 / 13, lfps
~148 ops and 5 launches; before lfps joined: 119 / 11 / 8). The same counts for a
`full`-only batch, per policy: count_query_aware_ops.py.
Run: TRITON_INTERPRET=1 python bench/kernels/count_query_device_ops.py
"""

from __future__ import annotations

import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch nothing on the device (metadata / views)
_FREE = ("view", "_unsafe_view", "alias", "as_strided", "expand", "permute", "transpose", "t", "slice",
         "select", "unsqueeze", "squeeze", "detach", "reshape", "split", "unbind", "_reshape_alias",
         "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "sym_size",
         "sym_stride", "is_same_size", "_to_copy_noop", "numel", "dim", "size", "stride", "flip_view")


class OpCounter(TorchDispatchMode):
    """aten ops outside Triton launches (the glue), and Triton launches. `free`:
    the views and allocations (no device kernel, but host dispatches all the same)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.free: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        # `t[idx] = <python scalar>`: on CUDA the scalar becomes a pageable host tensor
        # copied to the device, and such a copy first waits for the whole stream (a
        # host/device sync in the middle of the step; index_fill_ takes the scalar as
        # a kernel argument instead).
        self.host_scalar_writes = 0
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_kernel:
            name = func.overloadpacket.__name__
            (self.free if name in _FREE else self.ops)[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._orig = InterpretedFunction.run
        self._orig_setitem = torch.Tensor.__setitem__
        counter = self

        def setitem(t, idx, value):
            parts = idx if isinstance(idx, tuple) else (idx,)
            if isinstance(value, (bool, int, float)) and any(isinstance(p, torch.Tensor) for p in parts):
                counter.host_scalar_writes += 1
            return counter._orig_setitem(t, idx, value)

        torch.Tensor.__setitem__ = setitem

        def run(fn_self, *a, **k):
            counter.launches[fn_self.fn.__name__] += 1
            counter._in_kernel += 1
            try:
                return counter._orig(fn_self, *a, **k)
            finally:
                counter._in_kernel -= 1

        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._orig
        torch.Tensor.__setitem__ = self._orig_setitem
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


MIXED = [5, 1, 7, 3, 0, 4, 2, 6]  # quest 1-3, asyncspade 4-5, lfps 6, full 7, padding 0


def count_forward(rows=MIXED, group: int = 2, prepare=None) -> dict:
    """{'first': OpCounter, 'other': OpCounter} of one decode forward's layer calls
    on the batch `rows` of tests/test_query_device.py's twin; `prepare(twin)` runs
    after its admission, before the step is planned."""
    from sgl_sparse.decision import plan_decode
    from tests.test_query_device import HKV, LENS, SCALE, Twin

    twin = Twin(group, use_kernels=True)
    gen = torch.Generator().manual_seed(0)
    twin.admit(torch.randn(sum(LENS.values()), HKV * group, 16, generator=gen).half())
    if prepare is not None:
        prepare(twin)
    lens = [LENS[r] + 1 if r else 1 for r in rows]
    rows_t, lens_t = torch.tensor(rows), torch.tensor(lens, dtype=torch.int32)
    twin.rt.plan_step(rows, lens, torch.device("cpu"), graphed=True)
    plan = plan_decode(twin.st, rows_t, torch.ones(len(rows), dtype=torch.long), lens_t, (None, None),
                       num_kv_heads=HKV)
    q = torch.randn(len(rows), HKV * group, 16, generator=gen).half()
    out = {}
    o = torch.zeros(q.shape[0], q.shape[1], 16)  # the attention's output (not counted)
    for name in ("first", "other"):  # two layers of one forward (the twin's one layer, twice)
        with OpCounter() as c:
            lplan = twin.rt.select(0, plan, q, twin.k, twin.r2t, rows_t, lens_t, SCALE)
            twin.rt.finish(0, lplan, q, o, twin.k, twin.r2t, rows_t, lens_t, SCALE)
        out[name] = c
    return out


def count(group: int = 2) -> dict:
    """count_forward of the mixed batch."""
    return count_forward(MIXED, group)


if __name__ == "__main__":
    res = count()
    for name, c in res.items():
        print(f"{name:6s} glue aten ops {c.total:4d}  triton launches {sum(c.launches.values()):3d} "
              f"{dict(c.launches)}")
        print("       ", dict(c.ops.most_common()))
