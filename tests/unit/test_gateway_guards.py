"""The gateway's refusals that need no daemon: malformed fields, deep or invalid JSON, bodies over the
limit, a route's unexpected failure, the gRPC size refusal's status, and per-token session names.
Driven in-process with Starlette's TestClient (requests are refused before any call to the daemon)."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import pytest

pytest.importorskip("starlette")
from starlette.datastructures import Headers  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from cbd.gateway import app as app_module  # noqa: E402
from cbd.gateway.agentic.caller import caller_key  # noqa: E402
from cbd.gateway.app import create_app  # noqa: E402
from cbd.gateway.errors import ApiError, from_cbd  # noqa: E402
from cbd.gateway.limits import Limits, parse_json  # noqa: E402
from cbd.gateway.messages import routes as messages_routes  # noqa: E402
from cbd.gateway.requests import chat_call  # noqa: E402
from cbd_client.errors import CbdError  # noqa: E402

ASK = [{"role": "user", "content": "hi"}]
NOWHERE = "unix:/nonexistent/cbd.sock"  # every request here is refused before the daemon is called


@pytest.fixture()
def client():
    with TestClient(create_app(NOWHERE, limits=Limits(max_body_bytes=4096, max_prompts=8))) as c:
        yield c


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert "\n" not in error["message"]
    return error


MALFORMED = [  # (route, body, the param named)
    ("chat", {"messages": ASK, "tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ("chat", {"messages": ASK, "tools": "f"}, "tools"),
    (
        "chat",
        {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": "f"}},
        "tool_choice.function",
    ),  # fmt: skip
    (
        "chat",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}, *ASK]},
        "messages[0].tool_calls[0].function",
    ),  # fmt: skip
    (
        "chat",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}, *ASK]},
        "messages[0].tool_calls[0].id",
    ),  # fmt: skip
    ("chat", {"messages": [{"role": "assistant", "tool_calls": "x"}, *ASK]}, "messages[0].tool_calls"),
    ("chat", {"messages": [*ASK, {"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages[1].tool_call_id"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("chat", {"messages": ASK, "stop": ["ok", "\udfff"]}, "stop[1]"),
    ("chat", {"messages": ASK, "stop_token_ids": [2**33]}, "stop_token_ids"),
    ("chat", {"messages": ASK, "stop_token_ids": [2**31]}, "stop_token_ids"),
    ("chat", {"messages": ASK, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat", {"messages": ASK, "temperature": 10**400}, "temperature"),
    # the API's ranges, refused here with the field named (the daemon's own are wider or its message names none)
    ("chat", {"messages": ASK, "temperature": 2.5}, "temperature"),
    ("chat", {"messages": ASK, "temperature": -1}, "temperature"),
    ("chat", {"messages": ASK, "top_p": 1.5}, "top_p"),
    ("chat", {"messages": ASK, "min_p": -0.5}, "min_p"),
    ("chat", {"messages": ASK, "n": 65}, "n"),
    ("chat", {"messages": ASK, "stop": [str(i) for i in range(17)]}, "stop"),
    ("completions", {"prompt": "p", "temperature": 2.01}, "temperature"),
    ("completions", {"prompt": "p", "n": 65, "best_of": 65}, "n"),
    ("chat", {"messages": ASK, "stream_options": "yes"}, "stream_options"),
    ("completions", {"prompt": ["p"] * 9}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3, 2**40]]}, "prompt[1]"),
    ("completions", {"prompt": [1, -2]}, "prompt"),
    ("responses", {"input": "p", "tools": [{"type": "function", "name": "f", "description": 5}]},
     "tools[0].description"),
    ("responses", {"input": "p", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("responses", {"input": "p", "metadata": {"k": 5}}, "metadata"),
    ("responses", {"input": "p", "truncation": "bogus"}, "truncation"),
    ("responses", {"input": "p", "text": "json"}, "text"),
    ("responses", {"input": "p", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ("responses", {"input": "p", "top_logprobs": 3}, "top_logprobs"),
    # booleans given as strings are refused, never read as true
    ("chat", {"messages": ASK, "logprobs": "false"}, "logprobs"),
    ("chat", {"messages": ASK, "ignore_eos": "false"}, "ignore_eos"),
    ("chat", {"messages": ASK, "stream_options": {"include_usage": "false"}}, "stream_options.include_usage"),
    ("completions", {"prompt": "p", "echo": "false"}, "echo"),
    ("chat", {"messages": ASK, "functions": [{"name": "f"}]}, "functions"),
    ("chat", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "param"), MALFORMED)
def test_a_malformed_field_is_a_400_naming_it(client, route: str, body: dict[str, Any], param: str) -> None:
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}[route]
    # json.dumps writes lone surrogates and huge integers as JSON allows (\ud800, digits)
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == param, error
    assert "bad argument type" not in error["message"]


def test_the_daemons_refusals_name_the_field_as_each_api_names_it() -> None:
    from cbd.gateway.errors import ApiError, named
    from cbd.gateway.responses.request import DAEMON_PARAMS

    cases = [  # (the daemon's message, the Responses API's param, its code)
        ("tool 1: the name 'f' is given twice", "tools[1]", None),
        ("invalid structural_tag: Unsupported type", "tools", None),
        ("tool_choice names 'g', which is not among the tools given", "tool_choice", None),
        ("max_tokens must be >= 1, got 0", "max_output_tokens", None),
        ("the prompt has 9000 tokens; this engine's context holds at most 8192", "input", "context_length_exceeded"),
        ("invalid json_schema: bad", "text.format", None),
        ("something else entirely", None, None),
    ]
    for message, param, code in cases:
        error = named(ApiError(400, message), DAEMON_PARAMS)
        assert (error.param, error.code) == (param, code), message
    assert named(ApiError(400, "top_p must be in (0, 1]", param="given"), DAEMON_PARAMS).param == "given"
    assert named(ApiError(503, "tool 1 gone"), DAEMON_PARAMS).param is None  # only refusals of the request


def test_json_nested_too_deep_is_a_400_and_never_a_recursion_error(client) -> None:
    for depth in (65, 2000):  # 2000: past the interpreter's recursion limit, still under 4096 bytes
        body = '{"messages": ' + "[" * depth + "]" * depth + "}"
        assert "nests deeper than 64" in _error(client.post("/v1/chat/completions", content=body), 400)["message"]
    deep = "[" * 100_000 + "]" * 100_000  # over 4096 bytes: refused by size before it is parsed
    assert _error(client.post("/v1/chat/completions", content=deep), 413)["code"] == "request_too_large"
    limits = Limits()
    with pytest.raises(ApiError, match="nests deeper than 64 levels"):
        parse_json(("[" * 100_000 + "]" * 100_000).encode(), limits.max_json_depth)
    value = {"a": [[1, {"b": "c"}]]}
    assert parse_json(json.dumps(value).encode(), 4) == value  # exactly at the limit: accepted
    with pytest.raises(ApiError, match=r"deeper than 3 levels \(at a\[0\]\[1\]\)"):  # the object is the 4th level
        parse_json(json.dumps(value).encode(), 3)


def test_bodies_over_the_limit_are_413_declared_or_streamed(client) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    declared = client.post("/v1/chat/completions", content=big)
    assert _error(declared, 413)["code"] == "request_too_large"
    assert declared.headers.get("connection") != "close"  # a declared length is read to its end: the client sees 413
    streamed = client.post("/v1/chat/completions", content=iter([big[:3000], big[3000:]]))
    assert _error(streamed, 413)["message"] == "the request body is larger than 4096 bytes"
    assert streamed.headers["connection"] == "close"
    assert _error(client.post("/v1/chat/completions", content=b"{", headers={"Content-Length": "x1"}), 400)


def _anthropic_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and "\n" not in body["error"]["message"], body
    return body["error"]


def test_the_messages_routes_refuse_in_anthropics_shape_before_the_route_too(client, monkeypatch) -> None:
    big = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        declared = client.post(path, content=big)  # refused by its Content-Length, before any route runs
        assert _anthropic_error(declared, 413)["type"] == "request_too_large"
        streamed = client.post(path, content=iter([big[:3000], big[3000:]]))
        assert _anthropic_error(streamed, 413)["message"] == "the request body is larger than 4096 bytes"
    assert _anthropic_error(client.post("/v1/messages", content=b"{", headers={"Content-Length": "x1"}), 400)
    assert _anthropic_error(client.get("/v1/messages/nothing"), 404)["type"] == "not_found_error"
    assert _anthropic_error(client.get("/v1/messages"), 405)

    def broken(*args: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(messages_routes, "parse", broken)
    ask = {"model": "m", "max_tokens": 8, "messages": ASK}
    assert _anthropic_error(client.post("/v1/messages", json=ask), 500)["type"] == "api_error"
    # the OpenAI routes beside them keep OpenAI's shape for the same refusals
    assert _error(client.post("/v1/responses", content=big), 413)["code"] == "request_too_large"
    assert _error(client.post("/v1/chat/completions", content=big), 413)["code"] == "request_too_large"


def test_not_json_and_unknown_routes_answer_in_the_api_shape(client) -> None:
    assert _error(client.post("/v1/chat/completions", content=b"\xff\xfe{"), 400)["message"].endswith("not JSON")
    assert _error(client.post("/v1/chat/completions", content=b"[1]"), 400)["message"].endswith("a JSON object")
    assert _error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert _error(client.get("/v1/chat/completions"), 405)


def test_an_unexpected_failure_is_a_500_in_the_api_shape_logged_in_one_line(client, monkeypatch, caplog) -> None:
    def broken(*args: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(app_module, "chat_call", broken)
    with caplog.at_level(logging.INFO, logger="cbd.gateway"):
        response = client.post("/v1/chat/completions", json={"messages": ASK})
    assert _error(response, 500)["type"] == "server_error"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage().startswith("bug: POST /v1/chat/completions: KeyError")
    assert errors[0].exc_info is None  # no traceback above debug


def test_grpcs_message_size_refusal_is_413_never_429() -> None:
    too_big = CbdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9000000 vs. 8388608)")
    error = from_cbd(too_big)
    assert error.status == 413 and "Retry-After" not in error.headers
    assert (
        from_cbd(CbdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max (1 vs. 0)")).status == 413
    )
    full = from_cbd(CbdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after=0.2))
    assert full.status == 429 and full.headers["Retry-After"] == "1"
    # 499 is the gateway's own word for a client that left; the daemon cancelling a call is not that
    assert from_cbd(CbdError(grpc.StatusCode.CANCELLED, "shutting down")).status == 503


def test_session_names_are_scoped_by_a_hash_of_the_token() -> None:
    def scoped(headers: dict[str, str]) -> tuple[str, str] | None:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        return chat_call(body, "chat", caller_key(Headers(headers))).session_key

    alice, bob = scoped({"authorization": "Bearer tok-a"}), scoped({"authorization": "Bearer tok-b"})
    assert alice is not None and bob is not None and alice != bob and alice[1] == bob[1] == "chat"
    assert scoped({"authorization": "Bearer tok-a"}) == alice and "tok-a" not in alice[0] and len(alice[0]) == 64
    assert scoped({"x-api-key": "tok-a"}) == alice  # one key whichever header carries the token
    assert scoped({}) not in (alice, bob)
