"""lfps on the device path (sgl_sparse/lfps_device.py through query_device, the
Triton interpreter here) against the host-grouped torch path (queryaware/lfps.py,
the serving reference), on twin simulations over the same pool and queries.

Batches mix lfps rows of different knobs (sink 0, a 0.02 / 0.05 / 0.2, r 0.9, a local window of
10, a low eps whose heads bypass to V̄) with a quest row, a full row and a padding
row; one lfps row's budget covers its sequence at first (dense: full attention,
then indexed once the sequence outgrows it), one always; GQA 1 and 3 (a group not a
power of two); ragged lengths, no multiple of any block; a candidate buffer smaller
than |C1| (truncated to the best by Φ_ver + Φ_sla) and one holding every position.
Each step: the same per-head position sets and a_len (bypassed heads: 0), the same
attention output (bypassed heads: V̄), the same tables after the update."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse.config import LfpsPolicy, QuestPolicy
from tests.test_query_device import HKV, KV, MAXCTX, D, Twin, compare_steps

# Loads no SGLang: CI runs it under one SGLang version (tests/ci_legs.py).
pytestmark = pytest.mark.sglang_independent

SPECS = {
    # small a: the reference's κ is not normalized by the count (queryaware.lfps.kurtosis_threshold),
    # so a = 0.2 leaves C1 empty on most steps of random data
    1: LfpsPolicy(budget=12, local=6, sink=4, s=8, a=0.02),
    2: LfpsPolicy(budget=20, local=3, sink=0, s=16, a=0.05, r=0.9),
    3: LfpsPolicy(budget=8, local=10, sink=2, s=4, eps=0.02),  # heads bypass (ρ about 2 / n here)
    4: LfpsPolicy(budget=70, local=6, sink=4),  # covers its first steps (sink + budget + local + 1 >= n)
    5: LfpsPolicy(budget=60, local=6, sink=4),  # budget >= length: always dense, exactly full
    6: QuestPolicy(budget=16, recent=9, sink=4),
    7: None,  # full
}
LENS = {1: 83, 2: 61, 3: 97, 4: 75, 5: 40, 6: 71, 7: 50}


@pytest.mark.parametrize("group, candidates, power_sums, renorm", [(1, 24, False, False), (3, MAXCTX, False, False),
                                                                   (3, MAXCTX, True, False), (1, 24, True, True)])
def test_lfps_device_path_matches_the_torch_path(monkeypatch, group, candidates, power_sums, renorm):
    """power_sums: the tables' statistics by power sums about the store's shift
    (kernels/lfps_tables.STATS_POWER_SUMS), set from the prompt's tables, then each
    step's means, scaled as the tables decay. renorm: row 2's r at 0.5, whose tables
    then renormalize within the steps (the lazy decay's floor, 2^-8, after 8 of them),
    the shift with them."""
    import importlib

    lt = importlib.import_module("sgl_sparse.kernels.lfps_tables")
    monkeypatch.setattr(lt, "STATS_POWER_SUMS", power_sums)
    specs = {**SPECS, **({2: LfpsPolicy(budget=20, local=3, sink=0, s=16, a=0.05, r=0.5)} if renorm else {})}
    gen = torch.Generator().manual_seed(200 + group)
    kw = dict(specs=specs, lens=LENS, store={"candidates": candidates})
    ref, dev = Twin(group, use_kernels=False, **kw), Twin(group, use_kernels=True, **kw)
    assert dev.rt.device is not None and dev.rt.device.lfps is not None
    q_ext = torch.randn(sum(LENS.values()), HKV * group, D, generator=gen).to(KV)
    ref.admit(q_ext)
    dev.admit(q_ext)
    # shuffled, a padding row (request row 0, length 1); row 4 turns indexed at n = 82
    indexed = compare_steps(ref, dev, [3, 7, 1, 0, 5, 6, 4, 2], 10, gen)
    assert {r for _, r, _ in indexed} == {1, 2, 3, 4, 6}
    # row 3 lists its sinks whenever it attends: a_len 0 is a bypass (V̄ output, no update)
    bypassed = sum(int((a_len == 0).sum()) for _, r, a_len in indexed if r == 3)
    assert 0 < bypassed < 10 * HKV
    # the scored fraction's sums (|C1|, n - sink per selected step, layer and head): the
    # same on both paths, and only on the slots of rows lfps indexed
    from sgl_sparse.policies.base import PolicyId

    got, want = (t.rt.stores[PolicyId.LFPS].scored for t in (dev, ref))
    assert torch.equal(got, want), (got, want)
    live = want[..., 1].sum(-1) > 0
    assert int(live.sum()) == 4 and (want[..., 0] <= want[..., 1]).all()  # rows 1-4: lfps indexed steps
    # the shift: only where the switch needs it; set from the prompt's tables on both
    # paths, then each step's means on the device path's live slots only (the torch
    # path computes its moments directly)
    shifts = [t.rt.stores[PolicyId.LFPS].shift for t in (dev, ref)]
    if not power_sums:
        assert shifts == [None, None]
        return
    assert (shifts[1] != 0).any() and not torch.equal(shifts[0], shifts[1])
