"""Tool calls and structured output through a real daemon with the embedded model (generic call format):
named and required choices always call valid tools, none never calls, streamed call deltas add up to the
final calls, a three-turn tool loop in a session reuses its KV, tools with a response format reply with
calls or valid JSON, at most one call ends a reply that would call again, the answer after a tool result
copies no tool markup, and bad input is INVALID_ARGUMENT."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from cbd_client import CbdError, Client
from daemon_process import DaemonProcess
from grammar_cases import SEARCH, WEATHER

pytestmark = [pytest.mark.slow, pytest.mark.first]
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
         {"name": "search", "description": "Search the web", "parameters": SEARCH}]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(shared_daemon: DaemonProcess) -> Iterator[Client]:
    with Client(shared_daemon.address, timeout=300) as c:
        yield c


def check_calls(candidate, names: set[str]) -> None:
    assert candidate.tool_calls, candidate
    for call in candidate.tool_calls:
        assert call.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert "<tool_call>" not in candidate.text  # calls never leak into the text


def test_model_info_reports_the_generic_format_and_limits(client) -> None:
    info = client.model_info()
    assert info.tool_call_format == "generic" and info.max_tools == 128 and info.max_grammar_bytes == 65536


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_choice_always_calls_that_tool_with_valid_arguments(client, temperature) -> None:
    result = client.generate(
        ASK, tools=TOOLS, tool_choice="search", n=4, seed=3, temperature=temperature, max_tokens=80
    )
    for c in result.candidates:
        assert c.finish_reason == "tool_calls" and [t.name for t in c.tool_calls] == ["search"] and c.text == ""
        check_calls(c, {"search"})


def test_required_calls_a_given_tool_and_none_never_calls(client) -> None:
    required = client.generate(ASK, tools=TOOLS, tool_choice="required", n=2, seed=1, temperature=0.8, max_tokens=120)
    for c in required.candidates:
        assert c.finish_reason == "tool_calls"
        check_calls(c, set(SCHEMAS))
    none = client.generate(ASK, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=40)
    assert none.candidates[0].tool_calls == [] and none.candidates[0].finish_reason in ("stop", "length")


def test_a_reply_of_calls_only_has_no_text_wherever_max_tokens_cuts_it(client) -> None:
    """tool_choice required: the separators between calls and a call cut before its name is complete are
    not text either."""
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=160)

    def announced() -> list[int]:
        """Where each further call's name is announced: the tokens before it hold the separator and its
        begin marker."""
        tokens, at = 0, []
        for delta in client.stream(ASK, **kwargs):
            tokens += len(delta.token_ids)
            at += [tokens for call in delta.tool_calls if call.name and call.index > 0]
        return at

    with ThreadPoolExecutor(2) as pool:  # the whole reply and its stream side by side (greedy: the same reply)
        streamed = pool.submit(announced)
        full = client.generate(ASK, **kwargs).candidates[0]
        names_at = streamed.result()
    check_calls(full, set(SCHEMAS))
    assert len(full.tool_calls) >= 2 and len(names_at) == len(full.tool_calls) - 1, (full, names_at)
    cuts = [1, 2, 3] + [at - k for at in names_at for k in range(1, 7)]
    with ThreadPoolExecutor(len(cuts)) as pool:  # one batch: each cut is its own request all the same
        replies = list(pool.map(lambda n: client.generate(ASK, **{**kwargs, "max_tokens": n}).candidates[0], cuts))
    for max_tokens, cut in zip(cuts, replies):
        assert cut.text == "" and cut.finish_reason == "length", (max_tokens, cut.text)


def test_streamed_call_deltas_add_up_to_the_final_calls(client) -> None:
    kwargs = dict(tools=TOOLS, tool_choice="get_weather", temperature=0.0, max_tokens=80)
    final = client.generate(ASK, **kwargs).candidates[0].tool_calls
    names, arguments, text = {}, {}, ""
    for delta in client.stream(ASK, **kwargs):
        text += delta.text
        for piece in delta.tool_calls:
            names[piece.index] = names.get(piece.index, "") + piece.name
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    assert text == "" and [names[0]] == [c.name for c in final] and [arguments[0]] == [c.arguments for c in final]


def test_json_schema_and_regex_response_formats(client) -> None:
    for temperature in (0.0, 1.0):
        result = client.generate(ASK, response_format={"type": "json_schema", "json_schema": WEATHER}, n=4, seed=2,
                                 temperature=temperature, max_tokens=60)  # fmt: skip
        for c in result.candidates:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), WEATHER)
    answer = client.generate("Is the sky blue? Answer:", response_format={"type": "regex", "regex": " (yes|no)"},
                             temperature=0.0, max_tokens=10, logprobs=5).candidates[0]  # fmt: skip
    assert answer.text in (" yes", " no") and answer.finish_reason == "stop"
    # Alternatives are tokens the grammar allows: fewer than asked where it allows fewer, never one at -inf.
    assert all(math.isfinite(v) for lp in answer.logprobs for _, v in lp.top)
    assert min(len(lp.top) for lp in answer.logprobs) < 5


def test_a_three_turn_tool_loop_in_a_session_reuses_its_kv(client) -> None:
    def get_weather(city: str, unit: str) -> str:
        return json.dumps({"city": city, "temperature": 18 if unit == "C" else 64, "unit": unit})

    cached = []
    with client.session([{"role": "system", "content": "You are a weather assistant."}]) as agent:
        messages = ASK
        for _ in range(3):
            reply = agent.send(messages, tools=TOOLS, tool_choice="get_weather", temperature=0.0, max_tokens=80)
            call = reply.candidates[0].tool_calls[0]
            check_calls(reply.candidates[0], {"get_weather"})
            cached.append(reply.usage.cached_prompt_tokens)
            messages = [{"role": "tool", "tool_call_id": call.id, "content": get_weather(**call.parsed_arguments())},
                        {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
    assert cached[0] < cached[1] < cached[2], cached


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(response_format={"type": "regex", "regex": "(["}), "invalid regex"),
        (dict(response_format={"type": "json_schema", "json_schema": "{nope"}), "json_schema is not valid JSON"),
        (dict(tools=TOOLS, tool_choice="nope"), "not among the tools"),
        (dict(tools=[{"name": "x", "parameters": "[1]"}]), "must be a JSON schema object"),
        (dict(tools=TOOLS, response_format={"type": "regex", "regex": "(["}), "invalid response_format.regex"),
        (dict(tool_choice="required"), "needs tools"),
        (dict(response_format={"type": "regex", "regex": "a" * 70000}), "at most 65536"),
    ],
)
def test_bad_structured_input_is_invalid_argument(client, kwargs, match) -> None:
    with pytest.raises(CbdError, match=match) as info:
        client.generate(ASK, max_tokens=4, **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.stats().kv_blocks_used == 0


def test_tools_need_chat_input(client) -> None:
    with pytest.raises(CbdError, match="tools need chat input"):
        client.generate("plain text", tools=TOOLS, max_tokens=4)


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"]}


def test_tools_with_a_response_format_reply_with_calls_or_valid_json(client) -> None:
    seen = set()
    for ask in ("What is the weather in Paris?", "What is two plus two?"):
        result = client.generate([{"role": "user", "content": ask}], tools=TOOLS, response_format=ANSWER, n=4,
                                 seed=1, temperature=1.0, max_tokens=100)  # fmt: skip
        for c in result.candidates:
            cut = c.finish_reason == "length"  # max_tokens may cut the last call, or the JSON
            if c.tool_calls:
                seen.add("calls")
                assert c.text == "" and c.finish_reason in ("tool_calls", "length")
                for call in c.tool_calls[: len(c.tool_calls) - cut]:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            elif not cut:
                seen.add("text")
                assert c.finish_reason == "stop"
                jsonschema.validate(json.loads(c.text), ANSWER)
    assert seen == {"calls", "text"}  # both sides of the grammar's `or` were taken
    text_only = client.generate(ASK, tools=TOOLS, tool_choice="none", response_format=ANSWER, temperature=0.0,
                                max_tokens=60).candidates[0]  # fmt: skip
    assert not text_only.tool_calls and jsonschema.validate(json.loads(text_only.text), ANSWER) is None
    calls_only = client.generate(ASK, tools=TOOLS, tool_choice="required", response_format=ANSWER, temperature=0.0,
                                 max_tokens=80).candidates[0]  # fmt: skip
    check_calls(calls_only, set(SCHEMAS))


def test_at_most_one_call_stops_a_reply_that_would_call_again(client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris and London?"}]
    several = client.generate(ask, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=100).candidates[0]
    assert len(several.tool_calls) >= 2, several  # this prompt calls again when it may
    one = client.generate(ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0.0,
                          max_tokens=100).candidates[0]  # fmt: skip
    check_calls(one, set(SCHEMAS))
    assert len(one.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert one.tool_calls[0].arguments == several.tool_calls[0].arguments  # greedy: the same first call, then the end


def test_the_answer_after_a_tool_result_has_no_tool_markup(client) -> None:
    cases = [("What is the weather in Paris?", "Paris"), ("How warm is it in Rome today?", "Rome"),
             ("Is it cold in Oslo?", "Oslo"), ("What is the weather in Berlin?", "Berlin")]  # fmt: skip
    for ask, city in cases:
        result = (
            "21 degrees C, sunny" if city == "Berlin" else json.dumps({"city": city, "temperature": 18, "unit": "C"})
        )
        messages = [{"role": "user", "content": ask},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                     "arguments": json.dumps({"city": city, "unit": "C"})}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": result}]  # fmt: skip
        for choice in ("auto", "none"):
            answer = client.generate(messages, tools=TOOLS, tool_choice=choice, temperature=0.0,
                                     max_tokens=60).candidates[0]  # fmt: skip
            assert answer.text.strip() or (choice == "auto" and answer.tool_calls), (ask, choice)
            for markup in ("<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>"):
                assert markup not in answer.text, (ask, choice, answer.text)
