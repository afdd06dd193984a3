"""Decode batches whose rows all take one attention path run that path alone
(sgl_sparse/graph_variants.py: the `dense`, `kernel` and `mixed` graph variants, and
the same choice without graphs), and query-aware batches replay the graph with their
policies' blocks (`qa`, `qa_<policy>`).

Checked on CPU against the installed SGLang, in a subprocess (SGLang's CPU engine
stand-ins, tests/cpu_stand_ins; the two-segment kernel under TRITON_INTERPRET=1):
- the routing a batch gets (state rows of `full`, windowed and covering-window
  requests), the variant the runner is told to replay, whether FlashInfer is planned
  (and into which variant's wrappers), the row mask the kernel reads, CUDA-graph
  padding rows included; eager forwards; captures; SGLANG_SPARSE_ROUTE_VARIANTS=0;
- the forward itself, with SGLang's real KV pool, RadixAttention and ForwardBatch:
  the kernel-only path saves the step's K/V and gives bit for bit the output of the
  two-path forward for the same rows; the dense-only path returns FlashInfer's output
  and launches nothing else.
Stand-in (test only): SGLang's FlashInfer backend (it cannot exist on a CPU machine),
a small class with its per-size graph wrappers that records its plans and, in its
decode, saves the step's K/V as FlashInfer's does and returns an output of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server import server_env

SNIPPET = r"""
import json
from types import SimpleNamespace
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sgl_sparse import graph_variants as gv
from sgl_sparse.backend import SparseAttnBackend
from sgl_sparse.decision import plan_decode
from sgl_sparse.kernels import make_split_counters
from sgl_sparse.policies import PolicyId, RowInit
from sgl_sparse.state import SparseState

HQ, HKV, D, ROWS, POOL = 4, 2, 16, 8, 256
torch.manual_seed(0)


class FlashInferStandIn:
    # per-size graph wrappers as SGLang's FlashInfer backend keeps them; plans recorded
    def __init__(self, kv_pool):
        self.decode_cuda_graph_metadata = {}
        self.kv_pool = kv_pool
        self.calls = []
        self.made = 0

    def init_forward_metadata(self, fb):
        self.calls.append(["eager_plan", fb.seq_lens.tolist()])

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.calls.append(["graph_plan", fb.seq_lens.tolist(), in_capture])
        if in_capture:  # FlashInfer makes new wrappers at every capture of a size
            self.made += 1
            self.decode_cuda_graph_metadata[fb.batch_size] = f"wrappers-{self.made}"

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        self.calls.append(["decode"])
        self.kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, None), k, v)
        return torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), 7.0, dtype=q.dtype)


st = SparseState(ROWS, "cpu")
inits = {1: RowInit(PolicyId.FULL), 2: RowInit(PolicyId.STREAMING, window=8, sink=2),
         3: RowInit(PolicyId.STREAMING, window=8, sink=2), 4: RowInit(PolicyId.STREAMING, window=1000, sink=4)}
st.admit(list(inits), list(inits.values()))
kv = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float16, head_num=HKV, head_dim=D, layer_num=1,
                      device="cpu", enable_memory_saver=False)
layer = RadixAttention(HQ, D, D ** -0.5, HKV, layer_id=0)
lens = {1: 20, 2: 37, 3: 13, 4: 30}
req_to_token = torch.zeros(ROWS, 64, dtype=torch.int32)
free = iter(range(1, POOL))
for r, n in lens.items():
    req_to_token[r, :n] = torch.tensor([next(free) for _ in range(n)], dtype=torch.int32)
for buf in (kv.get_key_buffer(0), kv.get_value_buffer(0)):
    buf.copy_(torch.randn_like(buf, dtype=torch.float32).half())


def make_backend(route=True, eager_route=True, balance=True):
    be = object.__new__(SparseAttnBackend)
    be.balance_splits = balance  # compact.balance_splits on a GPU server
    be.device = torch.device("cpu")
    be.state, be.qa, be.lfps_scored, be.think_ids = st, None, None, st.think_ids
    be.token_to_kv_pool, be._layer0, be._num_kv_heads = kv, 0, HKV
    be.req_to_token_pool = type("R", (), {"req_to_token": req_to_token})()
    be.dense = FlashInferStandIn(kv)
    be._row_mask, be._row_mask_host = torch.zeros(ROWS, dtype=torch.int32), None
    be._split_counters = make_split_counters(ROWS, HKV, "cpu")
    be._no_compact = torch.zeros(1, HKV, 1, D, dtype=torch.float16)
    be._max_kv_len = req_to_token.shape[1]
    be.graph_variants = gv.wanted(be, route=route)
    be._graph_variant, be._dense_graph_wrappers, be._route = None, {}, gv.MIXED
    be._step_variant = gv.choose(be.graph_variants, False, gv.MIXED)
    be._prompt_q_plan = None
    be._row_splits, be._balance_gate, be._balance_step = None, None, False
    be.balanced_launches = None  # with metrics: tests/test_balanced_launches.py
    return be


