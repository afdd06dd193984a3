"""
The query-aware policies' per-forward tensors, in one launch
===========================================================

``sgl_sparse/query_device.py`` builds, once per decode forward, what quest,
asyncspade and lfps read at every layer: each store slot's batch row (the
slot -> row map), the row's knobs gathered from SparseState's device columns,
and the masks / ranges derived from them. As torch ops (``RowKnobs``,
``SlotRows``, ``_QuestForward``, ``_AspdForward``, ``LfpsForward``) that was
~155 small kernels per forward, and under a decode CUDA graph without
conditional nodes every replay ran them, whatever the batch held. Here one
launch computes the same values (the torch classes stay as this kernel's
reference, tests/kernels/test_qa_forward.py).

Data flow per program (one per store slot; the programs past a policy's slot
count do nothing for it):
  request metadata   the batch rows' req_pool_indices and seq_lens
  policy state       SparseState's columns by request row: policy, slot, sink,
                     budget, window, max_context, asyncspade's W / ridge,
                     lfps's r / eps / a
  per-step decision  the plan's b_start and a_slot (INDEXED rows)
  -> the slot's row  the batch row r with policy[r] == P, slot[r] == s and a
                     sequence that fits the store (n <= max_context): a scan of
                     the batch (bs is small: O(slots x bs) loads in all); none:
                     bs, and every field takes the torch path's fill
  -> fields          into per-policy int32 / int64 / float32 blocks [F, S],
                     whose rows the caller views (no copy)
asyncspade also needs one field per batch row (src: the slot the row reads its
stored selection from, -1 none); the programs below bs write it.

Outputs are allocated by the wrapper (torch.empty: no device kernel), so under
capture they sit in the graph's pool at static addresses and every replay
recomputes them before the first layer reads them, as the torch ops did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

__all__ = ["qa_forward", "QUEST_I32", "ASPD_I32", "LFPS_I32", "I64", "ASPD_I64"]

# the field rows of each block (the caller views them by name)
QUEST_I32 = ("n", "slot_live", "sink", "b_start", "first", "last", "slot_sel", "last_sel", "pages", "valid")
ASPD_I32 = ("push", "sink", "next_b", "hi", "budget", "valid")
LFPS_I32 = ("n", "sink", "local", "budget", "b_start", "zero", "c_max", "valid")
I64 = ("b", "b_any", "rpi")  # + quest: out_row; asyncspade: slot, count_cap
QUEST_I64 = I64 + ("out_row",)
ASPD_I64 = I64 + ("slot", "count_cap")
LFPS_F32 = ("r", "eps", "a")
#: rows per block of the batch scan (a program loops over blocks past it)
MAX_BLOCK_B = 1024


@triton.jit
def _floordiv(x, d: tl.constexpr):
    # torch's floor division (Triton's // truncates toward zero)
    q = x // d
    return q - ((x % d != 0) & (x < 0)).to(q.dtype)


@triton.jit
def _live(pol, slot, n, mc, P: tl.constexpr):
    """The row is policy P's and its store serves it: a slot, a sequence that fits (RowKnobs.live)."""
    return (pol == P) & (slot >= 0) & (n <= mc)


@triton.jit
def _indexed(A_SLOT, r, ok, INDEXED: tl.constexpr, HAS_ASLOT: tl.constexpr):
    """Batch row r is INDEXED this step (and ok)."""
    if HAS_ASLOT:
        return ok & (tl.load(A_SLOT + r, mask=ok, other=0).to(tl.int32) == INDEXED)
    else:
        return ok & (r < 0)  # no plan a_slot: no row is indexed (r >= 0)


@triton.jit
def _row_slot(RPI, SEQ, POL, SLOT, MAXC, r, ok, P: tl.constexpr):
    """Batch row(s) r (where ok): whether policy P's store serves the row, and its slot."""
    req = tl.load(RPI + r, mask=ok, other=0).to(tl.int64)
    pol = tl.load(POL + req, mask=ok, other=-1).to(tl.int32)
    slot = tl.load(SLOT + req, mask=ok, other=-1).to(tl.int32)
    n = tl.load(SEQ + r, mask=ok, other=0).to(tl.int32)
    mc = tl.load(MAXC + req, mask=ok, other=0).to(tl.int32)
    return ok & _live(pol, slot, n, mc, P), slot


