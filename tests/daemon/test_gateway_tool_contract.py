"""What agent frameworks send, through all three APIs of a real gateway, driven with the official `openai`
and `anthropic` packages: tools together with a response format (the reply is calls, or text valid under
the schema), at most one call (parallel_tool_calls false, disable_parallel_tool_use), and the defaults of
an omitted max_tokens (checked on the converted request: a reply up to the context is too long to run)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from cbd.gateway.requests import MAX_TOKENS, chat_call, completion_call
from daemon_process import DaemonProcess
from gateway_stack import TOKEN, Stack, stack

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                    "parameters": WEATHER}]  # fmt: skip
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
TWO_CITIES = "What is the weather in Paris and London?"
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tenant_daemon: DaemonProcess) -> Iterator[Stack]:
    yield from stack(tmp_path_factory.mktemp("tool-contract"), tenant_daemon)


def oai(gw: Stack) -> Any:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, max_retries=0)


def claude(gw: Stack) -> Any:
    return anthropic.Anthropic(base_url=gw.url, api_key=TOKEN, max_retries=0)


def test_an_omitted_chat_max_tokens_means_up_to_the_context_and_completions_keep_16() -> None:
    chat = chat_call({"messages": [{"role": "user", "content": "hi"}]}, None)
    assert chat.requests[0].sampling.max_tokens == MAX_TOKENS
    assert (
        chat_call({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, None)
        .requests[0]
        .sampling.max_tokens
        == 5
    )
    assert completion_call({"prompt": "Once"}).requests[0].sampling.max_tokens == 16
    assert completion_call({"prompt": "Once", "max_tokens": None}).requests[0].sampling.max_tokens == 16


@pytest.mark.slow
def test_chat_tools_with_a_response_format_give_calls_or_valid_json(gw: Stack) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    seen = set()
    for ask in ("What is the weather in Paris?", "What is two plus two?"):
        reply = oai(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], n=4,
                                                tools=CHAT_TOOLS, response_format=fmt, max_tokens=80, **SAMPLED)  # fmt: skip
        for choice in reply.choices:
            message, cut = choice.message, choice.finish_reason == "length"  # max_tokens may cut the last call
            if message.tool_calls:
                seen.add("calls")
                assert choice.finish_reason in ("tool_calls", "length") and not message.content
                for call in message.tool_calls[: len(message.tool_calls) - cut]:
                    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            elif not cut:
                seen.add("text")
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(message.content), ANSWER)
    assert seen == {"calls", "text"}  # both branches of the grammar were taken
    required = oai(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], tools=CHAT_TOOLS,
                                            tool_choice="required", response_format=fmt, parallel_tool_calls=False,
                                            max_tokens=60, temperature=0)  # fmt: skip
    assert len(required.choices[0].message.tool_calls) == 1 and required.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_responses_and_messages_take_tools_with_a_format(gw: Stack) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    r = oai(gw).responses.create(model="m", input="What is two plus two?", tools=RESPONSES_TOOLS, tool_choice="none",
                                 text={"format": fmt}, max_output_tokens=60, temperature=0)  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    r = oai(gw).responses.create(model="m", input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                 text={"format": fmt}, max_output_tokens=80, temperature=0)  # fmt: skip
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls or jsonschema.validate(json.loads(r.output_text), ANSWER) is None
    assert not (calls and r.output_text)
    m = claude(gw).messages.create(model="m", max_tokens=80, messages=[{"role": "user", "content": "What is 2+2?"}],
                                   tools=MESSAGES_TOOLS, tool_choice={"type": "none"}, extra_body={"temperature": 0,
                                   "output_config": {"format": {"type": "json_schema", "schema": ANSWER}}})  # fmt: skip
    assert [b.type for b in m.content] == ["text"]
    jsonschema.validate(json.loads(m.content[0].text), ANSWER)


@pytest.mark.slow
def test_at_most_one_call_in_every_api(gw: Stack) -> None:
    ask = [{"role": "user", "content": TWO_CITIES}]
    kwargs: dict[str, Any] = dict(model="m", messages=ask, tools=CHAT_TOOLS, tool_choice="required", max_tokens=100,
                                  temperature=0)  # fmt: skip
    several = oai(gw).chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert len(several) >= 2, several  # the prompt does lead to several calls when they are allowed
    one = oai(gw).chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert one.message.tool_calls[0].function.arguments == several[0].function.arguments  # the same first call
    r = oai(gw).responses.create(model="m", input=TWO_CITIES, tools=RESPONSES_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=100, temperature=0)  # fmt: skip
    assert [i.type for i in r.output] == ["function_call"] and r.parallel_tool_calls is False
    m = claude(gw).messages.create(model="m", max_tokens=100, messages=ask, tools=MESSAGES_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0})  # fmt: skip
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"


@pytest.mark.slow
def test_bad_parallel_flags_are_400s_in_each_apis_shape(gw: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls must be a boolean"):
        oai(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], tools=CHAT_TOOLS,
                                        max_tokens=4, extra_body={"parallel_tool_calls": "no"})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls must be a boolean"):
        oai(gw).responses.create(model="m", input="Hi", max_output_tokens=4, extra_body={"parallel_tool_calls": 1})
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use must be a boolean"):
        claude(gw).messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                   tools=MESSAGES_TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": "x"})  # type: ignore[typeddict-item]  # fmt: skip
