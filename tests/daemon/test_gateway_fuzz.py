"""Property-based fuzzing of the OpenAI-compatible API through a real `cbd openai` in front of a real
daemon (embedded model): chat and completions bodies, valid and not (wrong types, deep nesting, lone
surrogates, huge numbers, unknown fields). Every answer must be a success or an API-shaped error below
500, and afterwards the daemon holds no live request. CBD_GATEWAY_FUZZ_EXAMPLES sets the count."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cbd_client import Client  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from gateway_process import GatewayProcess  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("CBD_GATEWAY_FUZZ_EXAMPLES", "60"))

_huge = st.sampled_from([2**31, 2**33, 2**63, 2**64, 10**30, -(2**63), 10**400])
_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), _huge, st.floats(allow_nan=True),
                  st.text(max_size=8), st.sampled_from(["\ud800", "a\udfffb"]), st.just([]), st.just({}),
                  st.just([{"x": 1}]))  # fmt: skip
_text = st.one_of(st.text(max_size=24), st.sampled_from(["Name a fruit.", "\ud800", "", "x" * 300]))


DEEP = "__deep__"  # a placeholder, spliced into the body's text as that many nested arrays (see _text_of)


def _text_of(body: dict[str, Any]) -> bytes:
    """The body as JSON text (lone surrogates as \\ud800 escapes, huge integers as digits) with deep nests."""
    text = json.dumps(body)
    for depth in (70, 5000):
        text = text.replace(f'"{DEEP}{depth}"', "[" * depth + '{"k": 1}' + "]" * depth)
    return text.encode()


def _maybe(draw: Any, value: Any, junk: float = 0.15) -> Any:
    """`value`, or (now and then) something of the wrong shape in its place."""
    return draw(_junk) if draw(st.floats(0, 1)) < junk else value


@st.composite
def _tool_call(draw: Any) -> Any:
    function = _maybe(draw, {"name": _maybe(draw, "get_weather"), "arguments": _maybe(draw, '{"city": "Paris"}')})
    return _maybe(draw, {"id": _maybe(draw, "call_1"), "type": "function", "function": function})


@st.composite
def _message(draw: Any) -> Any:
    role = draw(st.sampled_from(["user", "user", "system", "developer", "assistant", "tool", "wizard"]))
    m: dict[str, Any] = {"role": _maybe(draw, role, 0.05), "content": _maybe(draw, draw(_text), 0.1)}
    if role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = _maybe(draw, draw(st.lists(_tool_call(), max_size=2)), 0.1)
    if role == "tool":
        m["tool_call_id"] = _maybe(draw, "call_1")
    return _maybe(draw, m, 0.05)


@st.composite
def _tool(draw: Any) -> Any:
    function = {"name": _maybe(draw, "get_weather"), "parameters": _maybe(draw, {"type": "object"})}
    return _maybe(draw, {"type": "function", "function": _maybe(draw, function)})


def _common(draw: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Sampling fields in and out of range, cbd's extensions, and fields no one knows."""
    options: dict[str, Any] = {
        "max_tokens": draw(st.sampled_from([1, 2, 3, 0, -1, 2**63])),
        "temperature": draw(st.sampled_from([0, 0.7, 2.5, -1, 1e308, 10**400])),
        "top_p": draw(st.sampled_from([1, 0.5, 0, 7])), "n": draw(st.sampled_from([1, 2, 0, 65, 10**6])),
        "seed": draw(st.sampled_from([0, 7, 2**64, -(2**70)])), "stop": draw(st.sampled_from(["\n", ["a", 3], 5])),
        "stop_token_ids": draw(st.sampled_from([[2], [2**31], [2**33], [-1], "x"])),
        "top_k": draw(st.sampled_from([0, 5, -1, 2**40])), "ignore_eos": draw(st.booleans()),
        "presence_penalty": draw(st.sampled_from([0, 0.5])), "logprobs": draw(st.sampled_from([None, True, 2, 30])),
        "stream_options": draw(st.sampled_from([{"include_usage": True}, "x"])),
        "cbd_session": draw(st.sampled_from(["fuzz-a", "fuzz-b", 5])), "unknown_field": draw(_junk),
        "deep": draw(st.sampled_from([[[{"k": 1}]], f"{DEEP}70", f"{DEEP}5000"])),
    }  # fmt: skip
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=4, unique=True)):
        body[name] = _maybe(draw, options[name], 0.2)
    if body.get("n") not in (None, 1, 2):  # keep the valid ones short: n stays small, no long generations
        body["max_tokens"] = 1
    body.setdefault("max_tokens", 2)
    return body


@st.composite
def chat_bodies(draw: Any) -> Any:
    body: dict[str, Any] = {"model": "m", "messages": _maybe(draw, draw(st.lists(_message(), min_size=1, max_size=3)),
                                                             0.05)}  # fmt: skip
    if draw(st.integers(0, 4)) == 0:
        body["tools"] = _maybe(draw, draw(st.lists(_tool(), min_size=1, max_size=2)), 0.1)
        body["tool_choice"] = _maybe(draw, draw(st.sampled_from(["auto", "required", {"function": {"name": "x"}}])))
    if draw(st.integers(0, 6)) == 0:
        body["response_format"] = _maybe(draw, {"type": draw(st.sampled_from(["json_object", "text", "xml"]))})
    body["stream"] = draw(st.sampled_from([False, False, True, "yes"]))
    return _common(draw, body)


@st.composite
def completion_bodies(draw: Any) -> Any:
    prompt = draw(st.one_of(_text, st.lists(st.integers(0, 300), min_size=1, max_size=6),
                            st.lists(_text, min_size=1, max_size=3), st.just([[1, 2], [2**40]]),
                            st.just(["p"] * 300), _junk))  # fmt: skip
    return _common(draw, {"model": "m", "prompt": prompt, "stream": draw(st.booleans())})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwfuzz")
    daemon = DaemonProcess(tmp / "cbd.sock", "--max-model-len", "512")
    gw = GatewayProcess(daemon.address, tmp / "gateway.log")
    try:
        daemon.wait_serving()
        gw.wait_serving()
        yield daemon, gw
    finally:
        gw.stop()
        assert daemon.stop() == 0, daemon.log()[-4000:]


def _check(response: httpx.Response) -> str:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code == 200:
        return "OK"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    return str(response.status_code)


def test_fuzzed_api_bodies_are_answered_below_500_and_leave_nothing_running(gateway) -> None:
    daemon, gw = gateway
    seen: dict[str, int] = {}
    with httpx.Client(base_url=gw.base, timeout=120) as http:

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(st.one_of(chat_bodies().map(lambda b: ("chat/completions", b)),
                         completion_bodies().map(lambda b: ("completions", b))))  # fmt: skip
        def check(case: tuple[str, dict[str, Any]]) -> None:
            route, body = case
            response = http.post(f"/v1/{route}", content=_text_of(body), headers={"Content-Type": "application/json"})
            outcome = _check(response)
            seen[outcome] = seen.get(outcome, 0) + 1

        check()
    assert seen.get("OK", 0) > 0 and seen.get("400", 0) > 0, seen
    assert "Traceback" not in gw.log() and "bug:" not in gw.log(), gw.log()[-4000:]
    deadline = time.monotonic() + 30
    with Client(daemon.address, timeout=30) as client:
        while (stats := client.stats()).live_requests:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
