"""Kernels for SFI's slow step and refresh, against plain PyTorch (interpreted on
CPU): the side effects of two_segment_decode (key norms of the new key, saved
queries, row_mask 2 = side effects only), the refresh path, window evidence and
the Selector scores."""

import dataclasses

import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.kernels import testing as T
from sgl_sparse.selector.refresh import window_logits_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the fp8 tests also run compiled (run_all.sh fp8)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_side_effects_key_norms_and_saved_queries(splits):
    hkv, group, d = 2, 4, 32
    lens = [40, 17, 29, 33]
    case = T.make_decode_case(lens, [0] * 4, [(0, n) for n in lens], num_kv_heads=hkv, group=group,
                              head_dim=d, cap=4, dtype=torch.bfloat16, seed=splits)
    knorm = torch.full((case.k_pool.shape[0], hkv), -1.0)
    q_save = torch.zeros(3, hkv * group, d, dtype=torch.bfloat16)
    q_save_slot = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    row_mask = torch.tensor([1, 2, 2, 0], dtype=torch.int32)
    out = torch.full_like(case.q, float("nan"))
    K.two_segment_decode(*case.args(), out=out, row_mask=row_mask, key_norms=knorm, q_save=q_save,
                         q_save_slot=q_save_slot, num_splits=splits, block_n=16, min_split_len=16)
    ref = K.two_segment_decode_ref(*case.args())
    # Row 0 attends; rows 1-2 only record; row 3 is untouched.
    assert T.rel_error(out[0].float(), ref[0]) < 1e-2
    assert out[1:].isnan().all()
    for b, n in enumerate(lens):
        tok = int(case.req_to_token[int(case.req_pool_idx[b]), n - 1])
        expect = case.k_pool[tok].float().norm(dim=-1)
        if row_mask[b] == 0:
            assert (knorm[tok] == -1).all()
        else:
            torch.testing.assert_close(knorm[tok], expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(q_save[1], case.q[0]) and torch.equal(q_save[0], case.q[2])
    assert (q_save[2] == 0).all()
    # Only the new keys got a norm.
    assert int((knorm[:, 0] >= 0).sum()) == 3


def refreshed_two_rows(use_kernels: bool, budgets=(20, 9), kv_dtype=torch.bfloat16, k_scales=None,
                       selections: str = "packed", seed: int = 0):
    """Two sfi rows (90 and 61 positions; sink 4 / 1, recent 16 / 8, their first slow
    step's window of 3 queries for the first) refreshed once by selector.refresh into a
    store keeping `selections`: (state, k pool, v pool), the pools in `kv_dtype`."""
    from sgl_sparse.compact import CompactStore
    from sgl_sparse.config import SfiPolicy, SparseServerConfig
    from sgl_sparse.policies import sfi
    from sgl_sparse.selector.refresh import refresh
    from sgl_sparse.state import SparseState

    hkv, hq, d = 2, 8, 32
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(200, hkv, d, generator=gen).to(torch.bfloat16).to(kv_dtype)
    v = torch.randn(200, hkv, d, generator=gen).to(torch.bfloat16).to(kv_dtype)
    r2t = torch.zeros(3, 96, dtype=torch.int32)
    r2t[1, :90] = torch.randperm(200, generator=gen)[:90].int()
    r2t[2, :61] = torch.randperm(200, generator=gen)[:61].int()
    q = torch.randn(3, 2, 3, hq, d, generator=gen).to(torch.bfloat16)
    cfg = SparseServerConfig.model_validate({"compact": {"slots": 2, "capacity": 40, "selections": selections},
                                             "policies": {"sfi": {"w_prefill": 3}}})
    st = SparseState(3, "cpu", cfg)
    specs = [SfiPolicy(budget=budgets[0], recent=16, sink=4, w_prefill=3, min_saving=0),
             SfiPolicy(budget=budgets[1], recent=8, sink=1, min_saving=0)]
    st.admit([1, 2], [sfi.init_row(s, [], [], (None, None)) for s in specs])
    st.compact = CompactStore(slots=2, capacity=40, num_layers=2, num_kv_heads=hkv, num_q_heads=hq, head_dim=d,
                              dtype=kv_dtype, pool_size=200, prompt_queries=2, device=torch.device("cpu"),
                              query_dtype=torch.bfloat16, selections=selections)
    st.compact.k_scales = k_scales
    st.compact.knorm[:] = k.float().norm(dim=-1)
    st.compact.q[:, :2] = q[:2, :, 0]
    st.compact.q_prompt[:, :2] = q[:2, :, 1:]
    st.saved_n[1], st.saved_n[2] = 90, 60
    st.prompt_q[1] = 2
    refresh(st, [1, 2], 96, lambda i: k, lambda i: v, r2t, d ** -0.5, use_kernels=use_kernels)
    return st, k, v


@pytest.mark.parametrize("budgets, counts, fp8", [((20, 9), (24, 10), False),   # budgets differ: sorted top-k
                                                  ((12, 12), (16, 13), False),  # every budget covers k: unordered
                                                  ((20, 9), (24, 10), True)])   # an fp8 pool, per-layer k_scale
def test_refresh_with_kernels_equals_the_torch_path(budgets, counts, fp8):
    """The CUDA path of selector.refresh (evidence, Selector and packing kernels)
    packs the same tokens as the plain-torch path; over an fp8 pool (SGLang's
    --kv-cache-dtype fp8_e4m3) both read the keys with each layer's k_scale and the
    compact buffers hold the pool's fp8 rows."""
    fp8_args = dict(kv_dtype=torch.float8_e4m3fn, k_scales=torch.tensor([0.5, 2.0])) if fp8 else {}
    states = [refreshed_two_rows(use_kernels, budgets, **fp8_args)[0] for use_kernels in (False, True)]
    a, b = states
    assert torch.equal(a.sel_count, b.sel_count) and tuple(a.sel_count[1:].tolist()) == counts
    for slot, n in ((int(a.slot[1]), counts[0]), (int(a.slot[2]), counts[1])):
        # Same tokens (the selection may tie-break differently only on exactly equal scores).
        ka = a.compact.k[:, slot, :, :n].float().sum(dim=-1).sort(dim=-1).values
        kb = b.compact.k[:, slot, :, :n].float().sum(dim=-1).sort(dim=-1).values
        torch.testing.assert_close(ka, kb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group, w", [(1, 1), (2, 3), (8, 4)])
def test_window_evidence_matches_the_selector_formula(dtype, group, w):
    from sgl_sparse.selector import core

    gen = torch.Generator().manual_seed(7 * group + w)
    hkv, d, lens = 2, 32, [70, 23, 41]
    case = T.make_decode_case(lens, [0] * 3, [(0, n) for n in lens], num_kv_heads=hkv, group=group,
                              head_dim=d, cap=4, dtype=dtype, seed=group * w)
    q = torch.randn(3, w, hkv * group, d, generator=gen).to(dtype) * 2
    last = torch.tensor([69, 22, 40])
    qpos = last[:, None] - torch.arange(w)[None, :]
    lo, hi = torch.tensor([4, 0, 3]), torch.tensor([60, 23, 3])  # request 2: empty range
    nq = torch.tensor([w, 1, max(1, w - 1)])
    beta = torch.tensor([0.5, 1.0, 2.0])
    n, scale = 70, d ** -0.5
    u = K.window_evidence(q, case.k_pool, case.req_to_token, case.req_pool_idx, qpos, lo, hi, nq, beta, n, scale,
                          block_n=16)
    # pass 2 in blocks of its own size (here smaller than the range: several blocks)
    u2 = K.window_evidence(q, case.k_pool, case.req_to_token, case.req_pool_idx, qpos, lo, hi, nq, beta, n, scale,
                           block_n=16, block_n2=32)
    assert torch.equal(u, u2)
    tok = case.req_to_token[case.req_pool_idx.long(), :n].long()
    logits = window_logits_torch(q, case.k_pool, tok, qpos, scale)
    qmask = torch.arange(w)[None, :] < nq[:, None]
    ref = core.evidence_power_mean(logits, core.candidate_mask(lo, hi, n), qmask, beta)
    assert not u.isnan().any() and u.shape == ref.shape
    assert (u[2] == 0).all() and (u[0, :, :4] == 0).all() and (u[0, :, 60:] == 0).all()
    assert T.rel_error(u, ref) < 1e-4


def _count_refresh_ops():
    """bench/kernels/count_refresh_ops.py: its refresh problem (per-layer pools) and op counter."""
    from tests.bench_scripts import load_bench_script

    return load_bench_script("kernels/count_refresh_ops.py")


@pytest.mark.parametrize("group, w", [(1, 1), (4, 3)])
def test_window_evidence_over_several_layers_reads_each_layers_keys(group, w):
    """One launch per pass for 3 layers (their pools as a LayerPools address table,
    separate random tensors) == one call per layer, bit for bit, and == the formula
    over that layer's keys: ragged rows, an empty range, a length off the blocks."""
    from sgl_sparse.selector import core

    gen = torch.Generator().manual_seed(group * 10 + w)
    hkv, d, lens, layers = 2, 32, [70, 23, 41], 3
    case = T.make_decode_case(lens, [0] * 3, [(0, n) for n in lens], num_kv_heads=hkv, group=group, head_dim=d,
                              cap=4, dtype=torch.bfloat16, seed=group + w)
    pools = [torch.randn(case.k_pool.shape, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    q = (torch.randn(layers, 3, w, hkv * group, d, generator=gen) * 2).to(torch.bfloat16)
    qpos = torch.tensor([69, 22, 40])[:, None] - torch.arange(w)[None, :]
    lo, hi = torch.tensor([4, 0, 3]), torch.tensor([60, 23, 3])  # request 2: empty range
    nq = torch.tensor([w, 1, max(1, w - 1)], dtype=torch.int32)
    beta = torch.tensor([0.5, 1.0, 2.0])
    n, scale = 70, d ** -0.5
    rep = lambda t: t.repeat(layers, *([1] * (t.dim() - 1))).contiguous()  # noqa: E731  layer-major rows
    ridx = case.req_pool_idx.int()
    u = torch.full((layers * 3, hkv, n), float("nan"))
    K.window_evidence(q.flatten(0, 1), K.LayerPools.of(pools), case.req_to_token, rep(ridx), rep(qpos), rep(lo).int(),
                      rep(hi).int(), rep(nq), rep(beta), n, scale, block_n=16, out=u)
    assert not u.isnan().any()
    tok = case.req_to_token[case.req_pool_idx.long(), :n].long()
    qmask = torch.arange(w)[None, :] < nq[:, None]
    for layer, pool in enumerate(pools):
        one = K.window_evidence(q[layer], pool, case.req_to_token, ridx, qpos, lo, hi, nq, beta, n, scale, block_n=16)
        assert torch.equal(u[layer * 3: (layer + 1) * 3], one)
        ref = core.evidence_power_mean(window_logits_torch(q[layer].double(), pool.double(), tok, qpos, scale),
                                       core.candidate_mask(lo, hi, n), qmask, beta.double())
        assert T.rel_error(one, ref) < 1e-4


def test_refresh_with_per_layer_pools_and_small_launch_bounds_equals_the_torch_path(monkeypatch):
    """The kernel refresh reads layer l's keys and values from layer l's own pool (not
    one pool shared by the layers, as the other refresh tests pass): the same packed
    buffers as the torch path, also with the layers split over several Selector
    chunks and several evidence launches (bounds lowered)."""
    from sgl_sparse.selector import refresh as R

    mod = _count_refresh_ops()
    layers = 3
    runs = []
    # Then (rows 1-3 in one group, 2 KV heads, G 4, w 3, N 96): 2 layers a Selector
    # chunk, 1 layer an evidence launch.
    for bounds in ((R._MAX_SELECT_ELEMS_KERNELS, R._MAX_LOGIT_ELEMS), (2 * 3 * 2 * 96, 3 * 2 * 4 * 3 * 96)):
        monkeypatch.setattr(R, "_MAX_SELECT_ELEMS_KERNELS", bounds[0])
        monkeypatch.setattr(R, "_MAX_LOGIT_ELEMS", bounds[1])
        out = []
        for use_kernels, later in ((True, mod.LATER), (True, ()), (False, ())):
            case = mod._setup(layers)
            R.refresh(case.state, case.rows, mod.CTX, case.k_buffer, case.v_buffer, case.req_to_token, case.scaling,
                      use_kernels=use_kernels, later=later)
            out.append(case.state)
        runs.append(out)
    for (a, b) in zip(*runs):  # the launch bounds change no bit
        assert torch.equal(a.sel_count, b.sel_count)
        assert torch.equal(a.compact.k, b.compact.k) and torch.equal(a.compact.v, b.compact.v)
    stored_rows, keys, torch_path = runs[1]
    assert torch.equal(keys.sel_count, torch_path.sel_count) and int(keys.sel_count[1:].min()) > 0
    assert torch.equal(stored_rows.sel_count, keys.sel_count)
    for row in range(1, 4):
        slot, n = int(keys.slot[row]), int(keys.sel_count[row])
        for buf in ("k", "v"):
            # Same rows per layer (ties of exactly equal scores may order them differently);
            # the torch path writes junk past n.
            got = getattr(keys.compact, buf)[:, slot, :, :n].float().sum(-1).sort(-1).values
            want = getattr(torch_path.compact, buf)[:, slot, :, :n].float().sum(-1).sort(-1).values
            torch.testing.assert_close(got, want)


def _selector_problem(seed, r, hkv, n, radii):
    """u as the evidence kernel leaves it (0 off A), key norms with ties and an outlier."""
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.selector import core

    gen = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, 6, (r,), generator=gen)
    hi = torch.clamp(lo + torch.randint(0, n, (r,), generator=gen), max=n)
    hi[0] = lo[0]  # an empty candidate range
    if r > 2:
        hi[1] = lo[1] + 1  # |A| = 1: x = 1
        lo[2], hi[2] = 0, n  # the whole range
    u = torch.rand(r, hkv, n, generator=gen) ** 3
    u = u.masked_fill(~core.candidate_mask(lo, hi, n), 0.0)
    # Quantized norms: the medians meet ties; one outlier per row.
    norms = (torch.rand(r, hkv, n, generator=gen) * 8).round() / 2 + 1
    norms[:, :, n // 2] = 40.0
    specs = [SfiPolicy(nms_radius=radii[i % len(radii)], beta=(0.5, 1.0, 2.0)[i % 3], alpha=(1.0, 0.0, 2.5)[i % 3],
                       clip=(0.02, 1.0, 0.3)[i % 3], excl_eta=(0.35, 0.0, 1.0)[i % 3], excl_tau=(1.0, 0.5, 2.0)[i % 3])
             for i in range(r)]
    return u, norms, lo, hi, specs


def test_soft_nms_compiles_for_sm90_with_its_halo_a_run_time_loop():
    """The Selector's Soft-NMS step (each row's radius read on the device, one binary
    for every radius) compiles for the H100/H200 (sm_90) without spilling: the
    neighbours are loaded in a loop, not held (ptxas' registers and stack)."""
    import importlib

    fn = importlib.import_module("sgl_sparse.kernels.selector_scores")._selector_refine
    ptrs = {"S": "*fp32", "LO": "*i32", "HI": "*i32", "GAMMA": "*fp32", "RADIUS": "*i32", "ETA": "*fp32",
            "TAU": "*fp32", "OUT": "*fp32"}
    const = {"R_LIMIT": 64, "BLOCK_H": 8, "BLOCK_N": 256}
    sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
    got = T.compile_sm90("sgl_sparse.kernels.selector_scores", "_selector_refine", sig, const, list(ptrs),
                         options={"num_warps": 4}, resources=True)
    assert got["stack_bytes"] == 0 and got["registers"] <= 128 and got.get("st.global.b32", 0) > 0, got


# Rows of one launch with different Soft-NMS radii (each its own loop bound), up to the config's 64.
@pytest.mark.parametrize("r, hkv, n, radii", [(3, 2, 37, [2]), (5, 3, 300, [0, 1, 3]), (4, 8, 1100, [2, 0]),
                                             (2, 2, 64, [5, 2]), (3, 2, 150, [64, 0, 7])])
def test_selector_scores_match_the_float64_formulas(r, hkv, n, radii):
    from sgl_sparse.selector import core

    u, norms, lo, hi, specs = _selector_problem(11 * r + n, r, hkv, n, radii)
    k32 = core.SelectorKnobs.from_specs(specs, "cpu", torch.float32)
    k64 = core.SelectorKnobs.from_specs(specs, "cpu", torch.float64)
    stats = K.selector_stats(u, norms, lo, hi, k32)
    allowed = core.candidate_mask(lo, hi, n)
    for b in range(r):
        if hi[b] <= lo[b]:
            continue
        on = norms[b][:, allowed[b, 0]]
        med = on.sort(dim=-1).values[:, (on.shape[-1] - 1) // 2]
        mad = (on - med[:, None]).abs().sort(dim=-1).values[:, (on.shape[-1] - 1) // 2]
        assert torch.equal(stats[b, :, 3], med) and torch.equal(stats[b, :, 4], mad)  # exact lower medians
    got = K.selector_scores(u, norms, lo, hi, k32)
    ref = core.refined_scores_from_evidence(u.double(), norms.double(), lo, hi, k64)
    assert not got.isnan().any()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin) and fin.any()
    assert T.rel_error(got[fin], ref[fin]) < 1e-5
    # The top-k the serving path keeps: equal unless two scores tie to float rounding.
    for b in range(r):
        c = int((hi[b] - lo[b]).clamp(min=0))
        k = min(c, 7)
        for h in range(hkv):
            a = set(got[b, h].topk(k).indices.tolist())
            e = set(ref[b, h].topk(k).indices.tolist())
            kth = ref[b, h].topk(k).values[-1] if k else 0
            assert all(abs(float(ref[b, h, j] - kth)) < 1e-5 * abs(float(kth)) + 1e-6 for j in a ^ e)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [4096, 32768, 131072])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_selector_scores_large(n, split):
    """Serving sizes on the GPU: exact medians; scores against float64 at least as
    accurate as the PyTorch fp32 path's. Kernel and torch sum 10^5 fp32 terms in
    different orders, so at 128K they differ from each other by ~7e-5 (run 2 on
    the H100) while both stay near float64: the bound is on the error vs float64."""
    from sgl_sparse.selector import core

    r, hkv = 4, 8
    u, norms, lo, hi, specs = _selector_problem(n, r, hkv, n, [2, 0, 1])
    u, norms, lo, hi = (x.cuda() for x in (u, norms, lo, hi))
    k32 = core.SelectorKnobs.from_specs(specs, "cuda", torch.float32)
    k64 = core.SelectorKnobs.from_specs(specs, "cuda", torch.float64)
    from sgl_sparse.kernels._split import STATS_RULE, split_count

    # the stats on one program per (row, head), or split over the automatic count (>= 2)
    splits = max(2, split_count(n, r * hkv, u.device, STATS_RULE)) if split else 1
    stats = K.selector_stats(u, norms, lo, hi, k32, splits=splits)
    on = norms[2]  # the whole range
    med = on.sort(dim=-1).values[:, (n - 1) // 2]
    assert torch.equal(stats[2, :, 3], med)
    got = K.selector_scores(u, norms, lo, hi, k32, splits=splits)
    ref = core.refined_scores_from_evidence(u.double(), norms.double(), lo, hi, k64)
    ref32 = core.refined_scores_from_evidence(u, norms, lo, hi, k32)
    fin = torch.isfinite(ref)
    assert not got.isnan().any() and torch.equal(torch.isfinite(got), fin)
    err, err_torch = T.rel_error(got[fin], ref[fin]), T.rel_error(ref32[fin], ref[fin])
    assert err <= max(2 * err_torch, 1e-5), (err, err_torch)
    assert err < 1e-3


def test_start_up_warm_up_runs_every_refresh_kernel_and_writes_nothing():
    from sgl_sparse.compact import CompactStore
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.selector.refresh import warm_up_kernels

    store = CompactStore(slots=2, capacity=40, num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=32,
                         dtype=torch.bfloat16, pool_size=100, prompt_queries=3, device=torch.device("cpu"))
    store.k.fill_(7.0)
    k = torch.randn(100, 2, 32).to(torch.bfloat16)
    r2t = torch.zeros(3, 96, dtype=torch.int32)
    warm_up_kernels(store, k, k.clone(), r2t, [SfiPolicy(w_prefill=4, nms_radius=3)])
    assert (store.k == 7.0).all()


def test_refresh_caches_the_layer_pools_until_the_kv_pools_change():
    """selector.refresh._layer_pools: the same LayerPools pair while the KV pools are
    the same (layer 0's K and V fetched only); rebuilt, with the new addresses, for
    reallocated pools, another layer count, a dtype view, and a getter returning a
    fresh tensor on every call. The pair is cached on its owner (the compact store):
    another owner builds its own, and a dropped owner frees it."""
    import gc
    import types
    import weakref

    from sgl_sparse.selector import refresh as R

    owner = types.SimpleNamespace(pools_cache=None)

    def pools(layers, dtype=torch.bfloat16):
        return [torch.zeros(64, 2, 16, dtype=dtype) for _ in range(layers)]

    def getter(ts, calls):
        def get(layer):
            calls.append(layer)
            return ts[layer]
        return get

    def addresses(lp):
        return lp.ptrs.tolist()

    k, v, calls = pools(3), pools(3), []
    first = R._layer_pools(owner, getter(k, calls), getter(v, calls), 3)
    assert addresses(first.k) == [t.data_ptr() for t in k] and addresses(first.v) == [t.data_ptr() for t in v]
    calls.clear()
    assert R._layer_pools(owner, getter(k, calls), getter(v, calls), 3) is first and calls == [0, 0]
    k2 = pools(3)  # a reallocated pool (the old one still referenced: new addresses)
    again = R._layer_pools(owner, getter(k2, []), getter(v, []), 3)
    assert again is not first and addresses(again.k) == [t.data_ptr() for t in k2]
    assert addresses(R._layer_pools(owner, getter(k2, []), getter(v, []), 2).k) == [t.data_ptr() for t in k2[:2]]
    half = [t.view(torch.float16) for t in k2]  # same addresses, another dtype
    assert R._layer_pools(owner, getter(half, []), getter(v, []), 2).k.pool.dtype == torch.float16
    fresh = lambda layer: k2[layer].clone()  # noqa: E731  e.g. a dequantizing read
    a = R._layer_pools(owner, fresh, getter(v, []), 3)
    b = R._layer_pools(owner, fresh, getter(v, []), 3)
    assert a is not b and addresses(b.k) == [t.data_ptr() for t in b.k_all]
    other = types.SimpleNamespace(pools_cache=None)
    mine = R._layer_pools(other, getter(k, []), getter(v, []), 3)
    assert mine is not R._layer_pools(owner, getter(k, []), getter(v, []), 3)
    gone = weakref.ref(mine)
    del mine, other
    gc.collect()
    assert gone() is None


def test_refresh_host_ops_stay_few():
    """One refresh's host work (bench/kernels/count_refresh_ops.py): the evidence, the
    Selector and the packing run once per chunk of layers, not once per layer.
    Measured (ops = a + b x layers): before, later rows 72 glue ops + (41 + 10 L)
    views/allocs + (4 + 4 L) Triton launches, rows 1-3 147 + (84 + 21 L) + (8 + 8 L);
    after, 29 + 54 + 8 and 72 + (121-122) + 16. With the pools' LayerPools pair cached
    across refreshes (counted after a first refresh over the same pools): 2 x layers
    KV buffer fetches -> 2 (layer 0's K and V, compared with the cache), the same glue
    ops and launches, views/allocs 52 and 120-121 at 2-4 layers (the address tables'
    two tensor copies, counted before for pools the counter had not seen, gone).
    Since session 33 the key norms' gather is a launch of its own (gather_key_norms):
    9 and 18 launches, the index gather and permuting copy gone."""
    mod = _count_refresh_ops()
    later = mod.per_layer(1, 2, later_only=True)
    assert later["triton launches"] == (9, 0) and later["glue ops"][1] == 0 and later["views/allocs"][1] <= 0
    assert later["glue ops"][0] <= 32, later
    mixed = mod.per_layer(1, 2)
    assert mixed["triton launches"] == (18, 0) and mixed["glue ops"][1] == 0, mixed
    assert mixed["glue ops"][0] <= 76 and mixed["views/allocs"][1] <= 0, mixed
    # the pools' address tables from the cache: layer 0's K and V fetched, not every layer's
    assert later["KV buffer fetches"] == (2, 0) and mixed["KV buffer fetches"] == (2, 0), (later, mixed)
    # no `t[idx] = scalar`: on CUDA a stream-wide wait (OpCounter.host_scalar_writes)
    assert later["host scalar writes"] == (0, 0) and mixed["host scalar writes"] == (0, 0), (later, mixed)


def test_evidence_pass1_compiles_for_sm90_and_keeps_16_byte_key_loads_from_the_table():
    """The layered first pass (keys through the LayerPools table) compiles for the H100
    (sm_90) with the same 16-byte vector loads as the one-pool variant; so does the
    variant over fp8 pools with per-layer key scales (16 keys' values a load)."""
    from sgl_sparse.kernels.window_evidence import _evidence_pass1 as fn

    types = {"Q": "*bf16", "K_POOL": "*bf16", "K_PTRS": "*i64", "K_SCALES": "*fp32", "REQ_TO_TOKEN": "*i32",
             "REQ_IDX": "*i32", "QPOS": "*i64", "LO": "*i32", "HI": "*i32", "PART_M": "*fp32", "PART_L": "*fp32",
             "LOGITS": "*fp32", "qk_scale": "fp32"}
    counts = []
    for layered, pool in ((False, "*bf16"), (True, "*bf16"), (True, "*fp8e4nv")):
        const = dict(GROUP=2, W_PAD=1, HEAD_DIM=128, BLOCK_M=16, BLOCK_D=128, BLOCK_N=64, FP32_DOT=False,
                     LAYERED=layered, HAS_K_SCALES=pool != "*bf16")
        sig = {name: "constexpr" if name in const else {**types, "K_POOL": pool}.get(name, "i32")
               for name in fn.arg_names}
        divisible = [name for name in fn.arg_names if sig[name].startswith("*") or name.startswith("stride_")]
        counts.append(T.compile_sm90("sgl_sparse.kernels.window_evidence", "_evidence_pass1", sig, const, divisible))
    one, layered, fp8 = counts
    assert one.get("ld.global.v4.b32", 0) > 0
    assert layered.get("ld.global.v4.b32") == one["ld.global.v4.b32"], counts
    assert fp8.get("ld.global.v4.b32", 0) > 0, counts


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_window_evidence_over_fp8_pools_with_each_layers_key_scale(fp8):
    """SFI over --kv-cache-dtype fp8_*: the pools hold k / k_scale in fp8, the queries
    stay bf16, each layer has its own k_scale. One launch over 2 layers == the formula
    over each layer's dequantized keys (the widening is exact), and unit scales give
    another answer (the scale is not ignored)."""
    from sgl_sparse.selector import core

    gen = torch.Generator().manual_seed(11)
    hkv, group, d, w, lens, layers = 2, 4, 32, 2, [70, 23, 41], 2
    case = T.make_decode_case(lens, [0] * 3, [(0, n) for n in lens], num_kv_heads=hkv, group=group, head_dim=d,
                              cap=4, dtype=torch.bfloat16, seed=3, device=DEVICE)
    k_scales = torch.tensor([0.5, 3.0], device=DEVICE)
    keys = [torch.randn(case.k_pool.shape, generator=gen).to(DEVICE) for _ in range(layers)]
    pools = [(k / s).to(fp8) for k, s in zip(keys, k_scales)]
    q = (torch.randn(layers, 3, w, hkv * group, d, generator=gen)).to(torch.bfloat16).to(DEVICE)
    qpos = (torch.tensor([69, 22, 40])[:, None] - torch.arange(w)[None, :]).to(DEVICE)
    lo, hi = torch.tensor([4, 0, 3], device=DEVICE), torch.tensor([60, 23, 3], device=DEVICE)  # request 2: empty
    nq = torch.tensor([w, 1, 1], dtype=torch.int32, device=DEVICE)
    beta = torch.tensor([0.5, 1.0, 2.0], device=DEVICE)
    n, scale = 70, d ** -0.5
    rep = lambda t: t.repeat(layers, *([1] * (t.dim() - 1))).contiguous()  # noqa: E731  layer-major rows
    ridx = case.req_pool_idx.int()
    args = (case.req_to_token, rep(ridx), rep(qpos), rep(lo).int(), rep(hi).int(), rep(nq), rep(beta), n, scale)
    u = K.window_evidence(q.flatten(0, 1), K.LayerPools.of(pools), *args, block_n=16, k_scales=k_scales)
    unscaled = K.window_evidence(q.flatten(0, 1), K.LayerPools.of(pools), *args, block_n=16)
    assert not u.isnan().any()
    tok = case.req_to_token[case.req_pool_idx.long(), :n].long()
    qmask = torch.arange(w, device=DEVICE)[None, :] < nq[:, None]
    for layer, pool in enumerate(pools):
        dequant = pool.double() * float(k_scales[layer])
        ref = core.evidence_power_mean(window_logits_torch(q[layer].double(), dequant, tok, qpos, scale),
                                       core.candidate_mask(lo, hi, n), qmask, beta.double())
        got = u[layer * 3: (layer + 1) * 3]
        assert T.rel_error(got, ref) < 1e-4
        # the torch path's scale argument is the same dequantization
        torch_path = window_logits_torch(q[layer].double(), pool.double(), tok, qpos, scale,
                                         k_scale=float(k_scales[layer]))
        torch.testing.assert_close(torch_path, window_logits_torch(q[layer].double(), dequant, tok, qpos, scale))
    assert T.rel_error(unscaled, u) > 0.05


def test_decode_key_norms_over_an_fp8_cache_are_the_dequantized_keys():
    """The norm the decode kernel stores for the new key over a scaled fp8 cache is the
    dequantized key's (k_scale times the stored one's): what the Selector's prior reads."""
    hkv, group, d = 2, 2, 32
    lens = [40, 17]
    case = T.make_decode_case(lens, [0] * 2, [(0, n) for n in lens], num_kv_heads=hkv, group=group,
                              head_dim=d, cap=4, dtype=torch.bfloat16, seed=4, device=DEVICE)
    case = dataclasses.replace(case, k_pool=(case.k_pool.float() / 0.25).to(torch.float8_e4m3fn),
                               v_pool=case.v_pool.to(torch.float8_e4m3fn),
                               a_k=case.a_k.to(torch.float8_e4m3fn), a_v=case.a_v.to(torch.float8_e4m3fn))
    knorm = torch.full((case.k_pool.shape[0], hkv), -1.0, device=DEVICE)
    K.two_segment_decode(*case.args(), key_norms=knorm, k_scale=0.25, block_n=16)
    for b, n in enumerate(lens):
        tok = int(case.req_to_token[int(case.req_pool_idx[b]), n - 1])
        torch.testing.assert_close(knorm[tok], case.k_pool[tok].float().norm(dim=-1) * 0.25, rtol=1e-5, atol=1e-5)
