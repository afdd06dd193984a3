"""Ops per decode layer of the captured query-aware path for a `full`-only batch, per policy, on CPU.

Under decode CUDA graphs (`query_aware.<policy>.cuda_graphs: true`) without
conditional nodes (torch 2.11, graph_gate.py) every captured block runs at every
step, whatever the batch holds. This counts, for a batch of one `full` row and
padding (bs = 8, 4 slots per store, tests/test_query_device.py's twin), the aten
ops outside Triton launches (each one a GPU kernel or more on CUDA, except views)
and the Triton launches of QueryAwareRuntime.select + finish, per policy alone
and all three together:
  first  the first layer of a forward (per-forward work + per-layer work)
  other  any further layer of the same forward (the per-layer work only)
and, with --mixed, the same for the mixed batch of count_query_device_ops.py.
Run: TRITON_INTERPRET=1 python bench/kernels/count_query_aware_ops.py [--mixed]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from count_query_device_ops import OpCounter  # noqa: E402

POLICIES = ("quest", "asyncspade", "lfps")
FULL_ONLY = [7, 0, 0, 0, 0, 0, 0, 0]  # a `full` row, padding
MIXED = [5, 1, 7, 3, 0, 4, 2, 6]  # quest 1-3, asyncspade 4-5, lfps 6, full 7, padding 0


def count(policies=POLICIES, rows=FULL_ONLY, group: int = 2) -> dict:
    """{'first': OpCounter, 'other': OpCounter} of one decode forward's select + finish
    calls with only `policies`' stores on the device path."""
    from sgl_sparse.decision import plan_decode
    from sgl_sparse.policies import PolicyId
    from tests.test_query_device import HKV, LENS, SCALE, Twin

    twin = Twin(group, use_kernels=True)
    gen = torch.Generator().manual_seed(0)
    twin.admit(torch.randn(sum(LENS.values()), HKV * group, 16, generator=gen).half())
    dev = twin.rt.device
    ids = {"quest": PolicyId.QUEST, "asyncspade": PolicyId.ASYNCSPADE, "lfps": PolicyId.LFPS}
    if "quest" not in policies:
        dev.quest = None
    if "asyncspade" not in policies:
        dev.aspd = None
    if "lfps" not in policies:
        dev.lfps = None
    dev._inner_gates = len(policies) > 1
    for p in POLICIES:  # the host path must not serve a dropped policy's rows either
        if p not in policies:
            twin.rt.stores.pop(ids[p], None)
    lens = [LENS[r] + 1 if r else 1 for r in rows]
    rows_t, lens_t = torch.tensor(rows), torch.tensor(lens, dtype=torch.int32)
    twin.rt.plan_step(rows, lens, torch.device("cpu"), graphed=True)
    plan = plan_decode(twin.st, rows_t, torch.ones(len(rows), dtype=torch.long), lens_t, (None, None),
                       num_kv_heads=HKV)
    q = torch.randn(len(rows), HKV * group, 16, generator=gen).half()
    o = torch.zeros(q.shape[0], q.shape[1], 16)
    out = {}
    for name in ("first", "other"):
        with OpCounter() as c:
            lplan = twin.rt.select(0, plan, q, twin.k, twin.r2t, rows_t, lens_t, SCALE)
            twin.rt.finish(0, lplan, q, o, twin.k, twin.r2t, rows_t, lens_t, SCALE)
        out[name] = c
    return out


def table(rows=FULL_ONLY) -> dict:
    res = {}
    for pols in [(p,) for p in POLICIES] + [POLICIES]:
        res["+".join(pols)] = count(pols, rows)
    return res


if __name__ == "__main__":
    batches = [("full-only", FULL_ONLY)] + ([("mixed", MIXED)] if "--mixed" in sys.argv else [])
    for bname, rows in batches:
        print(f"== {bname} batch {rows}")
        for name, r in table(rows).items():
            f, o = r["first"], r["other"]
            print(f"{name:24s} per layer: {o.total:4d} ops + {sum(o.launches.values()):2d} launches"
                  f"  | first layer (per-forward too): {f.total:4d} ops + {sum(f.launches.values()):2d} launches")
            print(f"{'':24s} launches {dict(o.launches)}")
