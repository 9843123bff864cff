"""The Responses API's routes: create (whole or streamed), retrieve, delete, cancel, input_items.

A response id names the cbd session and turn that produced it (`resp_<session>_<turn>`; the session id
starts with the affinity key a proxy routes by). Continuing the latest response of a session
(previous_response_id) is the session's next turn: only the new input is prefilled; before it, the
session is forked into a snapshot of the history as of that response (`<session>.t<turn>`, KV shared
copy-on-write). Continuing an older response forks that snapshot and takes the turn on the fork: every
branch of a tree of responses is served from resident KV. Where a session or snapshot is gone, or the
instructions differ, a session is re-created from the stored conversation (a recompute, never an
error). A turn on a session is claimed here while it runs, so two continuations of one response never
both take the session: the second forks.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cbd.gateway import checks
from cbd.gateway.agentic import caller
from cbd.gateway.agentic.blocks import Fold
from cbd.gateway.agentic.turns import Plan, Started, Turns, json_body
from cbd.gateway.errors import ApiError, bad_request, from_cbd
from cbd.gateway.responses import items
from cbd.gateway.responses.background import Background
from cbd.gateway.responses.request import Create, parse
from cbd.gateway.responses.store import ResponseStore, Stored
from cbd.gateway.responses.stream import Events, failure, reply_status
from cbd.gateway.streams import noting_gone, rest, settled_when_dropped, unless_gone
from cbd_client.errors import CbdError
from cbd_client.v1 import cbd_pb2 as pb


class Responses:
    def __init__(self, gateway: Any, store: ResponseStore) -> None:
        self.gateway = gateway
        self.store = store
        self.turns = Turns(gateway)
        self._claimed: set[str] = set()  # sessions with a turn of this gateway in flight
        self.background = Background(store)

    async def create(self, request: Request) -> Response:
        create = parse(await json_body(request))
        metadata = caller.metadata(request.headers)
        owner = caller.caller_key(request.headers)
        model = await self.gateway.model(metadata)
        plan, history, turn = await self._plan(create, owner)
        run = Run(self, create, owner, model, history, turn, plan.session_id)
        try:
            checks.check_tool_results(history + create.messages, "input")
            run.started = await unless_gone(request, self.turns.start(create.template, plan, metadata))
            if create.stream:
                events = settled_when_dropped(run.events(metadata), lambda: run.settle(metadata))
                return StreamingResponse(noting_gone(events, request), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
            if create.background:
                return JSONResponse(await self.background.begin(run, metadata))
            return JSONResponse(await unless_gone(request, run.whole(metadata)))
        finally:
            if run.started is None or not (create.stream or create.background):
                run.settle(metadata)

    async def _plan(self, create: Create, owner: str) -> tuple[Plan, list[dict[str, Any]], int]:
        """How to run the turn, the conversation it continues (without instructions) and the turn it is."""
        if create.previous_response_id is None:
            affinity = _affinity(owner, create.prompt_cache_key)
            return Plan(_with(create.instructions, create.messages), keep=create.store, affinity=affinity), [], 1
        found = await self.store.get(owner, create.previous_response_id)
        if found is None:
            raise not_found(create.previous_response_id, "previous_response_id")
        previous, latest = found
        _check_continuable(previous)
        history = previous.conversation
        whole = _with(create.instructions, history + create.messages)
        if not create.store:
            return Plan(whole, keep=False), history, 1
        session = previous.session_id
        if session is None or previous.instructions != create.instructions:
            return Plan(whole), history, 1  # the session's history is not this conversation's: a new one
        snapshot = _snapshot(session, previous.turn)
        if latest and session not in self._claimed:
            self._claimed.add(session)
            return Plan(whole, session, create.messages, snapshot=snapshot), history, previous.turn + 1
        # An older response (or the latest, busy): a fork of the snapshot taken when its session moved on.
        return Plan(whole, None, create.messages, fork_from=snapshot), history, previous.turn + 1

    def release(self, session_id: str | None) -> None:
        self._claimed.discard(session_id or "")

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("a stored response is not streamed again: retrieve polls it", "stream")
        stored = await self._find(request)
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await self.store.delete(await self._caller(request), response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        stored = await self._find(request)
        if not stored.response.get("background"):
            raise bad_request("only background responses can be cancelled")
        await self.background.cancel(stored.id)
        return JSONResponse((await self._find(request)).response)

    async def input_items(self, request: Request) -> Response:
        stored = await self._find(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        limit = request.query_params.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise bad_request("limit must be an integer from 1 to 100", "limit")
        listed = stored.input_items if order == "asc" else stored.input_items[::-1]
        after = request.query_params.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(listed) if item.get("id") == after), None)
            if at is None:
                raise bad_request(f"no input item {after!r} in this response", "after")
            listed = listed[at + 1 :]
        page = listed[: int(limit)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > len(page)})  # fmt: skip

    async def _caller(self, request: Request) -> str:
        """The caller's key, once the daemon has taken its token: a missing or wrong one is the 401 (or 403) a
        create gets. An unreachable daemon does not stop a read: rows are scoped by key either way."""
        try:
            await self.gateway.model(caller.metadata(request.headers), fresh=True)
        except ApiError as exc:
            if exc.status in (401, 403):
                raise
        return caller.caller_key(request.headers)

    async def _find(self, request: Request) -> Stored:
        response_id = request.path_params["response_id"]
        found = await self.store.get(await self._caller(request), response_id)
        if found is None:
            raise not_found(response_id)
        return found[0]


class Run:
    """One create call from the daemon's first message to the stored response."""

    def __init__(self, api: Responses, create: Create, owner: str, model: str, history: list[dict[str, Any]],
                 turn: int, claimed: str | None) -> None:  # fmt: skip
        self.api, self.create, self.owner, self.model, self.history = api, create, owner, model, history
        self.turn = turn
        self.claimed = claimed  # the session this call claimed for its turn (released in settle)
        self.started: Started | None = None
        self.fold = Fold()
        self.stream = Events(self.fold)
        self.created_at = int(time.time())
        self.done = False
        self.id = items.new_id("resp")

    def name(self) -> None:
        s = self.started
        assert s is not None
        if s.session_id is None:
            self.turn = 0
        else:
            self.turn = self.turn if s.continued else 1
            self.id = f"resp_{s.session_id}_{self.turn}"

    async def whole(self, metadata: list[tuple[str, str]]) -> dict[str, Any]:
        self.name()
        assert self.started is not None
        for event in self.fold.add(self.started.first):
            self.stream.of(event)
        try:
            async for response in rest(self.started.stream):
                for event in self.fold.add(response):
                    self.stream.of(event)
        except grpc.aio.AioRpcError as exc:
            raise from_cbd(CbdError.from_rpc(exc)) from None
        for event in self.fold.end(at_least_one=True):
            self.stream.of(event)
        return await self._finish()

    async def events(self, metadata: list[tuple[str, str]]) -> AsyncGenerator[bytes, None]:
        self.name()
        assert self.started is not None
        ended = False  # stored as it ended (else, while stored, a client gone mid-stream stores it cancelled)
        try:
            if self.create.store:  # retrieve finds it while it streams
                await self.api.store.put(self.stored(self.response("in_progress", []), None))
            yield self.stream.lifecycle("response.created", self.response("in_progress", []))
            yield self.stream.lifecycle("response.in_progress", self.response("in_progress", []))
            try:
                for event in self.fold.add(self.started.first):
                    for chunk in self.stream.of(event):
                        yield chunk
                async for response in rest(self.started.stream):
                    for event in self.fold.add(response):
                        for chunk in self.stream.of(event):
                            yield chunk
            except grpc.aio.AioRpcError as exc:
                failed = self.response("failed", self.stream.output("incomplete"))
                failed["error"] = failure(from_cbd(CbdError.from_rpc(exc)))
                if self.create.store:
                    await self.api.store.put(self.stored(failed, None))
                ended = True
                yield self.stream.lifecycle("response.failed", failed)
                return
            for event in self.fold.end(at_least_one=True):
                for chunk in self.stream.of(event):
                    yield chunk
            final = await self._finish()
            ended = True
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"])
            yield self.stream.lifecycle(kind or "response.failed", final)
        finally:
            self.settle(metadata)
            if self.create.store and not ended:
                cancelled = self.stored(self.response("cancelled", self.stream.output("incomplete")), None)
                await asyncio.shield(self.api.store.put(cancelled))

    async def _finish(self) -> dict[str, Any]:
        """The response object; stored (with the session's new turn) when asked to."""
        finish = self.fold.finish
        status = reply_status(finish)
        response = self.response(status, self.stream.output("completed" if status == "completed" else "incomplete"))
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            response["error"] = {"code": "server_error", "message": "the daemon ended the reply without finishing it"}
        if status == "completed":
            response["completed_at"] = int(time.time())
        u = self.fold.usage or pb.Usage()
        response["usage"] = {
            "input_tokens": u.prompt_tokens,
            # The prompt tokens computed are what the session's KV (and the prefix cache) now hold.
            "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens,
                                     "cache_write_tokens": u.prompt_tokens - u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }  # fmt: skip
        assert self.started is not None
        kept = self.started.session_id if status != "failed" else None  # a failed turn left its session as it was
        if self.create.store:
            await self.api.store.put(self.stored(response, kept))
        self.done = kept is not None
        return response

    def stored(self, response: dict[str, Any], session_id: str | None) -> Stored:
        """The row of this response (`session_id`: the session a continuation may take, None: none)."""
        conversation = [*self.history, *self.create.messages, self.fold.reply()]
        return Stored(self.id, self.owner, session_id, self.turn, self.created_at, self.create.instructions,
                      conversation, self.create.input_items, response)  # fmt: skip

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": None, "model": self.model, "output": output, "usage": None, **self.create.echo,
        }  # fmt: skip

    def settle(self, metadata: list[tuple[str, str]]) -> None:
        """After the call, whatever happened: stop the stream, release the session, close one opened in vain."""
        self.api.release(self.claimed)
        s = self.started
        if s is None:
            return
        s.cancel()
        if s.opened and not self.done and s.session_id is not None:
            self.api.turns.close(s.session_id, metadata)


def _check_continuable(previous: Stored) -> None:
    """A response still running (in the background, or streaming) has no output yet to continue from."""
    status = previous.response.get("status")
    if status in ("queued", "in_progress"):
        raise bad_request(f"previous response {previous.id!r} is still {status}: continue it once it has "
                          "finished (retrieve polls it)", "previous_response_id")  # fmt: skip


def _snapshot(session_id: str, turn: int) -> str:
    """The id of the session that keeps `session_id`'s history as of `turn` (forked before turn + 1)."""
    return f"{session_id}.t{turn}"


def _with(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": instructions}] if instructions else []) + messages


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response with id {response_id!r}", "not_found_error", param, "response_not_found")


def _affinity(owner: str, prompt_cache_key: str | None) -> str | None:
    """The affinity key a prompt_cache_key names, per caller (a key never routes by another caller's
    choice, and no client text reaches a session id)."""
    if prompt_cache_key is None:
        return None
    return hashlib.sha256(f"{owner}\0{prompt_cache_key}".encode()).hexdigest()[:32]
