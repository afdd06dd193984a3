"""The start-up warm-up compiles every binary a refresh launches: no Triton compile
while serving.

Triton compiles one binary per kernel, options, constexpr values and class of each
other argument: an integer 1, divisible by 16 or neither, a pointer 16-byte aligned or
not, unless the kernel opts out (`do_not_specialize`, `do_not_specialize_on_alignment`).
A class the warm-up (selector/refresh.warm_up_kernels) missed compiles in the middle
of a decode step: on the H100 the second layer chunk's view of the layers' address
table (8 bytes into it) compiled two kernels in the first SFI batch, 0.9 s
(bench/README, "Session 13"). The interpreter compiles nothing, so here each launch's
classes are computed with Triton's own specialization function
(`native_specialize_impl`, what `JITFunction.run` keys its binaries on) and the
refreshes' must all be among the warm-up's.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from sgl_sparse.kernels import testing as T  # TRITON_INTERPRET is set in tests/conftest.py

interpreter = pytest.importorskip("triton.runtime.interpreter")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402


def _binary_key(kernel, args, kwargs) -> tuple:
    """What Triton's JITFunction keys a compiled binary on, for one launch."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    dns = set(kernel.kwargs.get("do_not_specialize") or ())
    dnsoa = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    bound = dict(zip((p.name for p in params), args))
    bound.update((k, v) for k, v in kwargs.items() if k in {p.name for p in params})
    classes = []
    for i, p in enumerate(params):
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            classes.append((p.name, "=", value))
            continue
        specialize, align = not ({i, p.name} & dns), not ({i, p.name} & dnsoa)
        classes.append((p.name, native_specialize_impl(BaseBackend, value, False, specialize, align)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in bound))
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}", tuple(classes), options


@contextlib.contextmanager
def _binaries(monkeypatch, execute: bool = True):
    """The binary keys of every launch of our kernels inside the block; `execute=False`
    records without running them (for launches whose arguments no kernel's output can
    change: a graph's)."""
    seen: set[tuple] = set()
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        ours = self.fn.__module__.startswith("sgl_sparse")
        if ours:
            seen.add(_binary_key(self, args, kwargs))
        if execute or not ours:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(interpreter.InterpretedFunction, "run", recording)
        yield seen


def test_binary_keys_follow_triton_classes():
    """The key itself: integer and pointer classes, opt-outs and constexprs."""
    import triton
    import triton.language as tl

    def _k(X, n, m, BLOCK: tl.constexpr):
        pass

    kernel = triton.jit(do_not_specialize=["m"], do_not_specialize_on_alignment=["X"])(_k)
    x = torch.zeros(8)
    key = lambda *a, **kw: _binary_key(kernel, a, kw)[1]  # noqa: E731
    assert key(x, 7, 7, BLOCK=4) == (("X", ("*fp32", "")), ("n", ("i32", "")), ("m", ("i32", None)),
                                     ("BLOCK", "=", 4))
    assert key(x, 1, 1, BLOCK=4)[1:3] == (("n", ("constexpr", 1)), ("m", ("i32", None)))
    assert key(x, 32, 32, BLOCK=4)[1] == ("n", ("i32", "D"))
    assert key(x[1:], 7, 7, BLOCK=4)[0] == key(x, 7, 7, BLOCK=4)[0]  # X: alignment not keyed
    assert key(x, 2 ** 40, 7, BLOCK=4)[1] == ("n", ("i64", "D"))


def test_one_soft_nms_binary_serves_every_radius_a_request_may_ask_for(monkeypatch):
    """The Soft-NMS halo is each row's radius read on the device (clamped to the
    config's bound): requests asking for radii 0, 2, 5 and 64 launch the binary a
    default-radius warm-up compiled, nothing else."""
    from sgl_sparse.config import SfiPolicy
    from sgl_sparse.kernels import selector_scores
    from sgl_sparse.kernels.selector_scores import NMS_RADIUS_LIMIT
    from sgl_sparse.selector import core

    le = [m.le for m in SfiPolicy.model_fields["nms_radius"].metadata if hasattr(m, "le")]
    assert le == [NMS_RADIUS_LIMIT]
    gen = torch.Generator().manual_seed(3)
    r, hkv, n = 4, 2, 40
    u, norms = torch.rand(r, hkv, n, generator=gen), torch.rand(r, hkv, n, generator=gen) + 1
    lo, hi = torch.zeros(r, dtype=torch.long), torch.full((r,), n, dtype=torch.long)

    def launch(radii):
        knobs = core.SelectorKnobs.from_specs([SfiPolicy(nms_radius=x) for x in radii], "cpu", torch.float32)
        selector_scores(u, norms, lo, hi, knobs)

    with _binaries(monkeypatch, execute=False) as warm:
        launch([SfiPolicy().nms_radius] * r)
    with _binaries(monkeypatch, execute=False) as served:
        launch([0, 2, 5, NMS_RADIUS_LIMIT])
    assert served and served <= warm


