"""Bytes that are not a valid request message: INVALID_ARGUMENT naming the message, on every method, after auth."""

from __future__ import annotations

import grpc
import pytest

from cbd.server.methods import SERVICE
from cbd_client import Client
from cbd_client.v1 import cbd_pb2 as pb

CORRUPT = b"\xff\xff\xff"  # field number 0 / a truncated varint: no message parses from it
TOKEN = [("authorization", "Bearer tok-a")]


def _call(channel: grpc.Channel, method: str, server_streaming: bool, data: bytes, metadata: list) -> list[bytes]:  # type: ignore[type-arg]
    """Send raw bytes to /cbd.v1.Cbd/<method> and return the raw replies."""
    path = f"/{SERVICE.full_name}/{method}"
    if server_streaming:
        return list(channel.unary_stream(path)(data, timeout=30, metadata=metadata))
    return [channel.unary_unary(path)(data, timeout=30, metadata=metadata)]


def test_corrupt_bytes_are_invalid_argument_on_every_method_and_auth_still_applies(tiny_daemon, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-a\n")
    d = tiny_daemon("--auth-token-file", str(tokens))
    methods = [(m.name, m.server_streaming, m.input_type.full_name) for m in SERVICE.methods]
    assert ("Generate", True, "cbd.v1.GenerateRequest") in methods and len(methods) >= 8
    with grpc.insecure_channel(d.address) as channel:
        for name, server_streaming, message in methods:
            with pytest.raises(grpc.RpcError) as info:
                _call(channel, name, server_streaming, CORRUPT, TOKEN)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
            assert info.value.details() == f"the request is not a valid {message}", name
            with pytest.raises(grpc.RpcError) as denied:  # the interceptor answers before the bytes are read
                _call(channel, name, server_streaming, CORRUPT, [])
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        # Valid bytes on the same raw path are parsed and served, unary and streaming alike.
        (stats,) = _call(channel, "GetStats", False, pb.GetStatsRequest().SerializeToString(), TOKEN)
        assert pb.Stats.FromString(stats).kv_blocks_total > 0
        request = pb.GenerateRequest(
            tokens=pb.TokenIds(ids=list(range(2, 20))), sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
        )
        replies = [
            pb.GenerateResponse.FromString(r)
            for r in _call(channel, "Generate", True, request.SerializeToString(), TOKEN)
        ]
        assert sum(len(c.token_ids) for r in replies for c in r.candidates) == 3
    with Client(d.address, timeout=60, token="tok-a") as client:  # the typed client is unaffected
        assert len(client.generate(list(range(2, 20)), max_tokens=2, ignore_eos=True).candidates[0].token_ids) == 2
