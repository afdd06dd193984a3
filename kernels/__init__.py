"""Triton kernels for sparse decode (packaged as ``sgl_sparse.kernels``).

Public API:

* :func:`two_segment_decode` -- one-launch split-KV decode attention over a
  compact segment (A) plus an in-place paged position range (B).
* :func:`pack_compact` -- gather selected positions from the paged pool into
  the compact buffer.
* :func:`window_evidence` -- the Selector's evidence (softmax over the candidates,
  GQA mean, power mean over the window) fused, keys read in place.
* :func:`selector_scores` / :func:`selector_stats` -- the Selector's steps 1-5
  (normalizers, prior medians, fusion, Soft-NMS, exclusivity).
* :func:`plan_step` -- the per-step decode plan and state updates in one launch.
* :func:`choose_num_splits` -- the static split heuristic used by the above.
* Plain-PyTorch references: :func:`two_segment_decode_ref`,
  :func:`pack_compact_ref`, :func:`dense_decode_ref`.
"""

from .pack_compact import pack_compact
from .plan_step import plan_step
from .reference import dense_decode_ref, pack_compact_ref, two_segment_decode_ref
from .two_segment_decode import choose_num_splits, two_segment_decode
from .selector_scores import selector_scores, selector_stats
from .window_evidence import window_evidence

__all__ = [
    "two_segment_decode",
    "pack_compact",
    "plan_step",
    "window_evidence",
    "selector_scores",
    "selector_stats",
    "choose_num_splits",
    "two_segment_decode_ref",
    "pack_compact_ref",
    "dense_decode_ref",
]
