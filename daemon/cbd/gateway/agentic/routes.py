"""The agent APIs' routes, registered by app.create_app: Responses and Messages."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from starlette.responses import Response
from starlette.routing import Route

from cbd.gateway.errors import ApiError, named, reworded
from cbd.gateway.messages.routes import Messages, anthropic_errors, anthropic_response
from cbd.gateway.requests import CHAT_DAEMON_PARAMS, COMPLETIONS_DAEMON_PARAMS
from cbd.gateway.responses.request import DAEMON_PARAMS, DAEMON_PATHS
from cbd.gateway.responses.routes import Responses
from cbd.gateway.responses.store import ResponseStore, StoreSettings


def default_state_dir() -> Path:
    """<cache dir>/gateway: $CBD_CACHE_DIR, else $XDG_CACHE_HOME/cbd, else ~/.cache/cbd (the daemon's cache dir)."""
    env = os.environ.get("CBD_CACHE_DIR")
    cache = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cbd"
    return cache / "gateway"


MESSAGES_PREFIX = "/v1/messages"


def error_response(path: str, error: ApiError) -> Response:
    """An error in the shape of the API whose route `path` is: Anthropic's under /v1/messages, else OpenAI's."""
    if path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/"):
        return anthropic_response(error)
    for prefix, names, paths in _DAEMON_PARAMS:
        if path.startswith(prefix):
            return reworded(named(error, names), paths).response()
    return error.response()


_NO_PATHS: dict[str, str] = {}
_DAEMON_PARAMS = (("/v1/responses", DAEMON_PARAMS, DAEMON_PATHS), ("/v1/chat/completions", CHAT_DAEMON_PARAMS, _NO_PATHS),
                  ("/v1/completions", COMPLETIONS_DAEMON_PARAMS, _NO_PATHS))  # fmt: skip


def agent_routes(gateway: Any, store: StoreSettings | None = None) -> list[Route]:
    responses = Responses(gateway, ResponseStore(store or StoreSettings(default_state_dir())))
    messages = Messages(gateway)
    return [
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route(MESSAGES_PREFIX, anthropic_errors(messages.create), methods=["POST"]),
        Route(f"{MESSAGES_PREFIX}/count_tokens", anthropic_errors(messages.count_tokens), methods=["POST"]),
    ]
