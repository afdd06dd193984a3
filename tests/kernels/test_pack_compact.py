"""Tests for kernels.pack_compact (gather selected positions into segment A).

The kernel is a pure copy, so results must be *bit-identical* to the
reference. Destination buffers are poisoned with NaN before the launch:
packed rows must be fully written (no NaN), everything else must be left
exactly as it was (NaN stays NaN). ``a_len`` starts at random values so
updates of unflagged requests would be caught.
"""

import random

import pytest
import torch

from sgl_sparse import kernels as K  # TRITON_INTERPRET is set in tests/conftest.py
from sgl_sparse.kernels import testing as T

HAS_CUDA = torch.cuda.is_available()

DEVICE = "cuda" if HAS_CUDA else "cpu"


def gpu_test(fn):
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(fn)
    return pytest.mark.gpu(fn)


def poison(case):
    case.a_k.fill_(float("nan"))
    case.a_v.fill_(float("nan"))
    return case


def run_and_compare(case, **kw):
    """Run kernel and reference on private copies; assert identical results."""
    poison(case)
    ker = case.clone_outputs()
    ref = case.clone_outputs()
    K.pack_compact(*ker.args(), **kw)
    K.pack_compact_ref(*ref.args())
    torch.testing.assert_close(ker.a_k, ref.a_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ker.a_v, ref.a_v, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ker.a_len, ref.a_len)
    # Every packed row was written (no NaN left in the valid region).
    cap = case.a_k.shape[2]
    for b in range(case.sel_pos.shape[0]):
        if not bool(case.do_pack[b]):
            assert torch.equal(ker.a_len[b], case.a_len[b]), "unflagged request's a_len changed"
            continue
        slot = int(case.a_slot[b])
        for h in range(case.sel_pos.shape[1]):
            n = min(int(case.sel_len[b, h]), cap)
            assert not torch.isnan(ker.a_k[slot, h, :n]).any()
            assert not torch.isnan(ker.a_v[slot, h, :n]).any()
    # Slots not owned by a flagged request are untouched (still all NaN).
    owned = {int(case.a_slot[b]) for b in range(len(case.do_pack)) if bool(case.do_pack[b])}
    for s in range(case.a_k.shape[0]):
        if s not in owned:
            assert torch.isnan(ker.a_k[s]).all() and torch.isnan(ker.a_v[s]).all()
    return ker


PACK_CONFIGS = [
    # (dtype, head_dim, num_kv_heads, bs, block_n, max_chunks)
    (torch.bfloat16, 64, 2, 1, 16, 16),
    (torch.float16, 128, 3, 3, 16, 2),
    (torch.bfloat16, 128, 1, 5, 32, None),
    (torch.float16, 64, 4, 4, 16, 1),
]


@pytest.mark.parametrize("idx", range(len(PACK_CONFIGS)))
def test_pack_matches_reference(idx):
    dtype, head_dim, hkv, bs, block_n, max_chunks = PACK_CONFIGS[idx]
    rng = random.Random(idx)
    cap = 45
    seq_lens = [rng.randint(10, 120) for _ in range(bs)]
    sel_lens = [[rng.randint(0, min(cap, n)) for _ in range(hkv)] for n in seq_lens]
    sel_lens[0][0] = min(cap, seq_lens[0])  # one full selection
    do_pack = [True] + [rng.random() < 0.6 for _ in range(bs - 1)]
    case = T.make_pack_case(
        seq_lens, sel_lens, do_pack, num_kv_heads=hkv, head_dim=head_dim, cap=cap, dtype=dtype, device=DEVICE,
        seed=idx, sorted_positions=bool(idx % 2),
    )
    if idx == 1:
        case.do_pack = case.do_pack.to(torch.int32)  # int flags work too
    run_and_compare(case, block_n=block_n, max_chunks=max_chunks)


def test_pack_nothing_flagged():
    case = T.make_pack_case(
        [30, 50], [[10, 3], [0, 20]], [False, False], num_kv_heads=2, head_dim=64, cap=24, device=DEVICE, seed=9
    )
    ker = run_and_compare(case, block_n=16)
    assert torch.isnan(ker.a_k).all()


def test_pack_default_tiling():
    """Default block_n / max_chunks (the GPU configuration)."""
    case = T.make_pack_case(
        [200, 90], [[100, 7], [90, 0]], [True, True], num_kv_heads=2, head_dim=128, cap=130, device=DEVICE, seed=3
    )
    run_and_compare(case)


