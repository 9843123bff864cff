"""A real daemon (the embedded model, two bearer tokens: two tenants) and a real `cbd openai` gateway
in front of it, with its state directory in a temporary folder: the agent API tests' stack.

The daemon is conftest's session-wide `tenant_daemon` unless the module restarts it (then it is the stack's own);
the gateway and its state directory are always the module's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cbd_client.address import free_port
from daemon_process import DaemonProcess
from gateway_process import GatewayProcess

TOKEN = "alice-token"
OTHER_TOKEN = "bob-token"


class Stack:
    def __init__(self, daemon: DaemonProcess, tmp: Path, owns_daemon: bool) -> None:
        self.daemon, self.tmp, self.owns_daemon = daemon, tmp, owns_daemon
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway: GatewayProcess | None = None

    def start_gateway(self) -> None:
        """A gateway on this stack's port and state directory (again after stop_gateway: a restart)."""
        self.gateway = GatewayProcess(
            self.daemon.address, self.tmp / "gateway.log", "--state-dir", str(self.tmp / "state"), port=self.port
        )
        self.gateway.wait_serving(60)

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None

    def log(self) -> str:
        return (self.tmp / "gateway.log").read_text()

    def restart_daemon(self) -> None:
        """Stop the daemon (its sessions and prefix cache go with it) and serve again on the same address."""
        assert self.owns_daemon, "the shared daemon is not restarted: use stack(tmp) for a daemon of the module's own"
        assert self.daemon.stop() == 0, self.daemon.log()
        self.daemon = start_daemon(self.tmp)
        self.daemon.wait_serving()


def start_daemon(tmp: Path) -> DaemonProcess:
    """A daemon (not yet serving) behind the two tokens, its socket and token file in `tmp`."""
    (tmp / "tokens").write_text(f"alice {TOKEN}\nbob {OTHER_TOKEN}\n")
    return DaemonProcess(tmp / "cbd.sock", "--auth-token-file", str(tmp / "tokens"))


def stack(tmp: Path, daemon: DaemonProcess | None = None) -> Iterator[Stack]:
    """A gateway in `tmp` over `daemon` (the shared tenant daemon), or over a daemon of its own (None)."""
    s = Stack(daemon or start_daemon(tmp), tmp, owns_daemon=daemon is None)
    try:
        if s.owns_daemon:
            s.daemon.wait_serving()
        s.start_gateway()
        yield s
    finally:
        s.stop_gateway()
        if s.owns_daemon:
            assert s.daemon.stop() == 0, s.daemon.log()
