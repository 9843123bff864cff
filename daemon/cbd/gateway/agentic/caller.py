"""The caller of an agent API call: the metadata passed to the daemon, and the key that owns what is stored.

The key is the sha256 of the bearer token (from `Authorization: Bearer ...` or Anthropic's `x-api-key`),
never the token itself. Stored objects are looked up by (key, id), so another key's id is simply not
found. Without a token every caller shares the key of the empty token.
"""

from __future__ import annotations

import hashlib

from starlette.datastructures import Headers


def bearer(headers: Headers) -> str:
    """The caller's token ('' for none)."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def metadata(headers: Headers) -> list[tuple[str, str]]:
    """gRPC metadata of the daemon call: the caller's token as a bearer token (the daemon checks it)."""
    token = bearer(headers)
    return [("authorization", f"Bearer {token}")] if token else []


def caller_key(headers: Headers) -> str:
    return hashlib.sha256(bearer(headers).encode()).hexdigest()
