"""Supervision of the engine process: spawn it, read its Hello, watch it exit, kill it.

`EngineProcess.spawn` binds the channel (channel.py), starts the program and returns once the engine's
Hello arrived (the model is loaded and warm) or raises EngineStartFailed. `exited` resolves with the exit
status whenever the process ends, asked to or not; what that means for live requests is the caller's
business (remote.py). Runs on the frontend's event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from cbd.config import EngineConfig
from cbd.engine import api
from cbd.ipc.channel import FrontendChannel, bind


class EngineStartFailed(Exception):
    """The engine process could not start. kind: LOAD (the model could not be read as configured),
    SETTING (a setting that cannot work on this host), another failure's kind, or None (it exited)."""

    def __init__(self, message: str, kind: api.ErrorKind | None) -> None:
        super().__init__(message)
        self.kind = kind


class EngineProcess:
    def __init__(self, process: subprocess.Popen, channel: FrontendChannel) -> None:
        self.process = process
        self.channel = channel
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.on_exit: Callable[[int], object] | None = None  # called once on the event loop, with the status

    @classmethod
    async def spawn(cls, config: EngineConfig, program: Sequence[str], warmup: bool) -> tuple[EngineProcess, api.Hello]:
        """Spawn `program` (the engine process's entry, which takes --commands, --events, --config-json,
        --warmup/--no-warmup and --parent) and wait for its Hello. Raises EngineStartFailed."""
        channel = bind()
        argv = [
            *program, "--commands", channel.commands_address, "--events", channel.events_address,
            "--config-json", msgspec.json.encode(config).decode(), "--warmup" if warmup else "--no-warmup",
            "--parent", str(os.getpid()),
        ]  # fmt: skip
        spawned = cls(subprocess.Popen(argv, start_new_session=False), channel)
        spawned._watch_exit()
        try:
            return spawned, await spawned._hello()
        except BaseException:
            await spawned.kill()
            channel.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, command: api.Command) -> None:
        if not self.exited.done():
            self.channel.commands.send(api.command_encoder.encode(command), copy=False)

    async def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        await asyncio.shield(self.exited)

    def kill_now(self) -> None:
        """SIGKILL without waiting (its exit is then seen as any other)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)

    async def _hello(self) -> api.Hello:
        receive: asyncio.Future[Any] = asyncio.ensure_future(self.channel.events.recv())
        await asyncio.wait([receive, self.exited], return_when=asyncio.FIRST_COMPLETED)
        if not receive.done():
            receive.cancel()
            raise EngineStartFailed(
                f"the engine process exited with status {self.exited.result()} while starting", None
            )
        hello = api.hello_decoder.decode(receive.result())
        if hello.error is not None or hello.facts is None:
            error = hello.error or api.Failure(api.ErrorKind.ENGINE_FAILURE, "no model facts")
            raise EngineStartFailed(error.message, error.kind)
        return hello

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self.process.pid)
        except (AttributeError, OSError):  # no pidfd: poll

            async def poll() -> None:
                while self.process.poll() is None:
                    await asyncio.sleep(0.1)
                self._exit()

            asyncio.ensure_future(poll())
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self.process.wait()
            self._exit()

        loop.add_reader(pidfd, readable)

    def _exit(self) -> None:
        status = self.process.returncode
        if not self.exited.done():
            self.exited.set_result(status)
        if self.on_exit is not None:
            self.on_exit(status)
