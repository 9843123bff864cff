"""The engine process's side: an `Engine` served over two sockets to the frontend.

This process's main thread reads commands and hands each to the engine (the same calls the in-process
API makes); the engine thread runs the loop. Everything the engine produces for the frontend (outputs,
answers to commands, expired sessions) goes into one outbox, and the engine thread sends the outbox as
one `Events` message at the end of each turn of its loop: once per step for all requests, never once
per token per request. Candidates without stop strings are not detokenised here (see ipc/text.py).

Requests are admitted by the frontend (its caps, its retry hints); this engine's registry is uncapped.
The process ends after a `Stop` (exit 0) or when the engine stopped on a device error (exit 1), or when
the frontend's sockets go away; it dies with its parent (PR_SET_PDEATHSIG), so it is never orphaned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import zmq

from cbd.config import EngineConfig
from cbd.engine.admission import Admission
from cbd.engine.engine import Engine
from cbd.engine.grammar import GrammarSpec
from cbd.engine.outputs import CandidateDelta, RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions import TurnInput
from cbd.errors import EngineStopped, InvalidRequest, SettingError, UnknownRequest
from cbd.ipc import wire
from cbd.ipc.grammar_loads import GrammarLoads

log = logging.getLogger(__name__)
_HEARTBEAT_EVERY = 0.25  # seconds: an idle loop's heartbeat is sent at most this often


class Outbox:
    """What the engine process owes the frontend, sent as one Events message per turn of the loop."""

    def __init__(self, socket: zmq.Socket, engine: Engine) -> None:
        self._socket = socket
        self._engine = engine
        self._lock = threading.Lock()
        self._outputs: list[RequestOutput] = []
        self._replies: list[wire.Reply] = []
        self._expired: list[str] = []
        self._sent_heartbeat = 0.0

    def output(self, out: RequestOutput) -> None:
        with self._lock:
            self._outputs.append(out)

    def reply(self, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._replies.append(wire.Reply(call_id, value, None if error is None else wire.failure(error)))

    def reply_when_done(self, call_id: int, future: Future) -> None:
        def done(f: Future) -> None:
            exc = f.exception()
            self.reply(call_id, None if exc is not None else f.result(), exc)

        future.add_done_callback(done)

    def expired(self, session_id: str) -> None:
        with self._lock:
            self._expired.append(session_id)

    def flush(self, fatal: BaseException | None = None) -> None:
        """Send what is pending (one thread at a time calls this: the engine thread, or main once it stopped)."""
        heartbeat = self._engine.heartbeat
        with self._lock:
            outputs, replies, expired = self._outputs, self._replies, self._expired
            if not (outputs or replies or expired or fatal) and heartbeat - self._sent_heartbeat < _HEARTBEAT_EVERY:
                return
            self._outputs, self._replies, self._expired = [], [], []
        self._sent_heartbeat = heartbeat
        events = wire.Events(
            outputs, replies, expired, heartbeat, self._engine.stats(), None if fatal is None else wire.failure(fatal)
        )
        self._socket.send(wire.events_encoder.encode(events), copy=False)


class Endpoint:
    """Applies the frontend's commands to the engine (in this process's main thread)."""

    def __init__(self, engine: Engine, outbox: Outbox) -> None:
        self.engine = engine
        self.outbox = outbox
        self.loads = GrammarLoads(engine)
        self._handlers: dict[type, Callable[[Any], None]] = {
            wire.AddRequest: self._add_request, wire.AddTurn: self._add_turn, wire.Abort: self._abort,
            wire.OpenSession: self._open_session, wire.CloseSession: self._close_session,
            wire.GetSession: self._get_session, wire.ListSessions: self._list_sessions,
            wire.ForkSession: self._fork_session,
            wire.TouchSession: self._touch_session, wire.ResetPrefixCache: self._reset_prefix_cache,
        }  # fmt: skip

    def apply(self, command: wire.Command) -> bool:
        """Apply one command; False for Stop."""
        if type(command) is wire.Stop:
            return False
        self._handlers[type(command)](command)
        return True

    def _params(self, values: dict[str, Any], spec: GrammarSpec | None, compiled: str | None) -> SamplingParams:
        params = wire.params_from_wire(values)
        if spec is not None:  # compiled by the frontend's pool; loaded (see GrammarLoads), here a cache hit
            if compiled is None:
                raise InvalidRequest("a grammar reached the engine process without its compiled form")
            params = replace(params, grammar=self.engine.load_grammar(spec, compiled))
        return params

    def _add_request(self, c: wire.AddRequest) -> None:
        if c.grammar is not None and self.loads.must_load(c.grammar):
            self.loads.defer(c.request_id, c.grammar, c.compiled_grammar, lambda: self._start_request(c),
                             lambda: self._end_request(c, FinishReason.ABORT))  # fmt: skip
        else:
            self._start_request(c)

    def _start_request(self, c: wire.AddRequest) -> None:
        try:
            params = self._params(c.params, c.grammar, c.compiled_grammar)
            self.engine.submit(c.prompt, params, c.request_id, self.outbox.output)
        except Exception as exc:  # validated by the frontend; an answer is still owed: the request ends
            reason = FinishReason.ABORT if isinstance(exc, EngineStopped) else FinishReason.ERROR
            if reason is FinishReason.ERROR:
                log.error("request %s could not be added: %s", c.request_id, exc)
            self._end_request(c, reason)

    def _end_request(self, c: wire.AddRequest, reason: FinishReason) -> None:
        n = int(c.params.get("n", 1))
        deltas = [CandidateDelta(i, [], "", None, reason) for i in range(n)]
        self.outbox.output(RequestOutput(c.request_id, deltas, True, None))
        self.engine.nudge()

    def _add_turn(self, c: wire.AddTurn) -> None:
        if (c.grammar is not None and self.loads.must_load(c.grammar)) or self.loads.waiting(c.session_id):
            aborted = UnknownRequest(f"request {c.request_id!r} was aborted before it started")
            self.loads.defer(c.request_id, c.grammar, c.compiled_grammar, lambda: self._start_turn(c),
                             lambda: self._refuse_turn(c, aborted), session_id=c.session_id)  # fmt: skip
        else:
            self._start_turn(c)

    def _refuse_turn(self, c: wire.AddTurn, error: BaseException) -> None:
        self.outbox.reply(c.call_id, error=error)
        self.engine.nudge()

    def _start_turn(self, c: wire.AddTurn) -> None:
        try:
            params = self._params(c.params, c.grammar, c.compiled_grammar)
            turn = TurnInput(c.token_ids, c.replace, c.parent_candidate, c.expected_idle, c.retention, c.extends)
            future = self.engine.submit_turn(
                c.session_id, turn, params, request_id=c.request_id, on_output=self.outbox.output
            )
        except Exception as exc:
            self.outbox.reply(c.call_id, error=exc)
            self.engine.nudge()
            return
        self.outbox.reply_when_done(c.call_id, future)

    def _abort(self, c: wire.Abort) -> None:
        if not self.loads.abort(c.request_id):
            self.engine.abort(c.request_id)

    def _ask(self, call_id: int, ask: Callable[[], Future]) -> None:
        try:
            future = ask()
        except Exception as exc:
            self.outbox.reply(call_id, error=exc)
            self.engine.nudge()
            return
        self.outbox.reply_when_done(call_id, future)

    def _in_order(self, session_id: str, apply: Callable[[], None]) -> None:
        """Apply a session's command now, or behind its turn whose grammar still loads (GrammarLoads)."""
        if not self.loads.after(session_id, apply):
            apply()

    def _open_session(self, c: wire.OpenSession) -> None:
        self._ask(c.call_id, lambda: self.engine.open_session(
            c.ttl, c.token_ids, c.chat, c.session_id, expected_idle=c.expected_idle, retention=c.retention,
            priority=c.priority,
        ))  # fmt: skip

    def _close_session(self, c: wire.CloseSession) -> None:
        self._in_order(c.session_id, lambda: self._ask(c.call_id, lambda: self.engine.close_session(c.session_id)))

    def _get_session(self, c: wire.GetSession) -> None:
        self._in_order(c.session_id, lambda: self._ask(c.call_id, lambda: self.engine.get_session(c.session_id)))

    def _list_sessions(self, c: wire.ListSessions) -> None:
        self._ask(c.call_id, self.engine.list_sessions)

    def _fork_session(self, c: wire.ForkSession) -> None:
        self._in_order(c.session_id, lambda: self._ask(
            c.call_id, lambda: self.engine.fork_session(c.session_id, c.candidate, c.ttl, c.new_session_id)
        ))  # fmt: skip

    def _touch_session(self, c: wire.TouchSession) -> None:
        self._in_order(c.session_id, lambda: self.engine.touch_session(c.session_id))

    def _reset_prefix_cache(self, c: wire.ResetPrefixCache) -> None:
        self.engine.reset_prefix_cache()


