"""Logging: structlog on top of the standard library, one format for every logger in the process.

JSON lines when stderr is not a terminal (journald, files, collectors), a readable console format on a
terminal. Libraries and the engine log through `logging`; their records go through the same renderer.
Requests are logged once, when they end (`request_line`); never per token, never prompt text.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str, json_lines: bool | None = None, log_file: str | None = None) -> None:
    """Log to `log_file` (appending) or stderr; JSON lines unless the destination is a terminal."""
    stream = open(log_file, "a", buffering=1) if log_file else sys.stderr  # noqa: SIM115 - lives as long as the process
    if json_lines is None:
        json_lines = not stream.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())


_requests = structlog.stdlib.get_logger("cbd.request")


def request_line(**fields: Any) -> None:
    """The one line a request gets: ids, token counts, latencies, how it ended."""
    _requests.info("request", **fields)
