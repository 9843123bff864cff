"""Errors as OpenAI API clients expect them: an HTTP status and {"error": {message, type, param, code}}."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import grpc
from starlette.responses import JSONResponse

from cbd_client.errors import CbdError

# gRPC status -> (HTTP status, the API's error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),  # the daemon's doing: 499 is the client's only
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# gRPC core's words for a message over max_(send|receive)_message_length ("Received message larger than max
# (N vs. M)", "Sent message larger than max (N vs. M)")
_MESSAGE_TOO_LARGE = "message larger than max"


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_cbd(error: CbdError) -> ApiError:
    """The daemon's refusal as the API's: 429 carries the daemon's retry hint (Retry-After, retry-after-ms).

    gRPC's own refusal of a message over its size limit is RESOURCE_EXHAUSTED too, but no retry can
    succeed: 413, never 429 (the openai client retries 429s)."""
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE in error.details:
        return ApiError(413, f"the request is too large for the daemon: {error.details}", code="request_too_large")
    status, kind = _STATUS.get(error.code, (500, "server_error"))
    headers = {}
    if error.retry_after is not None:
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after))),
                   "retry-after-ms": str(max(1, round(1000 * error.retry_after)))}  # fmt: skip
    return ApiError(status, error.details or error.code.name, kind, code=error.code.name.lower(), headers=headers)


# The daemon's refusals begin with its own name for the field at fault; an API names that field its way.
_DAEMON_FIELDS = (
    (re.compile(r"tool (\d+)\b"), "tools[{}]"),
    (re.compile(r"tool '|at most \d+ tools|invalid structural_tag"), "tools"),
    (re.compile(r"(tool_choice|temperature|top_p|top_k|min_p|seed|n|logprobs|max_tokens)\b"), "{}"),
    (re.compile(r"stop |each stop string|stop strings"), "stop"),
    (re.compile(r"invalid (json_schema|json_object|response_format)|response_format"), "response_format"),
    (re.compile(r"the prompt|prompt token ids|the chat template|chat message"), "messages"),
)
_TOO_LONG = re.compile(r"the prompt(?:'s text)? has \d+ (?:tokens|characters)")


def reworded(error: ApiError, paths: Mapping[str, str]) -> ApiError:
    """A refusal whose message begins with the daemon's path of a field the API calls otherwise (`paths`: the
    daemon's -> the API's, e.g. a schema's `response_format.json_schema`), in the API's words."""
    for daemon, api in paths.items():
        if error.message.startswith((daemon + ".", daemon + ":", daemon + " ")):
            error.message = api + error.message[len(daemon) :]
            break
    return error


def named(error: ApiError, names: Mapping[str, str]) -> ApiError:
    """A 400 that names no param (the daemon's refusal): the param its message names, as the API calls it
    (`names`: the daemon's field -> the API's, where they differ); a prompt over the context also gets the
    code context_length_exceeded."""
    if error.status != 400 or error.param is not None:
        return error
    for pattern, template in _DAEMON_FIELDS:
        found = pattern.match(error.message)
        if found is not None:
            field = template.format(*found.groups()) if found.groups() else template
            head = field.split("[", 1)[0]
            error.param = names.get(head, head) + field[len(head) :]
            if _TOO_LONG.match(error.message):
                error.code = "context_length_exceeded"
            return error
    return error
