"""Triton kernels for sparse decode (packaged as ``sgl_sparse.kernels``).

Public API:

* :func:`two_segment_decode` -- one-launch split-KV decode attention over a
  compact segment (A) plus an in-place paged position range (B).
* :func:`pack_compact` -- gather selected positions from the paged pool into
  the compact buffer; :func:`pack_compact_layers` -- the same for several
  layers in one launch (their pools as a :class:`LayerPools` address table);
  :func:`list_compact_layers` -- their pool slots instead of a copy.
* :func:`window_evidence` -- the Selector's evidence (softmax over the candidates,
  GQA mean, power mean over the window) fused, keys read in place.
* :func:`selector_scores` / :func:`selector_stats` -- the Selector's steps 1-5
  (normalizers, prior medians, fusion, Soft-NMS, exclusivity).
* :func:`plan_step` -- the per-step decode plan and state updates in one launch.
* :func:`step_balance` -- a balanced step's splits and gate in one launch.
* :func:`choose_num_splits` -- the static split heuristic used by the above;
  :func:`make_split_counters` -- the counters of its one-launch merge.
* Quest (:mod:`.quest_pages`): :func:`quest_bounds_update` (extend),
  :func:`quest_bounds_decode` (one key per step), :func:`quest_page_scores`,
  :func:`quest_select_positions` (top-k pages -> ``a_pos`` for segment A).
* Token scores (:mod:`.token_scores`, AsyncSpade / LFPS): :func:`token_scores`
  over a position range, :func:`token_scores_at` over per-head candidate lists,
  :func:`token_select_positions` (top-k -> ``a_pos`` for segment A).
* :func:`index_token_scores` (:mod:`.index_keys`) -- AsyncSpade's scores from
  int8 copies of the keys that the launch itself keeps filled;
  :func:`quantize_keys` (the copies' definition), :func:`index_token_scores_ref`.
* :func:`topk_range` (:mod:`.topk_range`) -- top-k over a ragged ``[lo, hi)``
  per row, ascending positions out, cost bounded by the live range (quest /
  asyncspade under CUDA graphs, the Selector's step 6); :func:`topk_range_ref`;
  :func:`top_digit_hist_ref`, the definition of its ``h_top`` (the first radix
  pass's histogram, which the scores' producer may count instead).
* :func:`asyncspade_predict` (:mod:`.asyncspade_predict`) -- AsyncSpade's
  ring push and next-query prediction (the ridge fits over every window size)
  in one launch per layer; :func:`make_arrivals` (its per-row counters),
  :func:`asyncspade_predict_ref`.
* :func:`lfps_head_sparsity` (:mod:`.lfps_sparsity`) -- LFPS's head sparsity ρ
  (sink bypass) per query head from the sink and local keys read in place.
* :func:`qa_forward` (:mod:`.qa_forward`) -- quest / asyncspade / lfps's
  per-forward tensors (slot -> row maps, knobs, masks, ranges) in one launch.
* :mod:`.indexed_slots` -- the indexed rows' position lists as pool slots
  (``two_segment_decode(..., a_pos_slots=True)`` gathers from those fastest); the
  serving path's producers (``gather_selection``, ``expand_selection``,
  ``lfps_select_out``: ``slots=``) write them in the same pass, and
  :func:`~.indexed_slots.indexed_pool_slots` is the definition they are tested against.
* Plain-PyTorch references: :func:`two_segment_decode_ref`,
  :func:`pack_compact_ref`, :func:`dense_decode_ref`.
"""

from .asyncspade_predict import asyncspade_predict, asyncspade_predict_ref, make_arrivals
from .gather_key_norms import gather_key_norms, gather_key_norms_ref
from .index_keys import index_token_scores, index_token_scores_ref, quantize_keys
from .layer_pools import LayerPools
from .lfps_sparsity import lfps_head_sparsity
from .pack_compact import list_compact_layers, pack_compact, pack_compact_layers
from .quest_pages import (
    QUEST_PAGE_SIZE,
    quest_bounds_decode,
    quest_bounds_update,
    quest_page_scores,
    quest_select_positions,
)
from .plan_step import plan_step
from .balance_step import step_balance
from .reference import (
    dense_decode_ref,
    pack_compact_layers_ref,
    pack_compact_ref,
    quest_bounds_ref,
    quest_page_scores_ref,
    token_scores_at_ref,
    token_scores_ref,
    two_segment_decode_ref,
)
from .token_scores import token_scores, token_scores_at, token_select_positions
from .two_segment_decode import (
    balance_factor,
    balance_gate,
    balance_programs_per_sm,
    balanced_grid_splits,
    balanced_splits,
    balances,
    choose_num_splits,
    dense_step_balances,
    one_grid,
    plain_fp8_splits,
    plain_partition_splits,
    programs_per_sm,
    make_split_counters,
    step_row_splits,
    two_segment_decode,
)
from .selector_scores import selector_scores, selector_stats
from .topk_range import top_digit_hist_ref, topk_range, topk_range_ref
from .window_evidence import stored_evidence, window_evidence

__all__ = [
    "two_segment_decode",
    "balanced_splits",
    "balanced_grid_splits",
    "balance_factor",
    "balance_gate",
    "balance_programs_per_sm",
    "balances",
    "dense_step_balances",
    "one_grid",
    "step_row_splits",
    "list_compact_layers",
    "pack_compact",
    "pack_compact_layers",
    "LayerPools",
    "plan_step",
    "step_balance",
    "window_evidence",
    "stored_evidence",
    "selector_scores",
    "selector_stats",
    "gather_key_norms",
    "gather_key_norms_ref",
    "topk_range",
    "topk_range_ref",
    "top_digit_hist_ref",
    "asyncspade_predict",
    "asyncspade_predict_ref",
    "make_arrivals",
    "lfps_head_sparsity",
    "choose_num_splits",
    "plain_fp8_splits",
    "plain_partition_splits",
    "programs_per_sm",
    "make_split_counters",
    "QUEST_PAGE_SIZE",
    "quest_bounds_update",
    "quest_bounds_decode",
    "quest_page_scores",
    "quest_select_positions",
    "token_scores",
    "token_scores_at",
    "token_select_positions",
    "index_token_scores",
    "index_token_scores_ref",
    "quantize_keys",
    "two_segment_decode_ref",
    "pack_compact_ref",
    "pack_compact_layers_ref",
    "dense_decode_ref",
    "quest_bounds_ref",
    "quest_page_scores_ref",
    "token_scores_ref",
    "token_scores_at_ref",
]
