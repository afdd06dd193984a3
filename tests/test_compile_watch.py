"""The Triton compile watch (sgl_sparse/compile_watch.py) on the real `triton.knobs`.

Under TRITON_INTERPRET=1 nothing compiles, so the CPU tests call the installed hooks as
Triton's JITFunction._call_hook calls them (the same keyword arguments); the GPU test
compiles a fresh kernel for real.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytestmark = pytest.mark.sglang_independent

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
import triton.language as tl  # noqa: E402



@pytest.fixture
def watch(fresh_compile_watch):
    return fresh_compile_watch  # tests/conftest.py


def _compile(module: str, name: str = "_two_segment_kernel", warmup: bool = False):
    """What Triton passes to both hooks around one compile."""
    fn = types.SimpleNamespace(module=module, name=name, jit_function=None)
    # As Triton 3.6 / 3.7 fill it: the signature, constexprs and integer-1 arguments
    # by path, the divisibility attributes by path in configs[0].
    comp = {"key": ("k",), "signature": {"Q": "*bf16", "n": "i32", "m": "constexpr", "BLOCK": "constexpr"},
            "constants": {(2,): 1, (3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    kw = dict(key=("k",), repr=f"{name}[num_warps=4](n: i32 (D))", fn=fn, compile=comp,
              is_manual_warmup=warmup, already_compiled=False)
    skipped = knobs.runtime.jit_cache_hook(**kw)
    knobs.runtime.jit_post_compile_hook(**kw)
    return skipped


def test_start_up_compiles_are_info_and_serving_ones_warnings(watch, caplog):
    assert watch.install()
    caplog.set_level(logging.INFO, logger="sgl_sparse.compile_watch")
    assert not _compile("sgl_sparse.kernels.two_segment_decode")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "two_segment_decode._two_segment_kernel" in caplog.records[0].getMessage()
    assert watch.compiles_after_serving == 0

    watch.mark_serving()
    caplog.clear()
    assert not _compile("sgl_sparse.kernels.topk_range", "_topk_range_kernel")
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    msg = rec.getMessage()
    assert "while serving" in msg and "topk_range._topk_range_kernel" in msg
    assert msg.endswith("Q:*bf16/16, n:i32, m=1, BLOCK=64")
    ms = float(msg.split("(")[1].split(" ms")[0])
    assert 0 <= ms < 1000  # timed between the two hooks, not NaN
    assert watch.compiles_after_serving == 1 and watch.compiles == 2


def test_other_packages_kernels_and_manual_warmups_are_not_counted(watch, caplog):
    watch.install()
    watch.mark_serving()
    caplog.set_level(logging.INFO, logger="sgl_sparse.compile_watch")
    _compile("flash_attn.ops.triton.rotary")  # another package's kernel
    assert caplog.records == []
    _compile("sgl_sparse.kernels.pack_compact", warmup=True)  # kernel.warmup(...): not a stall
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert watch.compiles_after_serving == 0
    assert watch._started == {}


def test_listeners_hear_each_compile_of_ours_with_its_phase(watch):
    heard = []
    watch.install()
    watch.add_listener(heard.append)
    watch.add_listener(heard.append)  # once per listener
    _compile("sgl_sparse.kernels.two_segment_decode")
    _compile("flash_attn.ops.triton.rotary")  # another package's kernel
    watch.mark_serving()
    _compile("sgl_sparse.kernels.two_segment_decode")
    assert heard == [False, True]


def test_install_keeps_earlier_hooks_and_their_say_on_skipping(watch):
    seen = []

    def theirs_before(**kw):
        seen.append(("before", kw["repr"]))
        return True  # "skip this compile": Triton must still get it

    def theirs_after(**kw):
        seen.append(("after", kw["repr"]))

    knobs.runtime.jit_cache_hook = theirs_before
    knobs.runtime.jit_post_compile_hook = theirs_after
    assert watch.install() and watch.install()  # once per process: a second call adds nothing
    assert _compile("sgl_sparse.kernels.quest_pages", "_quest_kernel") is True
    assert [s for s, _ in seen] == ["before", "after"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_compile_while_serving_is_logged(watch, caplog):
    def _probe(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, offs.to(tl.float32) + n, mask=offs < n)

    _probe.__module__ = "sgl_sparse.kernels._compile_watch_probe"
    probe = triton.jit(_probe)
    watch.install()
    watch.mark_serving()
    caplog.set_level(logging.INFO, logger="sgl_sparse.compile_watch")
    x = torch.zeros(64, device="cuda")
    probe[(1,)](x, 7, BLOCK=64)
    probe[(1,)](x, 9, BLOCK=64)  # same class of n (other): no second compile
    probe[(1,)](x, 16, BLOCK=64)  # divisible by 16: a new binary
    torch.cuda.synchronize()
    assert x[15].item() == 31.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and watch.compiles_after_serving == 2, warnings
    assert all("_compile_watch_probe." in w and "._probe" in w for w in warnings)
    assert warnings[0].endswith("x_ptr:*fp32/16, n:i32, BLOCK=64")
    assert warnings[1].endswith("x_ptr:*fp32/16, n:i32/16, BLOCK=64")
