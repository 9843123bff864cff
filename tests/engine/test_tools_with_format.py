"""Tools together with a response format, and at most one call: the request's rules (server/structured.py),
the languages of the grammars they make (checked string by string with xgrammar's matcher, and by masked
random walks whose every reply must be calls only or text valid under the format), and the parser's
release of a format's text that begins like a call (llama3_json)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from cbd.engine.grammar.matcher import GrammarKind
from cbd.engine.grammar.tag_formats import expand, format_element
from cbd.errors import InvalidRequest
from cbd.server.structured import structure
from cbd.server.tool_call_parser import ToolCallParser
from cbd.server.tool_calls import GENERIC, HERMES, LLAMA3_JSON, MISTRAL, CallFormat
from cbd_client.v1 import cbd_pb2 as pb
from grammar_cases import walk

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
ANSWER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
          "required": ["name", "n"]}  # fmt: skip
FORMATS = [HERMES, MISTRAL, LLAMA3_JSON, GENERIC]


def request(choice: dict[str, Any] | None = None, schema: dict[str, Any] | None = ANSWER) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    r.chat.messages.add(role="user", content="Weather in Paris?")
    for name in ("get_weather", "search"):
        r.tools.add(name=name, parameters=json.dumps(WEATHER))
    if choice is not None:
        r.tool_choice.CopyFrom(pb.ToolChoice(**choice))
    if schema is not None:
        r.response_format.json_schema = json.dumps(schema)
    return r


def accepts(compiler, spec, text: str) -> bool:
    """Whether the grammar's language holds exactly this text (the whole of it, then the end)."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec).compiled)
    return bool(matcher.accept_string(text)) and bool(matcher.accept_token(compiler.info.stop_token_ids[0]))


def call(fmt: CallFormat, city: str = "Paris") -> str:
    return fmt.call_text("get_weather", json.dumps({"city": city}))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_auto_with_a_format_is_calls_only_or_text_in_the_format(compiler, fmt) -> None:
    s = structure(request(), fmt)
    assert s.spec is not None and s.spec.kind is GrammarKind.STRUCTURAL_TAG
    assert s.parse_calls and s.formatted and not s.calls_only
    assert accepts(compiler, s.spec, call(fmt))
    assert accepts(compiler, s.spec, call(fmt) + "\n" + call(fmt, "Rome"))
    assert accepts(compiler, s.spec, '{"name": "Bob", "n": 3}')
    assert not accepts(compiler, s.spec, '{"name":"Bob","n":3}')  # the format's compact JSON, as without tools
    assert not accepts(compiler, s.spec, '{"name": "Bob"}')  # required key missing
    assert not accepts(compiler, s.spec, "Let me check. " + call(fmt))  # no free text beside calls
    assert not accepts(compiler, s.spec, '{"name": "Bob", "n": 3}' + call(fmt))
    assert not accepts(compiler, s.spec, "It is sunny.")


def test_none_is_the_format_alone_and_required_or_named_ignore_it(compiler) -> None:
    s = structure(request({"mode": pb.TOOL_CHOICE_MODE_NONE}), GENERIC)
    assert s.spec is not None and s.spec.kind is GrammarKind.JSON_SCHEMA and not s.parse_calls
    for choice in ({"mode": pb.TOOL_CHOICE_MODE_REQUIRED}, {"name": "get_weather"}):
        s = structure(request(choice), GENERIC)
        assert s.calls_only and not s.formatted and s.spec is not None
        assert accepts(compiler, s.spec, call(GENERIC))
        assert not accepts(compiler, s.spec, '{"name": "Bob", "n": 3}')
    with pytest.raises(InvalidRequest, match="response_format"):  # checked even where calls make it moot
        r = request({"mode": pb.TOOL_CHOICE_MODE_REQUIRED}, schema=None)
        r.response_format.json_schema = "{not json"
        structure(r, GENERIC)


@pytest.mark.parametrize("kind, value, good, bad", [
    ("json_object", True, '{"a": [1, 2]}', "[1]"),
    ("regex", "[0-9]{3}", "123", "12a"),
    ("grammar", 'root ::= "yes" | "no"', "no", "maybe"),
])  # fmt: skip
def test_every_format_kind_combines_with_tools(compiler, kind, value, good, bad) -> None:
    r = request(schema=None)
    setattr(r.response_format, kind, value)
    spec = structure(r, HERMES).spec
    assert accepts(compiler, spec, good) and accepts(compiler, spec, call(HERMES))
    assert not accepts(compiler, spec, bad)


