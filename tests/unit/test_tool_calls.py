"""Tool-call formats: grammars from tools and tool_choice, chat rendering, and the streaming parser.

The parser is checked against the text it must take apart, split at every point; the grammars by walking
random logits under their mask (the embedded model's tokenizer) and parsing what comes out: every call
names a given tool and its arguments validate against that tool's schema (jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cbd.errors import InvalidRequest
from cbd.server.tool_call_parser import ToolCallParser
from cbd.server.tool_calls import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    detect_format,
    grammar_for,
    parse_tools,
    render_messages,
)  # fmt: skip
from grammar_cases import walk

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}  # fmt: skip
NESTED = {"type": "object", "properties": {"q": {"type": "object", "properties": {"terms": {"type": "array",
          "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["terms"]}}, "required": ["q"]}  # fmt: skip
TOOLS = [Tool("get_weather", "Weather now", WEATHER), Tool("search", "Search the web", NESTED)]


def fold(parser: ToolCallParser, pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    text, calls = [], {}
    for piece in pieces:
        out, deltas = parser.feed(piece)
        text.append(out)
        for d in deltas:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id
            call["name"] += d.name
            call["arguments"] += d.arguments
    text.append(parser.finish())
    return "".join(text), calls


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON, GENERIC], ids=lambda f: f.name)
def test_the_parser_splits_text_and_calls_wherever_the_stream_is_cut(fmt) -> None:
    args = [json.dumps({"city": "Paris {x}", "unit": "C"}), json.dumps({"q": {"terms": ['a"}', "b"]}})]
    reply = "Let me check. " + fmt.call_text("get_weather", args[0]) + "\n" + fmt.call_text("search", args[1])
    for cut in range(1, len(reply)):
        for pieces in ([reply[:cut], reply[cut:]], list(reply)):
            parser = ToolCallParser(fmt)
            text, calls = fold(parser, pieces)
            assert [c["name"] for c in calls.values()] == ["get_weather", "search"]
            assert [c["arguments"] for c in calls.values()] == args
            assert [c.arguments for c in parser.complete_calls] == args
            assert all(c["id"].startswith("call_") for c in calls.values())
            assert text == "Let me check. \n"


def test_text_that_only_looks_like_a_call_start_is_released_at_the_end() -> None:
    parser = ToolCallParser(HERMES)
    text, calls = fold(parser, ["a <tool", "_ca"])
    assert text == "a <tool_ca" and calls == {} and parser.calls == []


def test_a_call_cut_before_its_name_is_not_text() -> None:
    """The trigger was written, so the grammar had begun a call: the cut part of it is neither text nor a call."""
    for cut in range(len(HERMES.trigger), len(HERMES.begin) + 3):
        parser = ToolCallParser(HERMES)
        text, calls = fold(parser, ["Sure. " + HERMES.call_text("get_weather", "{}")[:cut]])
        assert text == "Sure. " and calls == {} and parser.calls == [], cut


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
def test_calls_only_replies_have_no_text_wherever_they_are_cut(fmt) -> None:
    """tool_choice required or named: separators between calls and a call's cut start are not text."""
    reply = fmt.call_text("get_weather", '{"city": "Paris"}') + "\n" + fmt.call_text("search", '{"q": "x"}')
    for cut in range(1, len(reply) + 1):
        parser = ToolCallParser(fmt, calls_only=True)
        text, calls = fold(parser, list(reply[:cut]))
        assert text == "", (cut, text)
        assert [c.name for c in parser.calls] == ["get_weather", "search"][: len(parser.calls)]


def test_a_call_cut_short_is_reported_incomplete() -> None:
    parser = ToolCallParser(HERMES)
    _, calls = fold(parser, [HERMES.call_text("get_weather", '{"city": "Pa')[: -len(HERMES.end)]])
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Pa'
    assert parser.complete_calls == []


def test_formats_are_read_off_the_chat_template() -> None:
    assert detect_format(None) is GENERIC and detect_format("{{ messages }}") is GENERIC
    assert detect_format("... <tool_call>\n{{ tool_call | tojson }}</tool_call>") is HERMES
    assert detect_format("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") is MISTRAL
    assert detect_format("{%- if tools %} ... <|python_tag|>") is LLAMA3_JSON


@pytest.mark.parametrize(
    "entries, match",
    [
        ([("", "", "")], "name must be 1 to 64"),
        ([("a", "", ""), ("a", "", "")], "given twice"),
        ([("a", "", "{nope")], "not valid JSON"),
        ([("a", "", "[1]")], "must be a JSON schema object"),
        ([(f"t{i}", "", "") for i in range(129)], "at most 128 tools"),
    ],
)
def test_bad_tools_are_invalid_requests(entries, match) -> None:
    with pytest.raises(InvalidRequest, match=match):
        parse_tools(entries)


def test_tool_choice_rules() -> None:
    assert grammar_for(HERMES, TOOLS, ToolChoice(ToolChoiceMode.NONE)) is None
    assert grammar_for(HERMES, [], ToolChoice()) is None
    with pytest.raises(InvalidRequest, match="not among the tools"):
        grammar_for(HERMES, TOOLS, ToolChoice(ToolChoiceMode.NAMED, "nope"))
    with pytest.raises(InvalidRequest, match="needs tools"):
        grammar_for(HERMES, [], ToolChoice(ToolChoiceMode.REQUIRED))


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", [ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED])
def test_constrained_replies_parse_into_calls_whose_arguments_validate(compiler, fmt, mode) -> None:
    spec = grammar_for(fmt, TOOLS, ToolChoice(mode, "search" if mode is ToolChoiceMode.NAMED else ""))
    assert spec is not None
    grammar = compiler.compile(spec)
    vocab = compiler.info.decoded_vocab
    schemas = {t.name: t.parameters for t in TOOLS}
    for seed in range(4):
        state = grammar.new_state()
        tokens = walk(state, compiler, seed, max_tokens=600)
        assert state.finished
        reply = b"".join(vocab[t] for t in tokens[:-1]).decode()
        parser = ToolCallParser(fmt, calls_only=True)
        assert fold(parser, [reply])[0] == ""  # the separators between calls are not text
        calls = parser.complete_calls
        assert calls, reply
        if mode is ToolChoiceMode.NAMED:
            assert [c.name for c in calls] == ["search"]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_generic_rendering_describes_tools_and_turns_calls_and_results_into_text() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "C"}'}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]  # fmt: skip
    out = render_messages(GENERIC, messages, TOOLS)
    assert (
        out[0]["role"] == "system"
        and out[0]["content"].startswith("Be brief.")
        and '"get_weather"' in out[0]["content"]
    )
    assert out[2]["content"] == GENERIC.call_text("get_weather", '{"city": "Paris", "unit": "C"}')
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    templated = render_messages(HERMES, messages, TOOLS)
    assert templated[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris", "unit": "C"},
    }


def test_a_tools_parameters_describe_an_object() -> None:
    assert parse_tools([("t", "d", '{"type": "object"}'), ("u", "d", "")])[0].parameters == {"type": "object"}
    for schema in ('{"type": "integer"}', '{"type": "string"}', '{"type": ["object", "null"]}'):
        with pytest.raises(InvalidRequest, match="parameters must be the schema of an object"):
            parse_tools([("t", "d", schema)])
