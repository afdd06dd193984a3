"""Random problem builders shared by the kernel tests and benchmarks.

Every builder draws *fresh* random data (``torch.randn``; never zeros), lays
requests out at random rows of ``req_to_token`` and maps their positions to a
random permutation of pool slots, so that ``req_to_token`` is non-contiguous
and any indexing mistake shows up as a numerical mismatch. Entries that a
correct kernel must not read (``req_to_token`` beyond a request's length,
compact-buffer rows beyond ``a_len``) are filled with valid-but-wrong data
rather than left empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "DecodeCase",
    "PackCase",
    "SfiRefreshCase",
    "make_decode_case",
    "make_pack_case",
    "make_sfi_refresh_case",
    "policy_segments",
    "set_indexed_rows",
    "rel_error",
    "compile_sm90",
]

IntOrPerHead = Union[int, Sequence[int]]

_COMPILE_SM90 = """
import collections, importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, kernel, sig, const, divisible, options, patterns, resources, keep_ptx = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
compiled = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
counts = collections.Counter(re.findall(r"(?:ld|st)\\.global[.\\w]*", ptx))
for p in patterns:
    counts[p] = len(re.findall(p, ptx))
if resources:  # Triton's own ptxas, as its launcher would assemble the PTX
    import os, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        info = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", src, "-o", os.path.join(d, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    counts["registers"] = int(re.search(r"Used (\\d+) registers", info).group(1))
    stack = re.search(r"(\\d+) bytes cumulative stack size", info)
    counts["stack_bytes"] = int(stack.group(1)) if stack else 0
    counts["shared_bytes"] = compiled.metadata.shared
if keep_ptx:
    counts["ptx"] = ptx
