"""Starting an agent API turn on a resident cbd session, with the fallbacks that keep it an answer.

A turn is planned as "continue this live session with these new messages" (the history is already in
its KV: only the new messages are prefilled), "fork this session and continue the fork" (a branch from an
earlier point, kept as a snapshot session: KV shared copy-on-write), or "the whole conversation". A
continuation may first fork its session into a snapshot of the history it continues, so that a later
branch from that point is a fork too. The continuation and the fork fall back to the whole conversation
on a fresh session when the session is gone (closed, expired, the daemon restarted: NOT_FOUND) or busy
with another turn (FAILED_PRECONDITION). A continuation found by the text of a resent conversation
(`Plan.whole`) sends the whole conversation and lets the daemon confirm it by tokens
(GenerateRequest.whole_conversation): the session's history must be exactly a token prefix of the
conversation's rendering, so the prompt is token for token the one a fresh session would get; when it
is not (ABORTED) the session is closed (`Plan.dropped`) and the conversation starts fresh. A fresh
session falls back to a plain call without one when the daemon has no room for another session
(RESOURCE_EXHAUSTED). Every fallback costs only the prefill the session would have saved, never an
error. A turn that is refused, fails or is abandoned leaves a continued session as it was (the daemon's
rule); a session opened for it is closed again by the caller (`Turns.close`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.requests import Request

from cbd.gateway.errors import from_cbd
from cbd.gateway.limits import parse_json
from cbd.gateway.requests import checked
from cbd.gateway.streams import first
from cbd_client.calls import set_prompt
from cbd_client.errors import CbdError
from cbd_client.routing import fork_session_id, with_affinity
from cbd_client.v1 import cbd_pb2 as pb

_FALL_BACK = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)


@dataclass(slots=True)
class Plan:
    messages: list[dict[str, Any]]  # the whole conversation, normalised chat messages
    session_id: str | None = None  # a live session whose history is a prefix of `messages`
    new_messages: list[dict[str, Any]] = field(default_factory=list)  # what follows that history
    keep: bool = True  # run a fresh conversation on a new session (False: a plain call)
    # Before the turn on session_id: fork it into a session of this id, a snapshot of the history the turn
    # continues (a later branch from that point forks the snapshot; None: no snapshot)
    snapshot: str | None = None
    # Instead of continuing session_id: fork this session (a snapshot) and take the turn on the fork
    fork_from: str | None = None
    # Continue session_id with the whole conversation, checked by the daemon token for token (see above)
    whole: bool = False
    dropped: bool = False  # set by Turns.start: session_id did not hold a token prefix and was closed
    ttl_seconds: float = 0.0  # of a new session; 0: the daemon's default
    # The affinity key of a new session's id (`<affinity>.<suffix>`) and of a plain call: conversations
    # sharing it reach the same replica (Responses' prompt_cache_key); None: the session's own id
    affinity: str | None = None
    retention: pb.Retention = pb.RETENTION_UNSPECIFIED
    # The last message is the start of the reply, which the call continues (a plain call: Chat's
    # continue_final_message)
    continue_final: bool = False


@dataclass(slots=True)
class Started:
    """A turn the daemon accepted (its first message read)."""

    stream: Any
    first: pb.GenerateResponse
    session_id: str | None  # the session it runs on (None: a plain call)
    opened: bool  # the session was opened for this turn
    continued: bool  # it continues Plan.session_id

    def cancel(self) -> None:
        self.stream.cancel()


class Turns:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway  # app.Gateway: its channel (stub) and call timeout
        self._closing: set[asyncio.Future[Any]] = set()

    async def start(self, template: pb.GenerateRequest, plan: Plan, metadata: list[tuple[str, str]]) -> Started:
        if plan.fork_from is not None and plan.new_messages:
            forked = await self._fork(plan.fork_from, fork_session_id(plan.fork_from), metadata)
            if forked is not None:
                try:
                    stream, first = await self._generate(template, plan.new_messages, forked, plan, metadata)
                    return Started(stream, first, forked, True, True)
                except grpc.aio.AioRpcError as exc:
                    self.close(forked, metadata)
                    if exc.code() not in _FALL_BACK:
                        raise from_cbd(CbdError.from_rpc(exc)) from None
        if plan.session_id is not None and plan.new_messages:
            if plan.snapshot is not None:
                await self._fork(plan.session_id, plan.snapshot, metadata)
            sent = plan.messages if plan.whole else plan.new_messages
            try:
                stream, first = await self._generate(template, sent, plan.session_id, plan, metadata)
                return Started(stream, first, plan.session_id, False, True)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _FALL_BACK:
                    raise from_cbd(CbdError.from_rpc(exc)) from None
                if exc.code() == grpc.StatusCode.ABORTED:  # not a token prefix: no resend will continue it
                    plan.dropped = True
                    self.close(plan.session_id, metadata)
        session_id = await self._open(plan, metadata) if plan.keep else None
        try:
            stream, first = await self._generate(template, plan.messages, session_id, plan, metadata)
        except grpc.aio.AioRpcError as exc:
            if session_id is not None:
                self.close(session_id, metadata)
            raise from_cbd(CbdError.from_rpc(exc)) from None
        except BaseException:
            if session_id is not None:
                self.close(session_id, metadata)
            raise
        return Started(stream, first, session_id, session_id is not None, False)

    async def _fork(self, source: str, proposed: str, metadata: list[tuple[str, str]]) -> str | None:
        """A fork of `source` (KV shared copy-on-write) with the proposed id; None where the daemon cannot
        make it (the source is gone or busy, no room for a session): the caller falls back."""
        request = pb.ForkSessionRequest(session_id=source, new_session_id=proposed)
        try:
            info = await self.gateway.stub.ForkSession(
                request, metadata=with_affinity(tuple(metadata), source), timeout=self.gateway.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (*_FALL_BACK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS):
                return None
            raise from_cbd(CbdError.from_rpc(exc)) from None
        return str(info.session_id)

    async def _open(self, plan: Plan, metadata: list[tuple[str, str]]) -> str | None:
        # proposed here: a proxy routes the open like every later call
        proposed = f"{plan.affinity}.{uuid.uuid4().hex[:16]}" if plan.affinity else uuid.uuid4().hex
        request = pb.OpenSessionRequest(session_id=proposed, ttl_seconds=plan.ttl_seconds, retention=plan.retention)
        try:
            info = await self.gateway.stub.OpenSession(
                request, metadata=with_affinity(tuple(metadata), proposed), timeout=self.gateway.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # no room for another session: a plain call
            raise from_cbd(CbdError.from_rpc(exc)) from None
        return str(info.session_id)

    async def _generate(
        self, template: pb.GenerateRequest, messages: list[dict[str, Any]], session_id: str | None, plan: Plan,
        metadata: list[tuple[str, str]],
    ) -> tuple[Any, pb.GenerateResponse]:  # fmt: skip
        request = pb.GenerateRequest()
        request.CopyFrom(template)
        request.ClearField("input")
        checked(lambda: set_prompt(request, messages))
        if plan.continue_final:
            request.chat.continue_final_message = True
        if session_id is not None:
            request.session_id = session_id
            request.retention = plan.retention
            request.whole_conversation = plan.whole and session_id == plan.session_id
        stream = self.gateway.stub.Generate(
            request, metadata=with_affinity(tuple(metadata), session_id or plan.affinity), timeout=self.gateway.timeout
        )
        try:
            return stream, await first(stream)
        except BaseException:
            stream.cancel()
            raise

    def close(self, session_id: str, metadata: list[tuple[str, str]]) -> None:
        """Close a session in the background (a session already gone is fine)."""
        task = asyncio.ensure_future(self._close(session_id, metadata))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, session_id: str, metadata: list[tuple[str, str]]) -> None:
        try:
            await self.gateway.stub.CloseSession(
                pb.CloseSessionRequest(session_id=session_id),
                metadata=with_affinity(tuple(metadata), session_id), timeout=30,
            )  # fmt: skip
        except grpc.aio.AioRpcError:
            pass  # already gone: closing is idempotent here


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object within the gateway's limits (limits.py), or a 400/408/413."""
    return parse_json(await request.body(), request.app.state.gateway.limits.max_json_depth)
