"""What one HTTP request may cost the gateway, and the request body parsed within those bounds.

Every limit is refused before the daemon sees the request: a body over `max_body_bytes` is a 413 while
it streams in (its declared Content-Length first, then the bytes counted chunk by chunk, never the
whole body buffered first); a body slower than `body_timeout` is a 408; headers slower than
`header_timeout` close the connection (guard.py). The parsed JSON may nest `max_json_depth` levels and
its strings must be valid Unicode (a lone surrogate such as "\\ud800" cannot reach protobuf);
`max_prompts` bounds the prompts of one /v1/completions call (each is a Generate call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cbd.gateway.errors import ApiError, bad_request

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 8 * MiB
    body_timeout: float = 30.0  # seconds for the whole body, from the request's headers on
    header_timeout: float = 10.0  # seconds for a request's headers, from the connection or the last response on
    max_json_depth: int = 64
    max_prompts: int = 256
    # Resent conversations whose sessions the gateway keeps for continuation (agentic/resends.py); 0: none.
    # Half the daemon's default max_sessions: the other half stays free for clients that open their own.
    max_conversations: int = 512

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        for name in ("body_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 2 <= self.max_json_depth <= 512:
            raise ValueError(f"max_json_depth must be from 2 to 512, got {self.max_json_depth}")
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {self.max_prompts}")
        if self.max_conversations < 0:
            raise ValueError(f"max_conversations must be >= 0, got {self.max_conversations}")


def too_large(limit: int, close: bool) -> ApiError:
    """413; `close`: the rest of the body is not worth reading (its length was not declared)."""
    return ApiError(413, f"the request body is larger than {limit} bytes", param=None, code="request_too_large",
                    headers={"Connection": "close"} if close else None)  # fmt: skip


def parse_json(body: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or a 400 (not JSON, too deep, a string that is not valid Unicode)."""
    try:
        value = json.loads(body)
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit: deeper than any limit here
        raise _too_deep(max_depth) from None
    except ValueError:  # includes UnicodeDecodeError
        raise bad_request("the request body is not JSON") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    _check_tree(value, max_depth)
    return value


def _check_tree(root: dict[str, Any], max_depth: int) -> None:
    """Depth and Unicode of every value, iteratively (a deep body must not recurse here either)."""
    # (value, depth, parent entry, key in the parent): the path is rebuilt only for an error message
    stack: list[tuple[Any, int, Any, Any]] = [(root, 1, None, None)]
    while stack:
        entry = stack.pop()
        value, depth = entry[0], entry[1]
        if isinstance(value, dict):
            if depth > max_depth:
                raise _too_deep(max_depth, _path(entry))
            for key, item in value.items():
                _text(key, entry)
                stack.append((item, depth + 1, entry, key))
        elif isinstance(value, list):
            if depth > max_depth:
                raise _too_deep(max_depth, _path(entry))
            stack.extend((item, depth + 1, entry, i) for i, item in enumerate(value))
        elif isinstance(value, str):
            _text(value, entry)


def _text(s: str, entry: tuple[Any, ...]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _path(entry)
        bad = s[exc.start].encode("unicode_escape").decode()
        raise bad_request(f"{where or 'the body'}: a string holds a lone surrogate ({bad}); strings must be valid "
                          "Unicode", where or None) from None  # fmt: skip


def _path(entry: tuple[Any, ...] | None) -> str:
    parts: list[str] = []
    while entry is not None and entry[2] is not None:
        key = entry[3]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    return "".join(reversed(parts)).lstrip(".")


def _too_deep(max_depth: int, where: str = "") -> ApiError:
    return bad_request(f"the request body nests deeper than {max_depth} levels" + (f" (at {where})" if where else ""),
                       where or None)  # fmt: skip
