"""Property-based fuzzing of the whole Generate request against a running daemon (tiny model).

Every generated request must end either in a valid stream (every candidate finishes, usage is
reported) or in a clean error status from a small allowed set; the daemon must never crash or hang,
leak KV blocks, and it must serve a normal request afterwards. CBD_FUZZ_EXAMPLES sets the number of
requests (default 10,000; raise it for a longer run).
"""

from __future__ import annotations

import os

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cbd_client import Client  # noqa: E402
from cbd_client.v1 import cbd_pb2 as pb  # noqa: E402
from cbd_client.v1.cbd_pb2_grpc import CbdStub  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402

EXAMPLES = int(os.environ.get("CBD_FUZZ_EXAMPLES", "10000"))
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,  # bad input
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # over a cap
    grpc.StatusCode.NOT_FOUND,  # unknown session
    grpc.StatusCode.FAILED_PRECONDITION,  # session state
}

_floats = st.one_of(
    st.floats(min_value=-2.0, max_value=3.0, width=32), st.sampled_from([0.0, 1.0, float("nan"), float("inf"), 1e30])
)
_schemas = st.sampled_from(["", "{}", '{"type": "object"}', "{bad", "[1]", '{"type": "nonsense"}', "x" * 70000])
_token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)), max_size=40)


@st.composite
def valid_requests(draw):  # type: ignore[no-untyped-def]
    """Requests within every limit (their variety exercises the engine: fan-outs, sampling, logprobs)."""
    request = pb.GenerateRequest()
    request.tokens.ids.extend(draw(st.lists(st.integers(2, 255), min_size=1, max_size=40)))
    request.n = draw(st.integers(0, 3))
    s = request.sampling
    s.max_tokens = draw(st.integers(1, 4))
    s.temperature = draw(st.floats(0.0, 2.0))
    s.top_p = draw(st.floats(0.01, 1.0))
    s.min_p = draw(st.floats(0.0, 1.0))
    s.top_k = draw(st.integers(0, 300))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        s.logprobs = draw(st.integers(0, 20))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 255), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    return request


@st.composite
def wild_requests(draw):  # type: ignore[no-untyped-def]
    """Any field anywhere in (and past) its range."""
    request = pb.GenerateRequest()
    kind = draw(st.sampled_from(["tokens", "tokens", "tokens", "text", "chat", "none"]))
    if kind == "tokens":
        request.tokens.ids.extend(draw(_token_ids))
    elif kind == "text":
        request.text = draw(st.text(max_size=40))
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            role = draw(st.sampled_from(["user", "assistant", "system", "", "robot"]))
            request.chat.messages.add(role=role, content=draw(st.text(max_size=20)))
    request.n = draw(st.sampled_from([0, 1, 1, 2, 3, 64, 65, 1000]))
    s = request.sampling
    if draw(st.integers(0, 3)) == 0:
        s.max_tokens = draw(st.sampled_from([0, 1, 2, 4, 8, 8, 8, 8, 600, 2**32 - 1]))  # past the context: LENGTH
    else:
        s.max_tokens = draw(st.integers(1, 6))  # keep most requests short
    for name in ("temperature", "top_p", "min_p"):
        if draw(st.booleans()):
            setattr(s, name, draw(_floats))
    if draw(st.booleans()):
        s.top_k = draw(st.sampled_from([0, 1, 5, 2**32 - 1]))
    if draw(st.booleans()):
        s.seed = draw(st.sampled_from([0, 7, 2**63 - 1, 2**63, 2**64 - 1]))
    if draw(st.booleans()):
        s.logprobs = draw(st.sampled_from([0, 1, 20, 21, 2**32 - 1]))
    s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=70)))
    s.ignore_eos = draw(st.booleans())
    s.include_special_tokens = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:
        request.session_id = draw(st.text(min_size=1, max_size=12))
    if draw(st.integers(0, 9)) == 0:
        request.request_id = draw(st.sampled_from(["fixed-id", "x" * 300]))
    if draw(st.integers(0, 9)) == 0:
        request.parent_candidate = draw(st.integers(0, 5))
    if draw(st.integers(0, 4)) == 0:
        for _ in range(draw(st.integers(0, 3))):
            request.tools.add(name=draw(st.sampled_from(["f", "g", "", 'a"b', "x" * 70])),
                              description=draw(st.text(max_size=10)), parameters=draw(_schemas))  # fmt: skip
    if draw(st.integers(0, 4)) == 0:
        choice = draw(st.sampled_from(["auto", "none", "required", "f", "nope", "bad-mode"]))
        if choice == "bad-mode":
            request.tool_choice.mode = 7  # not a ToolChoiceMode: open enums keep unknown numbers
        elif choice in ("auto", "none", "required"):
            request.tool_choice.mode = getattr(pb, f"TOOL_CHOICE_MODE_{choice.upper()}")
        else:
            request.tool_choice.name = choice
    if draw(st.integers(0, 4)) == 0:
        fmt = draw(st.sampled_from(["json_schema", "json_object", "regex", "grammar"]))
        if fmt == "json_schema":
            request.response_format.json_schema = draw(_schemas)
        elif fmt == "json_object":
            request.response_format.json_object = draw(st.booleans())
        else:
            values = ["", "(", "a+", "[a-z]{3}"] if fmt == "regex" else ["", 'root ::= "a"', "root ::= "]
            setattr(request.response_format, fmt, draw(st.sampled_from(values)))
    return request


@pytest.fixture(scope="module")
def fuzz_daemon(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz") / "cbd.sock", "--model", str(tiny_checkpoint("llama")),
                      "--num-kv-blocks", "256", "--max-model-len", "64")  # fmt: skip
    try:
        d.wait_serving(120)
        yield d
    finally:
        assert d.stop() == 0, d.log()[-4000:]


def test_fuzzed_requests_end_cleanly_and_the_daemon_keeps_serving(fuzz_daemon) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, int] = {}
    with grpc.insecure_channel(fuzz_daemon.address) as channel:
        stub = CbdStub(channel)

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(st.one_of(valid_requests(), wild_requests()))
        def check(request: pb.GenerateRequest) -> None:
            try:
                responses = list(stub.Generate(request, timeout=60))
            except grpc.RpcError as e:
                assert e.code() in ALLOWED, (e.code(), e.details(), request)
                assert len(e.details()) < 2000  # never echoes a huge input back
                seen[e.code().name] = seen.get(e.code().name, 0) + 1
                return
            n = request.n or 1
            finished = {c.index for r in responses for c in r.candidates if c.finish_reason}
            assert finished == set(range(n)), request
            assert responses[-1].HasField("usage")
            seen["OK"] = seen.get("OK", 0) + 1

        check()
    assert fuzz_process_alive(fuzz_daemon), fuzz_daemon.log()[-4000:]
    assert seen.get("OK", 0) > EXAMPLES // 20 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
    with Client(fuzz_daemon.address, timeout=60) as client:
        assert len(client.generate(list(range(2, 30)), max_tokens=4, ignore_eos=True).candidates[0].token_ids) == 4
        stats = client.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_used, stats.live_requests) == (0, 0, 0, 0)


def fuzz_process_alive(d: DaemonProcess) -> bool:
    return d.process.poll() is None
