"""A Generate request's tools, tool_choice and response_format, turned into a grammar spec and, for tools,
the call format its reply is parsed with.

Tools with a response format (tool_choice auto) make one structural tag: calls, or text in the format. The
format becomes an element of that tag, converted to EBNF where the tag compiles (in a compile worker, as
the format alone is compiled: compact JSON), so its text is the same language with or without tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbd.engine.grammar.matcher import GrammarKind, GrammarSpec
from cbd.engine.grammar.schema_check import load_schema
from cbd.engine.grammar.tag_formats import format_element
from cbd.errors import InvalidRequest
from cbd.server.tool_calls import (
    MAX_TOOL_NAME_CHARS,
    CallFormat,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    grammar_for,
    parse_tools,
)
from cbd_client.contract import SCHEMA_PATH
from cbd_client.v1 import cbd_pb2 as pb

_MODES = {
    pb.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED,
}


@dataclass(frozen=True, slots=True)
class Structure:
    tools: list[Tool] = field(default_factory=list)  # rendered into the prompt
    spec: GrammarSpec | None = None  # the reply's grammar
    parse_calls: bool = False  # split the reply into text and tool calls
    calls_only: bool = False  # tool_choice required or named: the reply is calls and nothing else
    formatted: bool = False  # calls or text in a response format: a call start never completed is text


def structure(request: pb.GenerateRequest, fmt: CallFormat) -> Structure:
    """Validate the request's structured-output fields; raises InvalidRequest naming the problem."""
    tools = parse_tools([(t.name, t.description, t.parameters) for t in request.tools])
    choice = _choice(request)
    kind = request.response_format.WhichOneof("format") if request.HasField("response_format") else None
    if tools and request.WhichOneof("input") != "chat":
        raise InvalidRequest("tools need chat input: they are rendered with the model's chat template")
    calls_only = choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
    format_spec = None if kind is None else _format_spec(request.response_format, kind)  # checked even if moot
    if format_spec is not None and (not tools or choice.mode is ToolChoiceMode.NONE):
        return Structure(tools, format_spec)
    text_format = _format_element(format_spec) if format_spec is not None and not calls_only else None
    spec = grammar_for(fmt, tools, choice, text_format)
    return Structure(tools, spec, spec is not None, spec is not None and calls_only, text_format is not None)


def _choice(request: pb.GenerateRequest) -> ToolChoice:
    if not request.HasField("tool_choice"):
        return ToolChoice()
    which = request.tool_choice.WhichOneof("choice")
    if which == "name":
        if len(request.tool_choice.name) > MAX_TOOL_NAME_CHARS:
            raise InvalidRequest(f"tool_choice.name has at most {MAX_TOOL_NAME_CHARS} characters (a tool's name)")
        return ToolChoice(ToolChoiceMode.NAMED, request.tool_choice.name)
    mode = _MODES.get(request.tool_choice.mode)
    if mode is None:
        raise InvalidRequest(f"unknown tool_choice mode {request.tool_choice.mode}")
    return ToolChoice(mode, at_most_one=request.tool_choice.at_most_one_call)


def _format_spec(fmt: pb.ResponseFormat, kind: str) -> GrammarSpec:
    if kind == "json_object":
        if not fmt.json_object:
            raise InvalidRequest("response_format.json_object must be true when set")
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    source = getattr(fmt, kind)
    if not source:
        raise InvalidRequest(f"response_format.{kind} is empty")
    if kind == "json_schema":  # refused here, before any compile, if the grammar would not enforce it
        load_schema(source, SCHEMA_PATH)
    return GrammarSpec(GrammarKind(kind), source)


def _format_element(spec: GrammarSpec) -> dict[str, Any]:
    """The format as a structural-tag element; its EBNF is made where the tag compiles (engine/grammar/tag_formats.py)."""
    return format_element(spec.kind.value, spec.source)
