"""The engine thread: applies the inbox's typed commands between steps and runs the core's steps.

Every command is dispatched by type to one handler here: the API's questions (api.py) through
`_questions`, which answers each with its result or its error, the rest through `_handlers`. Outputs reach each request's callback
through its live record when the loop calls `core.deliver()`: after a step, only once the stats
snapshot has been refreshed (a caller that saw its request finish then reads stats without it). Besides
steps, the loop expires idle sessions once a second (it wakes for that even when idle), keeps the
heartbeat that the daemon's watchdog and health read, and gives the heap's free pages back once it has
been idle for `idle_trim_seconds` after work (cbd/allocator.py).

A turn or fork of a session whose KV is still only in its file (restored at start) starts reading it
back on the disk tier's reader thread and waits, with every later command about that session, in
`_deferred` until the read has ended; meanwhile the loop goes on stepping the batch. Idle, the loop
reads restored sessions back ahead of their turns while the host tier has room
(sessions/read_back.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cbd.allocator import IdleTrim
from cbd.config import EngineConfig
from cbd.engine import api
from cbd.engine import inbox as cmd
from cbd.engine.admission import Admission
from cbd.engine.core import EngineCore
from cbd.engine.core_share import CoreShare
from cbd.engine.faults import FaultPlan, is_device_fault
from cbd.engine.live import LiveRequest
from cbd.engine.outputs import EngineStats, SaveReport, ended
from cbd.engine.sequence import FinishReason
from cbd.engine.sessions.checkpoints import SessionCheckpoints
from cbd.engine.sessions.records import SessionInfo
from cbd.engine.step_phases import DELIVER, INTAKE
from cbd.errors import EngineStopped
from cbd.lifetime import name_os_thread
from cbd.model.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    def __init__(
        self, config: EngineConfig, admission: Admission, inbox: queue.SimpleQueue[cmd.Command],
        wake: threading.Event, detokenize: bool = True,
    ) -> None:  # fmt: skip
        self.config = config
        self.detokenize = detokenize
        self.admission = admission
        self._inbox = inbox
        self._wake = wake
        self.core: EngineCore
        self.stats: EngineStats
        self.started = threading.Event()
        self.start_error: BaseException | None = None
        self._tp: Any = None  # rank 0's TensorParallelGroup when tensor_parallel_size > 1
        # The loop's last iteration that computed something or had nothing to do (watchdog, health):
        # a wedged step and a loop that can schedule nothing both leave it behind.
        self.heartbeat = time.monotonic()
        self.fatal: BaseException | None = None  # set when a device error stopped the engine
        self.on_session_expired: Callable[[str], object] | None = None
        # Called in the engine thread at the end of every turn of the loop (after its outputs were
        # delivered) and once more when the loop has stopped: where a batch of outputs is complete.
        self.on_step_end: Callable[[], object] | None = None
        self._faults = FaultPlan.from_env()
        self._trim = IdleTrim(config.idle_trim_seconds)
        self._cores: CoreShare | None = None  # adapts the CPU thread count (num_threads 0 on CPU)
        self._deferred: dict[str, list[cmd.Command]] = {}  # session key -> its commands waiting for its KV
        self._handlers: dict[type, Callable[[Any], None]] = {
            cmd.AddRequest: self._add_request, cmd.AddTurn: self._add_turn, cmd.Asked: self._asked,
            cmd.RunInEngine: self._run_in_engine, api.Abort: self._abort, api.TouchSession: self._touch_session,
            api.ResetPrefixCache: self._reset_prefix_cache,
        }  # fmt: skip
        self._questions: dict[type, Callable[[Any], Any]] = {
            api.OpenSession: self._open_session, api.CloseSession: self._close_session,
            api.GetSession: self._get_session, api.ListSessions: self._list_sessions,
            api.ForkSession: self._fork_session, api.SaveSessions: self._save_sessions,
            api.SavedNotes: self._saved_notes, api.SessionNote: self._session_note,
        }  # fmt: skip

    def run(self, loaded: LoadedModel | None) -> None:
        """The thread's body: load (or take) the model, warm up, then loop until a Stop command."""
        name_os_thread("cbd-engine")
        try:
            c = self.config
            if c.tensor_parallel_size > 1:
                from cbd.engine.device.tp_group import TensorParallelGroup

                self._tp = TensorParallelGroup(c)  # spawns ranks 1.. and joins them as rank 0
                loaded = load_model(
                    c.model, c.cache_dir, self._tp.device, c.torch_dtype(), pack_cpu_gemm=c.cpu_packed_gemm,
                    tensor_parallel=(0, c.tensor_parallel_size),
                )  # fmt: skip
            elif loaded is None:
                loaded = load_model(
                    c.model, c.cache_dir, c.torch_device(), c.torch_dtype(), pack_cpu_gemm=c.cpu_packed_gemm
                )
            self.core = EngineCore(loaded, self.config, self._tp, self.admission, self.detokenize)
            self.core.warm_up()  # CUDA graphs are captured before the engine reports started
            if self.core.checkpoints is not None:  # saved sessions are listed before the engine reports started
                self.core.checkpoints.restore()
                self.core.checkpoints.loads.on_loaded = self._wake.set
            self.stats = self.core.stats()
            if c.num_threads == 0 and c.tensor_parallel_size == 1 and self.core.runner.device.type == "cpu":
                self._cores = CoreShare(os.sched_getaffinity(0), (os.getpid(), os.getppid()))
        except BaseException as exc:  # handed to the Engine's constructor, which re-raises it
            self.start_error = exc
            return
        finally:
            self.started.set()
        self._loop()

    @property
    def idle_trims(self) -> int:
        """Heap trims after idle periods so far (read from any thread)."""
        return self._trim.trims

    def _loop(self) -> None:
        core = self.core
        next_expiry = 0.0
        progressed = True
        while True:
            if progressed:  # a loop that turns without computing anything is not a heartbeat
                self.heartbeat = time.monotonic()
            if not core.has_work():
                # Sessions expire by time, so an idle engine still wakes now and then; so does a trim due.
                trims = self._trim.trims
                # With session files, sessions due back are read ahead (ReadBack.prefetch): a look twice a second.
                every = 0.5 if core.checkpoints is not None else 1.0
                waits = [w for w in (every if core.sessions.sessions else None, self._trim.poll()) if w is not None]
                if self._trim.trims == trims:  # after a trim, one more turn reports it before the wait
                    self._wake.wait(timeout=min(waits) if waits else None)
            else:
                self._trim.busy()
                if self._cores is not None:
                    self._cores.adapt()
            self._wake.clear()
            core.phases.start()
            now = time.monotonic()
            if now >= next_expiry:
                next_expiry = now + 1.0
                for session_id in core.sessions.expire(now):
                    log.info("session %s expired", session_id)
                    if self.on_session_expired is not None:
                        self.on_session_expired(session_id)
            if not self._drain_inbox():
                break
            if core.checkpoints is not None:
                self._read_back(core.checkpoints)
            core.phases.lap(INTAKE)
            ran = False
            try:
                if self._faults is not None and core.scheduler.has_work():
                    self._faults.before_step(core.num_steps)
                steps_before = core.num_steps
                outputs = core.step()
                ran = bool(outputs) or core.num_steps != steps_before
                progressed = ran or not core.has_work()
                if not progressed:  # nothing could be scheduled: wait for a change instead of spinning
                    self._wake.wait(timeout=0.005)
            except Exception as exc:
                if is_device_fault(exc):
                    log.critical("device error: failing every live request and stopping the engine: %s", exc)
                    self.fatal = exc  # the Engine refuses new work from now on
                    core.fail_all(FinishReason.ERROR)
                    core.deliver()
                    break
                log.exception("engine step failed; failing the requests it held")
                core.fail_all(FinishReason.ERROR)
            self.stats = core.stats()
            core.deliver()
            self._step_end()
            core.phases.lap(DELIVER)
            core.phases.end_step(ran)
        core.fail_all(FinishReason.ABORT)
        core.deliver()
        left = [c for commands in self._deferred.values() for c in commands]
        self._deferred.clear()
        while True:  # commands that raced with shutdown: answer them rather than leave them hanging
            try:
                left.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in left:
            if isinstance(command, cmd.AddRequest):
                self._reject(command.live, command.params.n, FinishReason.ABORT)
            elif isinstance(command, cmd.AddTurn):
                self.admission.release(command.live.request_id)
            future = getattr(command, "future", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine is shutting down"))
        if core.checkpoints is not None:
            core.checkpoints.disk.close()  # writes queued before the Stop complete
        self.stats = core.stats()
        self._step_end()
        if self._tp is not None:
            self._tp.stop()

    def _step_end(self) -> None:
        if self.on_step_end is not None:
            try:
                self.on_step_end()
            except Exception:
                log.exception("step-end hook failed")

    def _drain_inbox(self) -> bool:
        """Apply queued commands in order; False once a Stop arrives."""
        handlers = self._handlers
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if type(command) is api.Stop:
                return False
            key = self._waits_for_kv(command)
            if key is not None:
                self._deferred.setdefault(key, []).append(command)
                continue
            handlers[type(command)](command)

    def _waits_for_kv(self, command: cmd.Command) -> str | None:
        """The session whose KV reading back `command` waits for (starting it if needed), or None."""
        checkpoints = self.core.checkpoints
        if checkpoints is None:
            return None
        if isinstance(command, cmd.AddTurn):
            key = command.session_id
        elif isinstance(command, cmd.Asked) and isinstance(command.question, api.SESSION_ORDERED):
            key = command.question.session_id
        elif isinstance(command, api.TouchSession):
            key = command.session_id
        else:
            return None
        if key in self._deferred:  # behind its session's earlier commands
            return key
        uses_kv = isinstance(command, cmd.AddTurn) or (
            isinstance(command, cmd.Asked) and isinstance(command.question, api.ForkSession)
        )
        if uses_kv and checkpoints.loads.needs_load(key):
            checkpoints.loads.start_load(key)
            return key
        return None

    def _read_back(self, checkpoints: SessionCheckpoints) -> None:
        """Apply the commands of sessions whose KV has been read back; start reading the next one ahead."""
        for key in checkpoints.loads.completed():
            for command in self._deferred.pop(key, []):
                self._handlers[type(command)](command)
        checkpoints.loads.prefetch(lambda key: key in self._deferred)

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

    def _abort(self, c: api.Abort) -> None:
        live = self.admission.get(c.request_id)
        if live is not None and live.request is not None:
            self.core.abort_request(c.request_id)
            self.core.deliver()

    def _asked(self, c: cmd.Asked) -> None:
        _answer(c.future, lambda: self._questions[type(c.question)](c.question))

    def _open_session(self, q: api.OpenSession) -> SessionInfo:
        sessions = self.core.sessions
        return sessions.info(
            sessions.open(q.ttl, q.token_ids, q.chat, q.session_id, q.expected_idle, q.retention, q.priority)
        )

    def _close_session(self, q: api.CloseSession) -> None:
        self.core.sessions.close(q.session_id)

    def _get_session(self, q: api.GetSession) -> SessionInfo:
        return self.core.sessions.info(self.core.sessions.get(q.session_id))

    def _list_sessions(self, q: api.ListSessions) -> list[SessionInfo]:
        return [self.core.sessions.info(s) for s in self.core.sessions.sessions.values()]

    def _fork_session(self, q: api.ForkSession) -> SessionInfo:
        sessions = self.core.sessions
        return sessions.info(sessions.fork(q.session_id, q.candidate, q.ttl, q.new_session_id))

    def _save_sessions(self, q: api.SaveSessions) -> SaveReport:
        checkpoints = self.core.checkpoints
        if checkpoints is None:
            return SaveReport()
        checkpoints.take_notes(q.notes)
        if q.seconds is not None:
            return checkpoints.save_all(q.seconds)
        return SaveReport(num_saved=checkpoints.save_idle(q.idle_for))

    def _saved_notes(self, q: api.SavedNotes) -> dict[str, bytes]:
        return self.core.checkpoints.notes() if self.core.checkpoints is not None else {}

    def _session_note(self, q: api.SessionNote) -> dict[str, bytes]:
        return self.core.checkpoints.notes(q.session_id) if self.core.checkpoints is not None else {}

    def _touch_session(self, c: api.TouchSession) -> None:
        self.core.sessions.touch(c.session_id)

    def _reset_prefix_cache(self, c: api.ResetPrefixCache) -> None:
        log.info("prefix cache reset: %d blocks dropped", self.core.block_manager.reset_prefix_cache())

    def _run_in_engine(self, c: cmd.RunInEngine) -> None:
        _answer(c.future, lambda: c.fn(self.core))

    def _reject(self, live: LiveRequest, n: int, reason: FinishReason) -> None:
        """Answer a request that never started: every candidate ends with `reason`."""
        self.admission.release(live.request_id)
        if live.on_output is None:
            return
        try:
            live.on_output(ended(live.request_id, n, reason))
        except Exception:
            log.exception("output callback for %s failed", live.request_id)


def _answer(future: Future[T], fn: Callable[[], T]) -> None:
    """Run fn for a command's future unless its caller cancelled it; the future gets the result or the error."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
