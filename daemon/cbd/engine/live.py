"""The record of one live request: from the moment it is reserved in admission until it finishes.

There is one registry of live requests (`Admission`, keyed by request id): the caller's thread
creates the record when it reserves a seat (which also makes the id unique among live requests),
the engine thread attaches the core's `Request` when it queues it, delivers every output through
`on_output`, and releases the record when the request finishes, fails or is aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cbd.engine.outputs import RequestOutput
    from cbd.engine.sequence import Request

OutputCallback = Callable[["RequestOutput"], object]  # its result is ignored


@dataclass(slots=True)
class LiveRequest:
    request_id: str
    num_reserved_tokens: int  # prompt tokens counted against max_queued_tokens (a turn: its new tokens)
    # Called in the engine thread with each output; must be quick and must not block.
    on_output: OutputCallback | None = None
    request: Request | None = None  # the core's request, once the engine thread has queued it
