"""A submitted request seen from a plain thread: iterate its outputs, or wait for the assembled result."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

from cbd.engine.outputs import RequestOutput, Usage
from cbd.engine.sequence import FinishReason


@dataclass(slots=True)
class Candidate:
    """One finished candidate, as assembled by RequestStream.result()."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    request_id: str
    candidates: list[Candidate]
    usage: Usage | None


class RequestStream:
    """A submitted request seen from a plain thread: iterate its outputs, or wait for the result."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self._n = n
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    def result(self) -> Completion:
        candidates = [Candidate(i) for i in range(self._n)]
        usage = None
        for output in self:
            for delta in output.candidates:
                c = candidates[delta.index]
                c.token_ids += delta.token_ids
                c.text += delta.text
                c.logprobs += delta.logprobs or []
                c.finish_reason = delta.finish_reason or c.finish_reason
            usage = output.usage
        return Completion(self.request_id, candidates, usage)