print(json.dumps(counts))
"""


def compile_sm90(module: str, kernel: str, signature: dict, constexprs: dict,
                 divisible: Sequence[str] = (), options: Optional[dict] = None,
                 patterns: Sequence[str] = (), resources: bool = False, keep_ptx: bool = False) -> dict:
    """Compile ``module.kernel`` for sm_90 (no GPU needed) and count its global
    loads/stores by width (e.g. ``ld.global.v4.b32``: 16-byte loads), and the
    matches of each regex of ``patterns`` in the PTX (keyed by the regex).
    ``options``: the launch's compile options (e.g. ``enable_fp_fusion``, ``num_warps``).
    ``resources``: also ``registers`` a thread and ``stack_bytes`` (spills) from
    Triton's ptxas, and ``shared_bytes`` a program: what bounds the programs
    resident on an SM (the occupancy ncu reports).
    ``keep_ptx``: the PTX text itself too, under the key ``"ptx"``.

    Runs in a fresh interpreter without ``TRITON_INTERPRET``: in the test
    process the kernels are interpreted and cannot be compiled. ``signature``
    maps every argument to a Triton type (``"*bf16"``, ``"i32"``, ``"constexpr"``);
    ``divisible``: arguments Triton may assume 16-divisible (as its launcher
    specializes aligned pointers and strides).
    """
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps([module, kernel, signature, constexprs, list(divisible), options or {}, list(patterns),
                      bool(resources), bool(keep_ptx)])
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90, arg], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_90 failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_on_device(fn, *args, device=None, **kw):
    """Run a kernel launcher on `device` (default: the GPU where there is one, else
    the Triton interpreter on CPU): tensor arguments copied there and copied back in
    place afterwards (the launchers write their outputs in place); outputs back on
    CPU. Lets one kernel test run compiled on the lent GPU and interpreted in CI."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return fn(*args, **kw)
    pairs = []

    def there(x):
        if isinstance(x, torch.Tensor):
            pairs.append((x, x.to(device)))
            return pairs[-1][1]
        if isinstance(x, tuple):  # e.g. the launchers' slots=(req_to_token, req_pool_idx, out)
            moved = [there(v) for v in x]
            return type(x)(*moved) if hasattr(x, "_fields") else tuple(moved)  # a NamedTuple keeps its type
        return x

    out = fn(*[there(x) for x in args], **{k: there(v) for k, v in kw.items()})
    for x, y in pairs:
        x.copy_(y.cpu())

    def back(o):
        return tuple(back(v) for v in o) if isinstance(o, tuple) else o.cpu() if isinstance(o, torch.Tensor) else o

    return back(out)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are exactly zero)."""
    out = out.double()
    ref = ref.double()
    num = torch.linalg.vector_norm(out - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


@dataclass
class DecodeCase:
    q: torch.Tensor
    a_k: torch.Tensor
    a_v: torch.Tensor
    a_slot: torch.Tensor
    a_len: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_idx: torch.Tensor
    b_start: torch.Tensor
    b_end: torch.Tensor
    sm_scale: float
    seq_lens: torch.Tensor  # [bs] int32, length of each request's sequence
    meta: dict = field(default_factory=dict)
    a_pos: Optional[torch.Tensor] = None  # [bs, Hkv, cap_pos] int32 (rows with a_slot == -2)

    def stored_as(self, kv_dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0) -> "DecodeCase":
        """The pool and compact buffers as SGLang stores a cache of ``kv_dtype``:
        ``(k / k_scale).to(kv_dtype)`` (memory_pool's set_kv_buffer); unit scales by
        default."""
        def store(t, s):
            return (t.float() / s).to(kv_dtype)
        return replace(self, k_pool=store(self.k_pool, k_scale), v_pool=store(self.v_pool, v_scale),
                       a_k=store(self.a_k, k_scale), a_v=store(self.a_v, v_scale))

    def slow_step_outputs(self, logits_len: int) -> dict:
        """The SFI slow step's side-effect buffers for ``two_segment_decode`` (every row
        its own slot): the key norms by pool slot, the saved queries and the kept
        logits ``[bs, Hkv, G, logits_len]`` fp32, as the backend passes them."""
        bs, hq, d = self.q.shape
        hkv, dev = self.k_pool.shape[1], self.q.device
        return dict(key_norms=torch.zeros(self.k_pool.shape[0], hkv, dtype=torch.float32, device=dev),
                    q_save=torch.empty(bs, hq, d, dtype=self.q.dtype, device=dev),
                    q_save_slot=torch.arange(bs, dtype=torch.int32, device=dev),
                    logits_out=torch.empty(bs, hkv, hq // hkv, logits_len, dtype=torch.float32, device=dev))

    def kwargs(self) -> dict:
        """Keyword arguments describing the problem (beyond the positional ones)."""
        return {} if self.a_pos is None else {"a_pos": self.a_pos}

    def args(self) -> tuple:
        """Positional arguments of two_segment_decode / two_segment_decode_ref."""
        return (
            self.q,
            self.a_k,
            self.a_v,
            self.a_slot,
            self.a_len,
            self.k_pool,
            self.v_pool,
            self.req_to_token,
            self.req_pool_idx,
            self.b_start,
            self.b_end,
            self.sm_scale,
        )

    def kv_lens(self) -> torch.Tensor:
        """[bs, Hkv] number of keys each (request, KV head) attends to."""
        cap = self.a_k.shape[2]
        b_len = (self.b_end - self.b_start).clamp_min(0).to(torch.int64)
        return self.a_len.to(torch.int64).clamp(0, cap) + b_len[:, None]


def _per_head(x: IntOrPerHead, num_kv_heads: int) -> List[int]:
    if isinstance(x, int):
        return [x] * num_kv_heads
    x = [int(v) for v in x]
    assert len(x) == num_kv_heads, f"expected {num_kv_heads} per-head values, got {len(x)}"
    return x


def _layout_requests(
    seq_lens: Sequence[int],
    *,
    max_ctx: int,
    max_reqs: int,
    extra_pool_tokens: int,
    device,
    gen: torch.Generator,
    pool_layout: str = "random",
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Random req_pool rows and pool slots -> (req_to_token, req_pool_idx, N).

    ``pool_layout="random"``: positions map to a random permutation of pool
    slots (worst case: every K/V row is a separate random access).
    ``"contiguous"``: each request owns a run of consecutive slots (best
    case, like a freshly allocated pool).
    """
    assert pool_layout in ("random", "contiguous")
    bs = len(seq_lens)
    total = int(sum(seq_lens))
    num_tokens = total + extra_pool_tokens
    # Unused entries point at random *valid* slots: reading them is a wrong
    # answer, not a crash.
    req_to_token = torch.randint(0, num_tokens, (max_reqs, max_ctx), generator=gen, device=device, dtype=torch.int32)
    req_pool_idx = torch.randperm(max_reqs, generator=gen, device=device)[:bs].to(torch.int64)
    if pool_layout == "random":
        perm = torch.randperm(num_tokens, generator=gen, device=device).to(torch.int32)
    else:
        perm = torch.arange(num_tokens, device=device, dtype=torch.int32)
    off = 0
    for b, n in enumerate(seq_lens):
        n = int(n)
        if n > 0:
            row = int(req_pool_idx[b].item())
            req_to_token[row, :n] = perm[off : off + n]
            off += n
    return req_to_token, req_pool_idx, num_tokens


