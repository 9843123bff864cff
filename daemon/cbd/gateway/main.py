"""`cbd openai`: serve the OpenAI-compatible API (uvicorn) in front of a running daemon."""

from __future__ import annotations

import argparse
import logging
import sys

_HELP = "serve the OpenAI-compatible HTTP API in front of a running daemon (needs cbd[openai])"
_DESCRIPTION = ("Serve /v1/chat/completions, /v1/completions and /v1/models over HTTP, as a client of a running "
                "cbd daemon (install with: pip install 'cbd[openai]').")  # fmt: skip


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
    p.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from cbd.gateway.app import create_app
    except ImportError as exc:
        print(
            f"cbd openai: {exc.name} is missing; install the gateway with: pip install 'cbd[openai]'", file=sys.stderr
        )
        return 78
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"cbd openai: --listen must be HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 78
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(args.daemon, args.request_timeout)
    uvicorn.run(app, host=host.strip("[]"), port=int(port), log_level=args.log_level.lower(), access_log=False)
    return 0