@triton.jit
def _slot_row(RPI, SEQ, POL, SLOT, MAXC, bs, P: tl.constexpr, s, BLOCK_B: tl.constexpr):
    """The batch row holding slot s of policy P this step (bs: none): the lowest
    row whose request is P's, has the slot and fits the store (RowKnobs.live)."""
    best = tl.full([], 0, tl.int32) + bs
    offs = tl.arange(0, BLOCK_B)
    for start in range(0, bs, BLOCK_B):
        r = start + offs
        live, slot = _row_slot(RPI, SEQ, POL, SLOT, MAXC, r, r < bs, P)
        hit = live & (slot == s)
        best = tl.minimum(best, tl.min(tl.where(hit, r, bs), axis=0))
    return best


@triton.jit
def _slot_knobs(RPI, SEQ, B_START, A_SLOT, POL, SLOT, SINK, BUDGET, WINDOW, MAXC, bs, P: tl.constexpr, s,
                INDEXED: tl.constexpr, HAS_ASLOT: tl.constexpr, BLOCK_B: tl.constexpr):
    """Slot s of policy P: its batch row b (bs: none), whether it has one, and the
    row's knobs, 0 where none (the torch path's fill). One lookup for the three
    policies, so they cannot drift apart; the knobs a policy ignores are dead loads."""
    b = _slot_row(RPI, SEQ, POL, SLOT, MAXC, bs, P, s, BLOCK_B)
    valid = b < bs
    bb = tl.where(valid, b, 0)
    req = tl.load(RPI + bb, mask=valid, other=0).to(tl.int64)
    n = tl.load(SEQ + bb, mask=valid, other=0).to(tl.int32)
    sink = tl.load(SINK + req, mask=valid, other=0).to(tl.int32)
    budget = tl.load(BUDGET + req, mask=valid, other=0).to(tl.int32)
    recent = tl.load(WINDOW + req, mask=valid, other=0).to(tl.int32)
    b_start = tl.load(B_START + bb, mask=valid, other=0).to(tl.int32)
    on = _indexed(A_SLOT, bb, valid, INDEXED, HAS_ASLOT)
    return b, valid, req, n, sink, budget, recent, b_start, on


@triton.jit
def _store_i64(O64, S, i, b, last_row, req):
    """The I64 rows every policy has: b, b_any, rpi."""
    tl.store(O64 + 0 * S + i, b.to(tl.int64))
    tl.store(O64 + 1 * S + i, tl.minimum(b, last_row).to(tl.int64))
    tl.store(O64 + 2 * S + i, req)


