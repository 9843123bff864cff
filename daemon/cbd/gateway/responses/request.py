"""A Responses create body -> what to generate (a GenerateRequest template) and what to echo back.

Mapped: input, instructions, previous_response_id, max_output_tokens (omitted: up to the context),
temperature, top_p, tools (type function: name, description, parameters; `strict` is implied: calls
are always constrained to the schema), tool_choice (auto, none, required, {type: function, name}),
parallel_tool_calls (false: at most one call), text.format (text, json_object, json_schema; with tools
and tool_choice auto the output is calls or text in the format), store, stream, background (with
store, without stream), metadata (echoed), prompt_cache_key (at most 256 characters: the affinity key of
the session a new conversation opens, agentic/turns.py, so conversations that name the same key land on the
replica whose prefix cache holds what they share; echoed). Refused with a 400: tools of other types, conversation,
reasoning effort, and include. `model` is accepted and ignored (one model is served).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbd.gateway import checks
from cbd.gateway.agentic import convert
from cbd.gateway.errors import bad_request
from cbd.gateway.responses import items
from cbd_client.contract import SCHEMA_PATH
from cbd_client.v1 import cbd_pb2 as pb

# The daemon's names of fields its refusals name, as this API names them (errors.named).
DAEMON_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                 "logprobs": "top_logprobs"}  # fmt: skip
# ... and the paths its messages begin with (errors.reworded).
DAEMON_PATHS = {SCHEMA_PATH: "text.format.schema"}


@dataclass(slots=True)
class Create:
    template: pb.GenerateRequest  # sampling, tools and format; the input is set per plan
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # the new input as chat messages
    instructions: str | None
    previous_response_id: str | None
    stream: bool
    store: bool
    background: bool  # answer in_progress at once; the turn runs on, retrieve polls it, cancel aborts it
    echo: dict[str, Any]  # request fields the response object repeats
    prompt_cache_key: str | None = None


def parse(body: dict[str, Any]) -> Create:
    _refuse_unsupported(body)
    if not isinstance(body.get("model"), (str, type(None))):
        raise bad_request("model must be a string (one model is served, whatever it names)", "model")
    given = items.input_items(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    template = pb.GenerateRequest(n=1)
    max_tokens = convert.integer(body, "max_output_tokens", 1, convert.MAX_TOKENS)
    convert.sampling(template, body, max_tokens)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    parallel = checks.flag(body, "parallel_tool_calls", True)
    if tools:
        convert.tools(template, tools, choice, parallel)
    elif choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    text = checks.section(body, "text")
    fmt = text.get("format")
    if fmt is not None:
        _format(template, fmt)
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad_request("text.verbosity is not supported (only its default, medium)", "text.verbosity")
    metadata = _metadata(body.get("metadata"))
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise bad_request(f"truncation must be auto or disabled, got {truncation!r}", "truncation")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    store = checks.flag(body, "store", True)
    stream = checks.flag(body, "stream", False)
    background = checks.flag(body, "background", False)
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not (isinstance(cache_key, str) and 0 < len(cache_key) <= 256):
        raise bad_request("prompt_cache_key must be a string of 1 to 256 characters", "prompt_cache_key")
    if background and (stream or not store):
        raise bad_request("background needs store: true and no stream", "background")
    echo: dict[str, Any] = {
        "instructions": instructions, "max_output_tokens": max_tokens, "metadata": metadata,
        "parallel_tool_calls": parallel, "previous_response_id": previous,
        "temperature": _or(body.get("temperature"), 1.0), "top_p": _or(body.get("top_p"), 1.0),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": {"format": fmt or {"type": "text"}, "verbosity": "medium"}, "truncation": truncation or "disabled",
        "background": background, "store": store, "prompt_cache_key": cache_key, "user": user,
        "max_tool_calls": body.get("max_tool_calls"), "top_logprobs": 0,
    }  # fmt: skip
    return Create(
        template, given, items.messages(given), instructions, previous, stream, store, background, echo, cache_key
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("conversation") is not None:
        raise bad_request("conversation is not supported: continue with previous_response_id", "conversation")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") not in (None, "none"):
        raise bad_request("reasoning is not supported", "reasoning")
    if body.get("include"):
        raise bad_request("include is not supported", "include")
    if body.get("prompt") is not None:
        raise bad_request("prompt templates are not supported: send input and instructions", "prompt")
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs is not supported", "top_logprobs")
    calls = body.get("max_tool_calls")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        raise bad_request("max_tool_calls must be a positive integer", "max_tool_calls")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _metadata(value: Any) -> dict[str, str]:
    """At most 16 pairs of strings: keys of at most 64 characters, values of at most 512 (the API's bounds)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata[{key[:MAX_METADATA_KEY]!r}]: keys are strings of at most {MAX_METADATA_KEY} "
                              f"characters, values strings of at most {MAX_METADATA_VALUE}", "metadata")  # fmt: skip
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        if not isinstance(tool.get("description"), (str, type(None))):
            raise bad_request(f"tools[{i}].description must be a string", f"tools[{i}].description")
        if not isinstance(tool.get("parameters"), (dict, type(None))):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", f"tools[{i}].parameters")
        out.append({"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters")})  # fmt: skip
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}
    raise bad_request("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def _format(template: pb.GenerateRequest, fmt: Any) -> None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        convert.response_format(template, {"type": "json_object"})
    elif kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("text.format.name is required (a string)", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be an object", "text.format.schema")
        convert.response_format(template, {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}})
    else:
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format")