def make_decode_case(
    seq_lens: Sequence[int],
    a_lens: Sequence[IntOrPerHead],
    b_ranges: Sequence[Tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    cap: int,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    max_ctx: Optional[int] = None,
    max_reqs: Optional[int] = None,
    num_slots: Optional[int] = None,
    q_scale: float = 1.0,
    empty_slot_value: Optional[int] = -1,
    req_pool_idx_dtype: torch.dtype = torch.int64,
    extra_pool_tokens: int = 7,
    pool_layout: str = "random",
) -> DecodeCase:
    """Build a random two-segment decode problem.

    Args:
        seq_lens: per-request sequence length (positions ``[0, n)`` exist in the pool).
        a_lens: per-request segment-A length, an int or one int per KV head.
        b_ranges: per-request ``(b_start, b_end)`` with ``0 <= b_start <= b_end <= n``.
        q_scale: multiply q (peakier softmax for values > 1).
        empty_slot_value: a_slot given to requests whose a_len is 0 for every
            head (the kernel must ignore it); ``None`` keeps a real slot.
        pool_layout: ``"random"`` (default) or ``"contiguous"`` pool slots.
    """
    device = torch.device(device)
    bs = len(seq_lens)
    assert len(a_lens) == bs and len(b_ranges) == bs
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    max_ctx = max_ctx or max(8, max(int(n) for n in seq_lens) + 5)
    max_reqs = max_reqs or bs + 3
    num_slots = num_slots or bs + 2
    hq = num_kv_heads * group

    req_to_token, req_pool_idx, num_tokens = _layout_requests(
        seq_lens, max_ctx=max_ctx, max_reqs=max_reqs, extra_pool_tokens=extra_pool_tokens, device=device, gen=gen,
        pool_layout=pool_layout,
    )

    def randn(*shape):
        # Directly in the target dtype: no fp32 temporary (matters at 128K x 32).
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = (torch.randn(bs, hq, head_dim, generator=gen, device=device) * q_scale).to(dtype)
    k_pool = randn(num_tokens, num_kv_heads, head_dim)
    v_pool = randn(num_tokens, num_kv_heads, head_dim)
    # Rows beyond a_len hold random data too: reading them would be wrong.
    a_k = randn(num_slots, num_kv_heads, cap, head_dim)
    a_v = randn(num_slots, num_kv_heads, cap, head_dim)

    a_len_rows = [_per_head(x, num_kv_heads) for x in a_lens]
    for row in a_len_rows:
        assert all(0 <= x <= cap for x in row), f"a_len must be in [0, {cap}]"
    a_len = torch.tensor(a_len_rows, dtype=torch.int32, device=device).view(bs, num_kv_heads)
    a_slot = torch.randperm(num_slots, generator=gen, device=device)[:bs].to(torch.int32)
    if empty_slot_value is not None:
        for b, row in enumerate(a_len_rows):
            if max(row) == 0:
                a_slot[b] = empty_slot_value

    for (s, e), n in zip(b_ranges, seq_lens):
        assert 0 <= s <= e <= n, f"bad segment-B range {(s, e)} for seq_len {n}"
    b_start = torch.tensor([s for s, _ in b_ranges], dtype=torch.int32, device=device)
    b_end = torch.tensor([e for _, e in b_ranges], dtype=torch.int32, device=device)

    return DecodeCase(
        q=q,
        a_k=a_k,
        a_v=a_v,
        a_slot=a_slot,
        a_len=a_len,
        k_pool=k_pool,
        v_pool=v_pool,
        req_to_token=req_to_token,
        req_pool_idx=req_pool_idx.to(req_pool_idx_dtype),
        b_start=b_start,
        b_end=b_end,
        sm_scale=head_dim**-0.5,
        seq_lens=torch.tensor([int(n) for n in seq_lens], dtype=torch.int32, device=device),
        meta=dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, cap=cap, dtype=dtype),
    )