@triton.jit(do_not_specialize=["bs"])
def _qa_forward_kernel(RPI, SEQ, B_START, A_SLOT, POL, SLOT, SINK, BUDGET, WINDOW, MAXC, QA_W, QA_RIDGE,
                       L_R, L_EPS, L_A,
                       Q32, Q64, A32, A64, AF, A_SRC, L32, L64, LF,
                       bs, SQ, SA, SL, scratch, ring_w, candidates,
                       P_Q: tl.constexpr, P_A: tl.constexpr, P_L: tl.constexpr, INDEXED: tl.constexpr,
                       HAS_ASLOT: tl.constexpr, HAS_Q: tl.constexpr, HAS_A: tl.constexpr, HAS_L: tl.constexpr,
                       PAGE: tl.constexpr, BLOCK_B: tl.constexpr):
    i = tl.program_id(0)
    last_row = tl.maximum(bs - 1, 0)
    if HAS_Q:
        if i < SQ:
            b, valid, req, n, sink, budget, recent, b_start, on = _slot_knobs(
                RPI, SEQ, B_START, A_SLOT, POL, SLOT, SINK, BUDGET, WINDOW, MAXC, bs, P_Q, i, INDEXED, HAS_ASLOT,
                BLOCK_B)
            first = _floordiv(sink, PAGE)
            last = _floordiv(b_start + PAGE - 1, PAGE)
            slot_sel = tl.where(on, i, -1)
            tl.store(Q32 + 0 * SQ + i, n)
            tl.store(Q32 + 1 * SQ + i, tl.where(valid, i, -1))  # slot_live: bounds at every live step
            tl.store(Q32 + 2 * SQ + i, sink)
            tl.store(Q32 + 3 * SQ + i, b_start)
            tl.store(Q32 + 4 * SQ + i, first)
            tl.store(Q32 + 5 * SQ + i, last)
            tl.store(Q32 + 6 * SQ + i, slot_sel)
            tl.store(Q32 + 7 * SQ + i, tl.where(on, last, first))  # not selected: an empty range
            tl.store(Q32 + 8 * SQ + i, _floordiv(budget, PAGE))
            tl.store(Q32 + 9 * SQ + i, valid.to(tl.int32))
            _store_i64(Q64, SQ, i, b, last_row, req)
            tl.store(Q64 + 3 * SQ + i, tl.where(on, b, -1).to(tl.int64))  # out_row
    if HAS_A:
        if i < SA:
            b, valid, req, n, sink, budget, recent, b_start, on = _slot_knobs(
                RPI, SEQ, B_START, A_SLOT, POL, SLOT, SINK, BUDGET, WINDOW, MAXC, bs, P_A, i, INDEXED, HAS_ASLOT,
                BLOCK_B)
            qa_w = tl.load(QA_W + req, mask=valid, other=0).to(tl.int64)
            ridge = tl.load(QA_RIDGE + req, mask=valid, other=0.0)
            next_b = tl.maximum(n + 1 - recent, 0)
            tl.store(A32 + 0 * SA + i, tl.where(valid, i, -1))  # push: no row, no push (q_hat 0)
            tl.store(A32 + 1 * SA + i, sink)
            tl.store(A32 + 2 * SA + i, next_b)
            tl.store(A32 + 3 * SA + i, tl.where(valid, next_b, 0))  # hi: no row, nothing scored
            tl.store(A32 + 4 * SA + i, budget)
            tl.store(A32 + 5 * SA + i, valid.to(tl.int32))
            _store_i64(A64, SA, i, b, last_row, req)
            tl.store(A64 + 3 * SA + i, tl.where(valid, i, scratch).to(tl.int64))  # no row: the scratch slot
            tl.store(A64 + 4 * SA + i, tl.minimum(qa_w + 1, ring_w))  # count_cap: the request's W + 1 queries
            tl.store(AF + i, ridge)
        if i < bs:  # the batch row's source slot for its stored selection (-1: keeps its a_pos / a_len)
            live, slot = _row_slot(RPI, SEQ, POL, SLOT, MAXC, i, i < bs, P_A)
            sel = _indexed(A_SLOT, i, live, INDEXED, HAS_ASLOT)
            tl.store(A_SRC + i, tl.where(sel, slot, -1))
    if HAS_L:
        if i < SL:
            b, valid, req, n, sink, budget, recent, b_start, on = _slot_knobs(
                RPI, SEQ, B_START, A_SLOT, POL, SLOT, SINK, BUDGET, WINDOW, MAXC, bs, P_L, i, INDEXED, HAS_ASLOT,
                BLOCK_B)
            tl.store(L32 + 0 * SL + i, tl.where(on, n, 0))  # 0: no program of the slot does anything
            tl.store(L32 + 1 * SL + i, sink)
            tl.store(L32 + 2 * SL + i, tl.maximum(recent - 1, 0))  # window = local + 1 (policies/lfps.py)
            tl.store(L32 + 3 * SL + i, tl.where(on, budget, 0))
            tl.store(L32 + 4 * SL + i, b_start)
            tl.store(L32 + 5 * SL + i, tl.zeros([], tl.int32))
            tl.store(L32 + 6 * SL + i, tl.zeros([], tl.int32) + candidates)
            tl.store(L32 + 7 * SL + i, valid.to(tl.int32))
            _store_i64(L64, SL, i, b, last_row, req)
            # float knobs by request row: no row reads the padding row 0's (its slot is off)
            tl.store(LF + 0 * SL + i, tl.load(L_R + req))
            tl.store(LF + 1 * SL + i, tl.load(L_EPS + req))
            tl.store(LF + 2 * SL + i, tl.load(L_A + req))


