"""The one exception type the client raises for a failed call."""

from __future__ import annotations

import grpc


class CbdError(Exception):
    """A call failed; `code` is the gRPC status (e.g. INVALID_ARGUMENT), `details` the daemon's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> CbdError:
        return cls(error.code(), error.details() or "")  # type: ignore[attr-defined]
