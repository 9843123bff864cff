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

from cbd.engine.outputs import CandidateDelta, RequestOutput
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
        # What was gathered since the last delivery, as one output (outputs.merge_outputs' rule, kept as each
        # comes: a candidate's held tokens are its delta's), and how many outputs it holds.
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
            held = self._held = RequestOutput(out.request_id, [], out.finished, out.usage, out.queue_seconds,
                                              out.priority, out.error, out.turn_ok)  # fmt: skip
        elif _carries_request_fields(out):  # most outputs carry none: nothing to merge
            held.finished = held.finished or out.finished
            held.usage = out.usage or held.usage
            held.queue_seconds = held.queue_seconds if held.queue_seconds is not None else out.queue_seconds
            held.priority = held.priority if held.priority is not None else out.priority
            held.error = out.error if out.error is not None else held.error
            held.turn_ok = out.turn_ok if out.turn_ok is not None else held.turn_ok
        self._num_held += 1
        due = out.finished
        for d in out.candidates:
            count = len(_merge_delta(held.candidates, d).token_ids)
            if d.finish_reason is not None or count >= self._tokens or (count and not self._started):
                due = True  # a candidate ended, has gathered enough, or holds the stream's first token
        if not due:
            return None
        if self._num_held > 1:
            held.candidates.sort(key=_index)
        self._held, self._num_held = None, 0
        self._started = self._started or any(d.token_ids for d in held.candidates)
        return held


def _carries_request_fields(out: RequestOutput) -> bool:
    return (
        out.finished or out.usage is not None or out.queue_seconds is not None or out.priority is not None
        or out.error is not None or out.turn_ok is not None
    )  # fmt: skip


def _merge_delta(deltas: list[CandidateDelta], d: CandidateDelta) -> CandidateDelta:
    """Add d to its candidate's delta in `deltas` (a copy of d when it has none yet); the merged delta."""
    for m in deltas:
        if m.index == d.index:
            m.token_ids += d.token_ids
            if d.text:
                m.text += d.text
            if d.logprobs is not None:
                m.logprobs = (m.logprobs or []) + d.logprobs
            if d.finish_reason:
                m.finish_reason = d.finish_reason
            if d.usage:
                m.usage = d.usage
            return m
    m = CandidateDelta(d.index, list(d.token_ids), d.text, None if d.logprobs is None else list(d.logprobs),
                       d.finish_reason, d.usage)  # fmt: skip
    deltas.append(m)
    return m


def _index(d: CandidateDelta) -> int:
    return d.index
