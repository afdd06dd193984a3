"""Query-aware sparse-decode policies: the tensor math, free of serving concerns.

- `asyncspade`: next-query prediction by assembled softmax ridge regression over a
  window of recent queries, scoring of keys by the predicted query, token-level
  Top-K and the overlap-ratio metric (ALGORITHMS.md §4, papers/004).
- `lfps`: Learn-From-the-Past candidate prediction from vertical/slash score
  tables with sink bypass (ALGORITHMS.md §3, papers/001).

Every hot function is pure torch on the inputs' device, without host syncs or
data-dependent shapes, so it can run inside CUDA-graph capture.
"""
