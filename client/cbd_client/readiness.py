"""Is a daemon there, and is it ready? Shared by the blocking and the asyncio client.

A daemon listens before it loads its model and answers grpc.health.v1 NOT_SERVING until it is warm, so a
client can tell "no daemon at this address" (fail at once, say what to do) from "a daemon that is starting"
(wait, and say so). The health call is made with raw bytes so that the client needs only grpcio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc

from cbd_client.errors import CbdError

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_REQUEST = b""  # HealthCheckRequest{service: ""}: the whole daemon
SERVING = 1
_START_HINT = "start one with `cbd serve --detach`, or point --address / CBD_ADDRESS at a running daemon"


def health_status(response: bytes) -> int:
    """HealthCheckResponse.status (field 1, a small enum varint); 0 (UNKNOWN) when absent."""
    return response[1] if len(response) >= 2 and response[0] == 0x08 else 0


def missing_socket(address: str) -> CbdError | None:
    """A unix address whose socket file does not exist: no daemon listens there (it creates it first)."""
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix:").removeprefix("//")
    if os.path.exists(path):
        return None
    return CbdError(grpc.StatusCode.UNAVAILABLE, f"no cbd daemon at {address}: {path} does not exist; {_START_HINT}")


def unreachable(address: str, error: grpc.RpcError) -> CbdError:
    reason = (error.details() or error.code().name).splitlines()[0]
    return CbdError(grpc.StatusCode.UNAVAILABLE, f"no cbd daemon answers at {address} ({reason}); {_START_HINT}")


def waiting_message(address: str, timeout: float, proxy: bool = False) -> str:
    if proxy:
        return f"no healthy replica behind the proxy at {address} yet; waiting up to {timeout:.0f}s for one to serve"
    return f"waiting up to {timeout:.0f}s for the daemon at {address} to finish loading its model"


# What a proxy (Envoy, deploy/) says in UNAVAILABLE when it answers but has no replica to send the call to:
# the replicas are starting (or all down), which is a wait, not "start a daemon".
_PROXY_WITHOUT_REPLICA = ("no healthy upstream", "upstream connect error", "no healthy host")


def proxy_without_replica(error: grpc.RpcError) -> bool:
    details = (error.details() or "").lower()
    return error.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _PROXY_WITHOUT_REPLICA)


def not_ready(address: str, timeout: float) -> CbdError:
    return CbdError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the daemon at {address} was still not ready after {timeout:.0f}s (loading, or shutting down); "
        "its log says why (journalctl -u cbd, or the --log-file)",
    )


POLL_SECONDS = 0.2
CHECK_TIMEOUT = 5.0


class Waiter:
    """The decisions of wait_ready, without its I/O: feed it each health check's outcome (the response
    bytes or the RpcError); it answers True once the daemon serves, False to poll again, or raises."""

    def __init__(self, address: str, timeout: float, on_wait: Callable[[str], None] | None) -> None:
        missing = missing_socket(address)
        if missing is not None:
            raise missing
        self.address = address
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.on_wait = on_wait

    def ready(self, outcome: bytes | grpc.RpcError) -> bool:
        proxy = False
        if isinstance(outcome, grpc.RpcError):
            code = outcome.code()
            proxy = proxy_without_replica(outcome)
            if code == grpc.StatusCode.UNAVAILABLE and not proxy:
                raise unreachable(self.address, outcome)
            if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise CbdError.from_rpc(outcome)
        elif health_status(outcome) == SERVING:
            return True
        if time.monotonic() > self.deadline:
            raise not_ready(self.address, self.timeout)
        if self.on_wait is not None:
            self.on_wait(waiting_message(self.address, self.timeout, proxy))
            self.on_wait = None  # said once
        return False
