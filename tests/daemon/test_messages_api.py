"""The Messages API (/v1/messages) driven with the official `anthropic` package: a real daemon (the
embedded model, two tenants' tokens) and a real `cbd openai` gateway in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from cbd.gateway.agentic.conversations import Conversations
from cbd_client import Client
from daemon_process import DaemonProcess
from gateway_stack import TOKEN, Stack, stack

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the current anthropic package sends no temperature itself


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tenant_daemon: DaemonProcess) -> Iterator[Stack]:
    yield from stack(tmp_path_factory.mktemp("messages"), tenant_daemon)


def client(gw: Stack, token: str = TOKEN) -> Any:  # Any: the SDK's request types name its own models only
    return anthropic.Anthropic(base_url=gw.url, api_key=token, max_retries=0)


def open_sessions(gw: Stack) -> int:
    with Client(gw.daemon.address, timeout=30, token=TOKEN) as c:
        return c.stats().open_sessions


@pytest.mark.slow
def test_a_resent_conversation_continues_its_session(gw: Stack) -> None:
    c = client(gw)
    before = open_sessions(gw)
    first = c.messages.create(model="m", max_tokens=20, **GREEDY, messages=ASK)
    assert first.type == "message" and first.role == "assistant" and first.stop_reason == "end_turn"
    assert "Paris" in first.content[0].text
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    messages = [*ASK, {"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "And the capital of Germany?"}]  # fmt: skip
    second = c.messages.create(model="m", max_tokens=20, **GREEDY, messages=messages)
    assert "Berlin" in second.content[0].text
    # The first exchange was resident: only the new message (and the turn's framing) was computed.
    assert (second.usage.cache_read_input_tokens or 0) >= prompt
    assert open_sessions(gw) == before + 1  # one session carried both calls
    counted = c.messages.count_tokens(model="m", messages=ASK)
    assert counted.input_tokens == prompt


@pytest.mark.slow
def test_streamed_events_assemble_to_the_whole_reply(gw: Stack) -> None:
    c = client(gw)
    whole = c.messages.create(model="m", max_tokens=30, **GREEDY, messages=ASK)
    with c.messages.stream(model="m", max_tokens=30, **GREEDY, messages=ASK) as stream:
        kinds, started = [], None
        for event in stream:
            kinds.append(event.type)
            if event.type == "message_start":
                started = event.message.usage.model_copy()  # as message_start had it (the snapshot changes)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    # message_start carries the prompt's input counts (nothing preempted here: the final ones are the same)
    inputs = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert started is not None and started.output_tokens == 0
    assert [getattr(started, k) for k in inputs] == [getattr(final.usage, k) for k in inputs], (started, final.usage)
    assert started.input_tokens + (started.cache_read_input_tokens or 0) == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0)  # fmt: skip
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
def test_a_tool_round_trip(gw: Stack) -> None:
    c = client(gw)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = c.messages.create(model="m", max_tokens=60, **GREEDY, messages=ask, tools=TOOLS,
                              tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    uses = [b for b in asked.content if b.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "21 degrees C, sunny"} for u in uses]
    follow = [*ask, {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
              {"role": "user", "content": results}]  # fmt: skip
    answer = c.messages.create(model="m", max_tokens=40, **GREEDY, messages=follow, tools=TOOLS,
                               tool_choice={"type": "none"})  # fmt: skip
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    assert (answer.usage.cache_read_input_tokens or 0) > 0
    # Streamed, the tool_use block's JSON deltas assemble to the same input.
    with c.messages.stream(model="m", max_tokens=60, **GREEDY, messages=ask, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"}) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == uses[0].input


@pytest.mark.slow
def test_stop_sequences_and_cache_control(gw: Stack) -> None:
    c = client(gw)
    counting = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    stopped = c.messages.create(model="m", max_tokens=40, **GREEDY, messages=counting, stop_sequences=["5"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert "5" not in stopped.content[0].text
    mark = {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": "You are a terse geography assistant.", "cache_control": mark}]
    marked = c.messages.create(model="m", max_tokens=10, **GREEDY, system=system, messages=ASK)
    # The three input counts add up to the prompt (count_tokens): the computed part is the cache write.
    u = marked.usage
    prompt = c.messages.count_tokens(model="m", system=system, messages=ASK).input_tokens
    assert u.input_tokens == 0 and u.cache_creation_input_tokens > 0
    assert u.cache_creation_input_tokens + (u.cache_read_input_tokens or 0) == prompt
    # The mark is the session's retention: high, and kept idle for the mark's hour.
    with Client(gw.daemon.address, timeout=30, token=TOKEN) as daemon:
        held = [s for s in daemon.list_sessions() if s.retention == "high"]
    assert len(held) == 1 and held[0].ttl_seconds == 3600


@pytest.mark.slow
def test_a_final_assistant_message_is_the_start_of_the_reply_it_continues(gw: Stack) -> None:
    """The prompt ends inside the prefill (the chat template's own continue_final_message rendering), and
    the reply is only what follows it: greedy, the tokens the daemon gives that rendering's token ids."""
    from transformers import AutoTokenizer

    from cbd.model.loader import resolve_checkpoint

    c = client(gw)
    conversation = [{"role": "user", "content": "Count from 1 to 10, separated by commas."},
                    {"role": "assistant", "content": "1, 2, 3,"}]  # fmt: skip
    reply = c.messages.create(model="m", max_tokens=12, **GREEDY, messages=conversation)
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None))
    ids = tokenizer.apply_chat_template(conversation, continue_final_message=True, tokenize=True, return_dict=True)
    with Client(gw.daemon.address, timeout=60, token=TOKEN) as daemon:
        oracle = daemon.generate(list(ids["input_ids"]), max_tokens=12, temperature=0)
    assert reply.content[0].text == oracle.candidates[0].text and reply.content[0].text
    assert c.messages.count_tokens(model="m", messages=conversation).input_tokens == len(ids["input_ids"])
    # An empty final assistant message is no prefill: the reply is the one to the conversation without it.
    empty = c.messages.create(model="m", max_tokens=8, **GREEDY, messages=[conversation[0], {"role": "assistant",
                                                                                            "content": ""}])  # fmt: skip
    plain = c.messages.create(model="m", max_tokens=8, **GREEDY, messages=[conversation[0]])
    assert empty.content[0].text == plain.content[0].text


