"""The gateway's routes: /v1/chat/completions, /v1/completions, /v1/models, /health.

Each API call becomes Generate calls on one shared gRPC channel to the daemon. The HTTP Authorization
header is passed through as the call's metadata (the daemon checks the bearer token when it has one).
A chat of one candidate without X-Cbd-Session continues the session of a conversation its caller sent
before when it extends it token for token (agentic/resends.py). A streamed reply starts only after the
daemon accepted the call (its first message), so refusals keep their HTTP status; a client that
disconnects mid-stream cancels the gRPC call, and the daemon frees the request's KV within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cbd.gateway.agentic.caller import caller_key
from cbd.gateway.agentic.resends import Resends, ResentTurn
from cbd.gateway.agentic.routes import agent_routes, error_response
from cbd.gateway.agentic.turns import Turns
from cbd.gateway.errors import ApiError, bad_request, from_cbd
from cbd.gateway.guard import Guard
from cbd.gateway.limits import Limits, parse_json
from cbd.gateway.replies import Reply
from cbd.gateway.requests import Call, chat_call, chat_message, completion_call
from cbd.gateway.responses.store import StoreSettings
from cbd.gateway.sessions import SessionMap
from cbd.gateway.streams import first, noting_gone, rest, settled_when_dropped, unless_gone
from cbd_client.contract import FinishReason
from cbd_client.errors import CbdError
from cbd_client.routing import with_affinity
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1 import cbd_pb2_grpc

log = logging.getLogger("cbd.gateway")
SESSION_HEADER = "x-cbd-session"


class Gateway:
    def __init__(self, daemon: str, timeout: float, sessions: SessionMap | None = None,
                 limits: Limits | None = None) -> None:  # fmt: skip
        self.daemon = daemon
        self.timeout = timeout
        self.limits = limits or Limits()
        self.sessions = sessions or SessionMap()
        self.resends = Resends(Turns(self), self.limits.max_conversations)
        self._channel: grpc.aio.Channel | None = None
        self._model: str | None = None

    @property
    def stub(self) -> cbd_pb2_grpc.CbdStub:
        if self._channel is None:
            options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
            self._channel = grpc.aio.insecure_channel(self.daemon, options=options)
        return cbd_pb2_grpc.CbdStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def model(self, metadata: list[tuple[str, str]], fresh: bool = False) -> str:
        """The served model's name (asked once; `fresh`: ask again, so the daemon checks this caller's token)."""
        if self._model is None or fresh:
            info = await self._unary(self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30))
            self._model = info.model
        return self._model

    async def _unary(self, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise from_cbd(CbdError.from_rpc(exc)) from None

    # ---- routes ----------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await _json(request)
        call = chat_call(body, request.headers.get(SESSION_HEADER), caller_key(request.headers))
        return await self._answer("chat", call, request)

    async def completions(self, request: Request) -> Response:
        body = await _json(request)
        return await self._answer("completion", completion_call(body, self.limits.max_prompts), request)

    async def models(self, request: Request) -> Response:
        name = await self.model(_metadata(request), fresh=True)
        # Both APIs' list shapes in one (each SDK reads its own fields and ignores the other's).
        return JSONResponse({"object": "list", "data": [_model_card(name)], "has_more": False, "first_id": name,
                             "last_id": name})  # fmt: skip

    async def model_card(self, request: Request) -> Response:
        name = await self.model(_metadata(request), fresh=True)
        if request.path_params["model"] != name:
            raise ApiError(404, f"model {request.path_params['model']!r} is not served here; {name!r} is",
                           "not_found_error", "model", "model_not_found")  # fmt: skip
        return JSONResponse(_model_card(name))

    async def health(self, request: Request) -> Response:
        """200 while the daemon serves (its gRPC health, which needs no token), else 503."""
        self.stub  # noqa: B018 - opens the channel
        try:
            answer = await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.details()}, status_code=503)
        return JSONResponse({"status": "ok" if serving else "not serving"}, status_code=200 if serving else 503)

    # ---- answering -------------------------------------------------------------------------------
    async def _answer(self, kind: str, call: Call, request: Request) -> Response:
        metadata = _metadata(request)
        model = await self.model(metadata)
        fresh: str | None = None  # a session opened for this call: closed again unless the call completes
        streams: list[Any] = []
        handed_off = False
        resent = self._resent(kind, call, request, metadata)
        try:
            if call.session_key is not None:
                if kind != "chat":
                    raise bad_request("sessions are for chats")
                fresh = await self._bind(call, metadata)
            if resent is not None:
                started = await unless_gone(request, resent.start(call.requests[0]))
                streams, firsts = [started.stream], [started.first]
            else:
                streams = [self._start(r, metadata) for r in call.requests]
                firsts = await unless_gone(request, self._firsts(streams))
            failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is not None and call.session_key is not None and fresh is None and _expired(failure):
                # The session the name was bound to is gone (closed, expired): a fresh one, transparently.
                for s in streams:
                    s.cancel()
                self.sessions.drop(call.session_key)
                fresh = await self._bind(call, metadata)
                streams = [self._start(r, metadata) for r in call.requests]
                firsts = await unless_gone(request, self._firsts(streams))
                failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is not None:
                if isinstance(failure, grpc.aio.AioRpcError):
                    raise from_cbd(CbdError.from_rpc(failure))
                raise failure
            heads = [f for f in firsts if isinstance(f, pb.GenerateResponse)]
            request_id = heads[0].request_id or uuid.uuid4().hex
            reply = Reply(kind, request_id, int(time.time()), model, call.n, call.logprobs)
            if not call.stream:
                folds = asyncio.gather(*(self._fold(reply, s, f, i * call.n)
                                         for i, (s, f) in enumerate(zip(streams, heads))))  # fmt: skip
                try:
                    await unless_gone(request, folds)
                except grpc.aio.AioRpcError as exc:
                    raise from_cbd(CbdError.from_rpc(exc)) from None
                whole = reply.whole()
                if any(c.get("finish_reason") == FinishReason.ABORT.value for c in whole["choices"]):
                    raise _cancelled_by_daemon()
                self._remember(call, reply, resent)
                fresh = None
                return JSONResponse(whole)
            handed_off = True
            events = self._events(call, reply, streams, heads, fresh, metadata, resent)
            body = settled_when_dropped(events, resent.settle) if resent else events
            return StreamingResponse(noting_gone(body, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        finally:
            if not handed_off:  # refused, failed, or the client went away: nothing may keep running
                for s in streams:
                    s.cancel()
                if fresh is not None:
                    self._abandon(call, fresh, metadata)
                if resent is not None:
                    resent.settle()

    def _resent(self, kind: str, call: Call, request: Request, metadata: list[tuple[str, str]]) -> ResentTurn | None:
        """A stateless chat of one candidate: the turn that may continue its caller's earlier conversation."""
        if kind != "chat" or call.session_key is not None or call.n != 1 or call.messages is None:
            return None
        owner = caller_key(request.headers)
        return ResentTurn(self.resends, owner, self.resends.plan(owner, call.messages), metadata)

    async def _firsts(self, streams: list[Any]) -> list[Any]:
        return await asyncio.gather(*(first(s) for s in streams), return_exceptions=True)

    def _start(self, request: pb.GenerateRequest, metadata: list[tuple[str, str]]) -> Any:
        return self.stub.Generate(
            request, metadata=with_affinity(tuple(metadata), request.session_id), timeout=self.timeout
        )

    @staticmethod
    async def _fold(reply: Reply, stream: Any, first: pb.GenerateResponse, offset: int) -> None:
        reply.add(first, offset)
        async for response in rest(stream):
            reply.add(response, offset)

    async def _events(
        self, call: Call, reply: Reply, streams: list[Any], firsts: list[pb.GenerateResponse], fresh: str | None,
        metadata: list[tuple[str, str]], resent: ResentTurn | None,
    ) -> AsyncGenerator[bytes, None]:  # fmt: skip
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, stream: Any, first: pb.GenerateResponse) -> None:
            await queue.put((i, first))
            try:
                async for response in rest(stream):
                    await queue.put((i, response))
                await queue.put((i, None))
            except grpc.aio.AioRpcError as exc:
                await queue.put((i, exc))

        pumps = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
        open_streams = len(streams)
        completed = False
        try:
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, grpc.aio.AioRpcError):  # after the headers: an error event, then the end
                    yield _sse(from_cbd(CbdError.from_rpc(item)).body())
                    return
                for chunk in reply.add(item, i * call.n):
                    if call.include_usage:  # every chunk has the key; the last one (no choices) its value
                        chunk["usage"] = None
                    cut = [c for c in chunk.get("choices", ()) if c.get("finish_reason") == FinishReason.ABORT.value]
                    for c in cut:  # the daemon cancelled the call (it is shutting down): an error, not a finish
                        c["finish_reason"] = None
                    yield _sse(chunk)
                    if cut:
                        yield _sse(_cancelled_by_daemon().body())
                        return
            if call.include_usage:
                yield _sse(reply.usage_chunk())
            self._remember(call, reply, resent)  # before [DONE]: a client may hang up the moment it sees it
            completed = True
            yield b"data: [DONE]\n\n"
        finally:  # also when the client went away: cancel what still runs (the daemon aborts it)
            for s in streams:
                s.cancel()
            for p in pumps:
                p.cancel()
            if not completed and fresh is not None:
                self._abandon(call, fresh, metadata)
            if resent is not None:
                resent.settle()

    # ---- sessions --------------------------------------------------------------------------------
    async def _bind(self, call: Call, metadata: list[tuple[str, str]]) -> str | None:
        """Make call.requests[0] a turn of the session bound to call.session_key (a new one if needed);
        returns the id of a session opened here (None when the bound one continues)."""
        assert call.session_key is not None and call.messages is not None
        request = call.requests[0]
        bound = self.sessions.get(call.session_key)
        plan = bound.continuation(call.messages) if bound is not None else None
        if plan is None:
            if bound is not None:
                asyncio.ensure_future(self._close(bound.session_id, metadata))
            proposed = uuid.uuid4().hex  # proposed here: a proxy routes the open like every later call
            info = await self._unary(
                self.stub.OpenSession(pb.OpenSessionRequest(session_id=proposed),
                                      metadata=with_affinity(tuple(metadata), proposed), timeout=self.timeout)
            )  # fmt: skip
            session_id, messages, parent, fresh = info.session_id, call.messages, None, info.session_id
        else:
            session_id, (messages, parent), fresh = bound.session_id, plan, None  # type: ignore[union-attr]
        request.session_id = session_id
        del request.chat.messages[:]
        for m in messages:
            message = request.chat.messages.add(
                role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", "")
            )
            for c in m.get("tool_calls") or ():
                message.tool_calls.add(id=c["id"], name=c["name"], arguments=c["arguments"])
        request.ClearField("parent_candidate")
        if parent is not None:
            request.parent_candidate = parent
        return fresh

    def _abandon(self, call: Call, session_id: str, metadata: list[tuple[str, str]]) -> None:
        """A session opened for a call that did not complete: closed, and its name forgotten."""
        if call.session_key is not None:
            self.sessions.drop(call.session_key)
        asyncio.ensure_future(self._close(session_id, metadata))

    async def _close(self, session_id: str, metadata: list[tuple[str, str]]) -> None:
        try:
            await self.stub.CloseSession(
                pb.CloseSessionRequest(session_id=session_id),
                metadata=with_affinity(tuple(metadata), session_id),
                timeout=30,
            )
        except grpc.aio.AioRpcError:
            pass  # already gone

    def _remember(self, call: Call, reply: Reply, resent: ResentTurn | None) -> None:
        if resent is not None:
            resent.completed(chat_message(reply.choices[0].message(), 0))
        if call.session_key is None or call.messages is None:
            return
        replies = [chat_message(reply.choices[i].message(), 0) for i in sorted(reply.choices)]
        self.sessions.bind(call.session_key, call.requests[0].session_id, call.messages, replies)


