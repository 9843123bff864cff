"""Admission control: caps on live requests and on their prompt tokens, with a retry hint.

Every request (plain or session turn) reserves a seat and its prompt tokens before it is queued and
gives them back when it finishes, fails or is cancelled. Beyond either cap `reserve` refuses at once
with CapacityExceeded, so memory stays bounded whatever the offered load. The refusal carries a retry
hint: the time in which, at the rate requests have been finishing lately, enough of the live ones will
have finished to make room for this caller *after* the callers refused before it whose hinted time has
not come yet (a virtual queue: a crowd of refused clients is spread over time instead of retrying
all at once).
Batch-priority requests see smaller caps (`batch_share` of each), so that under load they are refused
before interactive ones are.

Admission is also the one registry of live requests (`LiveRequest` records, see live.py): reserving
is where a request id is checked for uniqueness, once.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque

from cbd.engine.live import LiveRequest, OutputCallback
from cbd.errors import CapacityExceeded, InvalidRequest

# Bounds of the retry hint, seconds.
MIN_RETRY_AFTER = 0.05
MAX_RETRY_AFTER = 30.0
# How many recent finishes the rate is measured over.
_RATE_WINDOW = 256
# Refused callers remembered for the virtual queue at most.
_MAX_HINTED = 100_000


class Admission:
    def __init__(self, max_requests: int, max_tokens: int, batch_share: float = 1.0) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.batch_share = batch_share
        self._lock = threading.Lock()
        # request id -> record. Written under the lock; the engine thread reads it without (a dict
        # lookup is atomic, and a record is only removed by `release`).
        self._live: dict[str, LiveRequest] = {}
        self._tokens = 0
        self._finished_at: deque[float] = deque(maxlen=_RATE_WINDOW)
        self._hinted: list[float] = []  # heap: when refused callers still waiting were told to come back
        self._busy_since = 0.0  # when the live count last rose from 0 (monotonic)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @classmethod
    def unbounded(cls) -> Admission:
        """A registry without caps (an EngineCore driven directly, as tests and benchmarks do)."""
        return cls(2**62, 2**62)

    @property
    def live(self) -> dict[str, LiveRequest]:
        """The live requests by id (read-only use)."""
        return self._live

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def reserve(
        self, request_id: str, num_tokens: int, on_output: OutputCallback | None = None, batch: bool = False
    ) -> LiveRequest:
        """batch: a batch-priority request (its caps are `batch_share` of the caps)."""
        share = self.batch_share if batch else 1.0
        max_requests = max(1, int(self.max_requests * share)) if batch else self.max_requests
        max_tokens = max(1, int(self.max_tokens * share)) if batch else self.max_tokens
        kind = "; batch requests get a share of it" if batch and share < 1 else ""
        with self._lock:
            if request_id in self._live:
                raise InvalidRequest("request_id is already in use by a live request")
            if len(self._live) >= max_requests:
                wait = self._retry_after(len(self._live) - max_requests + 1)
                raise CapacityExceeded(
                    f"{len(self._live)} requests are live, the limit is {max_requests}{kind}; "
                    f"retry in {wait:.2f} s", retry_after=wait,
                )  # fmt: skip
            if num_tokens > max_tokens:  # never fits, however many finish: no retry hint
                raise CapacityExceeded(
                    f"the prompt's {num_tokens} tokens are more than the limit of {max_tokens} queued prompt "
                    f"tokens{kind}: it cannot be admitted"
                )
            if self._tokens + num_tokens > max_tokens:
                wait = self._retry_after(self._requests_to_free(self._tokens + num_tokens - max_tokens))
                raise CapacityExceeded(
                    f"{self._tokens} prompt tokens are queued or running, the limit is {max_tokens}{kind}; "
                    f"retry in {wait:.2f} s", retry_after=wait,
                )  # fmt: skip
            if not self._live:
                self._busy_since = time.monotonic()
            live = self._live[request_id] = LiveRequest(request_id, num_tokens, on_output)
            self._tokens += num_tokens
            return live

    def stalled(self, heartbeat: float, seconds: float) -> bool:
        """Work is pending and the engine loop has made no progress (its `heartbeat`, monotonic) for
        `seconds` since the work became pending: a loop that idled (or was loading) before the work came
        is not stalled. The one stall rule of the in-process and the remote engine."""
        return bool(self._live) and time.monotonic() - max(heartbeat, self._busy_since) > seconds

    def release(self, request_id: str) -> LiveRequest | None:
        """Give back a request's reservation and drop its record (idempotent: a second call for the
        same id does nothing and returns None)."""
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is not None:
                self._tokens -= live.num_reserved_tokens
                self._finished_at.append(time.monotonic())
            return live

    def _requests_to_free(self, excess_tokens: int) -> int:
        mean = self._tokens / max(1, len(self._live))
        return max(1, math.ceil(excess_tokens / max(1.0, mean)))

    def _retry_after(self, requests: int) -> float:
        """Seconds until `requests` live requests, plus one per caller still waiting on an earlier hint,
        have likely finished, from the recent finish rate."""
        now = time.monotonic()
        while self._hinted and self._hinted[0] <= now:
            heapq.heappop(self._hinted)
        if len(self._finished_at) < 2:
            wait = 1.0
        else:
            rate = (len(self._finished_at) - 1) / max(now - self._finished_at[0], 1e-3)
            wait = min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, (requests + len(self._hinted)) / rate))
        if len(self._hinted) < _MAX_HINTED:
            heapq.heappush(self._hinted, now + wait)
        return wait
