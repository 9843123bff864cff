"""Requests whose compiled grammar the engine process is still loading, off its command thread.

A grammar crosses serialized (ipc/grammar_pool.py); loading a large one takes up to about a second, so a
request whose grammar is not in the engine's cache yet is started by a loader thread once it is loaded,
and the command thread goes on with other commands meanwhile. An Abort that arrives while the grammar
loads is remembered and the request never starts; one that arrives after it started is the engine's.
The lock is held while a loaded request starts, so an Abort is applied either before (remembered) or
after (the engine knows the request), never in between.

Order within a session: while a turn of a session waits here, every later command naming that session
(a turn without a grammar, close, fork, get, touch) waits behind it on the same loader thread, so the
session sees its commands in the order the frontend sent them (a later turn never overtakes a turn whose
grammar loads). Requests without a session are not ordered with anything and start at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cbd.engine.engine import Engine
from cbd.engine.grammar.matcher import GrammarSpec

log = logging.getLogger(__name__)


class GrammarLoads:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="cbd-grammar-load")
        self._lock = threading.Lock()
        self._aborted: dict[str, bool] = {}  # request id -> aborted while its grammar loads
        self._waiting: dict[str, int] = {}  # session id -> its commands queued on the loader thread

    def must_load(self, spec: GrammarSpec) -> bool:
        return not self._engine.grammar_cached(spec)

    def waiting(self, session_id: str) -> bool:
        """Whether a command of this session waits on the loader thread (later ones must queue behind it)."""
        with self._lock:
            return session_id in self._waiting

    def defer(
        self, request_id: str, spec: GrammarSpec | None, serialized: str | None, start: Callable[[], None],
        aborted: Callable[[], None], session_id: str | None = None,
    ) -> None:  # fmt: skip
        """Load the grammar (if any) on the loader thread, then call `start` (or `aborted`, after an Abort)."""
        with self._lock:
            self._aborted[request_id] = False
            self._enter(session_id)

        def load() -> None:
            if spec is not None and serialized is not None:
                try:
                    self._engine.load_grammar(spec, serialized)
                except Exception as exc:  # `start` takes the grammar again, meets the error, and answers it
                    log.warning("request %s: its grammar could not be loaded: %s", request_id, exc)
            with self._lock:
                try:
                    if self._aborted.pop(request_id):
                        aborted()
                    else:
                        start()
                finally:
                    self._leave(session_id)

        self._loader.submit(load)

    def after(self, session_id: str, apply: Callable[[], None]) -> bool:
        """Queue `apply` behind the session's waiting commands; False (nothing queued) if none waits."""
        with self._lock:
            if session_id not in self._waiting:
                return False
            self._enter(session_id)

        def run() -> None:
            with self._lock:
                try:
                    apply()
                finally:
                    self._leave(session_id)

        self._loader.submit(run)
        return True

    def _enter(self, session_id: str | None) -> None:
        if session_id is not None:
            self._waiting[session_id] = self._waiting.get(session_id, 0) + 1

    def _leave(self, session_id: str | None) -> None:
        if session_id is not None:
            left = self._waiting.pop(session_id) - 1
            if left:
                self._waiting[session_id] = left

    def abort(self, request_id: str) -> bool:
        """True if the request's grammar is still loading (it will not start)."""
        with self._lock:
            if request_id in self._aborted:
                self._aborted[request_id] = True
                return True
        return False
