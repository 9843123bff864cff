"""The one exception type the client raises for a failed call."""

from __future__ import annotations

import grpc

from cbd_client.contract import RETRY_PUSHBACK_HEADER


class CbdError(Exception):
    """A call failed; `code` is the gRPC status (e.g. INVALID_ARGUMENT), `details` the daemon's message,
    `retry_after` the seconds the daemon suggests waiting before retrying (None when it gave none)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after = retry_after

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> CbdError:
        return cls(error.code(), error.details() or "", _retry_after(error))


def invalid_argument(message: str) -> CbdError:
    """A request the contract's types cannot carry, refused in the client, as the daemon would refuse it."""
    return CbdError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _retry_after(error: grpc.RpcError) -> float | None:
    trailing = getattr(error, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # noqa: BLE001 - a call without trailers has no hint
        return None
    for key, value in metadata or ():
        if key == RETRY_PUSHBACK_HEADER:  # the daemon's retry hint on RESOURCE_EXHAUSTED
            try:
                return max(0, int(value)) / 1000
            except (TypeError, ValueError):
                return None
    return None
