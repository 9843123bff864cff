"""The frontend's handle on the engine process: the engine's API, over the sockets of wire.py.

`RemoteEngine.start` spawns the engine process, waits for its Hello (the model is loaded and warm),
loads the same tokenizer for the frontend, and from then on reads the engine's `Events` on the event
loop: one message per engine step, whose outputs are handed to each request's `on_output` **on the
event loop** (not in another thread). Requests are admitted here (caps and retry hints, at once, with
no round trip); the record of a request lives until its last output arrives. The text of candidates
without stop strings is made here (text.py).

If the engine process exits without being asked to (a crash, a kill, a device error), every live
request ends with finish reason ERROR, every pending call fails with EngineFailure, and `fatal` is set:
the daemon then exits non-zero so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from cbd.config import EngineConfig
from cbd.engine.admission import Admission
from cbd.engine.grammar import CompiledGrammar, GrammarSpec, LazyGrammarCompiler
from cbd.engine.live import OutputCallback
from cbd.engine.outputs import CandidateDelta, EngineStats, ModelFacts, RequestOutput
from cbd.engine.sampling_params import PRIORITY_BATCH, SamplingParams, validate_request, validate_session_prefix
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions import RETENTION_NORMAL, SessionInfo, TurnInput
from cbd.errors import CapacityExceeded, EngineFailure, EngineStopped
from cbd.ipc import wire
from cbd.ipc.grammar_pool import CompileBudget, GrammarPool
from cbd.ipc.text import RequestText
from cbd.model.loader import load_tokenizer

log = logging.getLogger(__name__)
_Answer = Callable[[Any, BaseException | None], None]


class EngineStartFailed(Exception):
    """The engine process could not start. kind: "load" (the model could not be read as configured),
    "setting" (a setting that cannot work on this host), or another failure's name."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class _Request:
    on_output: OutputCallback | None
    n: int
    text: RequestText | None
    done: set[int]  # candidates that ended


