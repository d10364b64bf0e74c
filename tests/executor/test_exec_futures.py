"""FutureWrapper ordering and deadlines, with a fake clock and fake replies."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest

from mpexec.executor.futures import FutureWrapper, Reply


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReader:
    """Replies per rank, each available from a given (fake) time on."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.pending: dict[int, deque[tuple[float, Reply]]] = {}
        self.reads: list[tuple[int, int]] = []

    def add(self, rank: int, call_id: int, value: Any, at: float = 0.0, ok: bool = True) -> None:
        self.pending.setdefault(rank, deque()).append((at, (call_id, ok, value)))

    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        queue = self.pending.get(rank)
        if queue and (timeout is None or queue[0][0] <= self.clock.now + timeout):
            at, reply = queue.popleft()
            self.clock.now = max(self.clock.now, at)
            self.reads.append((rank, reply[0]))
            return reply
        if timeout is None:
            raise AssertionError("the test would block forever")
        self.clock.now += timeout
        raise TimeoutError("fake dequeue timed out")

    def unread_reply(self, rank: int, reply: Reply) -> None:
        self.pending.setdefault(rank, deque()).appendleft((0.0, reply))


def values(replies: dict[int, Reply]) -> list[Any]:
    return [replies[r][2] for r in sorted(replies)]


class Calls:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.reader = FakeReader(self.clock)
        self.queue: deque[FutureWrapper] = deque()
        self.lock = threading.Lock()
        self.next_id = 0

    def call(self, ranks: tuple[int, ...] = (0,), timeout: float | None = None) -> FutureWrapper:
        self.next_id += 1
        deadline = None if timeout is None else self.clock.now + timeout
        return FutureWrapper(self.queue, self.lock, self.reader, call_id=self.next_id,
                             ranks=ranks, deadline=deadline, finish=values,
                             method=f"call{self.next_id}", timeout=timeout, clock=self.clock)


def test_asking_a_later_future_resolves_the_earlier_ones_in_order() -> None:
    calls = Calls()
    futures = [calls.call(ranks=(0, 1)) for _ in range(3)]
    for call_id in (1, 2, 3):
        calls.reader.add(0, call_id, f"r0-{call_id}")
        calls.reader.add(1, call_id, f"r1-{call_id}")
    assert futures[2].result() == ["r0-3", "r1-3"]
    assert [f.done() for f in futures] == [True, True, True]
    assert futures[0].result() == ["r0-1", "r1-1"]
    assert [cid for _, cid in calls.reader.reads] == [1, 1, 2, 2, 3, 3]
    assert not calls.queue


def test_call_deadline_fails_the_call_and_its_late_reply_is_dropped() -> None:
    calls = Calls()
    slow = calls.call(timeout=1.0)
    calls.reader.add(0, 1, "late", at=5.0)  # arrives long after its deadline
    with pytest.raises(TimeoutError, match="call1 timed out after 1s"):
        slow.result()
    nxt = calls.call()
    calls.reader.add(0, 2, "mine", at=6.0)
    assert nxt.result() == ["mine"]


def test_result_timeout_keeps_the_reply_for_the_next_wait() -> None:
    calls = Calls()
    future = calls.call(ranks=(0, 1))
    calls.reader.add(0, 1, "a", at=0.0)
    calls.reader.add(1, 1, "b", at=3.0)
    with pytest.raises(TimeoutError, match="result"):
        future.result(timeout=1.0)
    assert not future.done()
    assert future.result(timeout=5.0) == ["a", "b"]


def test_later_call_times_out_at_its_own_deadline_behind_a_slow_one() -> None:
    calls = Calls()
    first = calls.call()  # no deadline
    second = calls.call(timeout=2.0)
    calls.reader.add(0, 1, "first", at=10.0)
    calls.reader.add(0, 2, "second", at=10.0)
    with pytest.raises(TimeoutError, match="call2"):
        second.result()
    assert calls.clock.now == pytest.approx(2.0)
    assert first.result() == ["first"]
    # second's reply, read by no one, is dropped by the next call on rank 0.
    third = calls.call()
    calls.reader.add(0, 3, "third", at=11.0)
    assert third.result() == ["third"]


def test_worker_failure_payload_goes_through_finish() -> None:
    calls = Calls()

    def finish(replies: dict[int, Reply]) -> Any:
        _, ok, payload = replies[0]
        if not ok:
            raise RuntimeError(payload)
        return payload

    future = FutureWrapper(calls.queue, calls.lock, calls.reader, call_id=1, ranks=(0,),
                           deadline=None, finish=finish, clock=calls.clock)
    calls.reader.add(0, 1, "it broke", ok=False)
    with pytest.raises(RuntimeError, match="it broke"):
        future.result()


def test_reader_error_fails_the_call_being_read_only() -> None:
    calls = Calls()
    first, second = calls.call(), calls.call()
    boom = ConnectionError("reply queue closed")

    def broken(rank: int, timeout: float | None) -> Reply:
        calls.reader.read_reply = original  # type: ignore[method-assign]
        raise boom

    original = calls.reader.read_reply
    calls.reader.read_reply = broken  # type: ignore[method-assign]
    calls.reader.add(0, 2, "two")
    assert second.result() == ["two"]
    with pytest.raises(ConnectionError):
        first.result()


def test_a_reply_for_a_later_call_is_a_protocol_error_and_is_kept() -> None:
    calls = Calls()
    first, second = calls.call(), calls.call()
    calls.reader.add(0, 2, "two")
    with pytest.raises(RuntimeError, match="answered call 2 before call 1"):
        first.result()
    assert second.result() == ["two"]


def test_fail_from_another_thread_wakes_nobody_twice() -> None:
    calls = Calls()
    futures = [calls.call() for _ in range(3)]
    for f in list(calls.queue):
        f.fail(RuntimeError("worker died"))
    assert not calls.queue
    for f in futures:
        with pytest.raises(RuntimeError, match="worker died"):
            f.result()