def set_indexed_rows(
    case: DecodeCase,
    counts: dict,
    *,
    cap_pos: int,
    seed: int = 0,
) -> DecodeCase:
    """Turn rows of ``case`` into indexed segment-A rows (``a_slot == -2``).

    ``counts`` maps a row ``b`` to its per-KV-head number of listed positions
    (an int or one int per head), each ``<= min(cap_pos, b_start[b])``. Every
    (row, head) gets its own random set of distinct positions below
    ``b_start[b]``, in random order. Entries past ``a_len`` -- and every entry
    of rows that are not indexed -- hold valid-looking positions of *other*
    rows' ranges or huge values, so reading them is a visible mismatch.
    Sets ``case.a_pos``, ``case.a_len`` and ``case.a_slot`` of those rows.
    """
    gen = torch.Generator(device=case.q.device)
    gen.manual_seed(seed)
    bs, num_kv_heads = case.a_len.shape
    dev = case.q.device
    a_pos = torch.randint(0, 1 << 30, (bs, num_kv_heads, cap_pos), generator=gen, device=dev, dtype=torch.int32)
    # Half the garbage is small (a real position of some request): clamping a
    # huge value would hide nothing, reading a plausible one must mismatch.
    small = torch.randint(0, 2, a_pos.shape, generator=gen, device=dev, dtype=torch.int32).bool()
    a_pos = torch.where(small, a_pos % max(1, int(case.b_start.max().item())), a_pos)
    for b, c in counts.items():
        s = int(case.b_start[b].item())
        row = _per_head(c, num_kv_heads)
        for h, m in enumerate(row):
            assert 0 <= m <= min(cap_pos, s), f"row {b} head {h}: {m} positions > min(cap_pos, b_start={s})"
            a_pos[b, h, :m] = torch.randperm(s, generator=gen, device=dev)[:m].to(torch.int32)
            case.a_len[b, h] = m
        case.a_slot[b] = -2
    case.a_pos = a_pos
    return case


def pool_slots_of(case: "DecodeCase") -> torch.Tensor:
    """``case.a_pos`` with every entry a pool slot (``a_pos_slots=True``): the
    request's ``req_to_token`` entry of the position, clamped into ``[0,
    b_start)`` as the kernel clamps positions; rows that are not indexed keep their
    (garbage) values, which the kernel never reads."""
    a_pos = case.a_pos.clone()
    for b in range(a_pos.shape[0]):
        if int(case.a_slot[b].item()) == -2 and int(case.b_start[b].item()) > 0:
            pos = a_pos[b].long().clamp(0, int(case.b_start[b].item()) - 1)
            a_pos[b] = case.req_to_token[int(case.req_pool_idx[b].item())][pos].to(torch.int32)
    return a_pos