class RemoteEngine:
    def __init__(
        self, config: EngineConfig, process: subprocess.Popen, context: zmq.asyncio.Context,
        commands: zmq.asyncio.Socket, events: zmq.asyncio.Socket, directory: str,
    ) -> None:  # fmt: skip
        self.config = config
        self._process = process
        self._context = context
        self._commands = commands
        self._events = events
        self._directory = directory
        self.facts: ModelFacts
        self.tokenizer: Any = None
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens, config.batch_queue_share)
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, _Answer] = {}
        self._call_ids = itertools.count()
        self._stats: EngineStats
        self.heartbeat = time.monotonic()
        self.fatal: BaseException | None = None
        self.on_session_expired: Callable[[str], object] | None = None
        self._stopping = False  # drain or shutdown began: no new work
        self._stop_sent = False  # the process was asked to exit: its exit is not a failure
        self._grammars: GrammarPool | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task | None = None
        self._closed: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, program: Sequence[str], warmup: bool = True) -> RemoteEngine:
        """Spawn `program` (the engine process's entry, which takes --commands, --events, --config-json,
        --warmup/--no-warmup and --parent) and wait until it serves. Raises EngineStartFailed."""
        directory = tempfile.mkdtemp(prefix="cbd-engine-")  # 0700: only this user can reach the sockets
        commands_address, events_address = f"ipc://{directory}/commands", f"ipc://{directory}/events"
        context = zmq.asyncio.Context(1)
        commands, events = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        for s in (commands, events):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        commands.bind(commands_address)
        events.bind(events_address)
        argv = [
            *program, "--commands", commands_address, "--events", events_address,
            "--config-json", msgspec.json.encode(config).decode(), "--warmup" if warmup else "--no-warmup", "--parent", str(os.getpid()),
        ]  # fmt: skip
        process = subprocess.Popen(argv, start_new_session=False)
        engine = cls(config, process, context, commands, events, directory)
        engine._watch_exit()
        try:
            await engine._hello()
        except BaseException:
            await engine._kill()
            raise
        return engine

    async def _hello(self) -> None:
        receive: asyncio.Future[bytes] = asyncio.ensure_future(self._events.recv())
        exited: asyncio.Future[Any] = self._exited
        await asyncio.wait([receive, exited], return_when=asyncio.FIRST_COMPLETED)
        if not receive.done():
            receive.cancel()
            raise EngineStartFailed(
                f"the engine process exited with status {self._exited.result()} while starting", "exited"
            )
        hello = wire.hello_decoder.decode(receive.result())
        if hello.error is not None or hello.facts is None:
            error = hello.error or wire.Failure("EngineFailure", "no model facts")
            raise EngineStartFailed(error.message, error.kind)
        self.facts = hello.facts
        blocks = self.facts.num_kv_blocks
        self._stats = EngineStats(0, 0, blocks, 0, blocks, 0, 0, 0, 0)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, Path(hello.checkpoint_dir or ""))
        budget = CompileBudget(
            self.config.grammar_compile_workers, self.config.grammar_compile_timeout,
            self.config.grammar_compile_memory_mib,
        )  # fmt: skip
        compiler = LazyGrammarCompiler(self.tokenizer, self.facts.vocab_size, self.facts.eos_token_ids)
        self._grammars = GrammarPool(compiler, budget)
        self._reader = asyncio.ensure_future(self._read())

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self._process.pid)
        except (AttributeError, OSError):  # no pidfd: poll

            async def poll() -> None:
                while self._process.poll() is None:
                    await asyncio.sleep(0.1)
                self._on_exit()

            asyncio.ensure_future(poll())
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._process.wait()
            self._on_exit()

        loop.add_reader(pidfd, readable)

    def _on_exit(self) -> None:
        status = self._process.returncode
        if not self._exited.done():
            self._exited.set_result(status)
        self._closed = asyncio.ensure_future(self._after_exit(status))

    async def _after_exit(self, status: int) -> None:
        """Read what the process sent before it exited, then end whatever it left unanswered."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            with contextlib.suppress(zmq.ZMQError, msgspec.DecodeError):
                while self.fatal is None and await self._events.poll(100):
                    self._apply(wire.events_decoder.decode(await self._events.recv()))
        if not self._stop_sent and self.fatal is None:
            how = f"signal {-status}" if status < 0 else f"status {status}"
            self.fatal = EngineFailure(f"the engine process exited unexpectedly ({how})")
            log.critical("%s; failing every live request", self.fatal)
        self._fail_all(FinishReason.ERROR if self.fatal is not None else FinishReason.ABORT)
        self._close_sockets()
        if self._grammars is not None:
            self._grammars.close()

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is live (True) or timeout seconds pass (False); accepts no new ones."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self.admission.num_live and time.monotonic() < deadline and not self._exited.done():
            await asyncio.sleep(0.02)
        return not self.admission.num_live

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process (live requests end with ABORT, streamed out) and wait for it to exit."""
        self._stopping = True
        if not self._exited.done():
            self._stop_sent = True
            self._send(wire.Stop())
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout)
            except TimeoutError:
                log.error("the engine process did not stop in %.0fs; killing it", timeout)
                await self._kill()
        if self._closed is not None:
            await self._closed

    async def _kill(self) -> None:
        self._stop_sent = True
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        await asyncio.shield(self._exited)
        if self._closed is not None:
            await self._closed

    def _close_sockets(self) -> None:
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._context.term()
        shutil.rmtree(self._directory, ignore_errors=True)

    # ---- the engine's API (event loop thread) ----------------------------------------------------
    @property
    def pid(self) -> int:
        return self._process.pid

    def model_facts(self) -> ModelFacts:
        return self.facts

    def stats(self) -> EngineStats:
        return self._stats

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

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile in a worker process of the pool, within its budgets (cached): a bad spec fails with
        InvalidRequest before anything is sent; the compiled form crosses with the request."""
        if self._grammars is None:
            raise EngineStopped("the engine is not serving")
        return await self._grammars.compile(spec)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        f = self.facts
        validate_request(prompt_token_ids, params, f.vocab_size, f.max_model_len, self.tokenizer is not None)

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> str:  # fmt: skip
        """Queue a request; as Engine.submit, but on_output is called on the event loop."""
        self._check_running()
        self.validate(prompt_token_ids, params)
        request_id = self._reserve(request_id, len(prompt_token_ids), params, on_output)
        spec, compiled = wire.grammar_to_wire(params.grammar)
        self._send(wire.AddRequest(request_id, prompt_token_ids, wire.params_to_wire(params), spec, compiled))
        return request_id

    def submit_turn(
        self, session_id: str, turn: TurnInput, params: SamplingParams, *, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> Future[str]:  # fmt: skip
        """Queue a turn of a session; as Engine.submit_turn (on_output on the event loop)."""
        try:
            request_id = self._reserve(request_id, len(turn.token_ids), params, on_output)
        except CapacityExceeded:  # refused for now; the session must not expire while its client retries
            self._send(wire.TouchSession(session_id))
            raise
        future: Future[str] = Future()
        rid = request_id

        def answered(value: Any, error: BaseException | None) -> None:
            if error is not None:
                self._forget(rid)
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)
            elif future.set_running_or_notify_cancel():
                future.set_result(rid)

        # A caller that gave up before the answer: the turn may be running by now; abort it (its last
        # output, ABORT, then ends its record here).
        future.add_done_callback(lambda f: self._send(wire.Abort(rid)) if f.cancelled() else None)
        spec, compiled = wire.grammar_to_wire(params.grammar)
        call_id = self._call(answered)
        self._send(wire.AddTurn(
            call_id, rid, session_id, turn.token_ids, turn.replace, turn.parent_candidate,
            wire.params_to_wire(params), spec, turn.expected_idle, turn.retention, compiled, turn.extends,
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
        return self._ask(
            lambda call_id: wire.OpenSession(call_id, ttl, tokens, chat, session_id, expected_idle, retention, priority)
        )

    def close_session(self, session_id: str) -> Future[None]:
        return self._ask(lambda call_id: wire.CloseSession(call_id, session_id))

    def get_session(self, session_id: str) -> Future[SessionInfo]:
        return self._ask(lambda call_id: wire.GetSession(call_id, session_id))

    def list_sessions(self) -> Future[list[SessionInfo]]:
        return self._ask(lambda call_id: wire.ListSessions(call_id))

    def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None,
        new_session_id: str | None = None,
    ) -> Future[SessionInfo]:  # fmt: skip
        return self._ask(lambda call_id: wire.ForkSession(call_id, session_id, candidate, ttl, new_session_id))

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still live; its blocks are freed before the engine's next step."""
        if request_id in self._requests and not self._exited.done():
            self._send(wire.Abort(request_id))

    def reset_prefix_cache(self) -> None:
        self._send(wire.ResetPrefixCache())

    # ---- internals -------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopping or self.fatal is not None or self._exited.done():
            raise EngineStopped("the engine is shutting down")

    def _reserve(
        self, request_id: str | None, num_tokens: int, params: SamplingParams, on_output: OutputCallback | None
    ) -> str:
        self._check_running()
        live = self.admission.reserve(
            request_id or uuid.uuid4().hex, num_tokens, batch=params.priority == PRIORITY_BATCH
        )
        self._requests[live.request_id] = _Request(
            on_output, params.n, RequestText.for_request(self.tokenizer, params), set()
        )
        return live.request_id

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.admission.release(request_id)

    def _send(self, command: wire.Command) -> None:
        if not self._exited.done():
            self._commands.send(wire.command_encoder.encode(command), copy=False)

    def _call(self, answer: _Answer) -> int:
        call_id = next(self._call_ids)
        self._calls[call_id] = answer
        return call_id

    def _ask(self, make: Callable[[int], wire.Command]) -> Future:
        self._check_running()
        future: Future = Future()

        def answered(value: Any, error: BaseException | None) -> None:
            if future.set_running_or_notify_cancel():
                future.set_exception(error) if error is not None else future.set_result(value)
            elif isinstance(value, SessionInfo):  # its caller gave up: the session it opened would be orphaned
                self._send(wire.CloseSession(self._call(lambda *_: None), value.session_id))

        self._send(make(self._call(answered)))
        return future

    async def _read(self) -> None:
        decode = wire.events_decoder.decode
        try:
            while True:
                message = await self._events.recv(copy=False)
                self._apply(decode(message.buffer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken channel: nothing more can be delivered, so stop the engine too
            log.exception("reading the engine process's events failed")
            self.fatal = EngineFailure(f"the engine channel failed: {type(exc).__name__}: {exc}")
            if self._process.poll() is None:
                self._process.send_signal(signal.SIGKILL)  # its exit then fails what is live

    def _apply(self, events: wire.Events) -> None:
        self.heartbeat = events.heartbeat
        if events.stats is not None:
            self._stats = events.stats
        for reply in events.replies:
            answer = self._calls.pop(reply.call_id, None)
            if answer is not None:
                answer(reply.value, None if reply.error is None else wire.raise_failure(reply.error))
        for session_id in events.expired:
            if self.on_session_expired is not None:
                try:
                    self.on_session_expired(session_id)
                except Exception:
                    log.exception("session-expired callback failed")
        requests = self._requests
        for out in events.outputs:
            record = requests.get(out.request_id)
            if record is None:
                continue
            if record.text is not None:
                try:
                    record.text.fill(out)
                except Exception:  # the tokenizer failed on these ids: the text is lost, the tokens are not
                    log.exception("detokenising an output of %s failed", out.request_id)
            for d in out.candidates:
                if d.finish_reason is not None:
                    record.done.add(d.index)
            if out.finished:
                del requests[out.request_id]
                self.admission.release(out.request_id)
            self._deliver(record, out)
        if events.fatal is not None and self.fatal is None:
            self.fatal = EngineFailure(f"the engine stopped: {events.fatal.message}")
            log.critical("%s", self.fatal)

    def _deliver(self, record: _Request, out: RequestOutput) -> None:
        if record.on_output is not None:
            try:
                record.on_output(out)
            except Exception:
                log.exception("output callback for %s failed", out.request_id)

    def _fail_all(self, reason: FinishReason) -> None:
        """End every request and call the engine process left unanswered (it is gone)."""
        error = self.fatal or EngineStopped("the engine is shutting down")
        calls, self._calls = self._calls, {}
        for answer in calls.values():
            answer(None, error)
        requests, self._requests = self._requests, {}
        for request_id, record in requests.items():
            self.admission.release(request_id)
            deltas = [CandidateDelta(i, [], "", None, reason) for i in range(record.n) if i not in record.done]
            self._deliver(record, RequestOutput(request_id, deltas, True, None))
