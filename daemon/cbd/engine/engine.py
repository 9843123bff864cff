"""Engine: runs an EngineCore in its own thread behind a thread-safe inbox.

Callers submit and abort from any thread; the engine thread applies those commands between steps,
so an abort frees the request's blocks before the next step is scheduled. Outputs are delivered by
calling each request's `on_output` in the engine thread: it must be quick and must not block
(the gRPC server hands them to its event loop with call_soon_threadsafe).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from cbd.config import EngineConfig
from cbd.engine.admission import Admission
from cbd.engine.core import EngineCore
from cbd.engine.faults import FaultPlan, is_device_fault
from cbd.engine.outputs import CandidateDelta, EngineStats, RequestOutput, Usage
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.errors import CapacityExceeded, EngineStopped
from cbd.model.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]
T = TypeVar("T")


@dataclass(slots=True)
class Candidate:
    """One finished candidate, as assembled by RequestStream.result()."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    request_id: str
    candidates: list[Candidate]
    usage: Usage | None


class RequestStream:
    """A submitted request seen from a plain thread: iterate its outputs, or wait for the result."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self._n = n
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    def result(self) -> Completion:
        candidates = [Candidate(i) for i in range(self._n)]
        usage = None
        for output in self:
            for delta in output.candidates:
                c = candidates[delta.index]
                c.token_ids += delta.token_ids
                c.text += delta.text
                c.logprobs += delta.logprobs or []
                c.finish_reason = delta.finish_reason or c.finish_reason
            usage = output.usage
        return Completion(self.request_id, candidates, usage)


class Engine:
    """The engine thread owns all model work, loading included.

    On CPU this matters: torch's OpenMP runtime gives each thread that runs parallel work its own
    thread team, and with more team threads than cores the teams stop spin-waiting between ops
    (about 20% slower decoding on two cores). Passing `loaded` (a model loaded by the caller's
    thread) works but forfeits that.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._callbacks: dict[str, OutputCallback | None] = {}  # live request ids; engine thread only
        # submitted and not yet finished: seats and prompt tokens, capped
        self.admission = Admission(self.config.max_queued_requests, self.config.max_queued_tokens)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._tp = None  # rank 0's TensorParallelGroup when tensor_parallel_size > 1
        # The engine loop's last iteration that computed something or had nothing to do (watchdog,
        # health): a wedged step and a loop that can schedule nothing both leave it behind.
        self.heartbeat = time.monotonic()
        self.fatal: BaseException | None = None  # set when a device error stopped the engine
        self._faults = FaultPlan.from_env()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="cbd-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def loaded(self) -> LoadedModel:
        return self.core.loaded

    # ---- caller side (any thread) --------------------------------------------------------------
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
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self.core.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        self._reserve(request_id, len(prompt_token_ids))
        self._inbox.put(("add", prompt_token_ids, params, request_id, on_output))
        self._wake.set()
        return request_id

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run fn(core) in the engine thread between steps; the future holds its result or exception."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        future: Future[T] = Future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return future

    def submit_turn(
        self,
        session_id: str,
        tokens: list[int],
        params: SamplingParams,
        *,
        replace: bool = False,
        parent_candidate: int | None = None,
        transcript: list[dict] | None = None,
        request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> Future[str]:
        """Queue a turn of a session (see EngineCore.add_session_turn). The future resolves to the
        request id once the engine thread accepted it, or raises UnknownSession, SessionBusy,
        InvalidRequest; CapacityExceeded and EngineStopped raise at once."""
        request_id = request_id or uuid.uuid4().hex
        try:
            self._reserve(request_id, len(tokens))
        except CapacityExceeded:  # refused for now; the session must not expire while its client retries
            self._inbox.put(("call", lambda core: core.sessions.touch(session_id), Future()))
            self._wake.set()
            raise

        def add(core: EngineCore) -> str:
            try:
                core.add_session_turn(
                    session_id, tokens, params, replace=replace, parent_candidate=parent_candidate,
                    transcript=transcript, request_id=request_id,
                )  # fmt: skip
            except BaseException:
                self._release(request_id)
                raise
            self._callbacks[request_id] = on_output
            return request_id

        try:
            future = self.call(add)
        except BaseException:
            self._release(request_id)
            raise
        # A caller that gives up before the engine thread took the turn cancels the future; the
        # turn never runs, so its reservation must be returned here.
        future.add_done_callback(lambda f: self._release(request_id) if f.cancelled() else None)
        return future

    def _reserve(self, request_id: str, num_tokens: int) -> None:
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self.admission.reserve(request_id, num_tokens)

    def _release(self, request_id: str) -> None:
        self.admission.release(request_id)

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
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def reset_prefix_cache(self) -> None:
        """Drop every reusable prefix that no live request holds (applied before the next step)."""
        self._inbox.put(("reset_prefix_cache",))
        self._wake.set()

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
        self._inbox.put(("stop",))
        self._wake.set()
        self._thread.join(timeout)

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
            self.core = EngineCore(loaded, self.config, self._tp)
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
            if not self._drain_inbox():
                break
            try:
                if self._faults is not None and core.scheduler.has_work():
                    self._faults.before_step(core.num_steps)
                steps_before = core.num_steps
                outputs = core.step()
                progressed = bool(outputs) or core.num_steps != steps_before or not core.has_work()
                if not progressed:  # nothing could be scheduled: wait for a change instead of spinning
                    self._wake.wait(timeout=0.005)
            except Exception as exc:
                if is_device_fault(exc):
                    log.critical("device error: failing every live request and stopping the engine: %s", exc)
                    self.fatal = exc
                    self._stopping = True
                    self._deliver(core.fail_all(FinishReason.ERROR))
                    break
                log.exception("engine step failed; failing the requests it held")
                outputs = core.fail_all(FinishReason.ERROR)
            self._stats = core.stats()
            self._deliver(outputs)
        self._deliver(core.fail_all(FinishReason.ABORT))
        while True:  # requests that raced with shutdown: answer them rather than leave them hanging
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(EngineStopped("the engine is shutting down"))
            if command[0] == "add":
                self._callbacks[command[3]] = command[4]
                self._reject(command[3], command[2].n, FinishReason.ABORT)
        self._stats = core.stats()
        if self._tp is not None:
            self._tp.stop()

    def _drain_inbox(self) -> bool:
        """Apply queued commands; False once a stop command arrives."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if command[0] == "stop":
                return False
            if command[0] == "add":
                _, prompt, params, request_id, on_output = command
                self._callbacks[request_id] = on_output
                try:
                    self.core.add_request(prompt, params, request_id)
                except Exception as exc:  # submit validated it; this is a bug, but the caller still gets an answer
                    log.exception("request %s could not be added: %s", request_id, exc)
                    self._reject(request_id, params.n, FinishReason.ERROR)
            elif command[0] == "call":
                _, fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.core))
                    except BaseException as exc:
                        future.set_exception(exc)
            elif command[0] == "reset_prefix_cache":
                log.info("prefix cache reset: %d blocks dropped", self.core.block_manager.reset_prefix_cache())
            elif command[0] == "abort" and command[1] in self.core.requests:
                self._deliver([self.core.abort_request(command[1])])

    def _reject(self, request_id: str, n: int, reason: FinishReason) -> None:
        deltas = [CandidateDelta(i, [], "", None, reason) for i in range(n)]
        self._deliver([RequestOutput(request_id, deltas, True, None)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.request_id not in self._callbacks:
                continue
            callback = self._callbacks[output.request_id]
            if output.finished:
                del self._callbacks[output.request_id]
                self._release(output.request_id)
            if callback is None:
                continue
            try:
                callback(output)
            except Exception:
                log.exception("output callback for %s failed", output.request_id)
