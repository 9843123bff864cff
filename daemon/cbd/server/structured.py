"""A Generate request's tools, tool_choice and response_format, turned into a grammar spec and, for tools,
the call format its reply is parsed with."""

from __future__ import annotations

from dataclasses import dataclass, field

from cbd.engine.grammar import MAX_GRAMMAR_BYTES, GrammarKind, GrammarSpec
from cbd.engine.schema_check import load_schema
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


def structure(request: pb.GenerateRequest, fmt: CallFormat) -> Structure:
    """Validate the request's structured-output fields; raises InvalidRequest naming the problem."""
    tools = parse_tools([(t.name, t.description, t.parameters) for t in request.tools])
    choice = _choice(request)
    kind = request.response_format.WhichOneof("format") if request.HasField("response_format") else None
    constrained_by_tools = bool(tools) and choice.mode is not ToolChoiceMode.NONE
    if constrained_by_tools and kind is not None:
        raise InvalidRequest("give tools or response_format, not both (unless tool_choice is none)")
    if tools and request.WhichOneof("input") != "chat":
        raise InvalidRequest("tools need chat input: they are rendered with the model's chat template")
    if kind is not None:
        return Structure(tools, _format_spec(request.response_format, kind))
    spec = grammar_for(fmt, tools, choice)
    if spec is not None and len(spec.source.encode()) > MAX_GRAMMAR_BYTES:  # pragma: no cover - GrammarSpec checks
        raise InvalidRequest(f"the tools' schemas are over {MAX_GRAMMAR_BYTES} bytes")
    calls_only = choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
    return Structure(tools, spec, spec is not None, spec is not None and calls_only)


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
    return ToolChoice(mode)


def _format_spec(fmt: pb.ResponseFormat, kind: str) -> GrammarSpec:
    if kind == "json_object":
        if not fmt.json_object:
            raise InvalidRequest("response_format.json_object must be true when set")
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    source = getattr(fmt, kind)
    if not source:
        raise InvalidRequest(f"response_format.{kind} is empty")
    if kind == "json_schema":  # refused here, before any compile, if the grammar would not enforce it
        load_schema(source, "response_format.json_schema")
    return GrammarSpec(GrammarKind(kind), source)
