"""Sessions that survive the daemon: saved at SIGTERM and in the background (`--disk-kv-dir`), listed again
by the next daemon on the directory, their KV read back from disk on their next turn. The oracle: the same
conversations on the shared daemon, which never restarted (greedy answers must be equal)."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from cbd_client import CbdError, Client
from cbd_client.session import Session
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub
from daemon_process import DaemonFactory, DaemonProcess, alive
from helpers import poll_until

GREEDY = {"max_tokens": 8, "temperature": 0.0}
SYSTEM = [{"role": "system", "content": "You answer in one short sentence."}]
pytestmark = pytest.mark.slow


@pytest.fixture()
def default_daemon(tmp_path: Path):  # noqa: ANN201
    factory = DaemonFactory(tmp_path, None)
    yield factory
    factory.stop_all()


def _user(i: int, turn: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Agent {i}, step {turn}: name a {('colour', 'fruit', 'city')[turn % 3]}."}]


class Agents:
    """Six conversations (four chats, two plain-text histories) and two forks, on one daemon."""

    def __init__(self, client: Client, tag: str) -> None:
        self.sessions: list[Session] = []
        for i in range(6):
            prefix = SYSTEM if i < 4 else "You are a terse assistant.\n"
            self.sessions.append(client.session(prefix, session_id=f"{tag}-agent-{i}", ttl=3600))

    def turn(self, k: int) -> list[tuple[str, int]]:
        """Turn k of every session: (its text, its cached prompt tokens)."""
        out = []
        for i, s in enumerate(self.sessions):
            prompt = _user(i, k) if i in (0, 1, 2, 3, 6) else f"Step {k}: name a colour.\n"  # 6: a chat fork
            c = s.send(prompt, **GREEDY)
            out.append((c.text, c.usage.cached_prompt_tokens))
        return out

    def fork(self) -> None:
        self.sessions += [self.sessions[0].fork(), self.sessions[4].fork()]


def _restart_in_place(
    old: DaemonProcess, start: DaemonFactory, flags: tuple[str, ...], how: signal.Signals
) -> tuple[DaemonProcess, str]:
    """Stop the daemon with `how`, start another on the same socket and flags; the old one's log too."""
    engine = old.engine_pid()
    old.process.send_signal(how)
    code = old.process.wait(120)
    log = old.log()
    assert code == (0 if how == signal.SIGTERM else -signal.SIGKILL), log[-3000:]
    poll_until(lambda: not alive(engine), 30, what="the engine process exits with the frontend")
    return start(*flags), log


def test_sessions_survive_sigterm_and_sigkill_answering_as_a_daemon_that_never_stopped(
    default_daemon: DaemonFactory, shared_daemon: DaemonProcess, tmp_path: Path
) -> None:  # fmt: skip
    flags = ("--disk-kv-dir", str(tmp_path / "sessions"), "--session-save-idle")
    d = default_daemon(*flags, "3600")  # nothing saved in the background: the shutdown saves it all
    with Client(d.address) as client, Client(shared_daemon.address) as oracle_client:
        agents, oracle = Agents(client, "durable"), Agents(oracle_client, "durable-oracle")
        for k in (1, 2):
            assert [t for t, _ in agents.turn(k)] == [t for t, _ in oracle.turn(k)]
        agents.fork()
        oracle.fork()
        # SIGTERM: every session is saved with its KV while the daemon drains.
        d, log = _restart_in_place(d, default_daemon, (*flags, "0.5"), signal.SIGTERM)
        assert "saved 8 sessions" in log and "(8 with KV, 0 token ids only, 0 failed)" in log, log[-3000:]
        with grpc.insecure_channel(d.address) as channel:
            listed = CbdStub(channel).ListSessions(pb.ListSessionsRequest()).sessions
        assert sorted(s.session_id for s in listed) == sorted(s.session_id for s in agents.sessions)
        # Listed at once, their KV in their files; an idle daemon reads them back into the host tier ahead of
        # their turns (or has begun to).
        assert all(s.kv_tier in (pb.KV_TIER_DISK, pb.KV_TIER_HOST) and s.resident_blocks == 0 for s in listed)
        assert all(s.disk_blocks + s.host_blocks > 0 for s in listed)
        poll_until(lambda: all(i.kv_tier == "host" for i in client.list_sessions()), 60, what="read back ahead")
        third, want = agents.turn(3), oracle.turn(3)
        assert [t for t, _ in third] == [t for t, _ in want]
        assert all(cached >= expected > 0 for (_, cached), (_, expected) in zip(third, want)), (third, want)
        assert client.get_session(agents.sessions[0].session_id).kv_tier == "gpu"
        stats = client.stats()
        assert stats.sessions_restored == 8 and stats.session_kv_reads >= 8 and stats.session_kv_read_failures == 0
        assert stats.last_save_seconds > 0  # the last shutdown's saving, the one before this daemon started
        # SIGKILL once the background saving has caught up with the third turns: nothing is lost.
        poll_until(lambda: client.stats().session_files_written >= 8, 60, what="the idle sessions are saved")
        d, _ = _restart_in_place(d, default_daemon, (*flags, "0.5"), signal.SIGKILL)
        fourth, want = agents.turn(4), oracle.turn(4)
        assert [t for t, _ in fourth] == [t for t, _ in want]
        assert all(cached >= expected > 0 for (_, cached), (_, expected) in zip(fourth, want)), (fourth, want)
        for session in agents.sessions + oracle.sessions:
            session.close()
        with pytest.raises(CbdError) as gone:
            client.get_session(agents.sessions[0].session_id)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
    d.stop()
    assert not list((tmp_path / "sessions").rglob("*.session"))  # closed sessions leave no file


def test_a_fork_of_a_chat_taken_over_from_a_stopped_daemon_continues_its_conversation(
    default_daemon: DaemonFactory, tmp_path: Path
) -> None:  # fmt: skip
    """Daemon "a" saves a chat at SIGTERM; daemon "b" on the same directory is asked to fork it before any
    turn (it takes the session over with its transcript): the fork's turn renders the whole conversation."""
    shared = ("--disk-kv-dir", str(tmp_path / "sessions"), "--session-save-idle", "3600")
    a = default_daemon(*shared, "--disk-kv-owner", "a", socket_name="a.sock")
    with Client(a.address) as client:
        session = client.session(SYSTEM, session_id="handed-over", ttl=3600)
        reply = session.send(_user(0, 1), **GREEDY)
    a.process.send_signal(signal.SIGTERM)
    assert a.process.wait(120) == 0
    b = default_daemon(*shared, "--disk-kv-owner", "b", socket_name="b.sock")
    with Client(b.address) as client:
        fork = client.fork_session("handed-over")
        ask = _user(0, 2)
        turn = client.generate(ask, session_id=fork.session_id, **GREEDY)
        whole = client.generate(SYSTEM + _user(0, 1) + [{"role": "assistant", "content": reply.text}] + ask, **GREEDY)
        assert (turn.text, turn.usage.prompt_tokens) == (whole.text, whole.usage.prompt_tokens)
        assert turn.usage.cached_prompt_tokens > 0  # the history's KV came with the session