def serve(config: EngineConfig, commands_address: str, events_address: str, warmup: bool) -> int:
    """The engine process's body; returns its exit status."""
    context = zmq.Context(1)
    commands = context.socket(zmq.PULL)
    events = context.socket(zmq.PUSH)
    for s in (commands, events):
        s.setsockopt(zmq.LINGER, 5000)  # what is queued at exit still reaches the frontend
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_address)
    events.connect(events_address)
    try:
        engine = _start(config, warmup)
    except BaseException as exc:
        kind = (
            "setting" if isinstance(exc, SettingError)
            else "load" if isinstance(exc, (OSError, ValueError)) else type(exc).__name__
        )  # fmt: skip
        events.send(wire.events_encoder.encode(wire.Hello(None, None, wire.Failure(kind, str(exc)))))
        events.close()
        context.term()
        return 1
    # Hello first: from the moment on_step_end is set, the engine thread owns the socket.
    events.send(wire.events_encoder.encode(wire.Hello(engine.model_facts(), str(engine.loaded.checkpoint_dir))))
    outbox = Outbox(events, engine)
    engine.on_session_expired = outbox.expired
    engine.on_step_end = outbox.flush
    endpoint = Endpoint(engine, outbox)
    status = 0
    try:
        while True:
            if commands.poll(200):
                command = wire.command_decoder.decode(commands.recv(copy=False).buffer)
                if not endpoint.apply(command):
                    break
            if not engine.running:  # the loop stopped by itself: a device error
                status = 1
                break
    finally:
        engine.on_step_end = None
        engine.shutdown()  # what is left ends with ABORT (ERROR after a device error)
        fatal = engine.fatal
        outbox.flush(fatal=fatal)
        status = 1 if fatal is not None else status
        commands.close()
        events.close()
        context.term()
    return status


def _start(config: EngineConfig, warmup: bool) -> Engine:
    engine = Engine(config, admission=Admission.unbounded(), detokenize=False)
    if warmup:
        prompt = [engine.loaded.eos_token_ids[0] if engine.loaded.eos_token_ids else 0] * 4
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return engine
