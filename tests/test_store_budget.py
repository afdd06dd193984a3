"""The sparse stores taken out of the KV pool's budget (sgl_sparse/store_budget.py).

Planned on the meta device, the bytes must be those the backend then allocates: checked
against the same stores built on the CPU, for every kind of store and its options, with
unavailable policies and zero slots left out. Then the budget split (pool cells against
SFI's per-slot key norms) and the hook's refusal, with the field names, when the stores
do not fit. The hook on the installed SGLang's budget method: tests/test_memory_headroom.py.
"""

from __future__ import annotations

import pytest
import torch

from sgl_sparse import query_store, store_budget
from sgl_sparse.config import SparseServerConfig
from sgl_sparse.policies.base import PolicyId
from sgl_sparse.store_budget import StoreShape, build_compact, build_query_stores, planned_bytes, pool_budget

SHAPE = StoreShape(num_layers=3, num_kv_heads=2, num_q_heads=8, head_dim=64, dtype=torch.bfloat16, context_len=700)
CPU = torch.device("cpu")


def _cfg(**over) -> SparseServerConfig:
    return SparseServerConfig.model_validate(over)


CONFIGS = {
    "none": {"compact": {"slots": 0}, "query_aware": {"quest": {"slots": 0}, "asyncspade": {"slots": 0},
                                                      "lfps": {"slots": 0}}},
    "defaults": {},
    "compact": {"compact": {"slots": 3, "capacity": 96}},
    "compact+logits": {"compact": {"slots": 2, "capacity": 64, "slow_logits_context": 4096}},
    "quest": {"query_aware": {"quest": {"slots": 4, "max_context": 513}}},
    "asyncspade kv, groups of 2": {"query_aware": {"asyncspade": {"slots": 2, "max_context": 300, "topk_layers": 2}}},
    "asyncspade int8": {"query_aware": {"asyncspade": {"slots": 3, "max_context": 256, "index_keys": "int8"}}},
    "asyncspade int4, one group": {"query_aware": {"asyncspade": {"slots": 1, "max_context": 128,
                                                                  "index_keys": "int4", "topk_layers": 14}}},
    "lfps": {"query_aware": {"lfps": {"slots": 2, "max_context": 200}}},
    "all": {"compact": {"slots": 2, "capacity": 64},
            "query_aware": {"quest": {"slots": 2, "max_context": 256}, "asyncspade": {"slots": 2, "max_context": 256},
                            "lfps": {"slots": 2, "max_context": 256}}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_bytes_are_the_allocated_bytes(name):
    cfg = _cfg(**CONFIGS[name])
    fixed, per_slot = planned_bytes(cfg, SHAPE)
    pool = 1234
    stores = build_query_stores(cfg, SHAPE, CPU)
    compact = build_compact(cfg, SHAPE, pool_size=pool, device=CPU)
    want = {pid.name.lower(): query_store.nbytes(s) for pid, s in stores.items()}
    if compact is not None:
        want["sfi"] = compact.nbytes() - pool * per_slot
        assert per_slot == SHAPE.num_layers * SHAPE.num_kv_heads * 4  # one fp32 norm a KV head and layer
    else:
        assert per_slot == 0
    assert fixed == want and all(v > 0 for v in fixed.values())
    assert (name == "none") == (not fixed)


def test_sfi_over_an_fp8_pool_copies_fp8_rows_beside_model_dtype_queries():
    """--kv-cache-dtype fp8_*: the compact K/V hold pool rows (fp8, 1 byte a value), the
    saved queries stay in the model's dtype; planned bytes are the allocated ones."""
    import dataclasses

    cfg = _cfg(compact={"slots": 2, "capacity": 64, "slow_logits_context": 256})
    fp8 = dataclasses.replace(SHAPE, dtype=torch.float8_e4m3fn, model_dtype=torch.bfloat16)
    compact = build_compact(cfg, fp8, pool_size=100, device=CPU)
    assert compact.k.dtype == compact.v.dtype == torch.float8_e4m3fn
    assert compact.q.dtype == compact.q_prompt.dtype == torch.bfloat16 and compact.k_scales is None
    fixed, per_slot = planned_bytes(cfg, fp8)
    assert fixed["sfi"] == compact.nbytes() - 100 * per_slot
    bf16, _ = planned_bytes(cfg, SHAPE)
    assert bf16["sfi"] - fixed["sfi"] == compact.k.numel() * 2  # K and V: a byte a value less


def test_unavailable_policies_and_zero_slots_get_no_store():
    cfg = _cfg(compact={"slots": 2}, query_aware={"quest": {"slots": 0}, "asyncspade": {"slots": 2},
                                                  "lfps": {"slots": 2}})
    cfg = cfg.model_copy(update={"unavailable": {"lfps": "off in CUDA graphs", "sfi": "no tokenizer"}})
    fixed, per_slot = planned_bytes(cfg, SHAPE)
    assert set(fixed) == {"asyncspade"} and per_slot == 0
    assert set(build_query_stores(cfg, SHAPE, CPU)) == {PolicyId.ASYNCSPADE}


def test_pool_budget_splits_between_cells_and_key_norms():
    cell = SHAPE.kv_cell_bytes()
    assert cell == 3 * 2 * 2 * 64 * 2
    assert pool_budget(10_000_000, 1_000_000, 0, cell) == 9_000_000
    left = pool_budget(10_000_000, 1_000_000, 24, cell)
    tokens = left // cell
    # the cells plus one key-norm entry per pool slot fill what the fixed stores leave
    assert left + tokens * 24 <= 9_000_000 < left + (tokens + 2) * (cell + 24)


def test_reserve_takes_the_stores_out_and_refuses_when_they_do_not_fit():
    none = CONFIGS["none"]
    cfg = _cfg(compact=none["compact"], query_aware={**none["query_aware"], "quest": {"slots": 4, "max_context": 4096}})
    quest = planned_bytes(cfg, SHAPE)[0]["quest"]
    left, fixed, line = store_budget.reserve(10 * quest, cfg, SHAPE)
    assert left == 9 * quest and fixed == quest
    assert "go to the sparse stores (quest " in line and "key norms" not in line
    assert store_budget.reserve(10 * quest, _cfg(**CONFIGS["none"]), SHAPE) == (10 * quest, 0, "")
    with pytest.raises(ValueError, match=r"raise --mem-fraction-static.*query_aware\.<policy>\.slots / max_context"):
        store_budget.reserve(quest // 2, cfg, SHAPE)
    cfg = _cfg(compact={"slots": 2, "capacity": 64}, query_aware=none["query_aware"])
    left, fixed, line = store_budget.reserve(1 << 24, cfg, SHAPE)
    assert fixed == planned_bytes(cfg, SHAPE)[0]["sfi"] and 0 < left < (1 << 24)
    assert "sfi " in line and "key norms per pool slot" in line


def test_a_cache_device_takes_the_selection_off_the_serving_gpu():
    """query_aware.asyncspade.cache_device: the copies, scores, histograms and the
    Top-K's output and scratch are the cache GPU's, so the serving GPU's budget pays
    for the ring and the selections only; planned on the meta device, allocated
    nowhere else."""
    aspd = {"slots": 3, "max_context": 256, "index_keys": "int4", "topk_layers": 2}
    here = planned_bytes(_cfg(query_aware={"asyncspade": aspd}), SHAPE)[0]["asyncspade"]
    there_cfg = _cfg(query_aware={"asyncspade": {**aspd, "cache_device": "cuda:1"}})
    there = planned_bytes(there_cfg, SHAPE)[0]["asyncspade"]
    store = build_query_stores(there_cfg, SHAPE, torch.device("meta"))[PolicyId.ASYNCSPADE]
    assert store.remote and store.kq.device.type == "meta" and store.ring.device.type == "meta"
    selection = query_store.nbytes(store, store.cache_tensors())
    extra = store.topk_out.numel() * 4 + store.topk_scratch.numel() * 4  # allocated on the cache GPU only
    assert there == query_store.nbytes(store) and here == there + selection - extra
    assert 0 < there < here


def test_a_cache_device_is_checked(monkeypatch):
    """cache_device_for: a GPU server, a GPU this process sees, not the serving one, with
    peer access both ways; each refusal names the field. A CPU machine has no second
    GPU: torch's device count and peer query are stood in for (test-only)."""
    field = "query_aware.asyncspade.cache_device"
    with pytest.raises(ValueError, match=f"{field}: 'cuda:1' needs a GPU server; this one runs on cpu"):
        query_store.cache_device_for("cuda:1", CPU)
    assert query_store.cache_device_for("cuda:1", torch.device("meta")).type == "meta"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    peers = {(0, 1): True, (1, 0): False}
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peers[(a, b)])
    serving = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=f"{field}: 'cuda:2', but this process sees 2 GPU"):
        query_store.cache_device_for("cuda:2", serving)
    with pytest.raises(ValueError, match=f"{field}: 'cuda:0' is the serving GPU itself"):
        query_store.cache_device_for("cuda:0", serving)
    with pytest.raises(ValueError, match=f"{field}: 'cuda:1' has no peer access to cuda:0"):
        query_store.cache_device_for("cuda:1", serving)
