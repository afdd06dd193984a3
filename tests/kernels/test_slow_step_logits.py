"""SFI's slow step reads the keys once: the dense attention stores the slow query's
logits (two_segment_decode(..., logits_out=)) and the Selector's evidence reads
them (kernels.stored_evidence) instead of every key again (window_evidence).

Against plain PyTorch / the Selector's formulas (interpreted on CPU), ragged
batches, GQA 1/4/8, lengths that are not a multiple of the blocks; and the whole
refresh (selected positions, packed compact buffers) against the key-reading path.
"""


import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.kernels import testing as T
from sgl_sparse.selector import core
from sgl_sparse.selector.refresh import window_logits_torch

_LOG2E = 1.4426950408889634
_SENTINEL = 123.0


def _slow_step(case, slots, length, *, splits, fused=False, row_mask=None):
    """Run the decode kernel with logits_out; returns (out, logits [S, Hkv, G, L])."""
    bs, hq, d = case.q.shape
    hkv = case.k_pool.shape[1]
    logits = torch.full((max(slots) + 2, hkv, hq // hkv, length), _SENTINEL)
    q_save = torch.zeros(max(slots) + 2, hq, d, dtype=case.q.dtype)
    out = K.two_segment_decode(*case.args(), q_save=q_save, q_save_slot=torch.tensor(slots, dtype=torch.int32),
                               logits_out=logits, num_splits=splits, fused_merge=fused, row_mask=row_mask,
                               block_n=16, min_split_len=16)
    return out, logits


def _ref_logits(case, b):
    """fp32 base-2 logits [Hkv, G, n] of request b's query over its positions."""
    n = int(case.seq_lens[b])
    hkv = case.k_pool.shape[1]
    tok = case.req_to_token[int(case.req_pool_idx[b]), :n].long()
    q = case.q[b].float().view(hkv, -1, case.q.shape[-1])
    k = case.k_pool[tok].float()  # [n, Hkv, D]
    return torch.einsum("hgd,nhd->hgn", q, k) * case.sm_scale * _LOG2E


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits, fused", [(1, False), (3, False), (3, True)])
def test_dense_slow_rows_store_their_logits(group, splits, fused):
    hkv, d = 2, 32
    lens = [53, 17, 40, 70]
    # Row 0, 1: dense slow rows (row 1 shorter than a block); row 2: windowed (not
    # dense) with a slot: stores nothing; row 3: dense, no slot; row 4 (below): a
    # slow row longer than the logits buffer.
    ranges = [(0, 53), (0, 17), (24, 40), (0, 70)]
    case = T.make_decode_case(lens, [0, 0, 3, 0], ranges, num_kv_heads=hkv, group=group, head_dim=d, cap=4,
                              dtype=torch.bfloat16, seed=group + splits)
    slots = [2, 0, 1, -1]
    out, logits = _slow_step(case, slots, 64, splits=splits, fused=fused)
    ref = K.two_segment_decode_ref(*case.args())
    assert T.rel_error(out.float(), ref) < 1e-2  # the attention is unchanged
    for b, slot in ((0, 2), (1, 0)):
        n = lens[b]
        torch.testing.assert_close(logits[slot, :, :, :n], _ref_logits(case, b), rtol=1e-5, atol=1e-4)
        assert (logits[slot, :, :, n:] == _SENTINEL).all()
    assert (logits[1] == _SENTINEL).all() and (logits[3] == _SENTINEL).all()
    # A row longer than the buffer stores its first L positions only.
    case2 = T.make_decode_case([70], [0], [(0, 70)], num_kv_heads=hkv, group=group, head_dim=d, cap=4,
                               dtype=torch.bfloat16, seed=5)
    _, lg = _slow_step(case2, [0], 48, splits=splits, fused=fused)
    torch.testing.assert_close(lg[0], _ref_logits(case2, 0)[..., :48], rtol=1e-5, atol=1e-4)


def test_record_only_and_skipped_rows_store_no_logits():
    case = T.make_decode_case([40, 40], [0, 0], [(0, 40), (0, 40)], num_kv_heads=2, group=2, head_dim=32, cap=4,
                              dtype=torch.bfloat16, seed=3)
    _, logits = _slow_step(case, [0, 1], 48, splits=2, row_mask=torch.tensor([2, 0], dtype=torch.int32))
    assert (logits == _SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_stored_evidence_equals_window_evidence_and_the_formula(dtype, group):
    hkv, d, lens = 2, 32, [70, 23, 41, 1030]
    case = T.make_decode_case(lens, [0] * 4, [(0, n) for n in lens], num_kv_heads=hkv, group=group, head_dim=d,
                              cap=4, dtype=dtype, seed=group, q_scale=2.0)
    slots = [3, 0, 2, 1]
    _, logits = _slow_step(case, slots, 1040, splits=2)
    lo = torch.tensor([4, 0, 3, 1])
    hi = torch.tensor([60, 23, 3, 1030 - 256])  # request 2: empty range
    beta = torch.tensor([0.5, 1.0, 2.0, 0.5])
    n = 1030
    slot_t = torch.tensor(slots, dtype=torch.int32)
    u = K.stored_evidence(logits, slot_t, lo, hi, beta, n)
    u_small = K.stored_evidence(logits, slot_t, lo, hi, beta, n, block_n=64)  # many blocks
    qpos = (case.seq_lens.long() - 1)[:, None]
    nq = torch.ones(4, dtype=torch.int32)
    old = K.window_evidence(case.q[:, None], case.k_pool, case.req_to_token, case.req_pool_idx, qpos, lo, hi, nq,
                            beta, n, case.sm_scale, block_n=16)
    tok = case.req_to_token[case.req_pool_idx.long(), :n].long()
    lg = window_logits_torch(case.q[:, None].double(), case.k_pool.double(), tok, qpos, case.sm_scale)
    ref = core.evidence_power_mean(lg, core.candidate_mask(lo, hi, n), torch.ones(4, 1, dtype=torch.bool),
                                   beta.double())
    assert not u.isnan().any() and u.shape == ref.shape
    assert (u[2] == 0).all() and (u[0, :, :4] == 0).all() and (u[0, :, 60:] == 0).all()
    assert T.rel_error(u, ref) < 1e-4
    assert T.rel_error(u_small, u) < 1e-6
    assert T.rel_error(u, old) < 1e-5


def _sfi_setup(logit_len):
    """Three SFI rows after a slow step at lengths 90, 61, 33 (per-row knobs), keys in
    one pool shared by the 2 layers, each layer's query (and logits) saved by its
    dense attention (kernels.testing.make_sfi_refresh_case)."""
    return T.make_sfi_refresh_case(2, logit_len=logit_len, shared_pools=True)


def _refresh(case, **kw):
    from sgl_sparse.selector.refresh import refresh

    refresh(case.state, case.rows, 96, case.k_buffer, case.v_buffer, case.req_to_token, case.scaling, **kw)
    return case.state


def test_refresh_from_stored_logits_packs_what_the_key_reading_path_packs():
    """End to end: a later slow step's refresh from the stored logits selects and
    packs the same tokens as the kernels re-reading the keys and as the torch path."""
    results = []
    for logit_len, use_kernels, later in ((96, True, {1, 2, 3}), (0, True, set()), (0, False, set())):
        results.append(_refresh(_sfi_setup(logit_len), use_kernels=use_kernels, later=later))
    new, old, torch_path = results
    assert torch.equal(new.sel_count, old.sel_count) and torch.equal(new.sel_count, torch_path.sel_count)
    for slot in range(3):
        n = int(new.sel_count[1 + slot])  # rows 1-3 hold slots 0-2 (admitted in order)
        assert int(new.slot[1 + slot]) == slot
        for other in (old, torch_path):
            # Same tokens (ties of exactly equal scores may order them differently).
            ka = new.compact.k[:, slot, :, :n].float().sum(dim=-1).sort(dim=-1).values
            kb = other.compact.k[:, slot, :, :n].float().sum(dim=-1).sort(dim=-1).values
            torch.testing.assert_close(ka, kb)
        assert torch.equal(new.compact.k[:, slot, :, :n], old.compact.k[:, slot, :, :n])
        assert torch.equal(new.compact.v[:, slot, :, :n], old.compact.v[:, slot, :, :n])


def test_refresh_falls_back_to_the_keys_beyond_the_stored_context():
    """A bound past the stored logits, or a first slow step, reads the keys: same result."""
    st_ref = _refresh(_sfi_setup(0), use_kernels=True, later={1, 2, 3})
    case = _sfi_setup(64)  # 96 > 64: the keys
    case.state.compact.logits.fill_(float("nan"))  # never read
    st = _refresh(case, use_kernels=True, later={1, 2, 3})
    assert torch.equal(st.sel_count, st_ref.sel_count)
    assert torch.equal(st.compact.k, st_ref.compact.k) and torch.equal(st.compact.v, st_ref.compact.v)


def test_first_slow_step_keeps_its_prompt_window():
    """Rows not in `later` use the prompt queries (w > 1): the stored logits do not apply."""
    a, b = _sfi_setup(96), _sfi_setup(0)
    for case in (a, b):
        case.state.prompt_q[torch.tensor(case.rows)] = 2
    a.state.compact.logits.fill_(float("nan"))
    st_a, st_b = _refresh(a, use_kernels=True), _refresh(b, use_kernels=True)
    assert torch.equal(st_a.compact.k, st_b.compact.k) and torch.equal(st_a.sel_count, st_b.sel_count)


def test_host_mirror_marks_later_slow_steps():
    """take_refresh: the first decode step's refresh is not `later`, a later slow one is."""
    from sgl_sparse.config import SfiPolicy, SparseServerConfig
    from sgl_sparse.policies import sfi
    from sgl_sparse.state import SparseState

    cfg = SparseServerConfig.model_validate({"compact": {"slots": 1, "capacity": 40}})
    st = SparseState(2, "cpu", cfg)
    spec = SfiPolicy(budget=8, recent=8, sink=2, t_max=2, sentence_triggers=False, min_saving=0)
    st.admit([1], [sfi.init_row(spec, [], [], (None, None))])
    st.set_step_rows([1], [100], [[]])  # step 0 launched (slow: first step)
    st.set_step_rows([1], [101], [[7]])  # its id arrived: step 0 evaluated
    assert st.take_refresh() == ({1: 101}, set())
    toks = [7]
    for n in range(102, 106):
        toks = toks + [7]
        st.set_step_rows([1], [n], [toks])
    pending, later = st.take_refresh()
    assert pending and later == {1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, group", [(4099, 2), (32768, 2), (32771, 4), (131072, 8)])
def test_gpu_stored_evidence_large(n, group):
    """Serving sizes: the slow step's stored logits give window_evidence's w = 1 evidence."""
    hkv, d, bs = 8, 128, 3
    lens = [n, n // 2 + 5, 1000]
    case = T.make_decode_case(lens, [0] * bs, [(0, x) for x in lens], num_kv_heads=hkv, group=group, head_dim=d,
                              cap=4, dtype=torch.bfloat16, device="cuda", seed=n)
    slots = torch.tensor([1, 2, 0], dtype=torch.int32, device="cuda")
    logits = torch.full((3, hkv, group, n), float("nan"), device="cuda")
    q_save = torch.zeros(3, hkv * group, d, dtype=torch.bfloat16, device="cuda")
    for fused in (False, True):
        K.two_segment_decode(*case.args(), q_save=q_save, q_save_slot=slots, logits_out=logits, fused_merge=fused,
                             split_counters=K.make_split_counters(bs, hkv, "cuda"))
        lo = torch.full((bs,), 4, device="cuda")
        hi = torch.tensor(lens, device="cuda") - 256
        beta = torch.full((bs,), 0.5, device="cuda")
        u = K.stored_evidence(logits, slots, lo, hi, beta, n)
        qpos = (case.seq_lens.long() - 1)[:, None]
        old = K.window_evidence(case.q[:, None], case.k_pool, case.req_to_token, case.req_pool_idx, qpos, lo, hi,
                                torch.ones(bs, dtype=torch.int32, device="cuda"), beta, n, case.sm_scale)
        assert not u.isnan().any()
        assert T.rel_error(u, old) < 1e-5
        # The kept set the Selector would rank first: the same up to float-rounding ties.
        k = 2048
        a, b = u.topk(k, dim=-1).indices.sort(-1).values, old.topk(k, dim=-1).indices.sort(-1).values
        assert (a == b).float().mean() > 0.999


def test_warm_up_with_stored_logits_writes_nothing():
    from sgl_sparse.compact import CompactStore
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.selector.refresh import warm_up_kernels

    store = CompactStore(slots=2, capacity=40, num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=32,
                         dtype=torch.bfloat16, pool_size=100, prompt_queries=3, device=torch.device("cpu"),
                         logit_len=96)
    assert store.logits.shape == (2, 2, 2, 2, 96) and store.logit_len == 96
    store.k.fill_(7.0)
    store.logits.fill_(1.5)
    k = torch.randn(100, 2, 32).to(torch.bfloat16)
    warm_up_kernels(store, k, k.clone(), torch.zeros(3, 96, dtype=torch.int32), [SfiPolicy(w_prefill=4)])
    assert (store.k == 7.0).all() and (store.logits == 1.5).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_logits_under_cuda_graph_replay():
    """One captured launch: each replay stores the logits of the rows whose slot is
    set at that replay (the slow ones), at the slot given then, and nothing else."""
    lens = [5000, 3000, 7000]
    case = T.make_decode_case(lens, [0] * 3, [(0, n) for n in lens], num_kv_heads=8, group=2, head_dim=128,
                              cap=4, dtype=torch.bfloat16, device="cuda", seed=13)
    logits = torch.zeros(3, 8, 2, 8192, device="cuda")
    q_save = torch.zeros(3, 16, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.full((3,), -1, dtype=torch.int32, device="cuda")
    counters = K.make_split_counters(3, 8, "cuda")
    kw = dict(max_kv_len=8192, q_save=q_save, q_save_slot=slots, logits_out=logits, fused_merge=True,
              split_counters=counters, row_mask=torch.ones(3, dtype=torch.int32, device="cuda"))
    K.two_segment_decode(*case.args(), **kw)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.two_segment_decode(*case.args(), **kw)
    for step, (b, slot) in enumerate(((0, 2), (2, 0), (1, 1))):
        logits.zero_()
        slots.fill_(-1)
        slots[b] = slot
        g.replay()
        torch.cuda.synchronize()
        n = lens[b]
        ref = _ref_logits(case, b)
        assert T.rel_error(logits[slot, :, :, :n], ref) < 1e-3, step
        assert int((logits != 0).sum()) == int((ref != 0).sum())
