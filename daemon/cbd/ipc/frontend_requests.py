"""The frontend's one registry of live requests and pending calls, and the demux of the engine's Events.

A request is admitted here (caps and retry hints, at once, with no round trip) into `Admission`, the one
registry of live requests of this process as of the engine's (live.py): its record lives until its last
output arrives, and its output callback is a `_Delivery` that also makes the text of candidates without
stop strings (text.py) and remembers which candidates ended. A call (a command with an answer) waits here under its call id until its typed reply comes.
`apply` hands each Events message out: replies to their calls, outputs to their requests' `on_output`,
expired sessions to `on_session_expired`. Everything runs on the frontend's event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from cbd.config import EngineConfig
from cbd.engine import api
from cbd.engine.admission import Admission
from cbd.engine.live import OutputCallback
from cbd.engine.outputs import EngineStats, RequestOutput, ended
from cbd.engine.sampling_params import PRIORITY_BATCH, SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.errors import EngineFailure
from cbd.ipc.text import RequestText

log = logging.getLogger(__name__)
Answer = Callable[[api.Reply], None]  # called with the call's reply (Refused with the error, when it failed)


@dataclass(slots=True)
class _Delivery:
    """A live request's output callback in the frontend (LiveRequest.on_output)."""

    on_output: OutputCallback | None
    n: int
    text: RequestText | None
    done: set[int]  # candidates that ended

    def __call__(self, out: RequestOutput) -> None:
        if self.text is not None:
            try:
                self.text.fill(out)
            except Exception:  # the tokenizer failed on these ids: the text is lost, the tokens are not
                log.exception("detokenising an output of %s failed", out.request_id)
        for d in out.candidates:
            if d.finish_reason is not None:
                self.done.add(d.index)
        if self.on_output is not None:
            try:
                self.on_output(out)
            except Exception:
                log.exception("output callback for %s failed", out.request_id)


class FrontendRequests:
    def __init__(self, config: EngineConfig, num_kv_blocks: int = 0) -> None:
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens, config.batch_queue_share)
        self.tokenizer: Any = None
        self._calls: dict[int, Answer] = {}
        self._call_ids = itertools.count()
        self.stats = EngineStats(0, 0, num_kv_blocks, 0, num_kv_blocks, 0, 0, 0, 0)
        self.heartbeat = time.monotonic()
        self.fatal: BaseException | None = None  # set when the engine process reported its fatal error
        self.on_session_expired: Callable[[str], object] | None = None

    def __contains__(self, request_id: str) -> bool:
        return self.admission.get(request_id) is not None

    def reserve(
        self, request_id: str, num_tokens: int, params: SamplingParams, on_output: OutputCallback | None
    ) -> str:
        """Admit a request (CapacityExceeded, or InvalidRequest for an id in use) and keep its record."""
        delivery = _Delivery(on_output, params.n, RequestText.for_request(self.tokenizer, params), set())
        live = self.admission.reserve(request_id, num_tokens, delivery, batch=params.priority == PRIORITY_BATCH)
        return live.request_id

    def forget(self, request_id: str) -> None:
        self.admission.release(request_id)

    def call(self, answer: Answer) -> int:
        call_id = next(self._call_ids)
        self._calls[call_id] = answer
        return call_id

    def apply(self, events: api.Events) -> None:
        self.heartbeat = events.heartbeat
        if events.stats is not None:
            self.stats = events.stats
        for reply in events.replies:
            answer = self._calls.pop(reply.call_id, None)
            if answer is not None:
                answer(reply)
        for session_id in events.expired:
            if self.on_session_expired is not None:
                try:
                    self.on_session_expired(session_id)
                except Exception:
                    log.exception("session-expired callback failed")
        for out in events.outputs:
            self._output(out)
        if events.fatal is not None and self.fatal is None:
            self.fatal = EngineFailure(f"the engine stopped: {events.fatal.message}")
            log.critical("%s", self.fatal)

    def _output(self, out: RequestOutput) -> None:
        live = self.admission.get(out.request_id)
        if live is None or live.on_output is None:
            return
        if out.finished:
            self.admission.release(out.request_id)
        live.on_output(out)

    def fail_all(self, reason: FinishReason, error: BaseException) -> None:
        """End every request and call the engine process left unanswered (it is gone)."""
        calls, self._calls = self._calls, {}
        for call_id, answer in calls.items():
            answer(api.Refused(call_id, api.failure(error)))
        for live in list(self.admission.live.values()):
            self.admission.release(live.request_id)
            delivery = cast(_Delivery, live.on_output)  # reserve() made every record's callback a _Delivery
            delivery(ended(live.request_id, delivery.n, reason, delivery.done))
