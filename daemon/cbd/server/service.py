"""The Cbd servicer: validate and convert, delegate to the engine, stream results back."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

import grpc

from cbd import allocator
from cbd.engine import api
from cbd.engine.outputs import RequestOutput, merge_outputs
from cbd.engine.sampling_params import (
    PRIORITY_INTERACTIVE,
)
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions.records import (
    RETENTION_NORMAL,
)
from cbd.errors import CbdError, EngineFailure, EngineStopped, InvalidRequest, PermissionDenied
from cbd.ipc.remote import RemoteEngine
from cbd.server import bounds, convert, session_messages, status
from cbd.server.auth import token_name
from cbd.server.chats import ChatLogs
from cbd.server.info import model_info
from cbd.server.info import stats as stats_message
from cbd.server.logs import request_line
from cbd.server.metrics import Metrics, priority_label
from cbd.server.prompts import PromptEncoder
from cbd.server.structured import structure
from cbd.server.tenancy import Caller, in_client_terms, new_session_id, split_key
from cbd.server.turns import submit_turn
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdServicer as _Base

T = TypeVar("T")
# Prompts with more client text than this are tokenized (and chat-rendered) on the prompt threads, not on
# the event loop: a bigger one would hold every stream and health check for milliseconds or more.
INLINE_PROMPT_CHARS = 4096
PROMPT_THREADS = 2


class CbdService(_Base):
    def __init__(
        self,
        metrics: Metrics | None = None,
        tokens: dict[str, bytes] | None = None,
        admin_token_name: str = "",
        stream_interval: int = 1,
        idle_trim_seconds: float = 0.0,
    ) -> None:
        self.engine: RemoteEngine | None = None  # set once the engine process serves
        self.tokens = tokens  # auth tokens by name: a caller's token name is its tenant
        self.admin_token_name = admin_token_name  # the operator's token (server/tenancy.py)
        self.stream_interval = stream_interval  # tokens per message of a batch stream (engine/stream_interval.py)
        self.prompts = PromptEncoder(None)
        self.chats = ChatLogs(None, ())
        # Bounded: at most PROMPT_THREADS prompts are tokenized at once (the tokenizer releases the GIL).
        self.prompt_threads = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="cbd-prompts")
        self.started_at = time.monotonic()
        self.idle_trim = allocator.IdleTrim(idle_trim_seconds)  # the frontend's (app.py runs it)
        self.metrics = metrics or Metrics()
        self.metrics.watch_engine(
            lambda: self.engine.stats() if self.engine else None,
            lambda: self.engine.num_live_requests if self.engine else 0,
            lambda: {"frontend": os.getpid(), **({"engine": self.engine.pid} if self.engine else {})},
            lambda: (
                {
                    "grammar_cache_bytes": self.engine.grammar_cache_bytes,
                    "chat_transcripts": len(self.chats.logs),
                    "idle_trims": self.idle_trim.trims,
                }
                if self.engine
                else {}
            ),
        )

    def attach(self, engine: RemoteEngine) -> None:
        """Serve through `engine`; its callbacks (outputs, expired sessions) run on this event loop."""
        self.prompts = PromptEncoder(engine.tokenizer)
        self.facts = engine.model_facts()
        self.chats = ChatLogs(engine.tokenizer, self.facts.eos_token_ids)
        engine.on_session_expired = self.chats.forget
        self.engine = engine

    def detach(self) -> None:
        self.engine = None

    def _engine(self) -> RemoteEngine:
        if self.engine is None:
            raise EngineStopped("the daemon is warming up or shutting down; retry shortly")
        return self.engine

    def _check_prompt(self, message: pb.GenerateRequest | pb.TokenizeRequest | pb.OpenSessionRequest) -> int:
        """Refuse an over-size prompt before any tokenizing; returns its client text's size."""
        return bounds.check_prompt_size(message, self.facts.max_model_len)

    async def _prompt_work(self, size: int, work: Callable[..., T], *args: object) -> T:
        """Tokenizing or rendering a prompt with `size` characters of client text: inline when small (no
        thread hop, and requests keep their arrival order), else on the prompt threads."""
        if size <= INLINE_PROMPT_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.prompt_threads, work, *args)

    @status.streaming
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        try:  # a request refused before it runs is counted by its status code
            engine = self._engine()
            bounds.check_request_id(request.request_id)
            bounds.check_session_id(request.session_id)
            own_interval = bounds.stream_interval(request)
            prompt_size = self._check_prompt(request)
            caller = self._caller(context)
            # The scheduling tenant: the token's name when auth is on (it wins over the field), else the field.
            tenant = caller.tenant if self.tokens is not None else request.tenant
            # The engine gathers a stream's outputs by its interval (engine/stream_interval.py): a message each.
            params = replace(
                convert.sampling_params(request, tenant), cache_scope=caller.tenant, stream_interval=own_interval,
                batch_stream_interval=self.stream_interval,
            )  # fmt: skip
            structured = structure(request, self.prompts.call_format)
            if structured.spec is not None:  # compiled in a worker process within its budgets; cached by text
                params = replace(params, grammar=await engine.compile_grammar(structured.spec))
            replies = (
                convert.ToolCallReplies(self.prompts.call_format, structured.calls_only, structured.formatted)
                if structured.parse_calls
                else None
            )
            # Unbounded: the engine never waits for a stream; one that fell behind gets what piled up merged.
            outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
            on_output = outputs.put_nowait
            arrived = time.monotonic()
            prompt_tokens: int | None = None  # known here for a plain request; a turn's (history + turn) from its usage
            # Client-chosen request ids live in the caller's namespace (server/tenancy.py); answers carry the client's.
            proposed_id = caller.key(request.request_id) if request.request_id else None
            session_key = caller.key(request.session_id)
            names = ((session_key, request.session_id), (proposed_id or "", request.request_id))
            if request.session_id:
                with in_client_terms(*names):
                    request_id = await submit_turn(
                        engine, self.prompts, self.chats, self._prompt_work, request, session_key, proposed_id, params,
                        on_output, structured.tools, prompt_size,
                    )  # fmt: skip
            elif request.HasField("parent_candidate"):
                raise InvalidRequest("parent_candidate names a candidate of a session's last turn; it needs session_id")
            elif request.HasField("expected_idle_ms") or request.retention:
                raise InvalidRequest("expected_idle_ms and retention are hints about a session; they need session_id")
            elif request.whole_conversation:
                raise InvalidRequest("whole_conversation is a way to continue a session; it needs session_id")
            else:
                prompt = await self._prompt_work(prompt_size, self.prompts.encode, request, structured.tools)
                prompt_tokens = len(prompt)
                with in_client_terms(*names):
                    request_id = engine.submit(prompt, params, proposed_id, on_output)  # makes an id if none
        except CbdError as exc:  # the engine failing (INTERNAL) is not a refusal
            if not isinstance(exc, EngineFailure):
                self.metrics.refused.labels(status.status_of(exc)[0].name).inc()
            raise
        client_request_id = split_key(request_id)[1]
        output: RequestOutput | None = None
        priority = params.priority  # the class it runs in, known for sure from its first output
        waiting_first_token = True
        last_token_at = first_token_at = 0.0
        finishes: set[str] = set()
        try:
            while output is None or not output.finished:
                pending = [await outputs.get()]  # an output (the engine gathers them by the stream interval)
                while not outputs.empty():  # this stream fell behind the engine: what piled up goes as one message
                    pending.append(outputs.get_nowait())
                elapsed = time.monotonic() - arrived
                has_tokens = False
                for out in pending:  # metrics count every engine output, merged or not
                    if out.priority is not None:
                        priority = out.priority
                    for d in out.candidates:
                        has_tokens = has_tokens or bool(d.token_ids)
                        if d.finish_reason is not None:
                            finishes.add(d.finish_reason.value)
                        if d.usage is not None:  # every candidate's names the request's prompt
                            prompt_tokens = d.usage.prompt_tokens
                    self.metrics.observe(out, elapsed)
                if has_tokens:  # latencies are per message: the outputs it gathers reach the client together
                    if waiting_first_token:
                        self.metrics.first_token.labels(priority_label(priority)).observe(elapsed)
                        waiting_first_token = False
                        first_token_at = elapsed
                    else:
                        self.metrics.inter_token.observe(elapsed - last_token_at)
                    last_token_at = elapsed
                output = merge_outputs(pending)
                message = convert.response(output, replies, self.prompts.token_text)
                message.request_id = client_request_id
                yield message
                if output.finished and any(d.finish_reason is FinishReason.ERROR for d in output.candidates):
                    if output.error is not None:  # the request's own doing (a grammar over its mask budget)
                        raise InvalidRequest(output.error)
                    raise EngineFailure("the engine failed while running this request; see the daemon's log")
        finally:
            duration = time.monotonic() - arrived
            completed = output is not None and output.finished
            if not completed:  # cancelled, deadline passed, or the client went away
                engine.abort(request_id)
                self.metrics.cancelled(duration)
            usage = output.usage if completed and output is not None else None
            request_line(
                request_id=client_request_id, session_id=request.session_id or None, n=params.n,
                priority=priority_label(priority), tenant=params.tenant or None,
                outcome="completed" if completed else "cancelled",
                prompt_tokens=usage.prompt_tokens if usage else prompt_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens if usage else None,
                completion_tokens=usage.completion_tokens if usage else None,
                ttft_s=None if waiting_first_token else round(first_token_at, 4),
                duration_s=round(duration, 4), finish_reasons=sorted(finishes) or None,
            )  # fmt: skip

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Who owns what this call creates and what it may name (server/tenancy.py)."""
        if self.tokens is None:
            return Caller("")
        name = token_name(self.tokens, context.invocation_metadata()) or ""
        return Caller(name, admin=bool(self.admin_token_name) and name == self.admin_token_name)

    @status.unary
    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:  # noqa: N802
        engine = self._engine()
        ttl = session_messages.ttl(request.ttl_seconds)
        kind = request.WhichOneof("prefix")
        size = self._check_prompt(request)
        messages, tokens = None, []
        if kind == "chat":
            if request.chat.continue_final_message:
                raise InvalidRequest("continue_final_message is for calls without a session_id")
            messages = self.prompts.messages(request.chat)
            tokens = await self._prompt_work(size, self.prompts.render, messages, False)
        elif kind is not None:
            tokens = await self._prompt_work(size, self.prompts.continuation, request, kind)
        bounds.check_session_id(request.session_id)  # empty: the daemon names it
        client_id = request.session_id or new_session_id()
        key = self._caller(context).key(client_id)
        with in_client_terms((key, client_id)):
            info = await asyncio.wrap_future(
                engine.open_session(
                    ttl,
                    tokens,
                    chat=messages is not None,
                    session_id=key,
                    expected_idle=request.expected_idle_ms / 1000 if request.HasField("expected_idle_ms") else None,
                    retention=session_messages.retention(request.retention) or RETENTION_NORMAL,
                    priority=convert.priority(request.priority) or PRIORITY_INTERACTIVE,
                )  # fmt: skip
            )
        if messages is not None:
            self.chats.open(info.session_id, messages)
        return session_messages.session_info(info)

    @status.unary
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:  # noqa: N802
        engine = self._engine()
        bounds.check_session_id(request.session_id, required=True)
        key = self._caller(context).key(request.session_id, request.tenant)
        try:
            with in_client_terms((key, request.session_id)):
                await asyncio.wrap_future(engine.close_session(key))
        finally:  # closed, unknown, or its caller gone while it closed: the transcript goes either way
            self.chats.forget(key)
        return pb.CloseSessionResponse()

    @status.unary
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:  # noqa: N802
        engine = self._engine()
        bounds.check_session_id(request.session_id, required=True)
        key = self._caller(context).key(request.session_id, request.tenant)
        with in_client_terms((key, request.session_id)):
            return session_messages.session_info(await asyncio.wrap_future(engine.get_session(key)))

    @status.unary
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:  # noqa: N802
        engine = self._engine()
        caller = self._caller(context)
        if request.all_tenants and not caller.admin and self.tokens is not None:  # without auth: one tenant
            raise PermissionDenied("only the admin token may list every tenant's sessions")
        infos = await asyncio.wrap_future(engine.list_sessions())
        mine = [i for i in infos if request.all_tenants or split_key(i.session_id)[0] == caller.tenant]
        return pb.ListSessionsResponse(sessions=[session_messages.session_info(i) for i in mine])

    @status.unary
    async def ForkSession(self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:  # noqa: N802
        engine = self._engine()
        bounds.check_session_id(request.session_id, required=True)
        candidate = request.candidate if request.HasField("candidate") else None
        caller = self._caller(context)
        source = caller.key(request.session_id)  # a fork belongs to its source's owner: the caller
        bounds.check_session_id(request.new_session_id, "new_session_id")  # empty: the daemon names it
        new_id = request.new_session_id or new_session_id()
        fork = caller.key(new_id)
        # Taken before the engine hop: the engine refuses to fork a session with a turn in flight,
        # so the conversation cannot change between this read and the fork. A fork of the new session
        # sent meanwhile finds it too (fork_pending).
        conversation = self.chats.conversation(source, candidate)
        pending = self.chats.fork_pending(fork, conversation) if conversation is not None else None
        try:
            with in_client_terms((source, request.session_id), (fork, new_id)):
                info = await asyncio.wrap_future(
                    engine.fork_session(source, candidate, session_messages.ttl(request.ttl_seconds), fork)
                )
                # A chat this frontend has no transcript of: taken over since (the fork claimed it), so its
                # transcript is its note (asked only here: forks of sessions that are no chats cost no hop).
                if pending is None and info.is_chat:
                    self.chats.restore(await asyncio.wrap_future(engine.ask(api.SessionNote(source))))
                    conversation = self.chats.conversation(source, candidate)
                    pending = self.chats.fork_pending(fork, conversation) if conversation is not None else None
        except BaseException:
            if pending is not None:
                self.chats.fork_refused(fork, pending)
            raise
        if pending is not None:
            self.chats.fork_made(info.session_id, pending)
        return session_messages.session_info(info)

    @status.unary
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:  # noqa: N802
        self._engine()
        size = self._check_prompt(request)
        ids = await self._prompt_work(size, self.prompts.encode, request)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    @status.unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:  # noqa: N802
        engine = self._engine()
        return model_info(self.facts, engine.config, self.prompts)

    @status.unary
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.Stats:  # noqa: N802
        engine = self._engine()
        return stats_message(engine.stats(), engine.num_live_requests, time.monotonic() - self.started_at)
