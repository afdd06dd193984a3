"""Host ops of one SFI refresh (selector.refresh on the kernel path), on CPU.

Counts the aten ops outside Triton launches (each one a GPU kernel or more on
CUDA, except views), the views/allocations, and the Triton launches of one
`refresh` of three rows -- one after its first slow step (window of its query +
2 prompt queries, keys read), two after a later one (w = 1, evidence from the
stored slow-step logits) -- and of the two later rows alone, as the serving path
calls it (one KV pool tensor per layer). Run at two layer counts, the ops of one
refresh are `a + b * layers`; the per-layer part `b` is what a 28-layer model
pays 28 times.
Guarded by tests/kernels/test_sfi_kernels.py::test_refresh_host_ops_stay_few.
Run: TRITON_INTERPRET=1 python bench/kernels/count_refresh_ops.py
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

HKV, HQ, D, POOL, CTX = 2, 8, 16, 256, 96
LENS = {1: 90, 2: 61, 3: 33}  # row -> length at its slow step
LATER = {2, 3}  # rows whose slow step was not their first


def _setup(layers: int, seed: int = 0):
    """A case whose rows 1-3 are due for a refresh (kernels.testing.make_sfi_refresh_case,
    shared with tests/kernels/test_slow_step_logits.py); per-layer K/V pools; random
    saved queries and slow-step logits (no decode launches: the counts do not depend
    on the values)."""
    from sgl_sparse.kernels.testing import make_sfi_refresh_case

    return make_sfi_refresh_case(layers, lens=[LENS[r] for r in sorted(LENS)], num_kv_heads=HKV, num_q_heads=HQ,
                                 head_dim=D, logit_len=CTX, slow_step=False, prompt_queries={1: 2},
                                 pool_size=POOL, ctx=CTX, seed=seed)


def count(layers: int, later_only: bool = False) -> OpCounter:
    """The host ops and launches of one kernel-path refresh of rows 1-3 (`later_only`:
    of the later rows 2-3 only, the common refresh of a long decode), after an earlier
    refresh over the same KV pools (their LayerPools pair cached, as in serving).
    `c.buffer_fetches`: calls of the per-layer K/V buffer getters (SGLang's
    get_key_buffer / get_value_buffer) during the counted refresh."""
    from sgl_sparse.selector import refresh as R

    case = _setup(layers)
    rows = sorted(LATER) if later_only else case.rows
    fetches = [0]

    def getter(pools):
        def get(layer: int) -> torch.Tensor:
            fetches[0] += 1
            return pools[layer]
        return get

    R._layer_pools(case.state.compact, case.k_buffer, case.v_buffer, layers)  # the previous refresh's
    with OpCounter() as c:
        R.refresh(case.state, rows, CTX, getter(case.k), getter(case.v), case.req_to_token, case.scaling,
                  use_kernels=True, later=LATER)
    c.buffer_fetches = fetches[0]
    return c


def _totals(c: OpCounter) -> dict[str, int]:
    return {"glue ops": c.total, "views/allocs": sum(c.free.values()), "triton launches": sum(c.launches.values()),
            "host scalar writes": c.host_scalar_writes, "KV buffer fetches": c.buffer_fetches}


def per_layer(lo: int = 2, hi: int = 4, later_only: bool = False) -> dict[str, tuple[float, float]]:
    """{kind: (a, b)}: one refresh issues `a + b * layers` of each kind (from two layer counts)."""
    t_lo, t_hi = _totals(count(lo, later_only)), _totals(count(hi, later_only))
    out = {}
    for kind in t_lo:
        b = (t_hi[kind] - t_lo[kind]) / (hi - lo)
        out[kind] = (t_lo[kind] - b * lo, b)
    return out


if __name__ == "__main__":
    for layers in (2, 4):
        c = count(layers)
        print(f"layers {layers}: " + "  ".join(f"{k} {v}" for k, v in _totals(c).items()))
        print("   ops     ", dict(c.ops.most_common()))
        print("   free    ", dict(c.free.most_common()))
        print("   launches", dict(c.launches.most_common()))
    for later_only in (False, True):
        rows = "rows 2-3 (later, stored logits)" if later_only else "rows 1-3 (first + later)"
        for kind, (a, b) in per_layer(later_only=later_only).items():
            print(f"{rows}: {kind} = {a:g} + {b:g} x layers")
