"""Tools, tool choice and response formats: from the caller's Python values to cbd.v1 messages.

tools=[{"name": "get_weather", "description": "...", "parameters": {...JSON schema...}}]
      (the OpenAI shape {"type": "function", "function": {...}} is accepted too)
tool_choice="auto" | "none" | "required" | "<a tool's name>" | {"name": "..."}
parallel_tool_calls=False: at most one call per candidate (default True: a reply may hold several)
response_format={"type": "json_schema", "json_schema": {...}} | {"type": "json_object"}
                | {"type": "regex", "regex": "..."} | {"type": "grammar", "grammar": "..."}
                | a JSON schema dict ({"type": "object", ...}) | a pydantic model class
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cbd_client.errors import invalid_argument
from cbd_client.v1 import cbd_pb2 as pb

_MODES = {"auto": pb.TOOL_CHOICE_MODE_AUTO, "none": pb.TOOL_CHOICE_MODE_NONE, "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def _json_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        return json.dumps(value.model_json_schema())
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise invalid_argument(f"{what} must be JSON (a dict, or JSON text): {exc}") from None


def set_tools(
    request: pb.GenerateRequest,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool = True,
) -> None:
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise invalid_argument(f"tool {i} must be a dict with 'name', 'description', 'parameters'")
        spec = tool.get("function", tool) if tool.get("type") == "function" else tool
        if not isinstance(spec.get("name"), str):
            raise invalid_argument(f"tool {i} needs a string 'name'")
        parameters = spec.get("parameters")
        request.tools.add(name=spec["name"], description=spec.get("description") or "",
                          parameters="" if parameters is None else _json_text(parameters, f"tool {spec['name']!r} parameters"))  # fmt: skip
    if not isinstance(parallel_tool_calls, bool):
        raise invalid_argument("parallel_tool_calls must be a boolean")
    if not parallel_tool_calls:
        request.tool_choice.at_most_one_call = True
    if tool_choice is None:
        return
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", tool_choice).get("name")
        if not isinstance(name, str):
            raise invalid_argument("tool_choice as a dict needs a tool 'name'")
        request.tool_choice.name = name
    elif isinstance(tool_choice, str):
        if tool_choice in _MODES:
            request.tool_choice.mode = _MODES[tool_choice]
        else:
            request.tool_choice.name = tool_choice
    else:
        raise invalid_argument("tool_choice must be 'auto', 'none', 'required', a tool's name, or {'name': ...}")


def set_response_format(request: pb.GenerateRequest, response_format: Any) -> None:
    if response_format is None:
        return
    target = request.response_format
    if isinstance(response_format, type):
        target.json_schema = _json_text(response_format, "response_format")
        return
    if not isinstance(response_format, dict):
        raise invalid_argument("response_format must be a dict or a pydantic model class")
    kind = response_format.get("type")
    if kind == "json_object":
        target.json_object = True
    elif kind == "json_schema" and "json_schema" in response_format:
        schema = response_format["json_schema"]
        schema = schema.get("schema", schema) if isinstance(schema, dict) and "schema" in schema else schema
        target.json_schema = _json_text(schema, "response_format json_schema")
    elif kind in ("regex", "grammar"):
        value = response_format.get(kind)
        if not isinstance(value, str):
            raise invalid_argument(f"response_format of type {kind!r} needs a string {kind!r}")
        setattr(target, kind, value)
    else:  # a JSON schema given directly
        target.json_schema = _json_text(response_format, "response_format")


def set_message_tool_fields(message: pb.ChatMessage, m: dict[str, Any]) -> None:
    """An assistant message's tool_calls (as a candidate reported them, or OpenAI-shaped) and a tool
    message's tool_call_id."""
    for call in m.get("tool_calls") or ():
        fn = call.get("function", call)
        arguments = fn.get("arguments", "")
        message.tool_calls.add(id=call.get("id", ""), name=fn.get("name", ""),
                               arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))  # fmt: skip
    if m.get("tool_call_id"):
        message.tool_call_id = m["tool_call_id"]
