"""Tenants: one token never reaches another tenant's sessions, forks, request ids or cached prefixes.

A real daemon (one for the module) with `--auth-token-file` naming alice, bob and an operator
(`--admin-token-name`). Every call bob makes about alice's session answers as an id that never existed
does (NOT_FOUND, the same message), and alice's session is unchanged: her next greedy turn equals the same
turn on a twin session that bob never touched.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cbd_client import Client
from cbd_client.errors import CbdError
from daemon_process import DaemonProcess, serving

TOKENS = "alice alice-token\nbob bob-token\nops ops-token\n"
PREFIX = [5, 17, 99, 23, 8, 41, 77, 3, 12, 64, 30, 2, 9, 11, 13, 15, 21, 33, 45, 6]
TURN = [7, 19, 28, 4]


@pytest.fixture(scope="module")
def shared(tiny_checkpoint, tmp_path_factory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    tokens = tmp / "tokens"
    tokens.write_text(TOKENS)
    flags = ("--auth-token-file", str(tokens), "--admin-token-name", "ops")
    with serving(tmp, *flags, model=str(tiny_checkpoint("llama"))) as d:
        yield d


@pytest.fixture()
def daemon(shared: DaemonProcess) -> Iterator[DaemonProcess]:
    """The module's daemon, every tenant's sessions closed after each test (by the admin token), so that each
    test starts with none."""
    yield shared
    with Client(shared.address, timeout=60, token="ops-token") as ops:
        for info in ops.list_sessions(all_tenants=True):
            ops.close_session(info.session_id, tenant=info.tenant)


def _refusal(call) -> CbdError:
    with pytest.raises(CbdError) as info:
        call()
    return info.value


def _greedy(session, tokens: list[int]) -> list[int]:
    return list(session.send(tokens, max_tokens=6, temperature=0, ignore_eos=True).candidates[0].token_ids)


def test_another_tenants_session_is_not_found_and_untouched(daemon) -> None:
    with (
        Client(daemon.address, timeout=60, token="alice-token") as alice,
        Client(daemon.address, timeout=60, token="bob-token") as bob,
    ):
        mine = alice.session(PREFIX, session_id="alice-agent-1")
        twin = alice.session(PREFIX, session_id="alice-twin")
        assert _greedy(mine, TURN) == _greedy(twin, TURN)

        def as_never_opened(call, session_id: str) -> None:
            theirs = _refusal(lambda: call(session_id))
            nobodys = _refusal(lambda: call("no-such-session"))
            assert theirs.code == nobodys.code == grpc.StatusCode.NOT_FOUND
            assert theirs.details.replace(session_id, "no-such-session") == nobodys.details

        as_never_opened(bob.get_session, "alice-agent-1")
        as_never_opened(bob.fork_session, "alice-agent-1")
        as_never_opened(bob.close_session, "alice-agent-1")
        as_never_opened(lambda sid: bob.generate(TURN, session_id=sid, max_tokens=2), "alice-agent-1")
        # bob's own session of the same name is his: it neither sees nor changes alice's.
        his = bob.session([1, 2, 3], session_id="alice-agent-1")
        assert his.info().num_tokens == 3 and his.info().tenant == "bob"
        his.close()
        assert [s.session_id for s in bob.list_sessions()] == []
        assert _refusal(lambda: bob.list_sessions(all_tenants=True)).code == grpc.StatusCode.PERMISSION_DENIED
        assert _refusal(lambda: bob.get_session("alice-agent-1", tenant="alice")).code == (
            grpc.StatusCode.PERMISSION_DENIED
        )

        info = alice.get_session("alice-agent-1")
        assert info.tenant == "alice" and info.num_tokens == twin.info().num_tokens
        assert _greedy(mine, TURN) == _greedy(twin, TURN)  # as if bob had never existed
        assert sorted(s.session_id for s in alice.list_sessions()) == ["alice-agent-1", "alice-twin"]


def test_same_ids_in_two_tenants_and_a_fork_stays_with_its_owner(daemon) -> None:
    with (
        Client(daemon.address, timeout=60, token="alice-token") as alice,
        Client(daemon.address, timeout=60, token="bob-token") as bob,
    ):
        a = alice.session(PREFIX, session_id="agent")
        b = bob.session([4, 4, 4], session_id="agent")
        fork = a.fork()
        assert fork.info().tenant == "alice" and fork.info().num_tokens == len(PREFIX)
        assert _refusal(lambda: bob.get_session(fork.session_id)).code == grpc.StatusCode.NOT_FOUND
        assert b.info().num_tokens == 3 and a.info().num_tokens == len(PREFIX)
        # A request id is per tenant too: both may use the same one at once, and answers echo it.
        theirs = iter(alice.stream(TURN, max_tokens=400, ignore_eos=True, request_id="job-1"))
        assert next(theirs).request_id == "job-1"  # alice's request is live (400 tokens to go)
        assert bob.generate(TURN, max_tokens=2, request_id="job-1").request_id == "job-1"
        assert all(delta.request_id == "job-1" for delta in theirs)


def test_the_admin_token_lists_and_closes_any_session(daemon) -> None:
    with (
        Client(daemon.address, timeout=60, token="alice-token") as alice,
        Client(daemon.address, timeout=60, token="ops-token") as ops,
    ):
        alice.session(PREFIX, session_id="alice-agent-1")
        listed = {(s.tenant, s.session_id) for s in ops.list_sessions(all_tenants=True)}
        assert ("alice", "alice-agent-1") in listed
        assert ops.get_session("alice-agent-1", tenant="alice").num_tokens == len(PREFIX)
        assert _refusal(lambda: ops.get_session("alice-agent-1")).code == grpc.StatusCode.NOT_FOUND  # its own
        ops.close_session("alice-agent-1", tenant="alice")
        assert _refusal(lambda: alice.get_session("alice-agent-1")).code == grpc.StatusCode.NOT_FOUND


def test_the_prefix_cache_is_per_tenant(daemon) -> None:
    prompt = list(range(3, 3 + 64))  # four full blocks of 16
    with (
        Client(daemon.address, timeout=60, token="alice-token") as alice,
        Client(daemon.address, timeout=60, token="bob-token") as bob,
    ):
        alice.generate(prompt, max_tokens=1)
        assert alice.generate(prompt, max_tokens=1).usage.cached_prompt_tokens > 0  # her cache works
        assert bob.generate(prompt, max_tokens=1).usage.cached_prompt_tokens == 0  # and is hers alone
        assert bob.generate(prompt, max_tokens=1).usage.cached_prompt_tokens > 0


def test_a_tenant_name_over_its_bound_is_invalid_argument(shared_tiny_daemon) -> None:
    with Client(shared_tiny_daemon.address) as anyone:
        too_long = _refusal(lambda: anyone.get_session("s", tenant="t" * 129))
        assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 128" in too_long.details


def test_the_command_line_client_presents_a_token(daemon) -> None:
    import json
    import os
    import subprocess
    import sys

    def stats(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cbd_client.cli", "--address", daemon.address, *args, "stats"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})  # fmt: skip

    assert "UNAUTHENTICATED" in stats().stderr
    assert "open_sessions" in json.loads(stats("--token", "bob-token").stdout)
    assert "open_sessions" in json.loads(stats(env={"CBD_TOKEN": "alice-token"}).stdout)
