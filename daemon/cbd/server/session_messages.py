"""Sessions as the gRPC API shows them: SessionInfo to its message, and the proto's session fields
(retention class, TTL) to the engine's terms. Session ids cross in the caller's terms (server/tenancy.py)."""

from __future__ import annotations

from cbd.engine.sampling_params import PRIORITY_BATCH
from cbd.engine.sessions.records import RETENTION_HIGH, RETENTION_LOW, RETENTION_NORMAL, SessionInfo
from cbd.errors import InvalidRequest
from cbd.server.tenancy import split_key
from cbd_client.contract import KV_TIER_PROTO, KvTier
from cbd_client.v1 import cbd_pb2 as pb


def ttl(seconds: float) -> float | None:
    """0 is the daemon's default (None); the engine checks the rest (inf: never expires; NaN is refused)."""
    return seconds or None


def session_info(info: SessionInfo) -> pb.SessionInfo:
    tenant, client_id = split_key(info.session_id)
    return pb.SessionInfo(
        session_id=client_id,
        tenant=tenant,
        num_tokens=info.num_tokens,
        resident_blocks=info.resident_blocks,
        pending_candidates=info.pending_candidates,
        idle_seconds=info.idle_seconds,
        busy=info.busy,
        ttl_seconds=info.ttl or 0.0,
        is_chat=info.is_chat,
        kv_tier=KV_TIER_PROTO[KvTier(info.tier)],
        host_blocks=info.host_blocks,
        disk_blocks=info.disk_blocks,
        expected_idle_ms=None if info.expected_idle is None else min(2**32 - 1, round(info.expected_idle * 1000)),
        retention={RETENTION_LOW: pb.RETENTION_LOW, RETENTION_HIGH: pb.RETENTION_HIGH}.get(
            info.retention, pb.RETENTION_NORMAL
        ),
        priority=pb.PRIORITY_BATCH if info.priority == PRIORITY_BATCH else pb.PRIORITY_INTERACTIVE,
    )


def retention(value: int) -> int | None:
    """The engine's retention class for a proto Retention; None for UNSPECIFIED."""
    classes: dict[int, int] = {
        pb.RETENTION_LOW: RETENTION_LOW,
        pb.RETENTION_NORMAL: RETENTION_NORMAL,
        pb.RETENTION_HIGH: RETENTION_HIGH,
    }
    if value == pb.RETENTION_UNSPECIFIED:
        return None
    if value not in classes:
        raise InvalidRequest(f"unknown retention {value}")
    return classes[value]
