"""The OpenAI-compatible gateway, driven with the official `openai` package: a real daemon (embedded model,
a bearer token, an admission cap of two live requests) and a real `cbd openai` process in front of it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from cbd_client import Client
from daemon_process import DaemonProcess
from gateway_process import GatewayProcess

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]  # fmt: skip


class Stack:
    def __init__(self, daemon: DaemonProcess, gateway: GatewayProcess, url: str) -> None:
        self.daemon, self.gateway, self.url = daemon, gateway, url

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", TOKEN), **{"max_retries": 0, **kwargs})

    def stats(self):
        with Client(self.daemon.address, timeout=30, token=TOKEN) as c:
            return c.stats()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    (tmp / "token").write_text(TOKEN)
    daemon = DaemonProcess(tmp / "cbd.sock", "--auth-token-file", str(tmp / "token"), "--max-queued-requests", "2")
    gateway = GatewayProcess(daemon.address, tmp / "gateway.log")
    try:
        daemon.wait_serving()
        gateway.wait_serving(60)
        yield Stack(daemon, gateway, f"{gateway.base}/v1")
    finally:
        gateway.stop()
        assert daemon.stop() == 0, daemon.log()


def test_models_and_a_chat_completion(stack) -> None:
    client = stack.client()
    (model,) = client.models.list().data
    assert model.id.startswith("SmolLM2") and client.models.retrieve(model.id).id == model.id
    reply = client.chat.completions.create(model=model.id, messages=ASK, max_tokens=20, temperature=0)
    assert reply.object == "chat.completion" and reply.model == model.id
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    u = reply.usage
    assert u.prompt_tokens > 10 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None


def test_streamed_deltas_join_to_the_whole_reply(stack) -> None:
    client = stack.client()
    whole = client.chat.completions.create(model="any", messages=ASK, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=ASK, max_tokens=40, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # On the wire, as the API documents include_usage: every chunk has "usage", null but on the last one.
    body = {"model": "m", "messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("POST", f"{stack.url}/chat/completions", json=body, headers=auth, timeout=60) as response:
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    raw = [json.loads(d) for d in data[:-1]]
    assert data[-1] == "[DONE]" and raw[-1]["choices"] == [] and raw[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" in c and c["usage"] is None for c in raw[:-1]) and all(c["choices"] for c in raw[:-1])


def test_n_candidates_with_a_seed_are_reproducible(stack) -> None:
    client = stack.client()

    def sample() -> list[str]:
        reply = client.chat.completions.create(model="m", messages=ASK, n=4, seed=11, temperature=0.9, max_tokens=16)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        return [c.message.content for c in reply.choices]

    first = sample()
    assert first == sample() and len(set(first)) > 1  # the same four, and not four copies of one


def test_tool_calls_are_parsed_and_their_arguments_validate(stack) -> None:
    client = stack.client()
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    reply = client.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert calls and all(c.type == "function" and c.function.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert call.id.startswith("call_")
    # Streamed: the call's pieces add up to the same call.
    stream = client.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice="required",
                                            max_tokens=80, temperature=0, stream=True)  # fmt: skip
    arguments: dict[int, str] = {}
    for chunk in stream:
        pieces = chunk.choices[0].delta.tool_calls or []
        assert len({d.index for d in pieces}) == len(pieces)  # one entry per call in a chunk
        for d in pieces:
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    assert arguments[0] == calls[0].function.arguments
    # The tool's result goes back, and the model answers in text.
    messages = [
        *ask,
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21, "unit": "C"}'},
    ]
    answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=30, temperature=0)  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_response_format_json_schema_validates(stack) -> None:
    client = stack.client()
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}  # fmt: skip
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content), person)
    ask = [{"role": "user", "content": 'Answer with the JSON object {"capital": "Paris"} and nothing else.'}]
    obj = client.chat.completions.create(model="m", messages=ask, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})  # fmt: skip
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_session_header_keeps_the_conversation_resident(stack) -> None:
    client = stack.client(default_headers={"X-Cbd-Session": "agent-7"})
    sessions_before = stack.stats().open_sessions
    messages: list[dict] = [{"role": "user", "content": "Name a fruit."}]
    cached = []
    for follow_up in ("Name another one.", "And a third one?", None):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    assert cached[0] < cached[1] < cached[2], cached
    assert stack.stats().open_sessions == sessions_before + 1  # one session carried all three calls
    # An edited history cannot continue the session: the gateway starts a fresh one transparently.
    edited = [{"role": "user", "content": "Name a vegetable."}]
    assert client.chat.completions.create(model="m", messages=edited, max_tokens=8, temperature=0).choices[0].message


def test_completions_with_one_and_several_prompts(stack) -> None:
    client = stack.client()
    one = client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0,
                                    logprobs=2)  # fmt: skip
    assert one.object == "text_completion" and one.choices[0].text
    lp = one.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and "".join(lp.tokens) == one.choices[0].text
    several = client.completions.create(model="m", prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0)
    assert [c.index for c in several.choices] == [0, 1] and several.usage.completion_tokens == 6


def test_errors_have_the_apis_statuses(stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=ASK, presence_penalty=0.5)
    assert "presence_penalty" in bad.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                       "function": {"name": "no_such_tool"}})  # fmt: skip
    with pytest.raises(openai.AuthenticationError):
        stack.client(api_key="wrong").chat.completions.create(model="m", messages=ASK, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for fmt, match in (({"type": "xml"}, "response_format.type must be"),
                       ({"type": "json_schema"}, "response_format.json_schema must be an object")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as bad:  # the ignore below: a type the SDK does not know, on purpose
            client.chat.completions.create(model="m", messages=ASK, max_tokens=2, response_format=fmt)  # type: ignore[arg-type]
        assert match in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=ASK, max_completion_tokens=0)
    assert "max_completion_tokens must be an integer from 1" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # the ignore below: a role the SDK does not know, on purpose
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)  # type: ignore[list-item,misc]
    assert "messages[0].role must be one of" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # a tool result must answer a call made before it
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            *ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "42"}])  # fmt: skip
    assert "a tool result names no earlier tool call: 'call_nope'" in bad.value.message
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as missing:  # unknown routes answer in the API's error shape too
        client.get("/no/such/route", cast_to=object)
    # The SDK types the error body as object; it is the API's error dict.
    assert missing.value.body["message"] == "GET /v1/no/such/route: Not Found"  # type: ignore[index]
    # The API's bounds are inclusive: 20 alternatives is the most, and allowed.
    most = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, logprobs=True, top_logprobs=20)
    assert most.choices[0].logprobs is not None and len(most.choices[0].logprobs.content[0].top_logprobs) == 20


def _blocker(stack, release: threading.Event) -> threading.Thread:
    """Holds one of the daemon's two seats (a long stream through the gateway) until `release` is set."""
    started = threading.Event()

    def run() -> None:
        stream = stack.client().chat.completions.create(model="m", messages=ASK, max_tokens=2000, stream=True,
                                                        extra_body={"ignore_eos": True})  # fmt: skip
        for _ in stream:
            started.set()
            if release.is_set():
                stream.close()
                return

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    return thread


