"""Bounds on what a client sends, checked before any work is done for it.

Strings the daemon echoes (in every stream message, in error messages) or logs have a bounded length and
a charset that cannot break a log line; their errors name the field and the bound, never the value. A
prompt's text is refused by its size before it is tokenized: a prompt that fits the context cannot be
more than PROMPT_CHARS_PER_TOKEN characters per token of it (real text averages about 4), so tokenizing
more than that is work for a refusal (an 8 MB prompt holds a tokenizer thread for seconds).
"""

from __future__ import annotations

import re

from cbd.engine.sampling_params import check_stream_interval
from cbd.engine.sessions.records import check_client_session_id
from cbd.errors import InvalidRequest
from cbd_client.v1 import cbd_pb2 as pb

MAX_REQUEST_ID_CHARS = 128
MAX_SESSION_ID_CHARS = 128  # engine/sessions/records.py's rule
# No '/': a request id is namespaced as TENANT/ID (server/tenancy.py); no spaces or control characters.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._~:-]+")
PROMPT_CHARS_PER_TOKEN = 32


def check_request_id(request_id: str) -> None:
    """An empty id is fine (the daemon makes one)."""
    if request_id and (len(request_id) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(request_id)):
        raise InvalidRequest(
            f"request_id must be 1-{MAX_REQUEST_ID_CHARS} characters of letters, digits and . _ ~ : - "
            f"(got {len(request_id)} characters)"
        )


def check_session_id(session_id: str, field: str = "session_id", required: bool = False) -> None:
    """A session id a call names, by the rule of the ids a client may propose (engine/sessions/records.py);
    an empty one is fine unless `required` (empty means: no session, or one the daemon names)."""
    if not session_id and not required:
        return
    try:
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidRequest(field)
        check_client_session_id(session_id)
    except InvalidRequest:
        raise InvalidRequest(
            f"{field} must be 1-{MAX_SESSION_ID_CHARS} characters of letters, digits and . _ ~ - "
            f"(not starting with '.'); got {len(session_id)} characters"
        ) from None


def max_prompt_chars(max_model_len: int) -> int:
    return max_model_len * PROMPT_CHARS_PER_TOKEN


def check_prompt_size(
    message: pb.GenerateRequest | pb.TokenizeRequest | pb.OpenSessionRequest, max_model_len: int
) -> int:
    """Refuse a prompt whose text (what is rendered into it: text, chat messages, tools) is longer than
    any prompt that fits the context, before it is tokenized. Returns the text's size in characters."""
    size, limit = prompt_chars(message), max_prompt_chars(max_model_len)
    if size > limit:
        raise InvalidRequest(
            f"the prompt's text has {size} characters; at most {limit} are tokenized "
            f"({PROMPT_CHARS_PER_TOKEN} per token of the {max_model_len}-token context)"
        )
    return size


def prompt_chars(message: pb.GenerateRequest | pb.TokenizeRequest | pb.OpenSessionRequest) -> int:
    """Characters of client text a prompt renders (token id inputs count none)."""
    kind = message.WhichOneof("prefix" if isinstance(message, pb.OpenSessionRequest) else "input")
    size = 0
    if kind == "text":
        size = len(message.text)
    elif kind == "chat":
        for m in message.chat.messages:
            size += len(m.role) + len(m.content) + len(m.tool_call_id)
            size += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    if isinstance(message, pb.GenerateRequest):
        size += sum(len(t.name) + len(t.description) + len(t.parameters) for t in message.tools)
    return size


def stream_interval(request: pb.GenerateRequest) -> int | None:
    """The request's own stream_interval (None: unset, the daemon chooses by its class)."""
    if not request.HasField("stream_interval"):
        return None
    check_stream_interval("stream_interval", request.stream_interval)  # refused before anything else is read
    return request.stream_interval
