"""Property-based fuzzing of the agent APIs (/v1/responses, /v1/messages, /v1/messages/count_tokens)
through a real `cbd openai` in front of a real daemon: bodies mixing valid and invalid shapes (item
lists of wrong types, unknown item and block types, tool results naming no call, tools with bad schemas,
out-of-range limits, unknown previous responses, junk cache_control, deep nesting, huge strings). Every
answer is the API's object (200) or the API's own one-line error below 500, and afterwards the gateway
still serves a valid call of each API. CBD_AGENT_FUZZ_EXAMPLES sets the count per API."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_gateway_fuzz import DEEP, _junk, _maybe, _text, _text_of  # noqa: E402

from gateway_stack import TOKEN, Stack, stack  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("CBD_AGENT_FUZZ_EXAMPLES", "40"))

_huge_text = st.sampled_from(["x" * 20_000, "word " * 3_000])
_nested = st.sampled_from([[[{"k": 1}]], f"{DEEP}70", f"{DEEP}5000"])
_schema = st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}}, {"type": "object"},
                           {"type": "nonsense"}, {"type": "object", "properties": 5}, {"$ref": "#/nowhere"}, "x"])  # fmt: skip


def _pick(draw: Any, body: dict[str, Any], options: dict[str, Any], most: int = 3) -> None:
    """Some of `options` into `body`, each now and then replaced by junk (now and then none: a plain body)."""
    if draw(st.integers(0, 3)) == 1:
        return
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=most, unique=True)):
        body[name] = _maybe(draw, options[name], 0.2)


@st.composite
def _response_item(draw: Any) -> Any:
    text = draw(st.one_of(_text, _huge_text))
    content = draw(st.sampled_from([text, [{"type": "input_text", "text": text}], [{"type": "input_image"}],
                                    [{"type": "output_text", "text": 5}], 7]))  # fmt: skip
    role = draw(st.sampled_from(["user", "user", "system", "developer", "assistant", "wizard", ["user"], {"r": 1}]))
    kind = draw(st.sampled_from(["message", None, "function_call", "function_call_output", "reasoning", ["message"],
                                 {"t": 1}]))  # fmt: skip
    item: dict[str, Any] = {"role": role, "content": content}
    if kind == "function_call":
        item = {"call_id": draw(st.sampled_from(["call_1", 5])), "name": "get_weather",
                "arguments": draw(st.sampled_from(['{"city": "Paris"}', None]))}  # fmt: skip
    elif kind == "function_call_output":
        item = {
            "call_id": draw(st.sampled_from(["call_1", "call_nope", None])),
            "output": draw(st.sampled_from(["sunny", [{"type": "input_text", "text": "sunny"}], {"x": 1}])),
        }
    if kind is not None:
        item["type"] = kind
    return _maybe(draw, item, 0.05)


@st.composite
def response_bodies(draw: Any) -> Any:
    given_input = draw(st.one_of(_text, _huge_text, _junk))
    if draw(st.booleans()):
        given_input = [draw(_response_item()) for _ in range(draw(st.integers(1, 3)))]
    body: dict[str, Any] = {"model": "m", "input": given_input}
    tool = {"type": draw(st.sampled_from(["function", "function", "web_search", 5])), "name": "get_weather",
            "parameters": draw(_schema)}  # fmt: skip
    _pick(draw, body, {
        "tools": [tool], "parallel_tool_calls": draw(st.sampled_from([True, False, "no"])),
        "tool_choice": draw(st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"},
                                             {"type": "function"}, "sometimes", {"type": "function", "name": 5}])),
        "text": {"format": draw(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}, 5,
                                                 {"type": "json_schema", "schema": draw(_schema)}, {"type": []}]))},
        "max_output_tokens": draw(st.sampled_from([1, 2, 3, 0, -1, 2**63, "2", 2.5])),
        "temperature": draw(st.sampled_from([0, 0.7, "0.5", -1, 10**400])),
        "previous_response_id": draw(st.sampled_from(["resp_unknown", "", "resp_a\nb", "../x", "resp_" + "x" * 300,
                                                      5])),
        "metadata": draw(st.sampled_from([{"k": "v"}, "x", [1], {"k": {"deep": [1]}}])),
        "prompt_cache_key": draw(st.sampled_from(["k", "x" * 257, "", 5])),
        "instructions": draw(st.sampled_from(["Be brief.", 5, ["x"]])), "store": draw(st.sampled_from([True, False])),
        "background": draw(st.sampled_from([False, True, "x"])), "include": draw(st.sampled_from([[], ["logprobs"]])),
        "reasoning": draw(st.sampled_from([{"effort": "none"}, {"effort": "high"}, "x"])),
        "unknown_field": draw(_junk), "deep": draw(_nested),
    })  # fmt: skip
    body.setdefault("max_output_tokens", 2)
    return body


@st.composite
def _block(draw: Any, role: str) -> Any:
    cache = draw(st.sampled_from([None, None, None, {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"},
                                  {"type": "persistent"}, {"type": "ephemeral", "ttl": []}, "x"]))  # fmt: skip
    text = draw(st.one_of(_text, _huge_text))
    block = draw(st.sampled_from([
        {"type": "text", "text": text}, {"type": "text", "text": text}, {"type": "text", "text": 5},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": draw(st.sampled_from([{}, "x", [1]]))}
        if role == "assistant" else {"type": "tool_use", "id": "toolu_1", "name": "get_weather"},
        {"type": "tool_result", "tool_use_id": draw(st.sampled_from(["toolu_1", "toolu_nope", 5])),
         "content": draw(st.sampled_from(["sunny", [{"type": "text", "text": "sunny"}], [{"type": "image"}], 5]))},
        {"type": draw(st.sampled_from(["image", "thinking", "document", ["text"], None]))},
    ]))  # fmt: skip
    if cache is not None:
        block["cache_control"] = cache
    return _maybe(draw, block, 0.1)


@st.composite
def _anthropic_message(draw: Any) -> Any:
    role = draw(st.sampled_from(["system", ["user"], "assistant"])) if draw(st.integers(0, 3)) == 1 else "user"
    key = role if isinstance(role, str) else "user"
    content = draw(st.one_of(_text, st.lists(_block(key), max_size=3), _junk)) if draw(st.booleans()) else "Hi."
    return _maybe(draw, {"role": role, "content": content}, 0.05)


@st.composite
def message_bodies(draw: Any) -> Any:
    messages = draw(st.lists(_anthropic_message(), min_size=1, max_size=3))
    body: dict[str, Any] = {"model": "m", "messages": draw(_junk) if draw(st.integers(0, 9)) == 1 else messages}
    tool = {"name": draw(st.sampled_from(["get_weather", 5])), "input_schema": draw(_schema),
            "type": draw(st.sampled_from(["custom", "web_search_20250305"]))}  # fmt: skip
    _pick(draw, body, {
        "system": draw(st.sampled_from(["Be brief.", [{"type": "text", "text": "Be brief."}], [{"type": "image"}],
                                        [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}], 5])),
        "stop_sequences": draw(st.sampled_from([["\n"], [""], [5], "x", ["a"] * 17])),
        "temperature": draw(st.sampled_from([0, 0.5, 1.5, "0.5", 10**400])), "top_k": draw(st.sampled_from([5, -1])),
        "tools": [tool], "thinking": draw(st.sampled_from([{"type": "disabled"}, {"type": "enabled"}, "x"])),
        "tool_choice": draw(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
                                             {"type": "tool"}, "auto", {"type": "auto", "disable_parallel_tool_use": 1},
                                             {"type": ["auto"]}])),
        "output_config": draw(st.sampled_from([{"format": {"type": "json_schema", "schema": {"type": "object"}}},
                                               {"format": {"type": "json_schema"}}, {"format": 5}, "x"])),
        "metadata": draw(st.sampled_from([{"user_id": "u"}, {"user_id": 5}, "x"])),
        "unknown_field": draw(_junk), "deep": draw(_nested),
    })  # fmt: skip
    if draw(st.integers(0, 3)) == 1:  # read first of all: its junk reaches the check that a later error would hide
        body["cache_control"] = draw(st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"},
                                                      {"type": "ephemeral", "ttl": 5}, {"type": "ephemeral", "ttl": []},
                                                      {"type": "ephemeral", "ttl": {"x": 1}}, "x"]))  # fmt: skip
    body["max_tokens"] = draw(st.sampled_from([None, 0, -1, 2**63, "2"])) if draw(st.integers(0, 4)) == 2 else 2
    if body["max_tokens"] is None:
        del body["max_tokens"]
    return body


@pytest.fixture(scope="module")
def gw(tmp_path_factory, tenant_daemon):
    yield from stack(tmp_path_factory.mktemp("agentfuzz"), tenant_daemon)


def _one_line(message: Any) -> None:
    assert isinstance(message, str) and message and "\n" not in message, message


def _check_responses(response: httpx.Response) -> str:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code == 200:
        assert response.json()["object"] == "response", response.text[:500]
        return "OK"
    error = response.json()["error"]
    assert isinstance(error["type"], str), error
    _one_line(error["message"])
    return str(response.status_code)


def _check_messages(route: str, response: httpx.Response) -> str:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    body = response.json()
    if response.status_code == 200:
        ok = isinstance(body.get("input_tokens"), int) if route.endswith("count_tokens") else body["type"] == "message"
        assert ok, response.text[:500]
        return "OK"
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    _one_line(body["error"]["message"])
    return str(response.status_code)


def _post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(route, content=_text_of(body), headers={"Content-Type": "application/json"})


def _fuzz(gw: Stack, strategy: Any, check: Any) -> dict[str, int]:
    seen: dict[str, int] = {}
    with httpx.Client(base_url=gw.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(strategy)
        def run(case: tuple[str, dict[str, Any]]) -> None:
            route, body = case
            outcome = check(route, _post(http, route, body))
            seen[outcome] = seen.get(outcome, 0) + 1

        run()
    assert seen.get("OK", 0) > 0 and seen.get("400", 0) > 0, seen
    assert "Traceback" not in gw.log() and "bug:" not in gw.log(), gw.log()[-4000:]
    return seen


def test_fuzzed_responses_bodies_get_a_response_or_a_one_line_error(gw: Stack) -> None:
    _fuzz(gw, response_bodies().map(lambda b: ("/v1/responses", b)), lambda _, r: _check_responses(r))
    with httpx.Client(base_url=gw.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        answer = _post(http, "/v1/responses", {"model": "m", "input": "Name a fruit.", "max_output_tokens": 2})
        assert answer.status_code == 200 and answer.json()["status"] in ("completed", "incomplete"), answer.text[:500]


def test_fuzzed_messages_bodies_get_a_message_or_a_one_line_error(gw: Stack) -> None:
    routes = st.sampled_from(["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"])
    _fuzz(gw, st.tuples(routes, message_bodies()), _check_messages)
    with httpx.Client(base_url=gw.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Name a fruit."}]}
        answer = _post(http, "/v1/messages", body)
        assert answer.status_code == 200 and answer.json()["type"] == "message", answer.text[:500]
