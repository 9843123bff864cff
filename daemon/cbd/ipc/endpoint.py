"""The engine process's side: an `Engine` served over two sockets to the frontend.

This process's main thread reads commands and hands each to the engine (the same calls the in-process
API makes); the engine thread runs the loop. Everything the engine produces for the frontend (outputs,
answers to commands, expired sessions) goes into one outbox, and the engine thread sends the outbox as
one `Events` message at the end of each turn of its loop: once per step for all requests, never once
per token per request. Candidates without stop strings are not detokenised here (see ipc/text.py).

Requests are admitted by the frontend (its caps, its retry hints); this engine's registry is uncapped.
The process ends after a `Stop` (exit 0) or when the engine stopped on a device error (exit 1), or when
the frontend's sockets go away; it dies with its parent (PR_SET_PDEATHSIG, once channel.py removed the socket
directory), so it is never orphaned and leaves nothing behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from cbd import gc_heap
from cbd.config import EngineConfig
from cbd.engine import api
from cbd.engine.admission import Admission
from cbd.engine.engine import Engine
from cbd.engine.grammar.matcher import GrammarSpec
from cbd.engine.outputs import RequestOutput, ended
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions.records import TurnInput
from cbd.errors import EngineStopped, InvalidRequest, SettingError, UnknownRequest
from cbd.ipc.channel import EngineChannel
from cbd.ipc.grammar_loads import GrammarLoads

log = logging.getLogger(__name__)
T = TypeVar("T")
_HEARTBEAT_EVERY = 0.25  # seconds: an idle loop's heartbeat is sent at most this often


class Outbox:
    """What the engine process owes the frontend, sent as one Events message per turn of the loop."""

    def __init__(self, socket: zmq.Socket, engine: Engine) -> None:
        self._socket = socket
        self._engine = engine
        self._lock = threading.Lock()
        self._outputs: list[RequestOutput] = []
        self._replies: list[api.Reply] = []
        self._expired: list[str] = []
        self._sent_heartbeat = 0.0

    def output(self, out: RequestOutput) -> None:
        with self._lock:
            self._outputs.append(out)

    def reply(self, reply: api.Reply) -> None:
        with self._lock:
            self._replies.append(reply)

    def refuse(self, call_id: int, error: BaseException) -> None:
        self.reply(api.Refused(call_id, api.failure(error)))

    def reply_when_done(self, call_id: int, future: Future[T], answer: Callable[[int, T], api.Reply]) -> None:
        """Answer with `answer(call_id, result)`, or Refused with the future's error."""

        def done(f: Future[T]) -> None:
            exc = f.exception()
            self.reply(api.Refused(call_id, api.failure(exc)) if exc is not None else answer(call_id, f.result()))

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
        events = api.Events(
            outputs, replies, expired, heartbeat, self._engine.stats(), None if fatal is None else api.failure(fatal)
        )
        self._socket.send(api.events_encoder.encode(events), copy=False)


