"""Facts of the cbd.v1 contract that are not in the generated code: enum names, limits, header names.

Declared once here and imported by the client, the daemon's gRPC server and the OpenAI gateway (the
lowest layer above proto/cbd/v1/cbd.proto, which every one of them depends on). The names are the
client API's (`Delta.finish_reason`, `SessionInfo.kv_tier`, `priority=`, `retention=`) and the labels of
the daemon's metrics; each enum is a `StrEnum`, so a member is equal to (and formats as) its name.
Invariant: every proto enum value but UNSPECIFIED has exactly one name here.
"""

from __future__ import annotations

from enum import StrEnum

from cbd_client.v1 import cbd_pb2 as pb


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled, or the daemon shut down before the reply was complete
    ERROR = "error"  # the engine failed while running it
    TOOL_CALLS = "tool_calls"  # the reply ended in complete tool calls


class Priority(StrEnum):
    INTERACTIVE = "interactive"  # the default class
    BATCH = "batch"  # runs in what interactive work leaves


class Retention(StrEnum):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


class KvTier(StrEnum):
    """Where a session's KV is (SessionInfo.kv_tier)."""

    NONE = "none"  # no tokens yet
    GPU = "gpu"
    HOST = "host"  # the host tier (offloaded while idle)
    RECOMPUTE = "recompute"  # released: the next turn prefills its history again
    DISK = "disk"  # only in its session file (restored at start, not used since)


FINISH_REASON_PROTO: dict[FinishReason, pb.FinishReason] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
PRIORITY_PROTO: dict[Priority, pb.Priority] = {
    Priority.INTERACTIVE: pb.PRIORITY_INTERACTIVE,
    Priority.BATCH: pb.PRIORITY_BATCH,
}
RETENTION_PROTO: dict[Retention, pb.Retention] = {
    Retention.LOW: pb.RETENTION_LOW,
    Retention.NORMAL: pb.RETENTION_NORMAL,
    Retention.HIGH: pb.RETENTION_HIGH,
}
KV_TIER_PROTO: dict[KvTier, pb.KvTier] = {
    KvTier.NONE: pb.KV_TIER_NONE,
    KvTier.GPU: pb.KV_TIER_GPU,
    KvTier.HOST: pb.KV_TIER_HOST,
    KvTier.RECOMPUTE: pb.KV_TIER_RECOMPUTE,
    KvTier.DISK: pb.KV_TIER_DISK,
}
# The other way: a proto value to its name (UNSPECIFIED and unknown values are absent).
FINISH_REASON_NAME = {v: k for k, v in FINISH_REASON_PROTO.items()}
PRIORITY_NAME = {v: k for k, v in PRIORITY_PROTO.items()}
RETENTION_NAME = {v: k for k, v in RETENTION_PROTO.items()}
KV_TIER_NAME = {v: k for k, v in KV_TIER_PROTO.items()}

# SamplingParams.logprobs: the chosen token's logprob and at most this many alternatives.
MAX_LOGPROBS = 20
# GenerateRequest.n: at most this many candidates; SamplingParams.stop: at most this many strings.
MAX_CANDIDATES = 64
MAX_STOP_STRINGS = 16
# The path a refusal of a response format's schema begins with ("<path>.<where in the schema>: why").
SCHEMA_PATH = "response_format.json_schema"

# gRPC's own name for a server's "retry after this many milliseconds" hint (gRFC A6), sent with
# RESOURCE_EXHAUSTED; the client reads it into CbdError.retry_after and grpc's retry policy honours it.
RETRY_PUSHBACK_HEADER = "grpc-retry-pushback-ms"
# Session affinity (the proto's "Affinity"): every call about a session carries its affinity key here.
AFFINITY_HEADER = "x-cbd-affinity"
# The replica a proxy chose for an affinity key (deploy/envoy.py); sent back, it pins later calls to it.
REPLICA_HEADER = "x-cbd-replica"