@pytest.mark.parametrize("fmt", [GENERIC, LLAMA3_JSON], ids=lambda f: f.name)
def test_masked_walks_end_as_calls_only_or_as_valid_formatted_text(compiler, fmt) -> None:
    s = structure(request(), fmt)
    grammar = compiler.compile(s.spec)
    vocab = compiler.info.decoded_vocab
    for seed in range(8):
        state = grammar.new_state()
        tokens = walk(state, compiler, seed, max_tokens=600)
        assert state.finished
        parser = ToolCallParser(fmt, formatted=True)
        text, _ = parser.feed(b"".join(vocab[t] for t in tokens[:-1]).decode())
        text += parser.finish()
        if parser.calls:
            assert text == "" and all(c.complete for c in parser.calls)
            for c in parser.calls:
                jsonschema.validate(json.loads(c.arguments), WEATHER)
        else:
            jsonschema.validate(json.loads(text), ANSWER)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_at_most_one_call_ends_the_reply_after_the_first(compiler, fmt) -> None:
    auto = structure(request({"at_most_one_call": True}, schema=None), fmt).spec
    assert accepts(compiler, auto, "Sure. " + call(fmt)) and accepts(compiler, auto, "No call needed.")
    assert not accepts(compiler, auto, "Sure. " + call(fmt) + "\n" + call(fmt, "Rome"))
    assert not accepts(compiler, auto, call(fmt) + " And more text.")
    several = structure(request(schema=None), fmt).spec  # the default: several calls
    assert accepts(compiler, several, "Sure. " + call(fmt) + "\n" + call(fmt, "Rome"))
    required = structure(request({"mode": pb.TOOL_CHOICE_MODE_REQUIRED, "at_most_one_call": True}, None), fmt).spec
    assert accepts(compiler, required, call(fmt))
    assert not accepts(compiler, required, call(fmt) + "\n" + call(fmt, "Rome"))
    with_format = structure(request({"at_most_one_call": True}), fmt).spec
    assert accepts(compiler, with_format, call(fmt)) and accepts(compiler, with_format, '{"name": "Bob", "n": 3}')
    assert not accepts(compiler, with_format, call(fmt) + "\n" + call(fmt, "Rome"))


def test_formatted_replies_are_calls_or_text_never_both() -> None:
    reply = call(HERMES) + "\n" + call(HERMES, "Rome")
    for cut in range(len(HERMES.trigger), len(reply) + 1):  # shorter cuts may be text in a regex or grammar format
        parser = ToolCallParser(HERMES, formatted=True)
        text = "".join(parser.feed(piece)[0] for piece in reply[:cut]) + parser.finish()
        assert text == "", (cut, text)  # the separator between calls is not text
    parser = ToolCallParser(HERMES, formatted=True)
    assert parser.feed('{"name": "Bob", "n": 3}')[0] + parser.finish() == '{"name": "Bob", "n": 3}'


def test_formatted_text_that_begins_like_a_call_is_text() -> None:
    reply = '{"name": "Bob", "n": 3}'
    parser = ToolCallParser(LLAMA3_JSON, formatted=True)
    text, deltas = parser.feed(reply)
    assert (text + parser.finish(), deltas, parser.calls) == (reply, [], [])
    parser = ToolCallParser(LLAMA3_JSON)  # without a format a cut call start stays no text
    assert parser.feed(reply)[0] + parser.finish() == ""


def test_tools_and_format_too_large_together_are_refused() -> None:
    def big(n: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 5} for i in range(n)}}

    r = request(schema=big(1000))  # ~45 KB, and the tools below ~22 KB: each under the cap, not together
    structure(r, HERMES)
    r.tools.add(name="wide", parameters=json.dumps(big(500)))
    with pytest.raises(InvalidRequest, match="make a .*-byte grammar; at most"):
        structure(r, HERMES)


def test_the_format_is_converted_where_the_tag_compiles_not_where_the_request_is_read() -> None:
    # A hostile schema's conversion takes seconds: the frontend only writes it into the tag; the compile
    # (a killable worker with budgets) converts it.
    spec = structure(request(schema={"type": "string", "pattern": "(a|b){2,50}(c|d){2,50}"}), HERMES).spec
    assert spec is not None
    tag = json.loads(spec.source)
    assert '"type": "response_format"' in json.dumps(tag) and '"grammar"' not in json.dumps(tag)
    assert '"type": "response_format"' not in expand(spec.source) and '"type": "grammar"' in expand(spec.source)
    bad = {"type": "or", "elements": [{"type": "const_string", "value": "x"}, format_element("regex", "(unclosed")]}
    with pytest.raises(InvalidRequest, match="invalid response_format.regex"):
        expand(json.dumps({"type": "structural_tag", "format": bad}))
    # Only the `or` element is the format: a tool schema holding the same shape (a const) stays as sent.
    lookalike = {"type": "object", "properties": {"k": {"const": format_element("regex", "a")}}}
    tools = request(schema=None)
    tools.tools.add(name="odd", parameters=json.dumps(lookalike))
    tools.response_format.regex = "[0-9]+"
    tag = structure(tools, HERMES).spec
    assert tag is not None
    assert expand(tag.source).count('"type": "response_format"') == 1  # the tool's const, untouched