def policy_segments(policy: str, seq_len: int, budget: int = 0, *, sink: int = 4, recent: int = 256):
    """(a_len, (b_start, b_end)) of one request under a named policy.

    * ``"dense"``: A empty, B = [0, n).
    * ``"sink_window"``: A = ``sink`` sink tokens, B = the last ``budget - sink`` positions.
    * ``"select_recent"``: B = the last ``min(recent, budget // 2)`` positions and
      A = sink + selected tokens for the rest of ``budget``.
    * ``"empty"``: no keys at all.
    Lengths are clipped so that A + B never exceeds the sequence.
    """
    n = int(seq_len)
    if policy == "dense":
        return 0, (0, n)
    if policy == "empty":
        return 0, (n, n)
    budget = min(int(budget), n)
    if policy == "sink_window":
        a = min(sink, budget)
        w = budget - a
        return a, (n - w, n)
    if policy == "select_recent":
        r = min(recent, budget // 2)
        return budget - r, (n - r, n)
    raise ValueError(f"unknown policy {policy!r}")


@dataclass
class PackCase:
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_idx: torch.Tensor
    sel_pos: torch.Tensor
    sel_len: torch.Tensor
    do_pack: torch.Tensor
    a_k: torch.Tensor
    a_v: torch.Tensor
    a_slot: torch.Tensor
    a_len: torch.Tensor
    seq_lens: torch.Tensor

    def args(self) -> tuple:
        """Positional arguments of pack_compact / pack_compact_ref."""
        return (
            self.k_pool,
            self.v_pool,
            self.req_to_token,
            self.req_pool_idx,
            self.sel_pos,
            self.sel_len,
            self.do_pack,
            self.a_k,
            self.a_v,
            self.a_slot,
            self.a_len,
        )

    def clone_outputs(self) -> "PackCase":
        """Same inputs, private copies of the in-place outputs (a_k, a_v, a_len)."""
        return PackCase(**{**self.__dict__, "a_k": self.a_k.clone(), "a_v": self.a_v.clone(), "a_len": self.a_len.clone()})


def make_pack_case(
    seq_lens: Sequence[int],
    sel_lens: Sequence[IntOrPerHead],
    do_pack: Sequence[bool],
    *,
    num_kv_heads: int,
    head_dim: int,
    cap: int,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    num_slots: Optional[int] = None,
    max_reqs: Optional[int] = None,
    sorted_positions: bool = True,
) -> PackCase:
    """Random pack problem: unique random positions per (request, head).

    Unused ``sel_pos`` entries (beyond ``sel_len``) hold out-of-range garbage
    so that reading them would fault or mismatch; ``a_len`` starts at random
    values so that the test sees which entries were (not) updated.
    """
    device = torch.device(device)
    bs = len(seq_lens)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    max_ctx = max(8, max(int(n) for n in seq_lens) + 5)
    max_reqs = max_reqs or bs + 3
    num_slots = num_slots or bs + 2
    req_to_token, req_pool_idx, num_tokens = _layout_requests(
        seq_lens, max_ctx=max_ctx, max_reqs=max_reqs, extra_pool_tokens=7, device=device, gen=gen
    )

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    k_pool = randn(num_tokens, num_kv_heads, head_dim)
    v_pool = randn(num_tokens, num_kv_heads, head_dim)
    a_k = randn(num_slots, num_kv_heads, cap, head_dim)
    a_v = randn(num_slots, num_kv_heads, cap, head_dim)

    sel_pos = torch.full((bs, num_kv_heads, cap), 1 << 30, dtype=torch.int32, device=device)
    sel_len_rows = [_per_head(x, num_kv_heads) for x in sel_lens]
    for b, n in enumerate(seq_lens):
        for h in range(num_kv_heads):
            m = sel_len_rows[b][h]
            assert 0 <= m <= min(cap, int(n)), "sel_len must be <= min(cap, seq_len)"
            pos = torch.randperm(int(n), generator=gen, device=device)[:m]
            if sorted_positions:
                pos = pos.sort().values
            sel_pos[b, h, :m] = pos.to(torch.int32)
    sel_len = torch.tensor(sel_len_rows, dtype=torch.int32, device=device).view(bs, num_kv_heads)
    a_len = torch.randint(0, cap + 1, (bs, num_kv_heads), generator=gen, device=device, dtype=torch.int32)
    a_slot = torch.randperm(num_slots, generator=gen, device=device)[:bs].to(torch.int32)
    return PackCase(
        k_pool=k_pool,
        v_pool=v_pool,
        req_to_token=req_to_token,
        req_pool_idx=req_pool_idx,
        sel_pos=sel_pos,
        sel_len=sel_len,
        do_pack=torch.tensor([bool(x) for x in do_pack], dtype=torch.bool, device=device),
        a_k=a_k,
        a_v=a_v,
        a_slot=a_slot,
        a_len=a_len,
        seq_lens=torch.tensor([int(n) for n in seq_lens], dtype=torch.int32, device=device),
    )


@dataclass
class SfiRefreshCase:
    """A ``SparseState`` whose SFI rows ``rows`` (1-3 of 4) are due for a refresh
    (``sgl_sparse.selector.refresh.refresh``), with one K and V pool per layer."""

    state: object  # sgl_sparse.state.SparseState
    k: List[torch.Tensor]  # [layers] x [pool, Hkv, D]
    v: List[torch.Tensor]
    req_to_token: torch.Tensor  # [4, ctx] int32
    rows: List[int]
    scaling: float

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def make_sfi_refresh_case(
    layers: int = 2,
    *,
    lens: Sequence[int] = (90, 61, 33),
    num_kv_heads: int = 2,
    num_q_heads: int = 8,
    head_dim: int = 32,
    logit_len: int = 0,
    shared_pools: bool = False,
    slow_step: bool = True,
    prompt_queries: Optional[dict] = None,
    pool_size: int = 256,
    ctx: int = 96,
    seed: int = 0,
    device: str = "cpu",
) -> SfiRefreshCase:
    """Three SFI rows (per-row knobs: budgets 20/9/12, sinks, beta, a Soft-NMS radius)
    after a slow step at lengths ``lens``, as the refresh tests and
    ``bench/kernels/count_refresh_ops.py`` build them.

    ``shared_pools``: every layer reads one K and one V pool (else one each);
    ``slow_step``: each layer's dense attention (``two_segment_decode``) saves the
    slow query and, with ``logit_len``, its logits, as serving does -- else the saved
    queries and logits are random (enough for op counts, and no decode launches);
    ``prompt_queries``: {row: number of prompt queries saved} (the first slow step's
    window; the saved prompt queries are random, stale for the other rows);
    ``device``: where the state, pools and store live (``slow_step=False`` off the CPU).
    """
    from sgl_sparse.compact import CompactStore
    from sgl_sparse.config import SfiPolicy, SparseServerConfig
    from sgl_sparse.policies import sfi
    from sgl_sparse.state import SparseState

    from .two_segment_decode import two_segment_decode

    assert len(lens) == 3 and max(lens) <= ctx
    gen = torch.Generator().manual_seed(seed)
    pools = 1 if shared_pools else layers
    shape = (pool_size, num_kv_heads, head_dim)
    assert device == "cpu" or not slow_step, "the slow step's decode launches run on the CPU case only"
    k = [torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(pools)] * (layers // pools)
    v = [torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(pools)] * (layers // pools)
    rows = [1, 2, 3]
    r2t = torch.zeros(4, ctx, dtype=torch.int32)
    for r, n in zip(rows, lens):
        r2t[r, :n] = torch.randperm(pool_size, generator=gen)[:n].int()
    cfg = SparseServerConfig.model_validate({"compact": {"slots": 3, "capacity": 40},
                                             "policies": {"sfi": {"w_prefill": 3}}})
    st = SparseState(4, device, cfg)
    specs = [SfiPolicy(budget=20, recent=16, sink=4, w_prefill=3),
             SfiPolicy(budget=9, recent=8, sink=1, beta=1.0, nms_radius=1),
             SfiPolicy(budget=12, recent=8, sink=2, beta=2.0)]
    st.admit(rows, [sfi.init_row(s, [], [], (None, None)) for s in specs])
    store = st.compact = CompactStore(slots=3, capacity=40, num_layers=layers, num_kv_heads=num_kv_heads,
                                      num_q_heads=num_q_heads, head_dim=head_dim, dtype=torch.bfloat16,
                                      pool_size=pool_size, prompt_queries=2, device=torch.device(device),
                                      logit_len=logit_len)

    def normal_(t: torch.Tensor) -> None:  # the CPU generator's stream wherever t lives
        if t.device.type == "cpu":
            t.normal_(generator=gen)
        else:
            t.copy_(torch.empty(t.shape, dtype=t.dtype).normal_(generator=gen))

    store.knorm[:] = torch.stack(k).float().norm(dim=-1)
    normal_(store.q_prompt)
    r2t = r2t.to(device)
    idx = torch.tensor(rows, device=device)
    lens_t = torch.tensor(list(lens), dtype=torch.int32, device=device)
    st.saved_n[idx] = lens_t
    for r, n in (prompt_queries or {}).items():
        st.prompt_q[r] = n
    scaling = head_dim ** -0.5
    if not slow_step:
        normal_(store.q)
        if store.logits is not None:
            normal_(store.logits)  # base-2 logits
        return SfiRefreshCase(st, k, v, r2t, rows, scaling)
    # The slow step: each layer's dense attention saves its query (and its logits).
    slots = st.slot[idx].int()
    zero, a_len = torch.zeros(3, dtype=torch.int32), torch.zeros(3, num_kv_heads, dtype=torch.int32)
    for layer in range(layers):
        q = (torch.randn(3, num_q_heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
        kw = dict(logits_out=store.logits[layer]) if store.logits is not None else {}
        two_segment_decode(q, store.k[layer], store.v[layer], zero - 1, a_len, k[layer], v[layer], r2t, idx, zero,
                           lens_t, scaling, q_save=store.q[layer], q_save_slot=slots, num_splits=2, block_n=16,
                           min_split_len=16, **kw)
    return SfiRefreshCase(st, k, v, r2t, rows, scaling)