def _serving_refreshes(case, monkeypatch) -> None:
    """Refreshes shaped like serving's: the first slow step (prompt queries: w > 1),
    then later ones (w = 1: from the stored logits where kept), at a bound of 90
    rounded to 96 and of 61 to 64. Layer chunks of 3 of the 4 layers and the evidence
    a layer at a time: the second chunk's and the odd layers' address tables start 8
    bytes into the table, as at 32768 x 8 on the H100 (chunks of 15 of 28 layers)."""
    from sgl_sparse.selector import refresh as R

    store, r2t = case.state.compact, case.req_to_token
    rows, ctx = len(case.rows), r2t.shape[1]
    monkeypatch.setattr(R, "_MAX_SELECT_ELEMS_KERNELS", 3 * rows * store.k.shape[2] * ctx)
    # the three rows' logits of one layer at the widest window: one group, a layer a launch
    monkeypatch.setattr(R, "_MAX_LOGIT_ELEMS", rows * store.q.shape[2] * (1 + store.q_prompt.shape[2]) * ctx)
    R.refresh(case.state, case.rows, 90, case.k_buffer, case.v_buffer, r2t, case.scaling, use_kernels=True)
    R.refresh(case.state, case.rows, 61, case.k_buffer, case.v_buffer, r2t, case.scaling, use_kernels=True,
              later=set(case.rows))
    R.refresh(case.state, case.rows[:1], 90, case.k_buffer, case.v_buffer, r2t, case.scaling,
              use_kernels=True, later=set(case.rows))


@pytest.mark.parametrize("rows_to", [None, 16], ids=["eager", "graph_rows_16"])
@pytest.mark.parametrize("logit_len", [0, 96], ids=["keys", "stored_logits"])
def test_refreshes_launch_only_binaries_the_warm_up_compiled(monkeypatch, logit_len, rows_to):
    """`rows_to`: the refreshes at a refresh graph's shapes (selector/graphs.py: rows
    padded to a bucket, here 16 -- an integer class of its own -- and the bound
    rounded up); the capture itself cannot run on a CPU and is switched off. A graph's
    launch arguments cannot depend on a kernel's output (replay reads none), so there
    the kernels are recorded, not run: the same keys in 0.4 s instead of 200."""
    from sgl_sparse.selector import graphs as G
    from sgl_sparse.selector import refresh as R

    layers = 4
    case = T.make_sfi_refresh_case(layers, logit_len=logit_len, prompt_queries={1: 2, 2: 2, 3: 1},
                                   slow_step=False)
    store, r2t = case.state.compact, case.req_to_token
    if rows_to is not None:
        monkeypatch.setattr(G.RefreshGraphs, "_capture", lambda self, *a, **kw: None)
        monkeypatch.setattr(G, "row_bucket", lambda r: rows_to)
        store.refresh_graphs = G.RefreshGraphs(torch.device("cpu"))
    execute = rows_to is None
    with _binaries(monkeypatch, execute) as warm:
        R.warm_up_kernels(store, case.k[0], case.v[0], r2t, [case.state.config.policies.sfi])
    with _binaries(monkeypatch, execute) as served:
        _serving_refreshes(case, monkeypatch)
    assert served, "the refreshes launched no kernel"
    missed = served - warm
    assert not missed, "compiled while serving:\n" + "\n".join(
        f"{name}: {[c for c in classes if all(c not in w[1] for w in warm if w[0] == name)]}"
        for name, classes, _ in sorted(missed, key=str))


