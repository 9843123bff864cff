"""`cbd openai`: serve the OpenAI-compatible API (uvicorn) in front of a running daemon."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

_HELP = "serve the OpenAI- and Anthropic-compatible HTTP APIs in front of a running daemon (needs cbd[openai])"
_DESCRIPTION = ("Serve OpenAI's /v1/chat/completions, /v1/completions, /v1/responses and /v1/models and "
                "Anthropic's /v1/messages over HTTP, as a client of a running cbd daemon (install with: "
                "pip install 'cbd[openai]').")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction, default_daemon: str) -> None:
    """`cbd openai` in the `cbd` command's help."""
    _add_arguments(sub.add_parser("openai", help=_HELP, description=_DESCRIPTION), default_daemon)


def main(argv: list[str]) -> int:
    """`cbd openai ...` (dispatched here before anything of the daemon is imported)."""
    from cbd_client.address import default_address

    parser = argparse.ArgumentParser(prog="cbd openai", description=_DESCRIPTION)
    _add_arguments(parser, default_address())
    return run(parser.parse_args(argv))


def _add_arguments(p: argparse.ArgumentParser, default_daemon: str) -> None:
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on (default 127.0.0.1:8000)")
    p.add_argument("--daemon", default=default_daemon, help=f"the daemon's gRPC address (default {default_daemon})")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a call may take before it is cancelled with 504 (default 600)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body in bytes; more is refused with 413 (default 8 MiB)")  # fmt: skip
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; then 408 (default 30)")  # fmt: skip
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive; then the connection is closed (default 10)")  # fmt: skip
    p.add_argument("--max-prompts", type=int, default=256,
                   help="most prompts in one /v1/completions call; more is refused with 400 (default 256)")  # fmt: skip
    p.add_argument("--max-json-depth", type=int, default=64,
                   help="deepest nesting of a request's JSON; deeper is refused with 400 (default 64)")  # fmt: skip
    p.add_argument("--max-conversations", type=int, default=512,
                   help="most resent conversations (Messages API, Chat Completions without X-Cbd-Session) whose "
                        "daemon sessions are kept for continuation; the least recently used beyond it are closed; "
                        "0: none; keep it below the daemon's --max-sessions (default 512)")  # fmt: skip
    p.add_argument("--state-dir", default=None,
                   help="where stored Responses API responses live (SQLite; default <cache dir>/gateway, the cache "
                        "dir being $CBD_CACHE_DIR or ~/.cache/cbd)")  # fmt: skip
    p.add_argument("--responses-ttl", type=float, default=30 * 86400.0,
                   help="seconds a stored response is kept (default 2592000: 30 days)")  # fmt: skip
    p.add_argument("--responses-max-rows", type=int, default=100_000,
                   help="most stored responses; the oldest beyond it are deleted (default 100000)")  # fmt: skip
    p.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from cbd.gateway.agentic.routes import default_state_dir
        from cbd.gateway.app import create_app
        from cbd.gateway.guard import guarded_protocol
        from cbd.gateway.limits import Limits
        from cbd.gateway.responses.store import StoreSettings
    except ImportError as exc:
        print(
            f"cbd openai: {exc.name} is missing; install the gateway with: pip install 'cbd[openai]'", file=sys.stderr
        )
        return 78
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"cbd openai: --listen must be HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 78
    try:
        limits = Limits(max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                        header_timeout=args.header_timeout, max_json_depth=args.max_json_depth,
                        max_prompts=args.max_prompts, max_conversations=args.max_conversations)  # fmt: skip
        store = StoreSettings(Path(args.state_dir) if args.state_dir else default_state_dir(), args.responses_ttl,
                              args.responses_max_rows)  # fmt: skip
    except ValueError as exc:
        print(f"cbd openai: {exc}", file=sys.stderr)
        return 78
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(args.daemon, args.request_timeout, limits, store)
    # h11 always (never httptools, even where installed): guarded_protocol extends it with the header timeout.
    uvicorn.run(app, host=host.strip("[]"), port=int(port), log_level=args.log_level.lower(), access_log=False,
                http=guarded_protocol(limits))  # fmt: skip
    return 0
