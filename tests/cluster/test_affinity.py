"""Session affinity in the contract: ids proposed by the client (validated, unique), forks that keep their
source's affinity key, and the x-cbd-affinity header on every call about a session."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from cbd_client import CbdError, Client
from daemon_process import DaemonProcess

PROMPT = list(range(2, 40))


@pytest.fixture(scope="module")
def client(shared_tiny_daemon: DaemonProcess) -> Iterator[Client]:
    with Client(shared_tiny_daemon.address, timeout=60) as c:
        yield c


def test_a_proposed_session_id_is_used_and_must_be_unique_and_well_formed(client) -> None:
    with client.session(PROMPT, session_id="agent-7") as session:
        assert session.session_id == "agent-7" and client.get_session("agent-7").num_tokens == len(PROMPT)
        with pytest.raises(CbdError) as taken:
            client.session(session_id="agent-7")
        assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS and "agent-7" in taken.value.details
        reply = session.send([5, 6, 7], max_tokens=3, ignore_eos=True, temperature=0)
        assert len(reply.candidates[0].token_ids) == 3
    for bad in ("has space", ".starts-with-dot", "x" * 129, "slash/no"):
        with pytest.raises(CbdError) as malformed:
            client.session(session_id=bad)
        assert malformed.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_clients_propose_ids_and_forks_keep_the_affinity_key(client) -> None:
    with client.session(PROMPT) as session:
        assert len(session.session_id) == 32 and "." not in session.session_id  # proposed by the client
        session.send([5, 6], max_tokens=2, ignore_eos=True, temperature=0)
        fork = session.fork()
        key, _, suffix = fork.session_id.partition(".")
        assert key == session.session_id and suffix  # lands beside its source behind a proxy
        assert fork.info().num_tokens == session.info().num_tokens
        with pytest.raises(CbdError) as taken:
            client.fork_session(session.session_id, new_session_id=fork.session_id)
        assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS
        fork.close()


def test_every_call_about_a_session_carries_its_affinity_key() -> None:
    """A stand-in server that records each call's x-cbd-affinity (and answers UNIMPLEMENTED)."""
    seen: list[tuple[str, str | None]] = []

    class Recorder(grpc.GenericRpcHandler):
        def service(self, details):
            seen.append((details.method.rsplit("/", 1)[1], dict(details.invocation_metadata).get("x-cbd-affinity")))
            return None  # UNIMPLEMENTED

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Recorder(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as c:
            for call in (
                lambda: c.session(session_id="abc"),
                lambda: c.generate([1, 2], session_id="abc.f1"),
                lambda: list(c.stream([1, 2], session_id="abc")),
                lambda: c.get_session("abc"),
                lambda: c.fork_session("abc.f1"),
                lambda: c.close_session("abc"),
                lambda: c.generate([1, 2]),
                lambda: c.generate([1, 2], affinity="planner-prompt"),
                lambda: list(c.stream([1, 2], affinity="planner-prompt.v2")),
            ):
                with pytest.raises(CbdError):
                    call()
    finally:
        server.stop(0)
    assert seen == [("OpenSession", "abc"), ("Generate", "abc"), ("Generate", "abc"), ("GetSession", "abc"),
                    ("ForkSession", "abc"), ("CloseSession", "abc"), ("Generate", None),
                    ("Generate", "planner-prompt"), ("Generate", "planner-prompt")]  # fmt: skip
    with Client(f"127.0.0.1:{port}", timeout=10) as c, pytest.raises(CbdError) as both:
        c.generate([1, 2], session_id="abc", affinity="other")  # a session's calls go by its id
    assert both.value.code == grpc.StatusCode.INVALID_ARGUMENT
