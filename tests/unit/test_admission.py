"""Admission control: both caps refuse at once, every reservation comes back, the retry hint follows the finish rate."""

from __future__ import annotations

import pytest

from cbd.engine import admission as admission_module
from cbd.engine.admission import MAX_RETRY_AFTER, MIN_RETRY_AFTER, Admission
from cbd.errors import CapacityExceeded, InvalidRequest


class FakeClock:
    """Stands in for the `time` module inside cbd.engine.admission only (the process's clock is untouched)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(admission_module, "time", fake)  # the module's own name for its clock
    return fake


def test_request_cap_refuses_and_release_makes_room() -> None:
    a = Admission(max_requests=2, max_tokens=1000)
    a.reserve("a", 10)
    a.reserve("b", 10)
    with pytest.raises(CapacityExceeded, match="2 requests are live, the limit is 2") as info:
        a.reserve("c", 10)
    assert info.value.retry_after is not None
    a.release("a")
    a.release("a")  # idempotent
    a.reserve("c", 10)
    assert (a.num_live, a.num_tokens) == (2, 20)


def test_token_cap_counts_prompt_tokens_and_duplicate_ids_are_invalid() -> None:
    a = Admission(max_requests=100, max_tokens=50)
    a.reserve("a", 30)
    with pytest.raises(CapacityExceeded, match="30 prompt tokens are queued or running, the limit is 50"):
        a.reserve("b", 21)
    a.reserve("b", 20)
    # A prompt over the cap by itself never fits: refused without a retry hint, naming its own size.
    with pytest.raises(CapacityExceeded, match="the prompt's 51 tokens are more than the limit of 50") as info:
        a.reserve("c", 51)
    assert info.value.retry_after is None
    with pytest.raises(InvalidRequest, match="already in use"):
        a.reserve("a", 1)
    for rid in ("a", "b"):
        a.release(rid)
    assert (a.num_live, a.num_tokens) == (0, 0)


def test_retry_hint_is_the_time_for_enough_requests_to_finish(clock: FakeClock) -> None:
    a = Admission(max_requests=10, max_tokens=10**6)
    for i in range(21):  # 20 finishes over 2 s: 10 per second
        a.reserve(f"old{i}", 5)
        a.release(f"old{i}")
        clock.now += 0.1
    clock.now -= 0.1
    for i in range(10):
        a.reserve(f"r{i}", 5)
    with pytest.raises(CapacityExceeded) as info:
        a.reserve("over", 5)
    assert info.value.retry_after == pytest.approx(0.1)  # one seat at 10 finishes/s
    hints = []
    for _ in range(3):  # callers refused while the first still waits queue up behind it
        with pytest.raises(CapacityExceeded) as info:
            a.reserve("over", 5)
        hints.append(info.value.retry_after)
    assert hints == pytest.approx([0.2, 0.3, 0.4])
    clock.now += 0.45  # their hinted times have passed: the queue is empty again
    a.max_tokens = 50  # the token cap: 5 more tokens need one 5-token request to finish
    a.max_requests = 100
    with pytest.raises(CapacityExceeded) as info:
        a.reserve("big", 25)  # 25 over the cap: five of the 5-token requests
    assert info.value.retry_after == pytest.approx(0.5 * (2.45 / 2.0), rel=0.01)  # the rate fell meanwhile


def test_retry_hint_is_bounded(clock: FakeClock) -> None:
    a = Admission(max_requests=1, max_tokens=10**6)
    a.reserve("x", 1)
    with pytest.raises(CapacityExceeded) as info:  # nothing finished yet: a default second
        a.reserve("y", 1)
    assert info.value.retry_after == 1.0
    a.release("x")
    clock.now += 1000
    a.reserve("x2", 1)
    a.release("x2")
    a.reserve("x3", 1)
    with pytest.raises(CapacityExceeded) as info:  # one finish per 1000 s: capped
        a.reserve("y", 1)
    assert info.value.retry_after == MAX_RETRY_AFTER
    fast = Admission(max_requests=1, max_tokens=10**6)
    for i in range(10):  # ten finishes within one instant: a hint of ~0 s, raised to the floor
        fast.reserve(f"f{i}", 1)
        fast.release(f"f{i}")
    fast.reserve("busy", 1)
    with pytest.raises(CapacityExceeded) as info:
        fast.reserve("z", 1)
    assert info.value.retry_after == MIN_RETRY_AFTER > 0


def test_a_loop_idle_before_the_work_came_is_not_stalled() -> None:
    """Stalled means no progress for that long *since work was pending*: a heartbeat from before a long
    idle spell (or the model's first load) does not make a new request's first moment a stall."""
    import time

    admission = Admission(8, 1000)
    long_ago = time.monotonic() - 3600.0  # the loop's last progress: an hour before this request
    assert not admission.stalled(long_ago, 30.0)  # no work: never stalled
    admission.reserve("r1", 10)
    assert not admission.stalled(long_ago, 30.0)  # work just came: not stalled yet
    assert admission.stalled(long_ago, -1.0)  # ... but it is as soon as the bound has passed with no progress
    admission.release("r1")
    assert not admission.stalled(long_ago, -1.0)