def test_pack_then_decode():
    """Pack a selection, then decode A(selected) + B(recent) == attention over those positions."""
    seq_lens = [90, 64, 120]
    hkv, group, head_dim, cap = 2, 4, 64, 32
    sel_lens = [[20, 31], [0, 5], [32, 1]]
    case = T.make_pack_case(
        seq_lens, sel_lens, [True, True, True], num_kv_heads=hkv, head_dim=head_dim, cap=cap, dtype=torch.float16,
        device=DEVICE, seed=5,
    )
    K.pack_compact(*case.args(), block_n=16)
    recent = [(n - 17, n) for n in seq_lens]
    q = torch.randn(len(seq_lens), hkv * group, head_dim, dtype=torch.float16, device=DEVICE)
    b_start = torch.tensor([s for s, _ in recent], dtype=torch.int32, device=DEVICE)
    b_end = torch.tensor([e for _, e in recent], dtype=torch.int32, device=DEVICE)
    sm_scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    K.two_segment_decode(
        q, case.a_k, case.a_v, case.a_slot, case.a_len, case.k_pool, case.v_pool, case.req_to_token,
        case.req_pool_idx, b_start, b_end, sm_scale, out=out, num_splits=2, block_n=16, min_split_len=16,
    )
    # Expected: plain attention over (selected positions) ++ (recent window), per KV head.
    ref = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        row = case.req_to_token[case.req_pool_idx[b]].long()
        for h in range(hkv):
            pos = torch.cat([case.sel_pos[b, h, : sel_lens[b][h]].long(), torch.arange(*recent[b], device=DEVICE)])
            k = case.k_pool[row[pos], h].double()
            v = case.v_pool[row[pos], h].double()
            qh = q[b, h * group : (h + 1) * group].double()
            p = torch.softmax(qh @ k.T * sm_scale, dim=-1)
            ref[b, h * group : (h + 1) * group] = (p @ v).cpu()
    assert not torch.isnan(out).any()
    assert T.rel_error(out.float().cpu(), ref) < 5e-3


@gpu_test
@pytest.mark.parametrize("ctx", [4096, 32768, 131072])
def test_gpu_pack_large(ctx):
    bs, hkv, cap = 4, 8, 2048
    rng = random.Random(ctx)
    seq_lens = [ctx - rng.randint(0, 99) for _ in range(bs)]
    sel_lens = [[rng.randint(0, cap) for _ in range(hkv)] for _ in range(bs)]
    case = T.make_pack_case(
        seq_lens, sel_lens, [True, False, True, True], num_kv_heads=hkv, head_dim=128, cap=cap, device="cuda", seed=1
    )
    run_and_compare(case)


def _layered_case(seed, *, layers, bs, hkv, head_dim, cap, width, dtype, device=DEVICE):
    """Per-layer pools (separate tensors, as SGLang keeps them), ragged rows, a sink
    prefix per row, some empty selections and unflagged rows; outputs NaN-poisoned."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 130) for _ in range(bs)]
    pool = sum(seq_lens) + 7
    k_pools = [torch.randn(pool, hkv, head_dim, generator=gen).to(dtype).to(device) for _ in range(layers)]
    v_pools = [torch.randn(pool, hkv, head_dim, generator=gen).to(dtype).to(device) for _ in range(layers)]
    r2t = torch.zeros(bs + 2, 140, dtype=torch.int32)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    for b, n in enumerate(seq_lens):
        r2t[rows[b], :n] = torch.randperm(pool, generator=gen)[:n].int()
    sink = torch.tensor([min(rng.randint(0, 5), n) for n in seq_lens], dtype=torch.int32)
    # Per (layer, row, head): ascending positions after the sink; the row's length is
    # the same for every layer and head (as the refresh's Top-K count).
    count = [rng.randint(0, min(width, n - int(s), cap - int(s))) for n, s in zip(seq_lens, sink.tolist())]
    count[0] = 0  # an empty selection (sink only)
    sel_pos = torch.zeros(layers * bs, hkv, width, dtype=torch.int32)
    for lb in range(layers * bs):
        b = lb % bs
        for h in range(hkv):
            cand = torch.arange(int(sink[b]), seq_lens[b])
            pick = cand[torch.randperm(len(cand), generator=gen)[: count[b]]].sort().values
            sel_pos[lb, h, : count[b]] = pick.int()
    sel_len = (sink + torch.tensor(count, dtype=torch.int32))[:, None].expand(-1, hkv)  # stride 0 along heads
    do_pack = torch.tensor([True] + [rng.random() < 0.7 for _ in range(bs - 1)])
    slots = torch.randperm(bs + 1, generator=gen)[:bs].int()
    a_k = torch.full((layers, bs + 1, hkv, cap, head_dim), float("nan"), dtype=dtype)
    a_len = torch.full((bs, hkv), -5, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (k_pools, v_pools, to(r2t), to(rows.int()), to(sel_pos), to(sel_len), to(sink), to(do_pack),
            to(a_k), to(a_k.clone()), to(slots), to(a_len))


@pytest.mark.parametrize("layers, bs, hkv, head_dim, width, block_n, max_chunks, dtype", [
    (3, 4, 2, 64, 23, 16, 2, torch.bfloat16),
    (2, 1, 1, 32, 40, 16, None, torch.float16),
    (4, 5, 3, 80, 9, 32, 16, torch.bfloat16),  # head_dim not a power of two
])
def test_pack_layers_matches_reference(layers, bs, hkv, head_dim, width, block_n, max_chunks, dtype):
    """One launch for every layer (address table) == pack_compact_ref per layer, bit for bit."""
    args = _layered_case(layers * 10 + bs, layers=layers, bs=bs, hkv=hkv, head_dim=head_dim, cap=45, width=width,
                         dtype=dtype)
    k_pools, v_pools, rest = args[0], args[1], args[2:]
    ref = [t.clone() for t in rest]
    K.pack_compact_layers(K.LayerPools.of(k_pools), K.LayerPools.of(v_pools), *rest, block_n=block_n,
                          max_chunks=max_chunks)
    K.pack_compact_layers_ref(k_pools, v_pools, *ref)
    a_k, a_v, a_len = rest[6], rest[7], rest[9]
    torch.testing.assert_close(a_k, ref[6], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a_v, ref[7], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a_len, ref[9])
    sel_len, do_pack, slots = rest[3], rest[5], rest[8]
    for b in range(bs):
        n = int(sel_len[b, 0])
        if bool(do_pack[b]):
            assert not a_k[:, int(slots[b]), :, :n].isnan().any() and a_k[:, int(slots[b]), :, n:].isnan().all()
        else:
            assert a_k[:, int(slots[b])].isnan().all() and (a_len[b] == -5).all()


def test_pack_layers_reads_each_layers_pool():
    """Layer l's rows come from pool l (not pool 0): pools filled with their layer index."""
    k_pools, v_pools, *rest = _layered_case(7, layers=3, bs=2, hkv=2, head_dim=16, cap=20, width=8,
                                            dtype=torch.float16)
    for layer, (k, v) in enumerate(zip(k_pools, v_pools)):
        k.fill_(layer)
        v.fill_(-layer)
    K.pack_compact_layers(K.LayerPools.of(k_pools), K.LayerPools.of(v_pools), *rest, block_n=16)
    a_k, a_v, slots, sel_len = rest[6], rest[7], rest[8], rest[3]
    n = int(sel_len[0, 0])  # row 0 is always packed
    for layer in range(3):
        assert (a_k[layer, int(slots[0]), :, :n] == layer).all() and (a_v[layer, int(slots[0]), :, :n] == -layer).all()