def batch(rows, padded):
    n = len(rows)
    seq = [lens[r] for r in rows] + [1] * (padded - n)  # padding: FlashInfer's fill value
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=padded,
                        input_ids=torch.ones(padded, dtype=torch.int64),
                        req_pool_indices=torch.tensor(rows + [0] * (padded - n)),
                        seq_lens=torch.tensor(seq, dtype=torch.int32),
                        out_cache_loc=torch.tensor([int(req_to_token[r, lens[r] - 1]) for r in rows] + [0] * (padded - n)),
                        seq_lens_sum=sum(seq), seq_lens_cpu=torch.tensor(seq, dtype=torch.int32))


def step(be, rows, padded, eager=False, in_capture=False):
    st.set_step_rows(rows, [lens[r] for r in rows], [[] for _ in rows])
    be.dense.calls.clear()
    fb = batch(rows, padded)
    be._prepare_forward(fb, eager=eager, in_capture=in_capture)
    return {"variant": be.step_graph_variant(), "route": be._route, "plans": be.dense.calls[:],
            "mask": be._row_mask[:padded].tolist()}


out = {"variants": {}, "replay": {}, "eager": {}, "capture": {}, "off": {}}
for qa_dev in (False, True):
    for route in (True, False):
        for qa in (True, False):
            be = make_backend()
            be.qa = SimpleNamespace(device=SimpleNamespace(policies=(PolicyId.QUEST,), only=None) if qa_dev else None)
            out["variants"][f"qa_dev={qa_dev},route={route},qa={qa}"] = list(gv.wanted(be, route=route, qa=qa))
# quest and asyncspade offered under graphs: a graph per policy beside the one with both
two = make_backend()
two.qa = SimpleNamespace(device=SimpleNamespace(policies=(PolicyId.QUEST, PolicyId.ASYNCSPADE), only=None))
# the default (SGLANG_SPARSE_QA_JOIN on since session 56) and the split server's
# variants (the switch off), which the routing checks below replay
out["variants_two_qa"] = list(gv.wanted(two))
two_variants = gv.wanted(two, qa_join=False)
out["variants_two_qa_split"] = list(two_variants)
out["variants_two_qa_one_graph"] = list(gv.wanted(two, qa=False))
gv.QA_POLICY_ENABLED = False  # SGLANG_SPARSE_QA_POLICY_VARIANTS=0
out["variants_two_qa_switch_off"] = list(gv.wanted(two))
gv.QA_POLICY_ENABLED = True
Q, A, L = PolicyId.QUEST, PolicyId.ASYNCSPADE, PolicyId.LFPS
out["choose_qa"] = {name: gv.choose(two_variants, bool(p), gv.MIXED, False, frozenset(p))
                    for name, p in (("quest", [Q]), ("asyncspade", [A]), ("both", [Q, A]), ("lfps", [L]), ("none", []))}
out["choose_qa_kernel_route"] = {name: gv.choose(two_variants, bool(p), gv.KERNEL, False, frozenset(p))
                                 for name, p in (("quest", [Q]), ("both", [Q, A]), ("lfps", [L]), ("none", []))}
out["choose_qa_kernel_route_balanced"] = gv.choose(two_variants, True, gv.KERNEL, True, frozenset([A]))
out["choose_qa_single_policy_server"] = gv.choose(("qa", "mixed", "dense", "kernel"), True, gv.MIXED, False,
                                                  frozenset([Q]))
# a capture of qa_<policy> narrows the device's blocks to that policy, and only then
only = {}
for v in two_variants:
    with two.capturing_graph_variant(v):
        only[v] = sorted(p.name for p in two.qa.device.only) if two.qa.device.only is not None else None
only["after"] = two.qa.device.only
out["only"] = only
out["captures_qa"] = {}
for v in two_variants:
    with two.capturing_graph_variant(v):
        out["captures_qa"][v] = two._captures_query_aware()
out["captures_qa"]["eager"] = two._captures_query_aware()
# the route each capture records: FlashInfer in the query-aware graphs but their twins
out["capture_route"] = {}
for v in two_variants:
    with two.capturing_graph_variant(v):
        two._route_decode_rows(batch([2, 3], 4), eager=False, in_capture=True)
        out["capture_route"][v] = two._route
# SGLANG_SPARSE_QA_JOIN (default on): the kernel-only twins' balanced twins; a query-aware batch
# with rows for the stock kernel joins the kernel in one (the state's query-aware
# policies set here: the routing reads only them), never without the twin captured,
# nor eagerly
join = make_backend()
join.qa = two.qa
join.graph_variants = gv.wanted(join, qa_join=True)
out["variants_two_qa_join"] = list(join.graph_variants)
no_balance = make_backend(balance=False)
no_balance.qa = two.qa
out["variants_two_qa_join_no_balance"] = list(gv.wanted(no_balance, qa_join=True))
out["choose_qa_join"] = {name: gv.choose(join.graph_variants, True, route, balance, frozenset(p))
                         for name, route, balance, p in (("quest", gv.KERNEL, True, [Q]),
                                                         ("both", gv.KERNEL, True, [Q, A]),
                                                         ("quest_plain", gv.KERNEL, False, [Q]),
                                                         ("quest_mixed", gv.MIXED, True, [Q]))}
