"""Engine: runs an EngineCore in its own thread behind a thread-safe inbox of typed commands.

Callers use the named methods from any thread (submit, session turns and lifecycle, abort, stats,
model facts); each puts one command (commands.py) in the inbox, and the engine thread applies the
queued commands between steps, so an abort frees the request's blocks before the next step is
scheduled. Answers are plain types, through a Future where the engine thread must compute them.
Outputs are delivered by calling each request's `on_output` in the engine thread: it must be quick
and must not block (the gRPC server hands them to its event loop with call_soon_threadsafe).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from cbd.config import EngineConfig
from cbd.engine import commands as cmd
from cbd.engine.admission import Admission
from cbd.engine.core import EngineCore
from cbd.engine.faults import FaultPlan, is_device_fault
from cbd.engine.live import LiveRequest, OutputCallback
from cbd.engine.outputs import CandidateDelta, EngineStats, ModelFacts, RequestOutput
from cbd.engine.request_stream import Completion, RequestStream
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions import SessionInfo, TurnInput
from cbd.errors import CapacityExceeded, EngineStopped
from cbd.model.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    """The engine thread owns all model work, loading included.

    On CPU this matters: torch's OpenMP runtime gives each thread that runs parallel work its own
    thread team, and with more team threads than cores the teams stop spin-waiting between ops
    (about 20% slower decoding on two cores). Passing `loaded` (a model loaded by the caller's
    thread) works but forfeits that.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.SimpleQueue[cmd.Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        # The one registry of live requests: seats and prompt tokens, capped; ids unique; callbacks.
        self.admission = Admission(self.config.max_queued_requests, self.config.max_queued_tokens)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._tp = None  # rank 0's TensorParallelGroup when tensor_parallel_size > 1
        # The engine loop's last iteration that computed something or had nothing to do (watchdog,
        # health): a wedged step and a loop that can schedule nothing both leave it behind.
        self.heartbeat = time.monotonic()
        self.fatal: BaseException | None = None  # set when a device error stopped the engine
        # Called in the engine thread with the id of each session that expired (the server drops
        # what it keeps beside the session); must be quick.
        self.on_session_expired: Callable[[str], None] | None = None
        self._faults = FaultPlan.from_env()
        self._handlers: dict[type, Callable] = {
            cmd.AddRequest: self._add_request, cmd.AddTurn: self._add_turn, cmd.Abort: self._abort,
            cmd.OpenSession: self._open_session, cmd.CloseSession: self._close_session,
            cmd.GetSession: self._get_session, cmd.ForkSession: self._fork_session,
            cmd.TouchSession: self._touch_session, cmd.ResetPrefixCache: self._reset_prefix_cache,
            cmd.RunInEngine: self._run_in_engine,
        }  # fmt: skip
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="cbd-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def loaded(self) -> LoadedModel:
        return self.core.loaded

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.core.loaded.tokenizer

    # ---- caller side (any thread) --------------------------------------------------------------
    def model_facts(self) -> ModelFacts:
        loaded, weight = self.core.loaded, self.core.loaded.model.embed_tokens.weight
        return ModelFacts(
            name=loaded.name, architecture=loaded.spec.model_type, vocab_size=loaded.spec.vocab_size,
            dtype=str(weight.dtype).removeprefix("torch."), device=str(weight.device),
            max_model_len=self.core.max_model_len, num_kv_blocks=self.core.block_manager.num_blocks,
            block_size=self.config.block_size, eos_token_ids=tuple(loaded.eos_token_ids),
        )  # fmt: skip

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for a request that can never run (reads only configuration)."""
        self.core.validate(prompt_token_ids, params)

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> str:
        """Queue a request. Raises at once: InvalidRequest for one that can never run or whose id is
        taken by a live request, CapacityExceeded when max_queued_requests are live, EngineStopped once
        shutdown has begun."""
        self._check_running()
        self.core.validate(prompt_token_ids, params)
        live = self._reserve(request_id, len(prompt_token_ids), on_output)
        self._send(cmd.AddRequest(live, prompt_token_ids, params))
        return live.request_id

    def submit_turn(
        self,
        session_id: str,
        turn: TurnInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> Future[str]:
        """Queue a turn of a session (see EngineCore.start_turn). The future resolves to the request
        id once the engine thread accepted it, or raises UnknownSession, SessionBusy, InvalidRequest;
        CapacityExceeded and EngineStopped raise at once."""
        try:
            live = self._reserve(request_id, len(turn.token_ids), on_output)
        except CapacityExceeded:  # refused for now; the session must not expire while its client retries
            self._send(cmd.TouchSession(session_id))
            raise
        future: Future[str] = Future()
        # A caller that gives up before the engine thread took the turn cancels the future; the
        # turn never runs, so its reservation must be returned here.
        future.add_done_callback(lambda f: self.admission.release(live.request_id) if f.cancelled() else None)
        self._send(cmd.AddTurn(live, session_id, turn, params, future))
        return future

    def open_session(self, ttl: float | None = None, token_ids: list[int] | None = None, chat: bool = False) -> Future[SessionInfo]:
        """A new session, optionally starting from `token_ids` (a system prompt; `chat`: a rendered
        conversation). ttl None: the configured default; inf: never expires."""
        self._check_running()
        tokens = list(token_ids or [])
        if tokens:
            self.core.validate(tokens + [0], SamplingParams())  # room for at least one more token
        return self._ask(lambda f: cmd.OpenSession(ttl, tokens, chat, f))

    def close_session(self, session_id: str) -> Future[None]:
        return self._ask(lambda f: cmd.CloseSession(session_id, f))

    def get_session(self, session_id: str) -> Future[SessionInfo]:
        return self._ask(lambda f: cmd.GetSession(session_id, f))

    def fork_session(self, session_id: str, candidate: int | None = None, ttl: float | None = None) -> Future[SessionInfo]:
        return self._ask(lambda f: cmd.ForkSession(session_id, candidate, ttl, f))

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Tests and tools: run fn(core) in the engine thread between steps. The server never does."""
        return self._ask(lambda f: cmd.RunInEngine(fn, f))

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        request_id = uuid.uuid4().hex
        stream = RequestStream(request_id, params.n)
        self.submit(prompt_token_ids, params, request_id, stream.put)
        return stream

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Submit every prompt at once and wait for all of them (batch convenience)."""
        streams = [self.stream(p, params) for p in prompts]
        return [s.result() for s in streams]

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still live; its blocks are freed before the next step."""
        self._send(cmd.Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def reset_prefix_cache(self) -> None:
        """Drop every reusable prefix that no live request holds (applied before the next step)."""
        self._send(cmd.ResetPrefixCache())

    @property
    def num_live_requests(self) -> int:
        return self.admission.num_live

    def stalled(self, seconds: float) -> bool:
        """Work is pending but the loop has made no progress for `seconds` (a wedged step or device, or a
        scheduler that can admit nothing)."""
        return self.admission.num_live > 0 and time.monotonic() - self.heartbeat > seconds

    def drain(self, timeout: float) -> bool:
        """Wait until no request is live (True) or timeout seconds pass (False); accepts no new ones."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self.admission.num_live and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.admission.num_live

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; live requests finish with reason ABORT."""
        self._stopping = True
        self._send(cmd.Stop())
        self._thread.join(timeout)

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineStopped("the engine is shutting down")

    def _reserve(self, request_id: str | None, num_tokens: int, on_output: OutputCallback | None) -> LiveRequest:
        self._check_running()
        return self.admission.reserve(request_id or uuid.uuid4().hex, num_tokens, on_output)

    def _send(self, command: cmd.Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _ask(self, make: Callable[[Future], cmd.Command]) -> Future:
        self._check_running()
        future: Future = Future()
        self._send(make(future))
        return future

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self, loaded: LoadedModel | None) -> None:
        try:
            c = self.config
            if c.tensor_parallel_size > 1:
                from cbd.engine.tp_group import TensorParallelGroup

                self._tp = TensorParallelGroup(c)  # spawns ranks 1.. and joins them as rank 0
                loaded = load_model(
                    c.model, c.cache_dir, self._tp.device, c.torch_dtype(), pack_cpu_gemm=c.cpu_packed_gemm,
                    tensor_parallel=(0, c.tensor_parallel_size),
                )  # fmt: skip
            elif loaded is None:
                loaded = load_model(
                    c.model, c.cache_dir, c.torch_device(), c.torch_dtype(), pack_cpu_gemm=c.cpu_packed_gemm
                )
            self.core = EngineCore(loaded, self.config, self._tp, self.admission)
            self.core.warm_up()  # CUDA graphs are captured before the engine reports started
            self._stats = self.core.stats()
        except BaseException as exc:  # handed to the constructor, which re-raises it
            self._start_error = exc
            return
        finally:
            self._started.set()
        self._loop()

    def _loop(self) -> None:
        core = self.core
        next_expiry = 0.0
        progressed = True
        while True:
            if progressed:  # a loop that turns without computing anything is not a heartbeat
                self.heartbeat = time.monotonic()
            if not core.has_work():
                # Sessions expire by time, so an idle engine still wakes now and then.
                self._wake.wait(timeout=1.0 if core.sessions.sessions else None)
            self._wake.clear()
            now = time.monotonic()
            if now >= next_expiry:
                next_expiry = now + 1.0
                for session_id in core.sessions.expire(now):
                    log.info("session %s expired", session_id)
                    if self.on_session_expired is not None:
                        self.on_session_expired(session_id)
            if not self._drain_inbox():
                break
            try:
                if self._faults is not None and core.scheduler.has_work():
                    self._faults.before_step(core.num_steps)
                steps_before = core.num_steps
                outputs = core.step()  # delivered to each request's on_output as they are made
                progressed = bool(outputs) or core.num_steps != steps_before or not core.has_work()
                if not progressed:  # nothing could be scheduled: wait for a change instead of spinning
                    self._wake.wait(timeout=0.005)
            except Exception as exc:
                if is_device_fault(exc):
                    log.critical("device error: failing every live request and stopping the engine: %s", exc)
                    self.fatal = exc
                    self._stopping = True
                    core.fail_all(FinishReason.ERROR)
                    break
                log.exception("engine step failed; failing the requests it held")
                core.fail_all(FinishReason.ERROR)
            self._stats = core.stats()
        core.fail_all(FinishReason.ABORT)
        while True:  # commands that raced with shutdown: answer them rather than leave them hanging
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, cmd.AddRequest):
                self._reject(command.live, command.params.n, FinishReason.ABORT)
            elif isinstance(command, cmd.AddTurn):
                self.admission.release(command.live.request_id)
            future = getattr(command, "future", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine is shutting down"))
        self._stats = core.stats()
        if self._tp is not None:
            self._tp.stop()

    def _drain_inbox(self) -> bool:
        """Apply queued commands in order; False once a Stop arrives."""
        handlers = self._handlers
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if type(command) is cmd.Stop:
                return False
            handlers[type(command)](command)

    def _add_request(self, c: cmd.AddRequest) -> None:
        try:
            self.core.start_request(c.live, c.prompt_token_ids, c.params)
        except Exception as exc:  # submit validated it; this is a bug, but the caller still gets an answer
            log.exception("request %s could not be added: %s", c.live.request_id, exc)
            self._reject(c.live, c.params.n, FinishReason.ERROR)

    def _add_turn(self, c: cmd.AddTurn) -> None:
        if not c.future.set_running_or_notify_cancel():
            return  # the caller gave up; its done-callback released the reservation
        try:
            self.core.start_turn(c.live, c.session_id, c.turn, c.params)
        except BaseException as exc:
            self.admission.release(c.live.request_id)
            c.future.set_exception(exc)
        else:
            c.future.set_result(c.live.request_id)

    def _abort(self, c: cmd.Abort) -> None:
        live = self.admission.get(c.request_id)
        if live is not None and live.request is not None:
            self.core.abort_request(c.request_id)  # delivers the final output itself

    def _open_session(self, c: cmd.OpenSession) -> None:
        sessions = self.core.sessions
        _answer(c.future, lambda: sessions.info(sessions.open(c.ttl, c.token_ids, c.chat)))

    def _close_session(self, c: cmd.CloseSession) -> None:
        _answer(c.future, lambda: self.core.sessions.close(c.session_id))

    def _get_session(self, c: cmd.GetSession) -> None:
        sessions = self.core.sessions
        _answer(c.future, lambda: sessions.info(sessions.get(c.session_id)))

    def _fork_session(self, c: cmd.ForkSession) -> None:
        sessions = self.core.sessions
        _answer(c.future, lambda: sessions.info(sessions.fork(c.session_id, c.candidate, c.ttl)))

    def _touch_session(self, c: cmd.TouchSession) -> None:
        self.core.sessions.touch(c.session_id)

    def _reset_prefix_cache(self, c: cmd.ResetPrefixCache) -> None:
        log.info("prefix cache reset: %d blocks dropped", self.core.block_manager.reset_prefix_cache())

    def _run_in_engine(self, c: cmd.RunInEngine) -> None:
        _answer(c.future, lambda: c.fn(self.core))

    def _reject(self, live: LiveRequest, n: int, reason: FinishReason) -> None:
        """Answer a request that never started: every candidate ends with `reason`."""
        self.admission.release(live.request_id)
        if live.on_output is None:
            return
        deltas = [CandidateDelta(i, [], "", None, reason) for i in range(n)]
        try:
            live.on_output(RequestOutput(live.request_id, deltas, True, None))
        except Exception:
            log.exception("output callback for %s failed", live.request_id)


def _answer(future: Future[T], fn: Callable[[], T]) -> None:
    """Run fn for a command's future unless its caller cancelled it; the future gets the result or the error."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