def test_a_full_daemon_is_429_with_retry_after_and_the_clients_retry_succeeds(stack) -> None:
    release = threading.Event()
    blockers = [_blocker(stack, release), _blocker(stack, release)]
    try:
        with pytest.raises(openai.RateLimitError) as full:
            stack.client().chat.completions.create(model="m", messages=ASK, max_tokens=4)
        headers = full.value.response.headers
        assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
        threading.Timer(1.0, release.set).start()  # the seat frees up while the client is retrying
        reply = stack.client(max_retries=8).chat.completions.create(model="m", messages=ASK, max_tokens=4)
        assert reply.choices[0].message.content
    finally:
        release.set()
        for blocker in blockers:
            blocker.join(60)


def test_a_client_that_disconnects_mid_stream_frees_the_request(stack) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("POST", f"{stack.url}/chat/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert stack.stats().running == 1
    deadline = time.monotonic() + 10
    while (s := stack.stats()).running or s.live_requests:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s.kv_blocks_used == 0 or s.open_sessions > 0


def test_the_gateway_imports_no_engine_or_server_code() -> None:
    code = ("import sys, cbd.gateway.app, cbd.gateway.main; "
            "bad = sorted(m for m in sys.modules if m.startswith(('cbd.engine', 'cbd.server', 'cbd.ipc', 'torch'))); "
            "assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_client_that_gives_up_on_a_whole_reply_frees_the_request(stack) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 2000, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Cbd-Session": "gives-up"}
    sessions_before = stack.stats().open_sessions
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/chat/completions", json=body, headers=headers, timeout=2.0)
    deadline = time.monotonic() + 10
    while (s := stack.stats()).running or s.live_requests or s.open_sessions != sessions_before:
        assert time.monotonic() < deadline, s  # the call is cancelled and the session it opened is closed
        time.sleep(0.1)


def test_calls_the_daemon_cancels_as_it_shuts_down_are_503s_not_a_finish(tmp_path) -> None:
    """A reply the daemon ends unfinished (it is shutting down, no grace) is the 503 of a call it cancelled:
    whole, the call's status; streamed, an error event after what had arrived; never finish_reason abort."""
    daemon = DaemonProcess(tmp_path / "cbd.sock", "--shutdown-grace", "0")
    gateway = GatewayProcess(daemon.address, tmp_path / "gateway.log")
    try:
        daemon.wait_serving()
        gateway.wait_serving(60)
        long = {"model": "m", "messages": ASK, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        whole: list[httpx.Response] = []
        caller = threading.Thread(
            target=lambda: whole.append(httpx.post(f"{gateway.base}/v1/chat/completions", json=long, timeout=120))
        )
        with httpx.stream("POST", f"{gateway.base}/v1/chat/completions", json={**long, "stream": True},
                          timeout=120) as streamed:  # fmt: skip
            lines = streamed.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            caller.start()
            with Client(daemon.address, timeout=30) as c:
                deadline = time.monotonic() + 60
                while c.stats().running < 2:
                    assert time.monotonic() < deadline, "the whole call never started"
                    time.sleep(0.05)
            daemon.process.terminate()
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        caller.join(120)
        chunks = [json.loads(data) for data in [first[len("data: ") :], *rest] if data != "[DONE]"]
        assert all(c["choices"][0].get("finish_reason") != "abort" for c in chunks if c.get("choices"))
        assert chunks[-1]["error"]["type"] == "service_unavailable_error", chunks[-1]
        assert whole and whole[0].status_code == 503, whole[0].text if whole else "no answer"
        assert whole[0].json()["error"]["type"] == "service_unavailable_error"
    finally:
        gateway.stop()
        daemon.stop()