out["balanced"] = {v: gv.is_balanced(v) for v in ("kernel_balanced", "qa_quest_kernel_balanced",
                                                   "qa_kernel_balanced", "qa_quest_kernel", "kernel", "qa")}
out["qa_policies_balanced"] = sorted(p.name for p in gv.qa_policies("qa_asyncspade_kernel_balanced"))
real_qa_policies = st.step_query_aware_policies
st.step_query_aware_policies = lambda: frozenset({Q})
out["qa_join"] = {}
plain_qa = make_backend()
plain_qa.qa, plain_qa.graph_variants = two.qa, two_variants
no_qa_graphs = make_backend()  # no query-aware graph captured: never joined into kernel_balanced
out["qa_join_no_qa_graphs"] = gv.qa_joins(no_qa_graphs.graph_variants, frozenset({Q}))
for name, be_, rows, eager in (("joined", join, [1, 2], False), ("not_captured", plain_qa, [1, 2], False),
                               ("eager", join, [1, 2], True), ("all_kernel", join, [2, 3], False)):
    st.set_step_rows(rows, [lens[r] for r in rows], [[] for _ in rows])
    be_._route_decode_rows(batch(rows, 4), eager=eager, in_capture=False)
    out["qa_join"][name] = {"variant": None if eager else be_._step_variant, "route": be_._route,
                            "balance_step": be_._balance_step, "mask": be_._row_mask[:4].tolist()}
st.step_query_aware_policies = real_qa_policies
with join.capturing_graph_variant("qa_quest_kernel_balanced"):
    out["qa_join_capture"] = [sorted(p.name for p in join.qa.device.only)]
    join._route_decode_rows(batch([2, 3], 4), eager=False, in_capture=True)
    out["qa_join_capture"] += [join._route, join._balance_step, join._captures_query_aware()]
be = make_backend()
gv.MIXED_ONE_LAUNCH = False  # SGLANG_SPARSE_MIXED_ONE_LAUNCH=0: a batch of both kinds runs both paths
for name, rows in (("full", [1]), ("full+covering", [1, 4]), ("windowed", [2, 3]), ("mixed", [1, 2]),
                   ("windowed+covering", [2, 4])):
    out["replay"][name] = step(be, rows, 4)
    out["eager"][name] = step(be, rows, len(rows), eager=True)
gv.MIXED_ONE_LAUNCH = True
# the default: a batch of both kinds runs on the kernel alone, balanced (joined); not
# without the balanced launch (compact.balance_splits off), nor with a row the state
# does not track (its plan columns are not its own: it stays on FlashInfer)
out["joined"] = {name: step(be, rows, 4) for name, rows in (("mixed", [1, 2]), ("windowed+covering", [2, 4]),
                                                              ("full+covering", [1, 4]), ("windowed", [2, 3]))}
out["joined"]["eager"] = step(be, [1, 2], 2, eager=True)
out["joined"]["no_balance"] = step(make_backend(balance=False), [1, 2], 4)
lens[5] = 10  # row 5: no state row (never admitted)
out["joined"]["untracked"] = step(be, [1, 2, 5], 4)
out["joined"]["untracked_tracked_after"] = st.step_rows_tracked()
out["joined"]["switch"] = [gv.joins(m, enabled) for m in ([0, 1], [2, 1], [1, 1], [0, 2], [0, 0])
                           for enabled in (True, False)]
for v in be.graph_variants:
    with be.capturing_graph_variant(v):
        be.dense.calls.clear()
        be._prepare_forward(batch([1, 2], 4), eager=False, in_capture=True)
        out["capture"][v] = [c[0] for c in be.dense.calls]
# compact.balance_splits off: no balanced twin is captured
out["variants_no_balance"] = list(make_backend(balance=False).graph_variants)
out["kept"] = {f"{v}/{bs}": w for (v, bs), w in be._dense_graph_wrappers.items()}
# a kernel-only step that may hold an SFI slow step among fast ones: the balanced twin
out["choose_balanced"] = [gv.choose(be.graph_variants, False, gv.KERNEL, True),
                          gv.choose(be.graph_variants, False, gv.MIXED, True),
                          gv.choose(be.graph_variants, True, gv.KERNEL, True)]
with be.capturing_graph_variant(gv.KERNEL_BALANCED):
    be._prepare_forward(batch([2, 3], 4), eager=False, in_capture=True)
    out["capture_balanced"] = [be._route, be._balance_step]
# a step whose kernel rows are all SFI slow steps (the state's step_dense_keys, set here
# for rows of another policy): balanced where kernels.dense_step_balances says so (long
# rows over fp8), the plain kernel graph otherwise
real_dense_keys = st.step_dense_keys
ab = make_backend()
out["all_slow"] = {}
for name, keys, fp8 in (("long_fp8", 1 << 30, True), ("long_bf16", 1 << 30, False), ("short_fp8", 64, True),
                        ("none", 0, True)):
    st.step_dense_keys = lambda keys=keys: keys
    ab._kv_fp8 = fp8
    out["all_slow"][name] = step(ab, [2, 3], 4)["variant"]
