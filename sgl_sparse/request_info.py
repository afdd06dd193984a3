"""Per-request results in the response: ``meta_info["sgl_sparse"]``.

SGLang (0.5.17 and 0.5.23 alike) carries plugin data from the scheduler to the
response through ``Req.customized_info``: a dict of *per-token* value lists that
the output streamer slices by the tokens it sends
(``values[sent_offset:len(output_ids)]``) into ``BatchTokenIDOutput.customized_info``;
the tokenizer manager appends each slice to the request's accumulated list and
puts that list under the same key in ``meta_info``. Here:

1. scheduler, when a finished request's row goes back to the pool (before the
   state row is released): its summary goes into ``req.customized_info`` as a
   sequence whose every non-empty slice is ``[summary]``, so whatever range of
   tokens the final output carries, it carries the summary once;
2. tokenizer manager, before it handles a batch of outputs: the streamer pads
   the key with ``None`` for every other request of the batch (streamed chunks
   of running requests); those are dropped, so a response holds
   ``meta_info["sgl_sparse"] == [summary]`` once its request finished and no
   such key (or ``[]``) before.

The summary: ``policy``, ``decode_steps``, ``slow_step_ratio`` (SFI; null for
policies without slow steps), ``mean_retention`` (mean over the request's decode
steps of tokens attended / tokens in cache; null without decode steps) and
``time_per_output_token_s``. A request retracted and re-admitted is summarised
from its re-admission on. A request whose KV row is released after its final
output was streamed (HiCache's asynchronous offload) gets no summary.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from sgl_sparse import compat

META_KEY = "sgl_sparse"


class _OnEverySlice:
    """Stands in for a per-token list: any non-empty slice is ``[value]``."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop = index.start or 0, index.stop
            return [self.value] if stop is None or stop > start else []
        return self.value


def time_per_output_token(req: Any, now: Optional[float] = None) -> Optional[float]:
    """(now - first token) / (output tokens - 1) on the scheduler's clock.

    ``time_stats.prefill_finished_time`` is SGLang's own stamp (perf_counter) of
    the request's first token; output tokens are counted through the stop
    position (an overlap-scheduler overshoot token is not the client's)."""
    t0 = getattr(getattr(req, "time_stats", None), "prefill_finished_time", 0.0) or 0.0
    n = len(req.output_ids_through_stop) if hasattr(req, "output_ids_through_stop") else len(req.output_ids)
    now = time.perf_counter() if now is None else now
    if t0 <= 0.0 or n < 2 or now < t0:
        return None
    return (now - t0) / (n - 1)


def on_request_freed(state, req: Any) -> None:
    """Scheduler side, BEFORE ``ReqToTokenPool.free(req)``: the row's stats are
    still live. Retraction also frees the row; only finished requests count."""
    finished = getattr(req, "finished", None)
    if not callable(finished) or not finished():
        return
    row = compat.req_pool_idx(req)
    stats = state.request_stats(int(row)) if row is not None else None
    if stats is None:
        return
    tpot = time_per_output_token(req)
    if state.metrics is not None:
        state.metrics.on_request_finished(stats["policy"], tpot)
    summary = {**stats, "time_per_output_token_s": tpot}
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[META_KEY] = _OnEverySlice(summary)


def compact_batch_output(recv_obj: Any) -> None:
    """Tokenizer-manager side, before a batch of outputs is handled: keep only
    the summary of each request under META_KEY (drop the streamer's padding)."""
    wrapped = getattr(recv_obj, "customized_info", None)
    if wrapped is None:
        return
    from sglang.srt.managers.io_struct import unwrap_from_pickle, wrap_as_pickle

    info = unwrap_from_pickle(wrapped)
    if not isinstance(info, dict) or META_KEY not in info:
        return
    info[META_KEY] = [[v for v in per_req if v is not None][-1:] for per_req in info[META_KEY]]
    recv_obj.customized_info = wrap_as_pickle(info)
