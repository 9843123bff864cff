"""Engine: runs an EngineCore in its own thread behind a thread-safe inbox of typed commands.

Callers use the methods from any thread (submit, session turns, `ask` with any of the API's questions
and `tell` with its tells, abort, stats, model facts); each puts one command (inbox.py) in the inbox, and
the engine thread applies the queued commands between steps, so an abort frees the request's blocks
before the next step is scheduled. Answers come through a Future, of the type the question's reply
declares (api.py). The named session methods validate what they can here, then ask.
Outputs are delivered by calling each request's `on_output` in the engine thread: it must be quick
and must not block (the gRPC server hands them to its event loop with call_soon_threadsafe).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from cbd.config import EngineConfig
from cbd.engine import api
from cbd.engine import inbox as cmd
from cbd.engine.admission import Admission
from cbd.engine.core import EngineCore
from cbd.engine.engine_loop import EngineLoop
from cbd.engine.grammar.matcher import CompiledGrammar, GrammarSpec, LazyGrammarCompiler
from cbd.engine.live import LiveRequest, OutputCallback
from cbd.engine.outputs import EngineStats, ModelFacts
from cbd.engine.request_stream import Completion, RequestStream
from cbd.engine.sampling_params import PRIORITY_BATCH, SamplingParams, validate_session_prefix
from cbd.engine.sessions.records import RETENTION_NORMAL, SessionInfo, TurnInput
from cbd.errors import CapacityExceeded, EngineStopped
from cbd.model.loader import LoadedModel

T = TypeVar("T")


class Engine:
    """The engine thread owns all model work, loading included.

    On CPU this matters: torch's OpenMP runtime gives each thread that runs parallel work its own
    thread team, and with more team threads than cores the teams stop spin-waiting between ops
    (about 20% slower decoding on two cores). Passing `loaded` (a model loaded by the caller's
    thread) works but forfeits that.
    """

    def __init__(
        self, config: EngineConfig | None = None, loaded: LoadedModel | None = None, *,
        admission: Admission | None = None, detokenize: bool = True,
    ) -> None:  # fmt: skip
        """admission: the registry of live requests (default: capped by the config's max_queued_*); an
        engine whose caller admits requests itself passes Admission.unbounded(). detokenize: see
        OutputProcessor (False: only candidates with stop strings are detokenised in the engine thread)."""
        self.config = config or EngineConfig()
        self._inbox: queue.SimpleQueue[cmd.Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        # The one registry of live requests: seats and prompt tokens, capped; ids unique; callbacks.
        self.admission = admission or Admission(
            self.config.max_queued_requests, self.config.max_queued_tokens, self.config.batch_queue_share
        )
        self._loop = EngineLoop(self.config, self.admission, self._inbox, self._wake, detokenize)
        self._thread = threading.Thread(target=self._loop.run, args=(loaded,), name="cbd-engine", daemon=True)
        self._thread.start()
        self._loop.started.wait()
        if self._loop.start_error is not None:
            raise self._loop.start_error
        self.core = self._loop.core  # tests and tools; the server never touches it
        loaded = self.core.loaded
        self._grammars = LazyGrammarCompiler(loaded.tokenizer, loaded.spec.vocab_size, tuple(loaded.eos_token_ids))

    @property
    def loaded(self) -> LoadedModel:
        return self.core.loaded

    @property
    def heartbeat(self) -> float:
        """When the engine loop last computed something or had nothing to do (watchdog, health)."""
        return self._loop.heartbeat

    @property
    def fatal(self) -> BaseException | None:
        """The device error that stopped the engine, if one did."""
        return self._loop.fatal

    @property
    def on_session_expired(self) -> Callable[[str], object] | None:
        """Called in the engine thread with the id of each session that expired (the server drops what
        it keeps beside the session); must be quick."""
        return self._loop.on_session_expired

    @on_session_expired.setter
    def on_session_expired(self, callback: Callable[[str], object] | None) -> None:
        self._loop.on_session_expired = callback

    @property
    def on_step_end(self) -> Callable[[], object] | None:
        """Called in the engine thread after each turn of the loop has delivered its outputs (and once
        when the loop stops): one batch of outputs is complete then. Must be quick."""
        return self._loop.on_step_end

    @on_step_end.setter
    def on_step_end(self, callback: Callable[[], object] | None) -> None:
        self._loop.on_step_end = callback

    def nudge(self) -> None:
        """Make the loop turn once (and so call on_step_end) even when it has nothing to compute."""
        self._wake.set()

    @property
    def running(self) -> bool:
        """The engine thread is alive (False once it stopped, after shutdown or a device error)."""
        return self._thread.is_alive()

    @property
    def tokenizer(self):
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

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec` against this model's tokenizer, from a cache keyed by the spec's
        text. Thread-safe; meant for a worker thread (the request waits, not the batch). Raises
        InvalidRequest for a spec the grammar library rejects, or a model without a tokenizer."""
        return self._grammars.compile(spec)

    def load_grammar(self, spec: GrammarSpec, serialized: str) -> CompiledGrammar:
        """A grammar compiled elsewhere (the frontend's compile pool), from its serialized form; cached
        by spec like compile_grammar. Thread-safe; takes a while for a large grammar (off the command thread)."""
        return self._grammars.load(spec, serialized)

    def grammar_cached(self, spec: GrammarSpec) -> bool:
        return self._grammars.cached(spec)

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
        return self.enqueue(prompt_token_ids, params, request_id, on_output)

    def enqueue(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> str:  # fmt: skip
        """Queue a request its caller validated (validate() or the same rule with this model's facts: the
        engine process's frontend did), so that a request is validated once. Raises as submit does."""
        live = self._reserve(request_id, len(prompt_token_ids), on_output, params)
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
            live = self._reserve(request_id, len(turn.token_ids), on_output, params)
        except CapacityExceeded:  # refused for now; the session must not expire while its client retries
            self._send(api.TouchSession(session_id))
            raise
        future: Future[str] = Future()
        # A caller that gives up before the engine thread took the turn cancels the future; the
        # turn never runs, so its reservation must be returned here.
        future.add_done_callback(lambda f: self.admission.release(live.request_id) if f.cancelled() else None)
        self._send(cmd.AddTurn(live, session_id, turn, params, future))
        return future

    def open_session(
        self, ttl: float | None = None, token_ids: list[int] | None = None, chat: bool = False,
        session_id: str | None = None, *, expected_idle: float | None = None, retention: int = RETENTION_NORMAL,
        priority: int = 0,
    ) -> Future[SessionInfo]:  # fmt: skip
        """A new session, optionally starting from `token_ids` (a system prompt; `chat`: a rendered
        conversation). ttl None: the configured default; inf: never expires. session_id: the id the caller
        proposes (InvalidRequest if malformed, SessionExists if open); None: one is made. expected_idle
        (seconds until the first turn) and retention: hints for the order in which idle KV leaves the GPU;
        priority: the class its turns are scheduled in unless a turn says otherwise."""
        self._check_running()
        tokens = list(token_ids or [])
        if tokens:
            validate_session_prefix(tokens, self.core.loaded.spec.vocab_size, self.core.max_model_len)
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

    def touch_session(self, session_id: str) -> None:
        """The session's client is still there: its idle TTL starts over."""
        self.tell(api.TouchSession(session_id))

    def ask(self, question: api.Question) -> Future[Any]:
        """Any of the API's questions; the future gets its answer or the error that refused it."""
        return self._ask(lambda f: cmd.Asked(question, f))

    def tell(self, command: api.Tell) -> None:
        self._send(command)

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
        self._send(api.Abort(request_id))

    def stats(self) -> EngineStats:
        return replace(
            self._loop.stats, grammar_cache_bytes=self._grammars.cached_bytes, num_idle_trims=self._loop.idle_trims
        )

    def reset_prefix_cache(self) -> None:
        """Drop every reusable prefix that no live request holds (applied before the next step)."""
        self._send(api.ResetPrefixCache())

    @property
    def num_live_requests(self) -> int:
        return self.admission.num_live

    def stalled(self, seconds: float) -> bool:
        """Work is pending but the loop has made no progress for `seconds` (a wedged step or device, or a
        scheduler that can admit nothing)."""
        return self.admission.stalled(self.heartbeat, seconds)

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
        self._send(api.Stop())
        self._thread.join(timeout)

    def _check_running(self) -> None:
        if self._stopping or self._loop.fatal is not None:
            raise EngineStopped("the engine is shutting down")

    def _reserve(
        self, request_id: str | None, num_tokens: int, on_output: OutputCallback | None, params: SamplingParams
    ) -> LiveRequest:
        self._check_running()
        batch = params.priority == PRIORITY_BATCH
        return self.admission.reserve(request_id or uuid.uuid4().hex, num_tokens, on_output, batch)

    def _send(self, command: cmd.Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _ask(self, make: Callable[[Future], cmd.Command]) -> Future:
        self._check_running()
        future: Future = Future()
        self._send(make(future))
        return future
