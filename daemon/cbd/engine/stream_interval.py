"""A request's outputs gathered into fewer: at most one per `tokens` tokens of a candidate.

A step makes one output per request. At a large batch, an output per request per step is most of the
work after the step: handing it over, sending it to the frontend, decoding it there, and one gRPC message
per stream per step (the frontend's and the client's largest cost per token). So the engine may gather a
request's outputs (the emitter, engine/emitter.py): once its first token has gone out (time to first token is
unchanged), its outputs are held until one candidate has `tokens` tokens not yet passed on, a candidate
ends, or the request ends; then everything held goes on at once as one output, in order. Nothing is
dropped or reordered while the engine runs (a request's last output, however it ends, is never held; if
the engine process itself dies, what it held dies with it and the stream ends with an error). The
interval is the request's own (SamplingParams.stream_interval, from GenerateRequest.stream_interval) or,
unset, 1 for an interactive request and SamplingParams.batch_stream_interval (the daemon's
--stream-interval) for a batch one; the class is known for sure from the request's first output (a
session turn takes its session's). An interval of 1 passes each output on as it comes.
"""

from __future__ import annotations

from operator import attrgetter

from cbd.engine.outputs import (
    CandidateDelta,
    RequestOutput,
    copy_delta,
    extend_delta,
    merge_request_fields,
    start_merge,
)  # fmt: skip
from cbd.engine.sampling_params import PRIORITY_BATCH


def gathers(own: int | None, batch_interval: int) -> bool:
    """Whether a request with these settings may have its outputs gathered (else each goes on as it comes)."""
    return (own or batch_interval) > 1


class StreamInterval:
    """The gathering of one request's outputs: `add` each as it is made; it answers the output due to go on."""

    __slots__ = ("_own", "_batch", "_tokens", "_held", "_num_held", "_started")

    def __init__(self, own: int | None, batch_interval: int, priority: int | None) -> None:
        """own: the request's stream_interval (None: by its class); batch_interval: a batch request's;
        priority: the class it asked for (None: known from its first output)."""
        self._own = own
        self._batch = batch_interval
        self._tokens = self._interval(priority)  # until the first output tells the class it runs in
        # What was gathered since the last delivery, as one output (merged as each comes, by outputs.py's rule:
        # a candidate's held tokens are its delta's), and how many outputs it holds.
        self._held: RequestOutput | None = None
        self._num_held = 0
        self._started = False  # a token has gone out

    def _interval(self, priority: int | None) -> int:
        if self._own is not None:
            return self._own
        return self._batch if priority == PRIORITY_BATCH else 1

    @property
    def passes_each(self) -> bool:
        """Its interval is 1 and nothing is held: each output goes on as it comes."""
        return self._tokens == 1 and self._held is None

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """Gather `out`; everything gathered so far, as one output, once it is due (else None). `out` itself
        is never changed (the held output is a copy)."""
        if out.priority is not None:  # the first output: the class it runs in
            self._tokens = self._interval(out.priority)
        held = self._held
        if held is None:
            if self._tokens == 1:  # passes each (the interval is fixed from here on: priority, first output only)
                return out
            held = self._held = start_merge(out, [])
        else:
            merge_request_fields(held, out)
        self._num_held += 1
        due = out.finished
        for d in out.candidates:
            count = len(_gather(held.candidates, d).token_ids)
            if d.finish_reason is not None or count >= self._tokens or (count and not self._started):
                due = True  # a candidate ended, has gathered enough, or holds the stream's first token
        if not due:
            return None
        if self._num_held > 1:
            held.candidates.sort(key=attrgetter("index"))
        self._held, self._num_held = None, 0
        self._started = self._started or any(d.token_ids for d in held.candidates)
        return held


def _gather(candidates: list[CandidateDelta], d: CandidateDelta) -> CandidateDelta:
    """Merge d into its candidate's delta among those held (a copy of d when it has none yet); that delta."""
    for m in candidates:
        if m.index == d.index:
            extend_delta(m, d)
            return m
    m = copy_delta(d)
    candidates.append(m)
    return m
