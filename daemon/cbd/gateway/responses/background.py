"""Background responses (`background: true`): the call answers `in_progress` once the daemon accepted
the turn; the turn runs on in a task of the gateway, and its stored row is what retrieve polls.

While it runs the row has no session (nothing may continue it yet); at the end it is the finished
response (completed, incomplete or failed, continuable as any other). Cancel aborts the turn (the
daemon frees its KV; a continued session stays as it was) and stores it as `cancelled`, with what it
had produced. A gateway that stops while one runs leaves the row in_progress; the next gateway on that
state directory stores it as failed when it opens the store (store.py): the turn died with the first.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from cbd.gateway.errors import ApiError
from cbd.gateway.responses.store import ResponseStore
from cbd.gateway.responses.stream import failure

if TYPE_CHECKING:
    from cbd.gateway.responses.routes import Run


class Background:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._running: dict[str, asyncio.Future[None]] = {}  # response id -> its task

    async def begin(self, run: Run, metadata: list[tuple[str, str]]) -> dict[str, Any]:
        """Store the response as in_progress and run the rest of the turn in a task; the response so far."""
        run.name()
        response = run.response("in_progress", [])
        try:
            await self.store.put(run.stored(response, None))
        except BaseException:
            run.settle(metadata)
            raise
        task = asyncio.ensure_future(self._run(run, metadata))
        self._running[run.id] = task
        return response

    async def _run(self, run: Run, metadata: list[tuple[str, str]]) -> None:
        try:
            await run.whole(metadata)
        except asyncio.CancelledError:
            await self.store.put(run.stored(run.response("cancelled", run.stream.output("incomplete")), None))
        except ApiError as exc:
            failed = run.response("failed", run.stream.output("incomplete"))
            failed["error"] = failure(exc)
            await self.store.put(run.stored(failed, None))
        finally:
            run.settle(metadata)
            self._running.pop(run.id, None)

    async def cancel(self, response_id: str) -> None:
        """Abort a running background response and wait until its cancelled row is stored (no-op when done)."""
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