def test_layer_pools_refuse_pools_that_cannot_share_a_launch():
    a = torch.zeros(10, 2, 16, dtype=torch.float16)
    with pytest.raises(AssertionError):
        K.LayerPools.of([a, torch.zeros(10, 2, 16, dtype=torch.bfloat16)])
    with pytest.raises(AssertionError):
        K.LayerPools.of([a, torch.zeros(12, 2, 16, dtype=torch.float16)])
    with pytest.raises(AssertionError):  # misaligned: an address the kernel could not assume aligned
        K.LayerPools.of([a, torch.zeros(10 * 2 * 16 + 1, dtype=torch.float16)[1:].view(10, 2, 16)])
    table = K.LayerPools.of([a, a.clone(), a.clone()])
    assert len(table) == 3 and len(table.layers(1, 3)) == 2 and int(table.layers(1, 3).ptrs[0]) == int(table.ptrs[1])


def test_pack_kernel_compiles_for_sm90_and_keeps_16_byte_loads_from_the_table():
    """The layered variant compiles for the H100 (sm_90) and reads K/V with the same
    16-byte vector loads as the one-pool variant (load_layer_pool's alignment hint)."""
    from sgl_sparse.kernels.pack_compact import _pack_compact_kernel as fn

    ints = ("BS", "SEL_W", "CAP")
    counts = []
    for layered in (False, True):
        const = dict(HEAD_DIM=128, BLOCK_N=64, BLOCK_D=128, LAYERED=layered, SINK_PREFIX=layered)
        sig, divisible = {}, []
        for name in fn.arg_names:
            if name in ("K_POOL", "V_POOL", "A_K", "A_V"):
                sig[name] = "*bf16"
            elif name in ("K_PTRS", "V_PTRS"):
                sig[name] = "*i64"
            elif name == "DO_PACK":
                sig[name] = "*u8"
            elif name in const:
                sig[name] = "constexpr"
            elif name.isupper() and name not in ints:
                sig[name] = "*i32"
            else:
                sig[name] = "i32"
            if sig[name].startswith("*") or name.startswith(("stride_k", "stride_v", "stride_a")):
                divisible.append(name)
        counts.append(T.compile_sm90("sgl_sparse.kernels.pack_compact", "_pack_compact_kernel", sig, const, divisible))
    one, layered = counts
    assert one.get("ld.global.v4.b32", 0) > 0
    assert layered.get("ld.global.v4.b32") == one["ld.global.v4.b32"], counts
    assert layered.get("st.global.v4.b32") == one["st.global.v4.b32"], counts