class Fields:
    """Named views of one policy's field blocks ([F, S] rows; no copies)."""

    def __init__(self, **blocks):
        for names, block in blocks.values():
            for k, name in enumerate(names):
                setattr(self, name, block[k])


def qa_forward(state, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, b_start: torch.Tensor,
               a_slot: torch.Tensor | None, *, indexed_id: int, page: int, quest_slots: int | None,
               aspd_slots: int | None, aspd_scratch: int = 0, aspd_ring_w: int = 1, lfps_slots: int | None,
               lfps_candidates: int = 0) -> dict:
    """The per-forward fields of each policy given a slot count (None: no store),
    in one launch. Returns {'quest' | 'asyncspade' | 'lfps': Fields}; asyncspade's
    also has `src` [bs] int32 and `ridge` [S, 1]. Field values as the torch
    classes of sgl_sparse/query_device.py / lfps_device.py (rpi as int64)."""
    from sgl_sparse.policies.base import PolicyId

    dev = seq_lens.device
    bs = seq_lens.shape[0]
    assert req_pool_indices.shape == (bs,) and b_start.shape == (bs,)
    for t in (req_pool_indices, seq_lens, b_start) + ((a_slot,) if a_slot is not None else ()):
        assert t.is_contiguous()
    i32, i64 = torch.int32, torch.int64
    out, dummy = {}, seq_lens
    sq, sa, sl = quest_slots or 0, aspd_slots or 0, lfps_slots or 0
    q32 = torch.empty(len(QUEST_I32), sq, dtype=i32, device=dev)
    q64 = torch.empty(len(QUEST_I64), sq, dtype=i64, device=dev)
    a32 = torch.empty(len(ASPD_I32), sa, dtype=i32, device=dev)
    a64 = torch.empty(len(ASPD_I64), sa, dtype=i64, device=dev)
    af = torch.empty(sa, 1, dtype=state.qa_ridge.dtype, device=dev)
    src = torch.empty(bs if aspd_slots is not None else 0, dtype=i32, device=dev)
    l32 = torch.empty(len(LFPS_I32), sl, dtype=i32, device=dev)
    l64 = torch.empty(len(I64), sl, dtype=i64, device=dev)
    lf = torch.empty(len(LFPS_F32), sl, dtype=state.lfps_r.dtype, device=dev)
    if quest_slots is not None:
        out["quest"] = Fields(i=(QUEST_I32, q32), l=(QUEST_I64, q64))
    if aspd_slots is not None:
        out["asyncspade"] = Fields(i=(ASPD_I32, a32), l=(ASPD_I64, a64))
        out["asyncspade"].ridge = af
        out["asyncspade"].src = src
    if lfps_slots is not None:
        out["lfps"] = Fields(i=(LFPS_I32, l32), l=(I64, l64), f=(LFPS_F32, lf))
    grid = max(sq, sa, sl, bs if aspd_slots is not None else 0)
    if grid == 0:
        return out
    _qa_forward_kernel[(grid,)](
        req_pool_indices, seq_lens, b_start, a_slot if a_slot is not None else dummy,
        state.policy, state.slot, state.sink, state.budget, state.window, state.max_context, state.qa_window,
        state.qa_ridge, state.lfps_r, state.lfps_eps, state.lfps_a,
        q32, q64, a32, a64, af, src, l32, l64, lf,
        bs, sq, sa, sl, aspd_scratch, aspd_ring_w, lfps_candidates,
        P_Q=int(PolicyId.QUEST), P_A=int(PolicyId.ASYNCSPADE), P_L=int(PolicyId.LFPS), INDEXED=indexed_id,
        HAS_ASLOT=a_slot is not None, HAS_Q=quest_slots is not None, HAS_A=aspd_slots is not None,
        HAS_L=lfps_slots is not None, PAGE=page, BLOCK_B=min(max(next_pow2(max(bs, 1)), 16), MAX_BLOCK_B))
    return out
