"""Python client for the cbd daemon (grpcio + protobuf only)."""

from cbd_client.address import default_address
from cbd_client.aio import AsyncClient
from cbd_client.client import Client
from cbd_client.errors import CbdError
from cbd_client.session import AsyncSession, Session
from cbd_client.types import (
    Candidate,
    Completion,
    Delta,
    ModelInfo,
    SessionInfo,
    Stats,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)  # fmt: skip

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "Candidate",
    "CbdError",
    "Client",
    "Completion",
    "Delta",
    "ModelInfo",
    "Session",
    "SessionInfo",
    "Stats",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "default_address",
]
