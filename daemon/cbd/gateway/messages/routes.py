"""The Messages API's routes: /v1/messages (whole or streamed) and /v1/messages/count_tokens.

Errors answer in the API's shape, {"type": "error", "error": {"type", "message"}}, with its statuses
(an overloaded daemon is 529 overloaded_error). A call whose messages extend a conversation a live
session holds, token for token, continues that session (agentic/resends.py); otherwise its conversation
starts a new one.
A cache_control mark raises the session's retention to high and, for ttl 1h, its idle TTL to an hour.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cbd.gateway import checks
from cbd.gateway.agentic import caller
from cbd.gateway.agentic.blocks import BlockKind, Event, EventKind, Fold
from cbd.gateway.agentic.resends import ResentTurn
from cbd.gateway.agentic.turns import Plan, Started, json_body
from cbd.gateway.errors import ApiError, from_cbd, reworded
from cbd.gateway.messages.request import DAEMON_PATHS, MessagesCall, parse
from cbd.gateway.requests import checked
from cbd.gateway.responses.items import new_id
from cbd.gateway.streams import noting_gone, rest, settled_when_dropped, unless_gone
from cbd_client.calls import set_prompt
from cbd_client.errors import CbdError
from cbd_client.v1 import cbd_pb2 as pb

# The OpenAI-shaped kinds of ApiError by status, as this API names them (and 503 as its 529).
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error"}  # fmt: skip


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _KINDS.get(error.status, "api_error"), "message": error.message}}


def anthropic_response(error: ApiError) -> JSONResponse:
    """An error in this API's shape and status (the daemon being away is its 529, overloaded)."""
    status = 529 if error.status == 503 else error.status
    return JSONResponse(error_body(reworded(error, DAEMON_PATHS)), status_code=status, headers=error.headers)


def anthropic_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return anthropic_response(exc)

    return wrapped