st.step_dense_keys = real_dense_keys
# sglang_sparse_decode_forwards_total: one per decode forward by the path it runs
# (the real metrics object, this subprocess's registry), none for a capture.
from prometheus_client import REGISTRY
from sgl_sparse.metrics import DECODE_PATHS, SchedulerMetrics
st.metrics = SchedulerMetrics("m")
mb = make_backend()
step(mb, [1], 4)
step(mb, [2, 3], 4)
step(mb, [2, 3], 4)
step(mb, [1, 2], 2, eager=True)
with mb.capturing_graph_variant(gv.KERNEL):
    mb._prepare_forward(batch([2, 3], 4), eager=False, in_capture=True)
out["paths"] = {p: REGISTRY.get_sample_value("sglang_sparse_decode_forwards_total", {"path": p, "model_name": "m"})
                for p in DECODE_PATHS}
st.metrics = None
step(be, [1], 4)
out["installed_dense"] = be.dense.decode_cuda_graph_metadata[4]
gv.MIXED_ONE_LAUNCH = False
step(be, [1, 2], 4)
gv.MIXED_ONE_LAUNCH = True
out["installed_mixed"] = be.dense.decode_cuda_graph_metadata[4]
off = make_backend(route=False)
out["off"]["variants"] = list(off.graph_variants)
out["off"]["windowed"] = step(off, [2, 3], 4)
out["off"]["full"] = step(off, [1], 4)

# The forward: windowed rows (and a full one) through each path.
def forward(route, rows, padded):
    be = make_backend()
    fb = batch(rows, padded)
    st.set_step_rows(rows, [lens[r] for r in rows], [[] for _ in rows])
    be._prepare_forward(fb, eager=False, in_capture=False)
    assert be._route == route, (be._route, route)
    be.plan = plan_decode(st, fb.req_pool_indices, fb.input_ids, fb.seq_lens, be.think_ids, num_kv_heads=HKV)
    q = torch.randn(padded, HQ * D, generator=torch.Generator().manual_seed(1)).half()
    k = torch.randn(padded, HKV, D, generator=torch.Generator().manual_seed(2)).half()
    v = torch.randn(padded, HKV, D, generator=torch.Generator().manual_seed(3)).half()
    locs = fb.out_cache_loc[: len(rows)]
    kv.get_key_buffer(0)[locs] = 0  # the step's K/V are not in the pool before the forward
    kv.get_value_buffer(0)[locs] = 0
    be.dense.calls.clear()
    o = be._forward_decode_cuda(q, k, v, layer, fb, True)
    saved = bool(torch.equal(kv.get_key_buffer(0)[locs], k[: len(rows)]) and torch.equal(kv.get_value_buffer(0)[locs], v[: len(rows)]))
    return o, saved, [c[0] for c in be.dense.calls], be._row_mask[:padded].clone()

o_kernel, saved_kernel, calls_kernel, mask_kernel = forward(gv.KERNEL, [2, 3], 4)
# a joined batch (full row 1, windowed row 2): the kernel alone serves both, each row
# against a float reference of the keys its policy attends (full: all 20; streaming:
# sink 2 + window 8 of 37), the step's own key included (saved before the kernel)
o_joined, saved_joined, calls_joined, mask_joined = forward(gv.KERNEL, [1, 2], 4)


