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

from count_query_device_ops import MIXED, count_forward  # noqa: E402

POLICIES = ("quest", "asyncspade", "lfps")
FULL_ONLY = [7, 0, 0, 0, 0, 0, 0, 0]  # a `full` row, padding


def count(policies=POLICIES, rows=FULL_ONLY, group: int = 2) -> dict:
    """{'first': OpCounter, 'other': OpCounter} of one decode forward's select + finish
    calls with only `policies`' stores on the device path."""
    from sgl_sparse.policies import PolicyId

    def keep_only(twin):
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

    return count_forward(rows, group, prepare=keep_only)


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
