"""The frontend's handle on the engine process: the engine's API, over the sockets of api.py.

`RemoteEngine.start` spawns the engine process (engine_process.py), waits for its Hello (the model is
loaded and warm), loads the same tokenizer for the frontend, and from then on reads the engine's
`Events` on the event loop: one message per engine step, demuxed by frontend_requests.py, whose
outputs are handed to each request's `on_output` **on the event loop** (not in another thread).
Requests are admitted there, at once, with no round trip.

If the engine process exits without being asked to (a crash, a kill, a device error), every live
request ends with finish reason ERROR, every pending call fails with EngineFailure, and `fatal` is set:
the daemon then exits non-zero so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import zmq

from cbd.config import EngineConfig
from cbd.engine import api
from cbd.engine.grammar.matcher import CompiledGrammar, GrammarSpec
from cbd.engine.live import OutputCallback
from cbd.engine.outputs import EngineStats, ModelFacts
from cbd.engine.sampling_params import SamplingParams, validate_request, validate_session_prefix
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions.records import RETENTION_NORMAL, SessionInfo, TurnInput
from cbd.errors import CapacityExceeded, EngineFailure, EngineStopped
from cbd.ipc.engine_process import EngineProcess
from cbd.ipc.frontend_requests import FrontendRequests
from cbd.ipc.grammar_pool import CompileBudget, GrammarPool, GrammarSource
from cbd.model.files import expects_tokenizer, import_tokenizer_library, load_tokenizer

log = logging.getLogger(__name__)


class RemoteEngine:
    def __init__(self, config: EngineConfig, process: EngineProcess, hello: api.Hello) -> None:
        if hello.facts is None:
            raise ValueError("a Hello without model facts")
        self.config = config
        self._process = process
        self.facts: ModelFacts = hello.facts
        self.requests = FrontendRequests(config, self.facts.num_kv_blocks)
        self.admission = self.requests.admission
        self._stopping = False  # drain or shutdown began: no new work
        self._stop_sent = False  # the process was asked to exit: its exit is not a failure
        self._grammars: GrammarPool | None = None
        self._reader: asyncio.Task | None = None
        self._closed: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, program: Sequence[str], warmup: bool = True) -> RemoteEngine:
        """Spawn `program` (see EngineProcess.spawn) and wait until it serves. Raises EngineStartFailed."""
        # The tokenizer's library is imported while the engine process starts (its tokenizer is loaded once
        # the engine has said where its checkpoint is); a failed import shows again in load_tokenizer.
        if expects_tokenizer(config.model):
            ahead = asyncio.ensure_future(asyncio.to_thread(import_tokenizer_library, config.model))
            ahead.add_done_callback(lambda f: f.cancelled() or f.exception())
        process, hello = await EngineProcess.spawn(config, program, warmup)
        engine = cls(config, process, hello)
        process.on_exit = engine._on_exit
        if process.exited.done():  # it exited between its Hello and now
            engine._on_exit(process.exited.result())
        try:
            checkpoint = Path(hello.checkpoint_dir or "")
            engine.requests.tokenizer = await asyncio.to_thread(load_tokenizer, checkpoint)
        except BaseException:
            await engine._kill()
            raise
        budget = CompileBudget(
            config.grammar_compile_workers, config.grammar_compile_timeout, config.grammar_compile_memory_mib
        )
        source = GrammarSource(
            checkpoint if engine.tokenizer is not None else None, engine.facts.vocab_size,
            tuple(engine.facts.eos_token_ids),
        )  # fmt: skip
        engine._grammars = GrammarPool(source, budget)
        engine._reader = asyncio.ensure_future(engine._read())
        return engine

    def _on_exit(self, status: int) -> None:
        self._closed = asyncio.ensure_future(self._after_exit(status))

    async def _after_exit(self, status: int) -> None:
        """Read what the process sent before it exited, then end whatever it left unanswered."""
        events = self._process.channel.events
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            with contextlib.suppress(zmq.ZMQError, msgspec.DecodeError):
                while self.fatal is None and await events.poll(100):
                    self.requests.apply(api.events_decoder.decode(await events.recv()))
        if not self._stop_sent and self.fatal is None:
            how = f"signal {-status}" if status < 0 else f"status {status}"
            self.fatal = EngineFailure(f"the engine process exited unexpectedly ({how})")
            log.critical("%s; failing every live request", self.fatal)
        reason = FinishReason.ERROR if self.fatal is not None else FinishReason.ABORT
        self.requests.fail_all(reason, self.fatal or EngineStopped("the engine is shutting down"))
        self._process.channel.close()
        if self._grammars is not None:
            self._grammars.close()

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is live (True) or timeout seconds pass (False); accepts no new ones."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self.admission.num_live and time.monotonic() < deadline and not self._process.exited.done():
            await asyncio.sleep(0.02)
        return not self.admission.num_live

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process (live requests end with ABORT, streamed out) and wait for it to exit."""
        self._stopping = True
        if not self._process.exited.done():
            self._stop_sent = True
            self._process.send(api.Stop())
            try:
                await asyncio.wait_for(asyncio.shield(self._process.exited), timeout)
            except TimeoutError:
                log.error("the engine process did not stop in %.0fs; killing it", timeout)
                await self._kill()
        if self._closed is not None:
            await self._closed

    async def _kill(self) -> None:
        self._stop_sent = True
        await self._process.kill()
        if self._closed is not None:
            await self._closed

    async def _read(self) -> None:
        decode = api.events_decoder.decode
        events = self._process.channel.events
        try:
            while True:
                message = await events.recv(copy=False)
                self.requests.apply(decode(message.buffer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken channel: nothing more can be delivered, so stop the engine too
            log.exception("reading the engine process's events failed")
            self.fatal = EngineFailure(f"the engine channel failed: {type(exc).__name__}: {exc}")
            self._process.kill_now()  # its exit then fails what is live

    # ---- what the server reads ---------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def tokenizer(self) -> Any:
        return self.requests.tokenizer

    @property
    def fatal(self) -> BaseException | None:
        return self.requests.fatal

    @fatal.setter
    def fatal(self, error: BaseException | None) -> None:
        self.requests.fatal = error

    @property
    def heartbeat(self) -> float:
        return self.requests.heartbeat

    @property
    def on_session_expired(self) -> Callable[[str], object] | None:
        return self.requests.on_session_expired

    @on_session_expired.setter
    def on_session_expired(self, callback: Callable[[str], object] | None) -> None:
        self.requests.on_session_expired = callback

    def model_facts(self) -> ModelFacts:
        return self.facts

    def stats(self) -> EngineStats:
        return self.requests.stats

    @property
    def grammar_cache_bytes(self) -> int:
        """Bytes of compile outcomes the frontend's grammar pool keeps."""
        return self._grammars.cached_bytes if self._grammars is not None else 0

    @property
    def num_live_requests(self) -> int:
        return self.admission.num_live

    def stalled(self, seconds: float) -> bool:
        """Work is pending but the engine loop has made no progress for `seconds`."""
        return self.admission.stalled(self.heartbeat, seconds)

    # ---- the engine's API (event loop thread) ----------------------------------------------------
    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile in a worker process of the pool, within its budgets (cached): a bad spec fails with
        InvalidRequest before anything is sent; the compiled form crosses with the request."""
        if self._grammars is None:
            raise EngineStopped("the engine is not serving")
        return await self._grammars.compile(spec)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        f = self.facts
        validate_request(
            prompt_token_ids,
            params,
            f.vocab_size,
            f.max_model_len,
            self.tokenizer is not None,
            self.config.max_num_seqs,
        )

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> str:  # fmt: skip
        """Queue a request; as Engine.submit, but on_output is called on the event loop."""
        self._check_running()
        self.validate(prompt_token_ids, params)
        request_id = self._reserve(request_id, len(prompt_token_ids), params, on_output)
        spec, compiled = api.grammar_to_wire(params.grammar)
        self._process.send(api.AddRequest(request_id, prompt_token_ids, api.WireParams.of(params), spec, compiled))
        return request_id

    def submit_turn(
        self, session_id: str, turn: TurnInput, params: SamplingParams, *, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> Future[str]:  # fmt: skip
        """Queue a turn of a session; as Engine.submit_turn (on_output on the event loop)."""
        try:
            rid = self._reserve(request_id, len(turn.token_ids), params, on_output)
        except CapacityExceeded:  # refused for now; the session must not expire while its client retries
            self.tell(api.TouchSession(session_id))
            raise
        future: Future[str] = Future()

        def answered(reply: api.Reply) -> None:
            if isinstance(reply, api.Refused):
                self.requests.forget(rid)
                if future.set_running_or_notify_cancel():
                    future.set_exception(api.raise_failure(reply.error))
            elif future.set_running_or_notify_cancel():
                future.set_result(rid)

        # A caller that gave up before the answer: the turn may be running by now; abort it (its last
        # output, ABORT, then ends its record here).
        future.add_done_callback(lambda f: self._process.send(api.Abort(rid)) if f.cancelled() else None)
        spec, compiled = api.grammar_to_wire(params.grammar)
        self._process.send(api.AddTurn(
            self.requests.call(answered), rid, session_id, turn.token_ids, turn.replace, turn.parent_candidate,
            api.WireParams.of(params), spec, turn.expected_idle, turn.retention, compiled, turn.extends,
        ))  # fmt: skip
        return future

    def open_session(
        self, ttl: float | None = None, token_ids: list[int] | None = None, chat: bool = False,
        session_id: str | None = None, *, expected_idle: float | None = None, retention: int = RETENTION_NORMAL,
        priority: int = 0,
    ) -> Future[SessionInfo]:  # fmt: skip
        self._check_running()
        tokens = list(token_ids or [])
        if tokens:
            validate_session_prefix(tokens, self.facts.vocab_size, self.facts.max_model_len)
        return self.ask(api.OpenSession(ttl, tokens, chat, session_id, expected_idle, retention, priority))

    def close_session(self, session_id: str) -> Future[None]:
        return self.ask(api.CloseSession(session_id))

    def get_session(self, session_id: str) -> Future[SessionInfo]:
        return self.ask(api.GetSession(session_id))

    def list_sessions(self) -> Future[list[SessionInfo]]:
        return self.ask(api.ListSessions())

    def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None,
        new_session_id: str | None = None,
    ) -> Future[SessionInfo]:  # fmt: skip
        return self.ask(api.ForkSession(session_id, candidate, ttl, new_session_id))

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still live; its blocks are freed before the engine's next step."""
        if request_id in self.requests and not self._process.exited.done():
            self._process.send(api.Abort(request_id))

    def reset_prefix_cache(self) -> None:
        self.tell(api.ResetPrefixCache())

    def ask(self, question: api.Question, draining: bool = False) -> Future[Any]:
        """Any of the API's questions; the future gets the value of its typed reply (SessionReply's info,
        SessionsReply's infos, Done: None) or the error Refused carries. draining: asked after `drain` too
        (saving sessions at shutdown), as long as the engine process runs."""
        if not draining or self.fatal is not None or self._process.exited.done():
            self._check_running()
        future: Future[Any] = Future()

        def answered(reply: api.Reply) -> None:
            if future.set_running_or_notify_cancel():
                if isinstance(reply, api.Refused):
                    future.set_exception(api.raise_failure(reply.error))
                else:
                    future.set_result(reply.value())
            elif isinstance(reply, api.SessionReply):  # its caller gave up: the session it opened is orphaned
                self._process.send(api.Ask(self.requests.call(lambda _: None), api.CloseSession(reply.info.session_id)))

        self._process.send(api.Ask(self.requests.call(answered), question))
        return future

    def tell(self, command: api.Tell) -> None:
        self._process.send(command)

    # ---- internals -------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopping or self.fatal is not None or self._process.exited.done():
            raise EngineStopped("the engine is shutting down")

    def _reserve(
        self, request_id: str | None, num_tokens: int, params: SamplingParams, on_output: OutputCallback | None
    ) -> str:
        self._check_running()
        return self.requests.reserve(request_id or uuid.uuid4().hex, num_tokens, params, on_output)
