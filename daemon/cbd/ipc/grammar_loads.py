"""Requests whose compiled grammar the engine process is still loading, off its command thread.

A grammar crosses serialized (ipc/grammar_pool.py); loading a large one takes up to about a second, so a
request whose grammar is not in the engine's cache yet is started by a loader thread once it is loaded,
and the command thread goes on with other commands meanwhile. An Abort that arrives while the grammar
loads is remembered and the request never starts; one that arrives after it started is the engine's.
The lock is held while a loaded request starts, so an Abort is applied either before (remembered) or
after (the engine knows the request), never in between.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cbd.engine.engine import Engine
from cbd.engine.grammar import GrammarSpec

log = logging.getLogger(__name__)


class GrammarLoads:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="cbd-grammar-load")
        self._lock = threading.Lock()
        self._aborted: dict[str, bool] = {}  # request id -> aborted while its grammar loads

    def must_load(self, spec: GrammarSpec) -> bool:
        return not self._engine.grammar_cached(spec)

    def defer(
        self, request_id: str, spec: GrammarSpec, serialized: str | None, start: Callable[[], None],
        aborted: Callable[[], None],
    ) -> None:  # fmt: skip
        """Load the grammar on the loader thread, then call `start` (or `aborted`, after an Abort)."""
        with self._lock:
            self._aborted[request_id] = False

        def load() -> None:
            if serialized is not None:
                try:
                    self._engine.load_grammar(spec, serialized)
                except Exception as exc:  # `start` takes the grammar again, meets the error, and answers it
                    log.warning("request %s: its grammar could not be loaded: %s", request_id, exc)
            with self._lock:
                if self._aborted.pop(request_id):
                    aborted()
                else:
                    start()

        self._loader.submit(load)

    def abort(self, request_id: str) -> bool:
        """True if the request's grammar is still loading (it will not start)."""
        with self._lock:
            if request_id in self._aborted:
                self._aborted[request_id] = True
                return True
        return False