class Messages:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    async def create(self, request: Request) -> Response:
        call = parse(await json_body(request))
        checks.check_tool_results(call.messages, "messages")
        metadata = caller.metadata(request.headers)
        owner = caller.caller_key(request.headers)
        model = await self.gateway.model(metadata)
        retention = pb.RETENTION_HIGH if call.cache_ttl is not None else pb.RETENTION_UNSPECIFIED
        resends = self.gateway.resends
        ttl = 3600.0 if (call.cache_ttl or 0) > 600 else 0.0
        if call.prefill:  # a reply continued from its start: a plain call (a session's turn is a new message)
            plan = Plan(call.messages, keep=False, whole=True, continue_final=True)
        else:
            plan = resends.plan(owner, call.messages, ttl_seconds=ttl, retention=retention)
        turn = Turn(call, model, ResentTurn(resends, owner, plan, metadata))
        try:
            turn.started = await unless_gone(request, turn.resent.start(call.template))
            if call.stream:
                events = settled_when_dropped(turn.events(), turn.resent.settle)
                return StreamingResponse(noting_gone(events, request), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
            return JSONResponse(await unless_gone(request, turn.whole()))
        finally:
            if not call.stream or turn.started is None:
                turn.resent.settle()

    async def count_tokens(self, request: Request) -> Response:
        call = parse({"max_tokens": 1, **await json_body(request)})
        tokenize = pb.TokenizeRequest()
        checked(lambda: set_prompt(tokenize, call.messages))
        if call.prefill:
            tokenize.chat.continue_final_message = True
        try:
            answer = await self.gateway.stub.Tokenize(tokenize, metadata=caller.metadata(request.headers), timeout=60)
        except grpc.aio.AioRpcError as exc:
            raise from_cbd(CbdError.from_rpc(exc)) from None
        return JSONResponse({"input_tokens": answer.count})


class Turn:
    """One /v1/messages call from the daemon's first message to the recorded conversation."""

    def __init__(self, call: MessagesCall, model: str, resent: ResentTurn) -> None:
        self.call, self.model, self.resent = call, model, resent
        self.started: Started | None = None
        self.fold = Fold()
        self.id = new_id("msg")

    async def whole(self) -> dict[str, Any]:
        assert self.started is not None
        self.fold.add(self.started.first)
        try:
            async for response in rest(self.started.stream):
                self.fold.add(response)
        except grpc.aio.AioRpcError as exc:
            raise from_cbd(CbdError.from_rpc(exc)) from None
        self.fold.end()
        stop_reason, stop_sequence = self._stop()
        self.resent.completed(self.fold.reply())
        return {**self._head(), "content": [self._block(i) for i in range(len(self.fold.blocks))],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage()}  # fmt: skip

    async def events(self) -> AsyncGenerator[bytes, None]:
        assert self.started is not None
        try:
            # The prompt's counts as the daemon's first message gives them; the final ones in message_delta.
            first = self.started.first.prompt_usage if self.started.first.HasField("prompt_usage") else None
            start = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": self._usage(first)}  # fmt: skip
            yield _sse("message_start", {"type": "message_start", "message": start})
            yield _sse("ping", {"type": "ping"})
            try:
                for event in self.fold.add(self.started.first):
                    yield self._event(event)
                async for response in rest(self.started.stream):
                    for event in self.fold.add(response):
                        yield self._event(event)
            except grpc.aio.AioRpcError as exc:
                yield _sse("error", error_body(from_cbd(CbdError.from_rpc(exc))))
                return
            for event in self.fold.end():
                yield self._event(event)
            stop_reason, stop_sequence = self._stop()
            self.resent.completed(self.fold.reply())
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            yield _sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self._usage()})
            yield _sse("message_stop", {"type": "message_stop"})
        finally:
            self.resent.settle()

    def _event(self, event: Event) -> bytes:
        block = self.fold.blocks[event.index]
        if event.kind is EventKind.OPEN:
            opened = ({"type": "text", "text": ""} if block.kind is BlockKind.TEXT else
                      {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}})  # fmt: skip
            return _sse("content_block_start", {"type": "content_block_start", "index": event.index,
                                                "content_block": opened})  # fmt: skip
        if event.kind is EventKind.DELTA:
            delta = ({"type": "text_delta", "text": event.delta} if block.kind is BlockKind.TEXT else
                     {"type": "input_json_delta", "partial_json": event.delta})  # fmt: skip
            return _sse("content_block_delta", {"type": "content_block_delta", "index": event.index, "delta": delta})
        return _sse("content_block_stop", {"type": "content_block_stop", "index": event.index})

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _block(self, index: int) -> dict[str, Any]:
        b = self.fold.blocks[index]
        if b.kind is BlockKind.TEXT:
            return {"type": "text", "text": b.text}
        try:
            arguments = json.loads(b.text) if b.text else {}
        except ValueError:
            arguments = {}  # cut short by max_tokens: stop_reason says so
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": arguments}

    def _stop(self) -> tuple[str, str | None]:
        finish = self.fold.finish
        if finish in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_ABORT):
            raise ApiError(500, "the daemon ended the reply without finishing it", "api_error")
        if finish == pb.FINISH_REASON_TOOL_CALLS:
            return "tool_use", None
        if finish == pb.FINISH_REASON_LENGTH:
            return "max_tokens", None
        generated = "".join(self.fold.token_texts)
        hits = [s for s in self.call.stop_sequences if s in generated]
        if hits:  # a stop sequence ends generation where it first appears: the one that ends last is it
            return "stop_sequence", max(hits, key=lambda s: (generated.rfind(s) + len(s), len(s)))
        return "end_turn", None

    def _usage(self, counts: pb.Usage | None = None) -> dict[str, Any]:
        """The API's usage of the reply's final counts, or of `counts` (the prompt's, at the start)."""
        u = counts or self.fold.usage or pb.Usage()
        fresh = u.prompt_tokens - u.cached_prompt_tokens
        # The three input counts add up to the prompt: the computed tokens are cache writes when the call
        # carries a cache_control mark (its session keeps them), else plain input.
        marked = self.call.cache_ttl is not None
        return {"input_tokens": 0 if marked else fresh, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": u.cached_prompt_tokens,
                "cache_creation_input_tokens": fresh if marked else 0}  # fmt: skip


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
