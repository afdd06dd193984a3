"""Test-only, pure-torch stand-in for the ``sgl_kernel`` package on CPU.

SGLang's CPU code path does ``from sgl_kernel import <op>_cpu`` at module
import time.  The real ``sglang-kernel`` wheel is a CUDA/AVX-512 native
extension that cannot be installed on our CPU CI machine, so this module
provides the handful of ops the CPU path imports:

* ops reached by plain serving are implemented faithfully in plain torch
  (same signature and semantics as the C++ kernels in sgl-kernel's
  ``csrc/cpu``): ``assign_req_to_token_pool_cpu`` and
  ``copy_all_layer_kv_cache_cpu``;
* speculative-decoding ops are only *imported* by plain serving, never called;
  they raise ``NotImplementedError``.

What this module deliberately does NOT do: register anything under
``torch.ops.sgl_kernel`` (in particular ``convert_weight_packed``).  SGLang
checks ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` to decide
whether the Intel-AMX fused kernels exist; leaving it unregistered makes every
layer (linear, RMSNorm, RoPE, SiLU-and-mul, sampling, ...) take its plain
PyTorch path.

See tests/cpu_stand_ins/README.md.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

__version__ = "0.0.0+sgl-sparse-cpu-stand-in"
IS_SGL_SPARSE_STAND_IN = True

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "build_draft_decode_metadata_cpu",
]


# ---------------------------------------------------------------------------
# Ops used by plain (non-speculative) serving: faithful implementations.
# ---------------------------------------------------------------------------


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    bs_upper: Optional[int] = None,  # accepted for schema compatibility; unused
) -> None:
    """Scatter freshly allocated KV slots into the request-to-token map.

    For every ``i`` in ``range(bs)`` (``bs = req_pool_indices.numel()``)::

        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = \
            out_cache_loc[prefix[i]:prefix[i + 1]]

    where ``prefix`` is the running sum of ``end_offset - start_offset``.

    * ``req_pool_indices``: ``[bs]`` int32/int64
    * ``req_to_token``: ``[max_num_reqs, pool_len]`` int32, written in place
    * ``start_offset`` / ``end_offset``: ``[bs]`` int32/int64 (same dtype)
    * ``out_cache_loc``: ``[sum(end - start)]`` int64
    """
    _check(req_to_token.dim() == 2, "req_to_token must be 2-D")
    _check(req_to_token.dtype == torch.int32, "req_to_token must be int32")
    _check(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _check(
        start_offset.dtype == end_offset.dtype,
        "start_offset and end_offset must have the same dtype",
    )
    _check(req_to_token.shape[1] == pool_len, "req_to_token.size(1) != pool_len")
    bs = req_pool_indices.shape[0]
    _check(
        start_offset.numel() == bs and end_offset.numel() == bs,
        "start_offset/end_offset must have bs elements",
    )
    if bs == 0:
        return
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    total = sum(e - s for s, e in zip(starts, ends))
    _check(
        total <= out_cache_loc.numel(),
        f"out_cache_loc has {out_cache_loc.numel()} entries, need {total}",
    )
    src = out_cache_loc.to(torch.int32)
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = src[pt : pt + n]
        pt += max(n, 0)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV slot rows inside every K/V buffer of a KV pool.

    For every buffer ``b`` (base address ``data_ptrs[b]``, ``strides[b]`` bytes
    per slot row)::

        buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]   for i in range(num_locs)

    Safe for arbitrarily overlapping ``tgt_loc``/``src_loc``: all source rows
    of a buffer are gathered before any target row is written (like the
    Triton kernel ``copy_all_layer_kv_cache_tiled`` and the C++ CPU kernel).

    * ``data_ptrs``: ``[num_bufs]`` uint64 (int64 accepted) raw base addresses
    * ``strides``: ``[num_bufs]`` int64, bytes per slot row
    * ``tgt_loc`` / ``src_loc``: ``[num_locs]`` int32/int64 slot indices
    """
    _check(
        data_ptrs.dtype in (torch.uint64, torch.int64), "data_ptrs must be uint64"
    )
    _check(strides.dtype == torch.int64, "strides must be int64")
    _check(tgt_loc.dtype == src_loc.dtype, "tgt_loc/src_loc dtype mismatch")
    num_bufs = data_ptrs.numel()
    _check(strides.numel() == num_bufs, "strides must have num_bufs elements")
    _check(tgt_loc.numel() == src_loc.numel(), "tgt_loc/src_loc size mismatch")
    if num_bufs == 0 or tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    # The pool owns the memory; we only touch rows [0, max_loc].
    rows_needed = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    _check(int(torch.minimum(tgt.min(), src.min()).item()) >= 0, "negative loc")
    ptrs = [int(p) & 0xFFFFFFFFFFFFFFFF for p in data_ptrs.to(torch.int64).tolist()]
    for base, stride in zip(ptrs, strides.tolist()):
        raw = (ctypes.c_uint8 * (rows_needed * stride)).from_address(base)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(rows_needed, stride)
        rows[tgt] = rows[src].clone()  # gather, then scatter


# ---------------------------------------------------------------------------
# Speculative-decoding ops: imported at module load by SGLang's CPU path, but
# only called by EAGLE/MTP/NGRAM speculative decoding, which our tests never
# enable.  Signatures mirror sgl-kernel's CPU wrappers.
# ---------------------------------------------------------------------------


def _speculative_only(name: str):
    raise NotImplementedError(
        f"sgl_kernel.{name} is a speculative-decoding kernel; the sgl-sparse "
        "test stand-in for sgl_kernel (tests/cpu_stand_ins) does not implement "
        "it. Plain serving never calls it: do not enable --speculative-* "
        "options on the CPU test server."
    )


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor,
) -> None:
    _speculative_only("rotate_input_ids_cpu")


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    _speculative_only("fill_accept_out_cache_loc_cpu")


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    _speculative_only("fill_bonus_tokens_cpu")


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    _speculative_only("assign_draft_cache_locs_contiguous_cpu")


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    _speculative_only("assign_extend_cache_locs_cpu")


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    _speculative_only("build_tree_kernel_efficient_cpu")


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    _speculative_only("verify_tree_greedy_cpu")


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    _speculative_only("build_draft_decode_metadata_cpu")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"sgl_kernel stand-in: {msg}")


def _trace_load() -> None:
    # SGL_SPARSE_STAND_IN_TRACE=/path/file: append one line per process that
    # imports this stand-in (used to check that SGLang's spawned scheduler /
    # detokenizer processes see tests/cpu_stand_ins on their PYTHONPATH).
    import os
    import sys

    path = os.environ.get("SGL_SPARSE_STAND_IN_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"sgl_kernel stand-in loaded pid={os.getpid()} argv0={sys.argv[0]!r}\n")


_trace_load()
