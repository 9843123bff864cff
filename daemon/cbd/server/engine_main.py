"""The engine process's entry: `python -m cbd.server.engine_main` (started by the daemon, never by hand).

It logs like the daemon (same format and destination), ignores the termination signals that reach the
whole process group or service (the daemon drains first, then sends Stop), dies with the daemon (leaving
no socket directory behind: ipc/channel.py), and serves the engine until told to stop (ipc/endpoint.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import torch

from cbd.config import EngineConfig
from cbd.ipc.channel import connect
from cbd.ipc.endpoint import serve
from cbd.lifetime import die_with_parent
from cbd.server import memory
from cbd.server.logs import configure as configure_logging

log = logging.getLogger("cbd.engine")


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="cbd-engine", description=__doc__.splitlines()[0])
    parser.add_argument("--commands", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-file", default="")
    parser.add_argument("--parent", type=int, default=0, help="the daemon's pid (exit at once if it is gone)")
    args = parser.parse_args(argv)
    # Connected first, and the socket directory removed, before asking to die with the daemon: a SIGKILL
    # from then on leaves nothing behind, and a daemon that dies before is seen here (ipc/channel.py).
    channel = connect(args.commands, args.events, args.parent)
    if channel is None:
        return 1
    die_with_parent()
    if args.parent and os.getppid() != args.parent:
        channel.close()
        return 1  # the daemon died before this process could ask to die with it
    configure_logging(args.log_level, log_file=args.log_file or None)
    config = EngineConfig.from_dict(json.loads(args.config_json))
    memory.configure(config)  # the allocator's settings, before the model loads
    threads = config.intra_op_threads()
    torch.set_num_threads(threads)
    log.info("engine process %d: %d intra-op threads", os.getpid(), threads)
    return serve(config, channel, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