@pytest.mark.slow
def test_errors_in_the_apis_shape(gw: Stack) -> None:
    c = client(gw)
    (listed,) = c.models.list().data  # the model routes answer in this API's shape too
    assert listed.id.startswith("SmolLM2") and listed.display_name == listed.id and listed.type == "model"
    assert c.models.retrieve(listed.id).id == listed.id
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="m", max_tokens=0, messages=ASK)
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "max_tokens must be an integer from 1 to 2147483647, got 0"}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])  # fmt: skip
    assert "names no earlier tool call" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:  # as the API: a prefill ends in no whitespace
        c.messages.create(model="m", max_tokens=5, messages=[*ASK, {"role": "assistant", "content": "Paris "}])
    assert "trailing whitespace" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:  # a schema the daemon refuses, named by this API's path
        c.messages.create(model="m", max_tokens=5, messages=ASK,
                          extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}})  # fmt: skip
    refusal: Any = bad.value.body  # the SDK types an error body as object: it is the API's error dict
    assert refusal["error"]["message"].startswith("output_config.format.schema.not: "), refusal
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(gw, "wrong").messages.create(model="m", max_tokens=5, messages=ASK)
    body: Any = denied.value.body  # the SDK types an error body as object: it is the API's error dict
    assert body["error"]["type"] == "authentication_error"
    raw = httpx.post(f"{gw.url}/v1/messages", headers={"x-api-key": TOKEN}, json={"model": "m", "messages": ASK})
    assert raw.status_code == 400 and raw.json()["error"] == {"type": "invalid_request_error",
                                                              "message": "max_tokens is required"}  # fmt: skip


def test_conversations_find_the_longest_held_prefix_of_the_owners_resend() -> None:
    conversations = Conversations()
    call = {"id": "call_1", "name": "f", "arguments": '{"b": 1, "a": 2}'}
    held = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    conversations.record("alice", "s1", held)
    resent = {**call, "arguments": '{"a":2,"b":1}'}  # the same call, resent with other spacing and key order
    follow = [held[0], {"role": "assistant", "content": "", "tool_calls": [resent]},
              {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
    assert conversations.find("alice", follow) == ("s1", 2)
    assert conversations.find("bob", follow) is None  # another key's conversation is not found
    assert conversations.find("alice", held) is None  # nothing new after what is held: not a turn
    edited = [{"role": "user", "content": "hello"}, *follow[1:]]
    assert conversations.find("alice", edited) is None
    conversations.forget("s1")
    assert conversations.find("alice", follow) is None
