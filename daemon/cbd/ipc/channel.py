"""The two sockets between the frontend and its engine process, and the directory that names them.

The frontend makes a private directory (0700: only this user can reach the sockets), binds a PUSH socket
for commands and a PULL socket for events there, and spawns the engine process with their addresses. The
engine process connects both and, once both connections are up, removes the directory: an established
connection needs no name, so from then on nothing is left in the temp directory whoever dies and however
(a SIGKILLed frontend included). The engine process asks to die with its parent only after that, so a
parent that dies while it connects is seen (`os.getppid()` changes) and the directory is still removed.
The frontend removes the directory too when its engine exits (an engine that died before connecting).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

_CONNECT_TIMEOUT = 60.0  # seconds: a frontend that bound its sockets and spawned us is there at once


def _tune(socket: zmq.Socket, linger_ms: int) -> None:
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)


@dataclass(slots=True)
class FrontendChannel:
    context: zmq.asyncio.Context
    commands: zmq.asyncio.Socket  # PUSH: frontend -> engine process
    events: zmq.asyncio.Socket  # PULL: engine process -> frontend
    directory: str
    commands_address: str
    events_address: str

    def close(self) -> None:
        self.commands.close(linger=0)
        self.events.close(linger=0)
        self.context.term()
        shutil.rmtree(self.directory, ignore_errors=True)


def bind() -> FrontendChannel:
    """The frontend's side, bound before the engine process is spawned."""
    directory = tempfile.mkdtemp(prefix="cbd-engine-")  # 0700
    commands_address, events_address = f"ipc://{directory}/commands", f"ipc://{directory}/events"
    context = zmq.asyncio.Context(1)
    commands, events = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    for s in (commands, events):
        _tune(s, 0)
    commands.bind(commands_address)
    events.bind(events_address)
    return FrontendChannel(context, commands, events, directory, commands_address, events_address)


@dataclass(slots=True)
class EngineChannel:
    context: zmq.Context
    commands: zmq.Socket  # PULL
    events: zmq.Socket  # PUSH

    def close(self) -> None:
        self.commands.close()
        self.events.close()
        self.context.term()


def connect(commands_address: str, events_address: str, parent: int) -> EngineChannel | None:
    """The engine process's side: connect both sockets, wait until both are connected, remove the socket
    directory. None (the directory removed, nothing left open) when the parent `parent` is gone first or
    the connections never come up."""
    context = zmq.Context(1)
    commands, events = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    _tune(commands, 5000)  # what is queued at exit still reaches the frontend
    _tune(events, 5000)
    monitors = [s.get_monitor_socket(zmq.EVENT_CONNECTED) for s in (commands, events)]
    commands.connect(commands_address)
    events.connect(events_address)
    pending = set(range(len(monitors)))
    deadline = time.monotonic() + _CONNECT_TIMEOUT
    while pending and time.monotonic() < deadline and (not parent or os.getppid() == parent):
        for i in list(pending):
            if monitors[i].poll(50) and recv_monitor_message(monitors[i])["event"] == zmq.EVENT_CONNECTED:
                pending.discard(i)
    for s, monitor in zip((commands, events), monitors, strict=True):
        s.disable_monitor()
        monitor.close(linger=0)
    _remove(commands_address, events_address)
    if pending:
        commands.close(linger=0)
        events.close(linger=0)
        context.term()
        return None
    return EngineChannel(context, commands, events)


def _remove(*addresses: str) -> None:
    """The socket files and then their directory (only if that leaves it empty: never a tree we did not make)."""
    paths = [a.removeprefix("ipc://") for a in addresses]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    for directory in {os.path.dirname(p) for p in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(directory)