def _expired(failure: BaseException) -> bool:
    return isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.NOT_FOUND


def _metadata(request: Request) -> list[tuple[str, str]]:
    auth = request.headers.get("authorization")
    return [("authorization", auth)] if auth else []


def _model_card(name: str) -> dict[str, Any]:
    """The served model as OpenAI's and Anthropic's model objects both describe one."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "cbd",
            "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}  # fmt: skip


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _json(request: Request) -> dict[str, Any]:
    """The body as a JSON object within the gateway's limits (limits.py), or a 400/408/413."""
    gateway: Gateway = request.app.state.gateway
    return parse_json(await request.body(), gateway.limits.max_json_depth)


def create_app(
    daemon: str, timeout: float = 600.0, limits: Limits | None = None, store: StoreSettings | None = None
) -> Starlette:
    limits = limits or Limits()
    gateway = Gateway(daemon, timeout, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await gateway.close()

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(request.url.path, exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        """Unknown routes and wrong methods in the API's error shape too."""
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(
            request.url.path, ApiError(exc.status_code, message, kind, headers=dict(exc.headers or {}))
        )

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/models", gateway.models, methods=["GET"]),
            Route("/v1/models/{model:path}", gateway.model_card, methods=["GET"]),
            Route("/health", gateway.health, methods=["GET"]),
            *agent_routes(gateway, store),  # /v1/responses, /v1/messages (agentic/routes.py)
        ],
        exception_handlers={ApiError: on_error, HTTPException: on_http_error},
        middleware=[Middleware(Guard, limits=limits, render=error_response)],
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app


def _cancelled_by_daemon() -> ApiError:
    """A reply the daemon ended before it was complete (it is shutting down): the 503 a call the daemon
    cancelled gets, not a finish reason of the API."""
    return ApiError(503, "the daemon cancelled this call before its reply was complete (it is shutting down); "
                    "retry it", "service_unavailable_error", code="cancelled")  # fmt: skip