def attend(qrow, r, positions):
    slots = req_to_token[r, positions].long()
    keys = kv.get_key_buffer(0)[slots].float().repeat_interleave(HQ // HKV, dim=1)  # [n, HQ, D]
    vals = kv.get_value_buffer(0)[slots].float().repeat_interleave(HQ // HKV, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", qrow.float().view(HQ, D), keys) * D ** -0.5, -1)
    return torch.einsum("hn,nhd->hd", w, vals).reshape(-1)


q_joined = torch.randn(4, HQ * D, generator=torch.Generator().manual_seed(1)).half()
joined_refs = [attend(q_joined[0], 1, list(range(20))), attend(q_joined[1], 2, [0, 1] + list(range(29, 37)))]
joined_err = [float((o_joined[i].float() - ref).norm() / ref.norm()) for i, ref in enumerate(joined_refs)]
# the same rows through both paths: FlashInfer (stand-in) serves nothing, the kernel all
mixed = make_backend()
st.set_step_rows([2, 3], [lens[2], lens[3]], [[], []])
fb = batch([2, 3], 4)
mixed._route_decode_rows(fb, eager=False, in_capture=True)  # as captured in the mixed graph
mixed._route, mixed._row_mask[:4] = gv.MIXED, torch.tensor([1, 1, 0, 0], dtype=torch.int32)
mixed.plan = plan_decode(st, fb.req_pool_indices, fb.input_ids, fb.seq_lens, mixed.think_ids, num_kv_heads=HKV)
q = torch.randn(4, HQ * D, generator=torch.Generator().manual_seed(1)).half()
k = torch.randn(4, HKV, D, generator=torch.Generator().manual_seed(2)).half()
v = torch.randn(4, HKV, D, generator=torch.Generator().manual_seed(3)).half()
o_mixed = mixed._forward_decode_cuda(q, k, v, layer, fb, True)
o_dense, saved_dense, calls_dense, _ = forward(gv.DENSE, [1, 4], 4)
# A balanced kernel-only forward (KERNEL_BALANCED: the step's shares computed once),
# and with BALANCE_GATE its plain twin launched beside it, the step's gate choosing:
# the rows' answers are the kernel-only forward's either way.
import importlib
tsd = importlib.import_module("sgl_sparse.kernels.two_segment_decode")
balanced = {}
gate_default, one_grid_default = tsd.BALANCE_GATE, tsd.BALANCE_ONE_GRID
for gate_on, one_grid in ((False, False), (True, False), (True, True)):
    tsd.BALANCE_GATE, tsd.BALANCE_ONE_GRID = gate_on, one_grid
    bb = make_backend()
    bb._kv_fp8 = False
    fb = batch([2, 3], 4)
    st.set_step_rows([2, 3], [lens[2], lens[3]], [[], []])
    bb._prepare_forward(fb, eager=True, in_capture=False)
    bb._balance_step = True  # as the balanced twin's replay
    bb.init_forward_metadata_in_graph(fb)
    o_bal = bb._forward_decode_cuda(q, k, v, layer, fb, True)
    ref = o_kernel[:2].float()
    balanced[str(gate_on) + ("_one_grid" if one_grid else "")] = {
        "splits": None if bb._row_splits is None else bb._row_splits.tolist(),
        "gate": None if bb._balance_gate is None else bb._balance_gate.tolist(),
        "rel_err": float((o_bal[:2].float() - ref).norm() / ref.norm()), "finite": bool(torch.isfinite(o_bal).all())}
tsd.BALANCE_GATE, tsd.BALANCE_ONE_GRID = gate_default, one_grid_default
# A joined batch with an indexed row, as a query-aware batch joined under
# SGLANG_SPARSE_QA_JOIN runs: the step's balanced shares taken from the step's plan
# (where an indexed row has no segment A yet), then the row's per-head lists filled as
# the layer's selection does (plan.with_indexed's fields): full row 1, streaming row 2,
# row 3 indexed (head 0: 3 positions, head 1: 5, and a recent window of 4), each
# against a float reference of the keys it attends.
import dataclasses
ku = importlib.import_module("sgl_sparse.kernels._utils")
fake_sms, ku.CPU_FAKE_NUM_SMS = ku.CPU_FAKE_NUM_SMS, 16  # programs enough for the full row to take several
jb = make_backend()
jb._kv_fp8 = False
rows3 = [1, 2, 3]
fb = batch(rows3, 4)
st.set_step_rows(rows3, [lens[r] for r in rows3], [[] for _ in rows3])
jb._prepare_forward(fb, eager=False, in_capture=False)
jb.init_forward_metadata_in_graph(fb)
p = jb.plan
b_start, a_slot, a_len_h = p.b_start.clone(), p.a_slot.clone(), p.a_len_per_head.clone()
b_start[2], a_slot[2] = lens[3] - 4, -2
heads3 = [[0, 3, 5], [1, 2, 4, 6, 8]]
a_pos = torch.zeros(4, HKV, 8, dtype=torch.int32)
for h, pos in enumerate(heads3):
    a_pos[2, h, :len(pos)] = torch.tensor(pos, dtype=torch.int32)
    a_len_h[2, h] = len(pos)
jb.plan = dataclasses.replace(p, b_start=b_start, a_slot=a_slot, a_len_per_head=a_len_h, a_pos=a_pos)
q3_ = torch.randn(4, HQ * D, generator=torch.Generator().manual_seed(11)).half()
k3_ = torch.randn(4, HKV, D, generator=torch.Generator().manual_seed(12)).half()
v3_ = torch.randn(4, HKV, D, generator=torch.Generator().manual_seed(13)).half()
o3_ = jb._forward_decode_cuda(q3_, k3_, v3_, layer, fb, True)
ku.CPU_FAKE_NUM_SMS = fake_sms


def attend_sets(qrow, r, sets):
    # sets[h]: the positions KV head h attends
    qh, G, outs = qrow.float().view(HQ, D), HQ // HKV, []
    for hq in range(HQ):
        slots = req_to_token[r, sets[hq // G]].long()
        keys = kv.get_key_buffer(0)[slots, hq // G].float()
        vals = kv.get_value_buffer(0)[slots, hq // G].float()
        outs.append(torch.softmax(keys @ qh[hq] * D ** -0.5, -1) @ vals)
    return torch.cat(outs)


recent3 = list(range(lens[3] - 4, lens[3]))
refs3 = [attend_sets(q3_[0], 1, [list(range(20))] * HKV),
         attend_sets(q3_[1], 2, [[0, 1] + list(range(29, 37))] * HKV),
         attend_sets(q3_[2], 3, [heads3[0] + recent3, heads3[1] + recent3])]
joined_indexed = {"variant": jb._step_variant, "balanced": jb._row_splits is not None,
                  "splits": None if jb._row_splits is None else jb._row_splits.tolist(),
                  "gate": None if jb._balance_gate is None else jb._balance_gate.tolist(),
                  "rel_err": [float((o3_[i].float() - ref).norm() / ref.norm()) for i, ref in enumerate(refs3)],
                  "finite": bool(torch.isfinite(o3_[:3]).all())}
out["forward"] = {
    "joined_indexed": joined_indexed,
    "balanced": balanced,
    "joined": {"rel_err": joined_err, "finite": bool(torch.isfinite(o_joined[:2]).all()), "saved_kv": saved_joined,
               "dense_calls": calls_joined, "mask": mask_joined.tolist()},
    "kernel_saved_kv": saved_kernel, "kernel_dense_calls": calls_kernel, "kernel_mask": mask_kernel.tolist(),
    "kernel_rows_equal_mixed": bool(torch.equal(o_kernel[:2], o_mixed[:2])),
    "kernel_finite": bool(torch.isfinite(o_kernel).all()),
    "dense_calls": calls_dense, "dense_saved_kv": saved_dense, "dense_is_flashinfer": bool((o_dense == 7).all()),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    env = server_env({"TRITON_INTERPRET": "1"})
    env.pop("SGLANG_SPARSE_ROUTE_VARIANTS", None)
    env.pop("SGL_SPARSE_ROUTE_VARIANTS", None)
    env.pop("SGLANG_SPARSE_BALANCE_SPLITS", None)
    env.pop("SGL_SPARSE_BALANCE_SPLITS", None)
    env.pop("SGLANG_SPARSE_MIXED_ONE_LAUNCH", None)
    env.pop("SGL_SPARSE_MIXED_ONE_LAUNCH", None)
    env.pop("SGLANG_SPARSE_QA_JOIN", None)
    env.pop("SGL_SPARSE_QA_JOIN", None)
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, cwd=tmp_path_factory.mktemp("route"),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_captured_variants(res):
    v = res["variants"]
    # query-aware blocks captured: their graph, then both paths, then one path each
    # (with the balanced twin of the kernel-only one: SGLANG_SPARSE_QA_JOIN's default)
    assert v["qa_dev=True,route=True,qa=True"] == ["qa", "qa_kernel", "qa_kernel_balanced", "mixed", "dense", "kernel",
                                                   "kernel_balanced"]
    assert v["qa_dev=True,route=True,qa=False"] == ["qa", "dense", "kernel", "kernel_balanced"]
    assert v["qa_dev=True,route=False,qa=True"] == ["qa", "mixed"]
    assert v["qa_dev=True,route=False,qa=False"] == []  # one graph with the blocks (before)
    assert v["qa_dev=False,route=True,qa=True"] == ["mixed", "dense", "kernel", "kernel_balanced"]
    assert v["qa_dev=False,route=False,qa=True"] == []  # one graph, both paths (before)
    # two query-aware policies under graphs: one graph each beside the one with both
    assert res["variants_two_qa"] == ["qa", "qa_quest", "qa_asyncspade", "qa_kernel", "qa_quest_kernel",
                                      "qa_asyncspade_kernel", "qa_kernel_balanced", "qa_quest_kernel_balanced",
                                      "qa_asyncspade_kernel_balanced", "mixed", "dense", "kernel", "kernel_balanced"]
    # SGLANG_SPARSE_QA_JOIN=0: no balanced twins of the query-aware graphs
    assert res["variants_two_qa_split"] == ["qa", "qa_quest", "qa_asyncspade", "qa_kernel", "qa_quest_kernel",
                                            "qa_asyncspade_kernel", "mixed", "dense", "kernel", "kernel_balanced"]
    assert res["variants_two_qa_one_graph"] == ["qa", "dense", "kernel", "kernel_balanced"]
    assert res["variants_two_qa_switch_off"] == ["qa", "qa_kernel", "qa_kernel_balanced", "mixed", "dense", "kernel",
                                                 "kernel_balanced"]


@pytest.mark.timeout(300)
def test_query_aware_batches_replay_their_policies_graph(res):
    # a batch whose query-aware rows are all of one policy: that policy's graph; rows of
    # two policies: the graph with both; a policy without its own graph: the one with all
    assert res["choose_qa"] == {"quest": "qa_quest", "asyncspade": "qa_asyncspade", "both": "qa", "lfps": "qa",
                                "none": "mixed"}
    assert res["choose_qa_single_policy_server"] == "qa"
    # every row to the kernel (each query-aware row indexed): the kernel-only twin
    assert res["choose_qa_kernel_route"] == {"quest": "qa_quest_kernel", "both": "qa_kernel", "lfps": "qa_kernel",
                                             "none": "kernel"}
    assert res["choose_qa_kernel_route_balanced"] == "qa_asyncspade_kernel"
    # the capture of qa_<policy> holds that policy's blocks alone; the others, none
    assert res["only"] == {"qa": None, "qa_quest": ["QUEST"], "qa_asyncspade": ["ASYNCSPADE"], "qa_kernel": None,
                           "qa_quest_kernel": ["QUEST"], "qa_asyncspade_kernel": ["ASYNCSPADE"], "mixed": None,
                           "dense": None, "kernel": None, "kernel_balanced": None, "after": None}
    assert res["captures_qa"] == {"qa": True, "qa_quest": True, "qa_asyncspade": True, "qa_kernel": True,
                                  "qa_quest_kernel": True, "qa_asyncspade_kernel": True, "mixed": False,
                                  "dense": False, "kernel": False, "kernel_balanced": False, "eager": True}
    # the twins capture no FlashInfer launch (the kernel route), the others as before
    assert res["capture_route"] == {"qa": "mixed", "qa_quest": "mixed", "qa_asyncspade": "mixed",
                                    "qa_kernel": "kernel", "qa_quest_kernel": "kernel",
                                    "qa_asyncspade_kernel": "kernel", "mixed": "mixed", "dense": "dense",
                                    "kernel": "kernel", "kernel_balanced": "kernel"}


@pytest.mark.timeout(300)
def test_replay_routes_each_batch_to_its_paths(res):
    r = res["replay"]
    # every row dense (full, a covering window): FlashInfer alone, planned as stock
    for name in ("full", "full+covering"):
        assert r[name]["variant"] == r[name]["route"] == "dense", name
        assert r[name]["plans"] == [["graph_plan", [20, 1, 1, 1] if name == "full" else [20, 30, 1, 1], False]]
        assert r[name]["mask"] == [0, 0, 0, 0]
    # every row windowed: the kernel alone, no FlashInfer plan; padding rows to the kernel
    assert r["windowed"]["variant"] == r["windowed"]["route"] == "kernel"
    assert r["windowed"]["plans"] == []
    assert r["windowed"]["mask"] == [1, 1, 1, 1]
    # both kinds: both paths, FlashInfer planned with one key for the kernel's rows
    for name, seq in (("mixed", [20, 1, 1, 1]), ("windowed+covering", [1, 30, 1, 1])):
        assert r[name]["variant"] == r[name]["route"] == "mixed", name
        assert r[name]["plans"] == [["graph_plan", seq, False]], name
        assert r[name]["mask"] == ([0, 1, 0, 0] if name == "mixed" else [1, 0, 0, 0])


@pytest.mark.timeout(300)
def test_query_aware_batches_join_the_kernel_in_a_balanced_twin(res):
    """SGLANG_SPARSE_QA_JOIN (on by default): the kernel-only query-aware twins' balanced twins."""
    assert res["variants_two_qa_join"] == [
        "qa", "qa_quest", "qa_asyncspade", "qa_kernel", "qa_quest_kernel", "qa_asyncspade_kernel",
        "qa_kernel_balanced", "qa_quest_kernel_balanced", "qa_asyncspade_kernel_balanced",
        "mixed", "dense", "kernel", "kernel_balanced"]
    # no balanced launch (compact.balance_splits off): no twin
    assert "qa_kernel_balanced" not in res["variants_two_qa_join_no_balance"]
    assert res["choose_qa_join"] == {"quest": "qa_quest_kernel_balanced", "both": "qa_kernel_balanced",
                                     "quest_plain": "qa_quest_kernel", "quest_mixed": "qa_quest"}
    assert res["balanced"] == {"kernel_balanced": True, "qa_quest_kernel_balanced": True,
                               "qa_kernel_balanced": True, "qa_quest_kernel": False, "kernel": False, "qa": False}
    assert res["qa_policies_balanced"] == ["ASYNCSPADE"]
    j = res["qa_join"]
    # a quest batch with a full row (0) and a windowed one (1): every row, padding too, on the
    # kernel in the balanced twin
    assert j["joined"] == {"variant": "qa_quest_kernel_balanced", "route": "kernel", "balance_step": True,
                           "mask": [1, 1, 1, 1]}
    # the twin not captured (SGLANG_SPARSE_QA_JOIN=0), or eager: both paths, the full row FlashInfer's
    assert j["not_captured"] == {"variant": "qa_quest", "route": "mixed", "balance_step": False,
                                 "mask": [0, 1, 0, 0]}
    assert j["eager"]["route"] == "mixed" and j["eager"]["mask"] == [0, 1, 0, 0]
    assert res["qa_join_no_qa_graphs"] is False
    # every row the kernel's already, nothing to balance: the plain twin
    assert j["all_kernel"] == {"variant": "qa_quest_kernel", "route": "kernel", "balance_step": False,
                               "mask": [1, 1, 1, 1]}
    # its capture: quest's blocks alone, the kernel alone, balanced
    assert res["qa_join_capture"] == [["QUEST"], "kernel", True, True]


@pytest.mark.timeout(300)
def test_a_joined_batch_with_an_indexed_row_attends_each_row_s_keys(res):
    j = res["forward"]["joined_indexed"]
    assert j["variant"] == "kernel_balanced" and j["balanced"] and j["finite"]
    # the balanced launch ran (the gate open), the full row spread over more programs
    assert j["gate"] == [1] and j["splits"][0] > max(j["splits"][1:3]), j
    assert max(j["rel_err"]) < 2e-2, j["rel_err"]


@pytest.mark.timeout(300)
def test_batches_of_both_kinds_join_the_kernel(res):
    j = res["joined"]
    # both kinds: the kernel alone, balanced, no FlashInfer plan, every row (padding too) on it
    for name in ("mixed", "windowed+covering"):
        assert j[name]["variant"] == "kernel_balanced" and j[name]["route"] == "kernel", name
        assert j[name]["plans"] == [] and j[name]["mask"] == [1, 1, 1, 1], name
    # one kind: as before (all dense stays FlashInfer's, exactly stock)
    assert j["full+covering"]["variant"] == "dense" and j["full+covering"]["mask"] == [0, 0, 0, 0]
    assert j["windowed"]["variant"] == "kernel"
    assert j["eager"]["route"] == "kernel" and j["eager"]["plans"] == [] and j["eager"]["mask"] == [1, 1]
    # no balanced launch, or a row without state: both paths
    assert j["no_balance"]["variant"] == "mixed" and j["no_balance"]["mask"] == [0, 1, 0, 0]
    assert j["untracked"]["variant"] == "mixed" and j["untracked"]["mask"] == [0, 1, 0, 0]
    assert j["untracked_tracked_after"] is False
    # joins: kernel rows beside stock-kernel ones (0 or 2), only with the switch on
    assert j["switch"] == [True, False, True, False, False, False, False, False, False, False]


@pytest.mark.timeout(300)
def test_eager_forwards_skip_the_unused_path(res):
    e = res["eager"]
    assert e["full"]["route"] == "dense" and e["full"]["plans"] == [["eager_plan", [20]]]
    assert e["windowed"]["route"] == "kernel" and e["windowed"]["plans"] == []
    assert e["mixed"]["route"] == "mixed" and e["mixed"]["plans"] == [["eager_plan", [20, 1]]]


@pytest.mark.timeout(300)
def test_captures_and_wrappers_per_variant(res):
    assert res["capture"] == {"mixed": ["graph_plan"], "dense": ["graph_plan"], "kernel": [], "kernel_balanced": []}
    # the balanced twin: replayed for a kernel-only step that asks for it, captured as
    # the kernel route with balanced splits
    assert res["choose_balanced"] == ["kernel_balanced", "mixed", "kernel_balanced"]
    assert res["capture_balanced"] == ["kernel", True]
    # all-slow steps: the balanced twin only where balancing doubles their programs
    assert res["all_slow"] == {"long_fp8": "kernel_balanced", "long_bf16": "kernel", "short_fp8": "kernel",
                               "none": "kernel"}
    assert res["variants_no_balance"] == ["mixed", "dense", "kernel"]
    # (the eager batch of both kinds: joined, the balanced kernel)
    assert res["paths"] == {"dense": 1.0, "kernel": 2.0, "kernel_balanced": 1.0, "mixed": 0.0, "qa": 0.0,
                            "qa_quest": 0.0, "qa_asyncspade": 0.0, "qa_lfps": 0.0, "qa_kernel": 0.0,
                            "qa_quest_kernel": 0.0, "qa_asyncspade_kernel": 0.0, "qa_lfps_kernel": 0.0,
                            "qa_kernel_balanced": 0.0, "qa_quest_kernel_balanced": 0.0,
                            "qa_asyncspade_kernel_balanced": 0.0, "qa_lfps_kernel_balanced": 0.0,
                            "reference": 0.0}
    # each variant that plans FlashInfer keeps its own wrappers; replays put them back
    kept = res["kept"]
    assert set(kept) == {"mixed/4", "dense/4"} and kept["mixed/4"] != kept["dense/4"]
    assert res["installed_dense"] == kept["dense/4"] and res["installed_mixed"] == kept["mixed/4"]


@pytest.mark.timeout(300)
def test_route_variants_off_runs_both_paths(res):
    off = res["off"]
    assert off["variants"] == []
    for name in ("windowed", "full"):
        assert off[name]["route"] == "mixed" and len(off[name]["plans"]) == 1, name


@pytest.mark.timeout(300)
def test_forward_of_each_path(res):
    f = res["forward"]
    # kernel alone: the step's K/V saved, FlashInfer never called, padding rows served
    assert f["kernel_saved_kv"] and f["kernel_dense_calls"] == [] and f["kernel_mask"] == [1, 1, 1, 1]
    assert f["kernel_rows_equal_mixed"] and f["kernel_finite"]
    # joined: the full row and the windowed one from one kernel launch, each as its policy attends
    jf = f["joined"]
    assert jf["saved_kv"] and jf["dense_calls"] == [] and jf["mask"] == [1, 1, 1, 1] and jf["finite"]
    assert all(e < 2e-3 for e in jf["rel_err"]), jf
    # dense alone: FlashInfer's output (and its K/V write), no kernel
    assert f["dense_calls"] == ["decode"] and f["dense_saved_kv"] and f["dense_is_flashinfer"]
    # balanced (its shares once a step), and with its gated plain twin, as two launches or
    # one (BALANCE_ONE_GRID): the same answers
    plain, gated, one_grid = (f["balanced"][k] for k in ("False", "True", "True_one_grid"))
    assert plain["splits"] is not None and plain["gate"] is None, plain
    assert gated["splits"] == plain["splits"] and gated["gate"] in ([0], [1]), gated
    assert one_grid["splits"] == plain["splits"] and one_grid["gate"] == gated["gate"], one_grid
    for r in (plain, gated, one_grid):
        assert r["finite"] and r["rel_err"] < 2e-3, r
