"""The engine process's commands keep their order around a grammar that is still loading: a later turn or
session command of the same session waits behind the turn whose grammar loads, requests of no session do
not wait, and an Abort that arrives meanwhile ends the loading request without starting it. The engine
here is a recorder whose grammar loads block until the test lets them go."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from cbd.engine import api
from cbd.engine.grammar.matcher import CompiledGrammar, GrammarKind, GrammarSpec
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.ipc.endpoint import Endpoint

SPEC = GrammarSpec(GrammarKind.REGEX, "[a-z]+")
PARAMS = api.WireParams.of(SamplingParams(max_tokens=2))


class _Recorder:
    """Records the engine calls in order; load_grammar blocks until `release` is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        self.loaded: set[GrammarSpec] = set()

    def grammar_cached(self, spec: GrammarSpec) -> bool:
        return spec in self.loaded

    def load_grammar(self, spec: GrammarSpec, serialized: str) -> CompiledGrammar:
        if spec not in self.loaded:
            assert self.release.wait(30)
            self.calls.append("load")
            self.loaded.add(spec)
        return CompiledGrammar(spec, object(), serialized)

    def enqueue(self, prompt: list[int], params: SamplingParams, request_id: str, on_output: Any) -> str:
        self.calls.append(f"submit {request_id}")
        return request_id

    def submit_turn(
        self, session_id: str, turn: Any, params: SamplingParams, *, request_id: str, on_output: Any
    ) -> Future:
        self.calls.append(f"turn {session_id} {request_id}")
        return _done(request_id)

    def ask(self, question: api.Question) -> Future:
        if isinstance(question, api.GetSession):
            self.calls.append(f"get {question.session_id}")
            return _done(question.session_id)
        assert isinstance(question, api.CloseSession)
        self.calls.append(f"close {question.session_id}")
        return _done(True)

    def tell(self, command: api.Tell) -> None:
        assert isinstance(command, api.TouchSession)
        self.calls.append(f"touch {command.session_id}")

    def abort(self, request_id: str) -> None:
        self.calls.append(f"abort {request_id}")

    def nudge(self) -> None:
        pass


class _Outbox:
    def __init__(self) -> None:
        self.replies: dict[int, Any] = {}
        self.outputs: list[RequestOutput] = []

    def output(self, out: RequestOutput) -> None:
        self.outputs.append(out)

    def refuse(self, call_id: int, error: BaseException) -> None:
        self.replies[call_id] = error

    def reply_when_done(self, call_id: int, future: Future, answer: Any) -> None:
        future.add_done_callback(lambda f: self.replies.__setitem__(call_id, f.result()))


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _turn(call_id: int, request_id: str, session_id: str, grammar: GrammarSpec | None) -> api.AddTurn:
    return api.AddTurn(call_id, request_id, session_id, [5, 6], False, None, PARAMS, grammar,
                        compiled_grammar=None if grammar is None else "{}")  # fmt: skip


def _endpoint() -> tuple[Endpoint, _Recorder, _Outbox]:
    engine, outbox = _Recorder(), _Outbox()
    return Endpoint(engine, outbox), engine, outbox  # type: ignore[arg-type]


def _drain(endpoint: Endpoint) -> None:
    endpoint.loads._loader.submit(lambda: None).result(30)  # the loader thread runs its queue in order


def test_a_sessions_later_commands_wait_behind_its_turn_whose_grammar_loads() -> None:
    endpoint, engine, outbox = _endpoint()
    endpoint.apply(_turn(1, "t1", "s", SPEC))  # its grammar loads
    endpoint.apply(_turn(2, "t2", "s", None))  # sent after t1: must not overtake it
    endpoint.apply(api.TouchSession("s"))
    endpoint.apply(api.Ask(3, api.GetSession("s")))
    endpoint.apply(api.Ask(4, api.CloseSession("s")))
    endpoint.apply(api.AddRequest("r", [5, 6], PARAMS, None))  # of no session: starts at once
    endpoint.apply(_turn(5, "u1", "other", None))  # another session: starts at once
    # apply() hands a command that need not wait to the engine at once; the loader is held on engine.release
    assert engine.calls == ["submit r", "turn other u1"]
    engine.release.set()
    _drain(endpoint)
    assert engine.calls == [
        "submit r", "turn other u1", "load", "turn s t1", "turn s t2", "touch s", "get s", "close s",
    ]  # fmt: skip
    assert outbox.replies == {1: "t1", 2: "t2", 3: "s", 4: True, 5: "u1"}
    assert not endpoint.loads.waiting("s")
    endpoint.apply(api.Ask(6, api.GetSession("s")))  # nothing waits any more: applied at once
    assert engine.calls[-1] == "get s" and outbox.replies[6] == "s"


def test_an_abort_while_the_grammar_loads_ends_the_request_and_the_session_goes_on() -> None:
    endpoint, engine, outbox = _endpoint()
    endpoint.apply(api.AddRequest("r", [5, 6], PARAMS, SPEC, "{}"))
    endpoint.apply(_turn(1, "t1", "s", SPEC))
    endpoint.apply(_turn(2, "t2", "s", None))
    endpoint.apply(api.Abort("r"))
    endpoint.apply(api.Abort("t1"))
    engine.release.set()
    _drain(endpoint)
    assert engine.calls == ["load", "turn s t2"]  # neither aborted request reached the engine; no abort owed
    (ended,) = outbox.outputs
    assert ended.request_id == "r" and ended.finished and ended.candidates[0].finish_reason.value == "abort"
    assert "aborted before it started" in str(outbox.replies[1]) and outbox.replies[2] == "t2"