@pytest.mark.parametrize("rows", [16, 32])
def test_key_norms_of_a_refresh_with_rows_divisible_by_16_are_warm(monkeypatch, rows):
    """A refresh of every row of a batch admitted together (sfi-pinned at 8192 x 32:
    32 rows) gathers its key norms with R = 32, an integer class the warm-up's 1- and
    2-row launches do not have; served on the H200 that compiled mid-decode (135 ms,
    session 42). R is not specialized: the same binary."""
    from sgl_sparse.kernels import gather_key_norms
    from sgl_sparse.selector import refresh as R

    case = T.make_sfi_refresh_case(4, logit_len=96, prompt_queries={1: 2, 2: 2, 3: 1}, slow_step=False)
    store, r2t = case.state.compact, case.req_to_token
    with _binaries(monkeypatch, execute=False) as warm:
        R.warm_up_kernels(store, case.k[0], case.v[0], r2t, [case.state.config.policies.sfi])
    n = 64
    tok = r2t[torch.arange(rows) % r2t.shape[0], :n].long()
    with _binaries(monkeypatch, execute=False) as served:
        for first in range(2):  # a first chunk's slice and a later one's, as the refresh takes them
            gather_key_norms(store.knorm[first: first + 1], tok)
    assert served and served <= warm, served - warm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_refresh_after_the_warm_up_compiles_nothing(monkeypatch, fresh_compile_watch):
    """The same refreshes, compiled for real, counted by sgl_sparse/compile_watch.py."""
    from sgl_sparse.selector import refresh as R

    compile_watch = fresh_compile_watch
    assert compile_watch.install()
    case = T.make_sfi_refresh_case(4, logit_len=96, prompt_queries={1: 2, 2: 2, 3: 1}, slow_step=False,
                                   device="cuda")
    R.warm_up_kernels(case.state.compact, case.k[0], case.v[0], case.req_to_token, [case.state.config.policies.sfi])
    warm = compile_watch.compiles
    _serving_refreshes(case, monkeypatch)
    torch.cuda.synchronize()
    print(f"warm-up: {warm} compiles; refreshes after it: {compile_watch.compiles - warm}")
    assert compile_watch.compiles == warm


@pytest.mark.parametrize("rows", [[1], [1, 4, 6], [4, 1, 2, 7], [1, 2, 3, 4, 5, 6, 7]],
                         ids=["one_quest", "odd_rows", "two_quest", "every_policy"])
def test_quest_extends_launch_only_the_binary_the_warm_up_compiled(monkeypatch, rows):
    """quest's extend bounds every quest row of a forward in one launch a layer, its
    four fields slices of the forward's one host-to-device copy. At an odd offset in
    that copy a field is 8 bytes off 16, another pointer class: on the H200 the first
    quest prefills compiled the kernel twice, 0.3 s each (session 57). The fields now
    lead the copy, padded to even counts, and the start-up warm-up
    (query_serving.warm_up_extend_kernels) compiles their one class."""
    from sgl_sparse.policies import PolicyId
    from sgl_sparse.query_serving import warm_up_extend_kernels
    from tests.test_query_device import MODULES, SPECS, Twin

    name = "sgl_sparse.kernels.quest_pages._quest_bounds_update_kernel"
    specs = {r: SPECS[r] for r in rows}
    twin = Twin(2, use_kernels=True, num_layers=2, specs=specs)
    store = twin.st.query_stores[PolicyId.QUEST]
    before = store.kmin.clone(), store.kmax.clone()
    with _binaries(monkeypatch) as warm:
        warm_up_extend_kernels(twin.st.query_stores, twin.k, twin.r2t)
    assert torch.equal(store.kmin, before[0]) and torch.equal(store.kmax, before[1])  # slot -1: nothing written
    inits = [MODULES[s.policy if s is not None else "full"].init_row(s, [], [], (None, None)) for s in specs.values()]
    admitted = twin.st.admit(rows, inits)
    lens = [twin.lens[r] for r in rows]
    twin.rt.plan_extend(rows, lens, lens, admitted)
    assert all(t.data_ptr() % 16 == 0 for t in twin.rt._quest_extend)
    q = torch.randn(sum(lens), 4, twin.d).to(twin.k.dtype)
    with _binaries(monkeypatch) as served:
        for li in range(2):
            twin.rt.on_extend(li, q, twin.k, twin.v, twin.r2t, 0.25)
    served = {k for k in served if k[0] == name}
    assert served and served <= warm, served - warm
    assert {k[0] for k in warm} == {name}
