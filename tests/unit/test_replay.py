"""A streamed session turn that survives its daemon (Session(recover=True).stream): the re-run on the
re-opened session is checked against what was already streamed and only the rest is passed on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from cbd_client.errors import CbdError
from cbd_client.replay import Replay
from cbd_client.session import AsyncSession, Session
from cbd_client.types import Delta, SessionInfo, ToolCallDelta, Usage

USAGE = Usage(4, 0, 4)


def _d(index: int, tokens: tuple[int, ...], text: str, finish: str | None = None, **kw) -> Delta:
    return Delta("r", index, text, tokens, finish_reason=finish, usage=USAGE if finish else None, **kw)


def _join(deltas: list[Delta], index: int = 0) -> tuple[list[int], str]:
    mine = [d for d in deltas if d.index == index]
    return [t for d in mine for t in d.token_ids], "".join(d.text for d in mine)


def test_a_regrouped_rerun_passes_on_only_what_is_new() -> None:
    replay = Replay(2)
    first = [_d(0, (1, 2), "ab"), _d(1, (7,), "x"), _d(0, (3,), "c", "stop")]
    given = [replay.feed(d) for d in first]
    assert given == first  # a first run passes through untouched
    replay.restart()
    again = [_d(1, (7, 8), "xy"), _d(0, (1, 2, 3), "abc", "stop"), _d(1, (9,), "z", "length")]
    fresh = [f for f in (replay.feed(d) for d in again) if f is not None]
    assert fresh == [_d(1, (8,), "y"), _d(1, (9,), "z", "length")]  # candidate 0 had finished: nothing new
    completion = replay.completion()
    assert [c.token_ids for c in completion.candidates] == [[1, 2, 3], [7, 8, 9]]
    assert [c.text for c in completion.candidates] == ["abc", "xyz"]
    assert [c.finish_reason for c in completion.candidates] == ["stop", "length"]


def test_a_rerun_that_departs_from_what_was_streamed_is_aborted() -> None:
    replay = Replay(1)
    replay.feed(_d(0, (1, 2), "ab"))
    replay.restart()
    replay.feed(_d(0, (1,), "a"))
    with pytest.raises(CbdError) as error:
        replay.feed(_d(0, (5, 6), "zz"))
    assert error.value.code == grpc.StatusCode.ABORTED and "different tokens" in error.value.details


def test_tool_call_fragments_are_not_repeated() -> None:
    replay = Replay(1)
    replay.feed(_d(0, (1,), "", tool_calls=(ToolCallDelta(0, "call_0", "ls", '{"pa'),)))
    replay.restart()
    fresh = replay.feed(_d(0, (1, 2), "", tool_calls=(ToolCallDelta(0, "call_0", "ls", '{"path": "."}'),)))
    assert fresh is not None and fresh.token_ids == (2,)
    assert fresh.tool_calls == (ToolCallDelta(0, "", "", 'th": "."}'),)
    assert replay.completion().candidates[0].tool_calls[0].arguments == '{"path": "."}'


class _FlakyClient:
    """Streams `reply` one token per delta; the first run is cut after `cut` deltas (UNAVAILABLE)."""

    def __init__(self, reply: list[int], cut: int, rerun: list[int] | None = None) -> None:
        self.reply, self.cut, self.rerun = reply, cut, rerun
        self.runs: list[tuple[str, object]] = []
        self.opened: list[object] = []

    def _deltas(self, session_id: str, prompt: object) -> Iterator[Delta]:
        self.runs.append((session_id, prompt))
        first = len(self.runs) == 1
        reply = self.reply if first or self.rerun is None else self.rerun
        for i, token in enumerate(reply):
            if first and i == self.cut:
                raise CbdError(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield _d(0, (token,), f"<{token}>", "length" if i == len(reply) - 1 else None)

    def stream(self, prompt, *, n, session_id, parent_candidate, **sampling) -> Iterator[Delta]:
        yield from self._deltas(session_id, prompt)

    def session(self, prefix, ttl) -> SessionInfo:
        self.opened.append(prefix)
        return SessionInfo(f"s{len(self.opened)}", 0, 0, 0, 0.0, False, 600.0, False)


def test_a_stream_cut_midway_is_finished_on_the_reopened_session(monkeypatch) -> None:
    monkeypatch.setattr("cbd_client.session.RECOVERY_PAUSE", 0)
    client = _FlakyClient([11, 12, 13, 14], cut=2)
    session = Session(client, SessionInfo("s0", 0, 0, 0, 0.0, False, 600.0, False), prefix=[1, 2], recover=True)  # type: ignore[arg-type]
    deltas = list(session.stream([3]))
    assert _join(deltas) == ([11, 12, 13, 14], "<11><12><13><14>")
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1, 1] and deltas[-1].finish_reason == "length"
    assert client.runs == [("s0", [3]), ("s1", [3])] and client.opened == [[1, 2]]
    assert session.recoveries == 1 and session.transcript is not None
    assert session.transcript.as_prefix() == [1, 2, 3, 11, 12, 13, 14]  # the whole reply joins the history


def test_a_rerun_that_departs_ends_the_turn_and_leaves_the_history_without_it(monkeypatch) -> None:
    monkeypatch.setattr("cbd_client.session.RECOVERY_PAUSE", 0)
    client = _FlakyClient([11, 12, 13], cut=2, rerun=[11, 99, 13])
    session = Session(client, SessionInfo("s0", 0, 0, 0, 0.0, False, 600.0, False), prefix=[1], recover=True)  # type: ignore[arg-type]
    got: list[Delta] = []
    with pytest.raises(CbdError) as error:
        for d in session.stream([3]):
            got.append(d)
    assert error.value.code == grpc.StatusCode.ABORTED
    assert _join(got)[0] == [11, 12] and session.transcript is not None and session.transcript.as_prefix() == [1]


def test_without_recover_a_lost_stream_raises_as_before() -> None:
    client = _FlakyClient([11, 12, 13], cut=1)
    session = Session(client, SessionInfo("s0", 0, 0, 0, 0.0, False, 600.0, False))  # type: ignore[arg-type]
    got: list[Delta] = []
    with pytest.raises(CbdError) as error:
        for d in session.stream([3]):
            got.append(d)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and _join(got)[0] == [11] and len(client.runs) == 1


class _AsyncFlakyClient(_FlakyClient):
    async def stream(self, prompt, *, n, session_id, parent_candidate, **sampling):  # type: ignore[no-untyped-def,override]
        for d in self._deltas(session_id, prompt):
            yield d

    async def session(self, prefix, ttl) -> SessionInfo:  # type: ignore[no-untyped-def,override]
        return _FlakyClient.session(self, prefix, ttl)


def test_the_async_session_streams_through_a_loss_too(monkeypatch) -> None:
    monkeypatch.setattr("cbd_client.session.RECOVERY_PAUSE", 0)
    client = _AsyncFlakyClient([11, 12, 13], cut=1)
    session = AsyncSession(client, SessionInfo("s0", 0, 0, 0, 0.0, False, 600.0, False), prefix=[1], recover=True)  # type: ignore[arg-type]

    async def run() -> list[Delta]:
        return [d async for d in session.stream([3])]

    assert _join(asyncio.run(run()))[0] == [11, 12, 13] and session.recoveries == 1


class _LostAtTheEnd(_FlakyClient):
    """Streams the whole reply, then the connection drops (before the call's trailers)."""

    def stream(self, prompt, *, n, session_id, parent_candidate, **sampling) -> Iterator[Delta]:
        self.runs.append((session_id, prompt))
        for i, token in enumerate(self.reply):
            yield _d(0, (token,), f"<{token}>", "stop" if i == len(self.reply) - 1 else None)
        raise CbdError(grpc.StatusCode.UNAVAILABLE, "connection reset")


def test_a_loss_after_the_last_delta_keeps_the_whole_answer(monkeypatch) -> None:
    monkeypatch.setattr("cbd_client.session.RECOVERY_PAUSE", 0)
    client = _LostAtTheEnd([11, 12], cut=-1)
    session = Session(client, SessionInfo("s0", 0, 0, 0, 0.0, False, 600.0, False), prefix=[1], recover=True)  # type: ignore[arg-type]
    assert _join(list(session.stream([3])))[0] == [11, 12]
    assert len(client.runs) == 1 and session.recoveries == 0  # not run again (an unseeded re-run could differ)
    assert session.transcript is not None and session.transcript.as_prefix() == [1, 3, 11, 12]
