"""The `cbd` command: `cbd openai` runs the gateway without importing the daemon (here, its only
dispatch; the daemon's parser lists it for --help only); the rest is the daemon's (server/app.py)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["openai"]:
        from cbd.gateway.main import main as gateway

        return gateway(argv[1:])
    from cbd.server.app import main as daemon

    try:
        return daemon(argv)
    except BrokenPipeError:  # the reader went away (`cbd config --print-defaults | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