class Endpoint:
    """Applies the frontend's commands to the engine (in this process's main thread)."""

    def __init__(self, engine: Engine, outbox: Outbox) -> None:
        self.engine = engine
        self.outbox = outbox
        self.loads = GrammarLoads(engine)
        self._handlers: dict[type, Callable[[Any], None]] = {
            api.AddRequest: self._add_request, api.AddTurn: self._add_turn, api.Abort: self._abort,
            api.Ask: self._ask, api.TouchSession: self._tell, api.ResetPrefixCache: self._tell,
        }  # fmt: skip

    def apply(self, command: api.Command) -> bool:
        """Apply one command; False for Stop."""
        if type(command) is api.Stop:
            return False
        self._handlers[type(command)](command)
        return True

    def _params(self, params: api.WireParams, spec: GrammarSpec | None, compiled: str | None) -> SamplingParams:
        if spec is None:
            return params.to_params()
        if compiled is None:  # compiled by the frontend's pool; loaded (see GrammarLoads), here a cache hit
            raise InvalidRequest("a grammar reached the engine process without its compiled form")
        return params.to_params(self.engine.load_grammar(spec, compiled))

    def _add_request(self, c: api.AddRequest) -> None:
        if c.grammar is not None and self.loads.must_load(c.grammar):
            self.loads.defer(c.request_id, c.grammar, c.compiled_grammar, lambda: self._start_request(c),
                             lambda: self._end_request(c, FinishReason.ABORT))  # fmt: skip
        else:
            self._start_request(c)

    def _start_request(self, c: api.AddRequest) -> None:
        try:
            params = self._params(c.params, c.grammar, c.compiled_grammar)
            self.engine.enqueue(c.prompt, params, c.request_id, self.outbox.output)  # validated by the frontend
        except Exception as exc:  # validated by the frontend; an answer is still owed: the request ends
            reason = FinishReason.ABORT if isinstance(exc, EngineStopped) else FinishReason.ERROR
            if reason is FinishReason.ERROR:
                log.error("request %s could not be added: %s", c.request_id, exc)
            self._end_request(c, reason)

    def _end_request(self, c: api.AddRequest, reason: FinishReason) -> None:
        self.outbox.output(ended(c.request_id, c.params.n, reason))
        self.engine.nudge()

    def _add_turn(self, c: api.AddTurn) -> None:
        if (c.grammar is not None and self.loads.must_load(c.grammar)) or self.loads.waiting(c.session_id):
            aborted = UnknownRequest(f"request {c.request_id!r} was aborted before it started")
            self.loads.defer(c.request_id, c.grammar, c.compiled_grammar, lambda: self._start_turn(c),
                             lambda: self._refuse_turn(c, aborted), session_id=c.session_id)  # fmt: skip
        else:
            self._start_turn(c)

    def _refuse_turn(self, c: api.AddTurn, error: BaseException) -> None:
        self.outbox.refuse(c.call_id, error)
        self.engine.nudge()

    def _start_turn(self, c: api.AddTurn) -> None:
        try:
            params = self._params(c.params, c.grammar, c.compiled_grammar)
            turn = TurnInput(c.token_ids, c.replace, c.parent_candidate, c.expected_idle, c.retention, c.extends)
            future = self.engine.submit_turn(
                c.session_id, turn, params, request_id=c.request_id, on_output=self.outbox.output
            )
        except Exception as exc:
            self.outbox.refuse(c.call_id, exc)
            self.engine.nudge()
            return
        self.outbox.reply_when_done(c.call_id, future, api.TurnAccepted)

    def _abort(self, c: api.Abort) -> None:
        if not self.loads.abort(c.request_id):
            self.engine.abort(c.request_id)

    def _ask(self, c: api.Ask) -> None:
        """Any question, answered with its own reply type (api.py); validated by the frontend."""
        question = c.question

        def ask() -> None:
            try:
                future = self.engine.ask(question)
            except Exception as exc:
                self.outbox.refuse(c.call_id, exc)
                self.engine.nudge()
                return
            self.outbox.reply_when_done(c.call_id, future, question.reply)

        self._in_order(question, ask)

    def _tell(self, c: api.Tell) -> None:
        self._in_order(c, lambda: self.engine.tell(c))

    def _in_order(self, command: api.Question | api.Tell, apply: Callable[[], None]) -> None:
        """Apply a command about a session now, or behind its turn whose grammar still loads (GrammarLoads)."""
        if not isinstance(command, api.SESSION_ORDERED) or not self.loads.after(command.session_id, apply):
            apply()


def serve(config: EngineConfig, channel: EngineChannel, warmup: bool) -> int:
    """The engine process's body, on the connected channel (closed here); returns its exit status."""
    commands, events = channel.commands, channel.events
    try:
        engine = _start(config, warmup)
    except BaseException as exc:
        kind = (
            api.ErrorKind.SETTING if isinstance(exc, SettingError)
            else api.ErrorKind.LOAD if isinstance(exc, (OSError, ValueError)) else api.failure(exc).kind
        )  # fmt: skip
        events.send(api.events_encoder.encode(api.Hello(None, None, api.Failure(kind, str(exc)))))
        channel.close()
        return 1
    # Hello first: from the moment on_step_end is set, the engine thread owns the socket.
    events.send(api.events_encoder.encode(api.Hello(engine.model_facts(), str(engine.loaded.checkpoint_dir))))
    outbox = Outbox(events, engine)
    engine.on_session_expired = outbox.expired
    engine.on_step_end = outbox.flush
    endpoint = Endpoint(engine, outbox)
    status = 0
    try:
        while True:
            if commands.poll(200):
                command = api.command_decoder.decode(commands.recv(copy=False).buffer)
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
        channel.close()
    return status


def _start(config: EngineConfig, warmup: bool) -> Engine:
    engine = Engine(config, admission=Admission.unbounded(), detokenize=False)
    if warmup:
        prompt = [engine.loaded.eos_token_ids[0] if engine.loaded.eos_token_ids else 0] * 4
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    log.info("start-up objects kept out of garbage collection: %d", gc_heap.freeze())
    return engine
