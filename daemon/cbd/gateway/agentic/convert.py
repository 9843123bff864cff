"""Request fields both agent APIs map the same way onto a GenerateRequest, and the checks they share."""

from __future__ import annotations

import json
from typing import Any

from cbd.gateway.checks import number, set_top_p
from cbd.gateway.errors import bad_request
from cbd.gateway.requests import MAX_TOKENS, checked
from cbd_client.structured import set_response_format, set_tools
from cbd_client.v1 import cbd_pb2 as pb


def integer(body: dict[str, Any], name: str, low: int, high: int, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"{name} is required", name)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"{name} must be an integer from {low} to {high}, got {value!r}", name)
    return value


def sampling(request: pb.GenerateRequest, body: dict[str, Any], max_tokens: int | None) -> None:
    """temperature, top_p, top_k and the token budget (None: up to the context, where generation ends anyway)."""
    s = request.sampling
    s.max_tokens = MAX_TOKENS if max_tokens is None else max_tokens
    temperature = number(body, "temperature", 0, 2)
    if temperature is not None:
        s.temperature = temperature
    top_p = number(body, "top_p", 0, 1)
    if top_p is not None:
        set_top_p(s, top_p)
    top_k = integer(body, "top_k", 0, MAX_TOKENS)
    if top_k is not None:
        s.top_k = top_k


def tools(request: pb.GenerateRequest, functions: list[dict[str, Any]], choice: Any, parallel: bool = True) -> None:
    """Functions as {name, description, parameters}; choice as the chat API's tool_choice; parallel false:
    at most one call."""
    checked(lambda: set_tools(request, functions, choice, parallel))


def response_format(request: pb.GenerateRequest, fmt: dict[str, Any]) -> None:
    """A chat-API response_format (json_object or json_schema)."""
    checked(lambda: set_response_format(request, fmt))


def canonical_arguments(arguments: str) -> str:
    """A call's arguments as compared between a reply and its resend (key order and spacing aside)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments
