"""A stream's outputs gathered into fewer messages: at most one per `tokens` tokens of a candidate.

The engine delivers one output per request per step. At a large batch, one gRPC message per stream per
step is most of the frontend's (and the client's) work per token, so a stream may gather them: once its
first token has gone out (time to first token is unchanged), its outputs are held until one candidate has
`tokens` tokens not yet passed on, a candidate ends, or the request ends; then everything held goes on at
once, in order. Nothing is dropped or reordered. The interval is the request's own
(GenerateRequest.stream_interval) or, unset, 1 for an interactive request and the daemon's setting for a
batch one; the class is known for sure from the request's first output (a session turn takes its
session's). An interval of 1 passes each output on as it comes.
"""

from __future__ import annotations

from collections.abc import Callable

from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import PRIORITY_BATCH

MAX_STREAM_INTERVAL = 1024


class StreamInterval:
    """The output callback of one stream: calls `deliver` with the outputs held so far when they are due."""

    __slots__ = ("_deliver", "_own", "_batch", "_tokens", "_held", "_gathered", "_started")

    def __init__(
        self, deliver: Callable[[list[RequestOutput]], None], own: int | None, batch_interval: int, priority: int | None
    ) -> None:
        """own: the request's stream_interval (None: by its class); batch_interval: the daemon's setting;
        priority: the class it asked for (None: known from its first output)."""
        self._deliver = deliver
        self._own = own
        self._batch = batch_interval
        self._tokens = self._interval(priority)  # until the first output tells the class it runs in
        self._held: list[RequestOutput] = []
        self._gathered: dict[int, int] = {}  # tokens held per candidate since the last delivery
        self._started = False  # a token has gone out

    def _interval(self, priority: int | None) -> int:
        if self._own is not None:
            return self._own
        return self._batch if priority == PRIORITY_BATCH else 1

    def __call__(self, out: RequestOutput) -> None:
        if out.priority is not None:  # the first output: the class it runs in
            self._tokens = self._interval(out.priority)
        if self._tokens == 1 and not self._held:  # the interval is fixed from here on (priority: first output only)
            self._deliver([out])
            return
        self._held.append(out)
        due = out.finished
        gathered = self._gathered
        for d in out.candidates:
            count = gathered[d.index] = gathered.get(d.index, 0) + len(d.token_ids)
            if d.finish_reason is not None or count >= self._tokens or (count and not self._started):
                due = True  # a candidate ended, has gathered enough, or holds the stream's first token
        if due:
            held, self._held = self._held, []
            gathered.clear()
            self._started = self._started or any(d.token_ids for o in held for d in o.candidates)
            self._deliver(held)
