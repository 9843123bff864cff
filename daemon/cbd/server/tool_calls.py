"""Tool calls: the model family's call format, the grammar that holds a reply to it, and the parser that
turns a streamed reply back into calls.

A format is the text around one call: `begin` + tool name + `between` + arguments (a JSON object) + `end`.
The family is read off the chat template: `<tool_call>` tags (Qwen 2.5/3, Hermes), `[TOOL_CALLS]` (Mistral),
`<|python_tag|>` / ipython (Llama 3.x JSON calls). A template with no tool support (the embedded SmolLM2)
gets the generic format: the tags of the first family, with the tools described in a system message that
cbd writes. The reply is constrained by an xgrammar structural tag: free text in which the trigger starts a
call whose name is one of the tools and whose arguments match that tool's schema (tool_choice auto), one
or more calls and nothing else (required), or exactly one call of the named tool (a named choice). With a
response format besides (auto), the reply is either calls and nothing else or text in the format. With
at most one call, the first call ends the reply.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cbd.engine.grammar.matcher import MAX_GRAMMAR_BYTES, GrammarKind, GrammarSpec
from cbd.engine.grammar.schema_check import load_schema
from cbd.errors import InvalidRequest

MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64


@dataclass(frozen=True, slots=True)
class CallFormat:
    name: str
    begin: str  # before the tool's name
    between: str  # between the name and the arguments object
    end: str  # after the arguments object
    trigger: str  # what starts a call inside free text
    template_renders_tools: bool  # the chat template takes `tools=` itself

    def call_text(self, name: str, arguments: str) -> str:
        return f"{self.begin}{name}{self.between}{arguments}{self.end}"


HERMES = CallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>", True)
MISTRAL = CallFormat("mistral", '[TOOL_CALLS][{"name": "', '", "arguments": ', "}]", "[TOOL_CALLS]", True)
LLAMA3_JSON = CallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", '{"name": ', True)
GENERIC = CallFormat("generic", HERMES.begin, HERMES.between, HERMES.end, HERMES.trigger, False)


def detect_format(chat_template: str | None) -> CallFormat:
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("ipython" in template and "tools" in template):
        return LLAMA3_JSON
    return GENERIC


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # a JSON schema; {} = any JSON object

    def openai(self) -> dict[str, Any]:
        """The shape chat templates take in `tools=`."""
        schema = self.parameters or {"type": "object"}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": schema},
        }


class ToolChoiceMode(Enum):
    AUTO = "auto"  # text, or calls
    NONE = "none"  # text only: no grammar, nothing parsed
    REQUIRED = "required"  # at least one call
    NAMED = "named"  # exactly one call, of this tool


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str = ""
    at_most_one: bool = False  # the first call ends the reply


def parse_tools(entries: list[tuple[str, str, str]]) -> list[Tool]:
    """(name, description, parameters as JSON text) from the request, validated."""
    if len(entries) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools, got {len(entries)}")
    tools, seen = [], set()
    for i, (name, description, parameters) in enumerate(entries):
        if not name or any(c in name for c in '"\\\n') or len(name) > MAX_TOOL_NAME_CHARS:
            raise InvalidRequest(
                f"tool {i}: name must be 1 to {MAX_TOOL_NAME_CHARS} characters without quotes, backslashes or newlines"
            )
        if name in seen:
            raise InvalidRequest(f"tool {i}: the name {name!r} is given twice")
        seen.add(name)
        schema = load_schema(parameters, f"tool {name!r}: parameters") if parameters else {}
        if not isinstance(schema, dict):
            raise InvalidRequest(f"tool {name!r}: parameters must be a JSON schema object")
        kind = schema.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
            raise InvalidRequest(f"tool {name!r}: parameters must be the schema of an object (the call's arguments)")
        tools.append(Tool(name, description, schema))
    return tools


def grammar_for(
    fmt: CallFormat, tools: list[Tool], choice: ToolChoice, text_format: dict[str, Any] | None = None
) -> GrammarSpec | None:
    """The structural tag that holds a reply to the format; None for tool_choice none (or no tools).
    text_format: a structural-tag element the reply's text must match (a response format); with tool_choice
    auto the reply is then calls only or text in it, never both, so it parses either way."""
    if choice.mode is ToolChoiceMode.NONE or not tools:
        if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
            raise InvalidRequest(f"tool_choice {choice.mode.value} needs tools")
        return None
    if choice.mode is ToolChoiceMode.NAMED:
        named = [t for t in tools if t.name == choice.name]
        if not named:
            raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not among the tools given")
        return _structural_tag(_tag(fmt, named[0]))
    tags = [_tag(fmt, t) for t in tools]
    one = choice.at_most_one  # stop_after_first: the grammar ends after the first call
    # Calls only, one or more, one per line.
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one,
    }
    if choice.mode is ToolChoiceMode.REQUIRED:
        return _structural_tag(calls)
    if text_format is not None:
        return _structural_tag({"type": "or", "elements": [calls, text_format]})
    return _structural_tag({"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags, "stop_after_first": one})


def _tag(fmt: CallFormat, tool: Tool) -> dict[str, Any]:
    schema = tool.parameters or {"type": "object"}
    return {"type": "tag", "begin": f"{fmt.begin}{tool.name}{fmt.between}",
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": fmt.end}  # fmt: skip


def _structural_tag(fmt: dict[str, Any]) -> GrammarSpec:
    source = json.dumps({"type": "structural_tag", "format": fmt})
    size = len(source.encode())
    if size > MAX_GRAMMAR_BYTES:  # said here in the request's terms, before GrammarSpec refuses it
        raise InvalidRequest(
            f"the tools' schemas (with the response_format, if any) make a {size}-byte grammar; at most {MAX_GRAMMAR_BYTES}"
        )
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, source)


def generic_system_prompt(tools: list[Tool]) -> str:
    listing = "\n".join(json.dumps(t.openai()["function"]) for t in tools)
    example = GENERIC.call_text("<tool name>", "<arguments as a JSON object>")
    return ("You can call tools. The tools, one JSON object each:\n" + listing + "\nTo call a tool, reply with:\n"
            + example + "\nThe result comes back in a <tool_response> message.")  # fmt: skip


def render_messages(fmt: CallFormat, messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Messages for the chat template. Templates with tool support get OpenAI-shaped tool calls and `tool`
    messages as they are; for the generic format, calls become text in the assistant's content, results
    become user messages in <tool_response> tags, and a system message describes the tools."""
    if fmt.template_renders_tools:
        return [_openai_message(m) for m in messages]
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(GENERIC.call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": m["role"], "content": (m.get("content") or "") + calls})
        else:
            out.append({"role": m["role"], "content": m.get("content", "")})
    if tools:
        prompt = generic_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _openai_message(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": _json_or_text(c["arguments"])}}
             for c in m["tool_calls"]]  # fmt: skip
    return {**m, "tool_calls": calls}


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def new_call_id() -> str:
    return "call_" + secrets.token_hex(8)
