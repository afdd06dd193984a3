"""The sparse stores against SGLang's memory split: store_budget's hook on the KV budget
(compat.KV_BUDGET_TARGET, compat.kv_budget_shape), and the warning when the stores crowd
SGLang's activation share where that hook did not run (backend.stores_headroom_warning,
compat.memory_split).

SGLang sizes its KV pool so that (1 - --mem-fraction-static) of the memory free before
the model loaded stays free for activations and CUDA graphs; the backend allocates its
stores after that, and without the hook they came out of this share. On an H200 (bench/README "Session 26") 32 slots
of quest, asyncspade and lfps at 33792 positions took 24.9 of the 25.9 GiB left at
--mem-fraction-static 0.8, and the decode-graph capture then ran out of memory inside
SGLang with nothing pointing at the stores. Checked here, in a subprocess with the
installed SGLang: that its ModelRunner still keeps the two figures compat reads (drift
between releases fails here, not on a GPU), and what the warning says for that case;
and that the budget method the hook wraps still has the signature, the bytes and the
fields it reads, with the hook registered on it.
"""

from __future__ import annotations

import pytest

from tests.server import run_snippet

pytestmark = pytest.mark.timeout(300)

SNIPPET = r"""
import inspect, json
from types import SimpleNamespace
from sglang.srt.model_executor import model_runner as mr
from sgl_sparse import compat
from sgl_sparse.backend import stores_headroom_warning

src = inspect.getsource(mr)
GiB = 2 ** 30
out = {
    "keeps_free_before_load": "self.pre_model_load_memory = " in src,
    "keeps_fraction": "self.mem_fraction_static = " in src,
    "split": compat.memory_split(SimpleNamespace(pre_model_load_memory=139.0, mem_fraction_static=0.8)),
    "split_missing": compat.memory_split(SimpleNamespace(mem_fraction_static=0.8)),
    # session 26's server: 24.9 GiB of stores, 139 GiB free before the load, 0.8
    "h200": stores_headroom_warning(int(24.9 * GiB), 139 * GiB, 0.8),
    "small": stores_headroom_warning(int(13.0 * GiB), 139 * GiB, 0.8),
    "no_room": stores_headroom_warning(int(30 * GiB), 30 * GiB, 0.5),
}
# store_budget: the KV budget method its hook wraps, and what compat.kv_budget_shape reads
import dataclasses
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.plugins.hook_registry import HookRegistry
from sgl_sparse import plugin, store_budget

owner, _, method = compat.KV_BUDGET_TARGET.rpartition(".")
out["budget_method"] = (owner.rsplit(".", 1)[-1] == "KVCacheConfigurator"
                        and list(inspect.signature(getattr(KVCacheConfigurator, method)).parameters)
                        == ["self", "pre_model_load_memory"])
out["budget_returns_bytes"] = "return int(rest_memory * (1 << 30))" in inspect.getsource(getattr(KVCacheConfigurator, method))
out["configurator_fields"] = sorted({"model_config", "layer_info", "kv_cache_dtype", "server_args", "is_draft_worker"}
                                    - {f.name for f in dataclasses.fields(KVCacheConfigurator)})
out["layer_info_fields"] = "num_effective_layers" in ModelLayerInfo.__struct_fields__
out["model_config_attrs"] = (all(hasattr(ModelConfig, a) for a in ("get_num_kv_heads",))
                             and "self.dtype = " in inspect.getsource(ModelConfig.__init__))  # the model's dtype
plugin.register()
out["hooked"] = any(h is store_budget.reserve_for_stores for _t, h, _s in HookRegistry._hooks[compat.KV_BUDGET_TARGET])
print("RESULT " + json.dumps(out))
"""


def test_stores_headroom_warning_on_the_installed_sglang():
    out = run_snippet(SNIPPET)
    assert out["keeps_free_before_load"] and out["keeps_fraction"], out
    assert out["split"] == [139 * 2 ** 30, 0.8] and out["split_missing"] is None
    msg = out["h200"]
    # 24.9 of 0.2 x 139 = 27.8 GiB: more than half; 0.8 - 24.9 / 139 = 0.62
    assert msg is not None and "24.90 GiB of the 27.80 GiB" in msg and "2.90 GiB left" in msg
    assert "--mem-fraction-static 0.62" in msg
    assert "query_aware.<policy>.slots / max_context" in msg and "compact.slots" in msg
    assert out["small"] is None  # 13 of 27.8 GiB: under half
    # store_budget's hook: SGLang's KV budget method, its bytes, and the fields the shape reads
    assert out["budget_method"] and out["budget_returns_bytes"], out
    assert out["configurator_fields"] == [] and out["layer_info_fields"] and out["model_config_attrs"], out
    assert out["hooked"]
    assert "a smaller --mem-fraction-static" in out["no_room"]  # 0.5 - 1.0 <= 0: no number to give
