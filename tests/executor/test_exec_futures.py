"""The call order: futures and blocking calls, ordering and deadlines, with a fake
clock and fake replies (no processes)."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from mpexec.errors import WorkerError
from mpexec.executor.futures import CallOrder, FutureWrapper, PendingCall, UndecodableReply
from mpexec.executor.protocol import Reply, decode_replies


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


def values(method: str, replies: dict[int, Reply]) -> list[Any]:
    return [replies[r][2] for r in sorted(replies)]


class Calls:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.reader = FakeReader(self.clock)
        self.order = CallOrder(self.reader, clock=self.clock)
        self.next_id = 0

    def record(self, ranks: tuple[int, ...] = (0,), timeout: float | None = None,
               finish: Any = values) -> PendingCall:
        self.next_id += 1
        deadline = None if timeout is None else self.clock.now + timeout
        return PendingCall(self.next_id, f"call{self.next_id}", ranks, deadline, finish,
                           timeout)

    def call(self, ranks: tuple[int, ...] = (0,), timeout: float | None = None,
             finish: Any = values) -> FutureWrapper:
        record = self.record(ranks, timeout, finish)
        future = FutureWrapper(self.order, record)
        self.order.add(record)
        return future

    def blocking(self, ranks: tuple[int, ...] = (0,)) -> PendingCall:
        record = self.record(ranks)
        self.order.add(record)
        return record


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
    assert len(calls.order) == 0


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

    def finish(method: str, replies: dict[int, Reply]) -> Any:
        _, ok, payload = replies[0]
        if not ok:
            raise RuntimeError(payload)
        return payload

    future = calls.call(finish=finish)
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
    calls.order.fail_all(lambda: RuntimeError("worker died"))
    assert len(calls.order) == 0
    errors = []
    for f in futures:
        assert f.done()  # completed by fail_all itself, nobody asked
        with pytest.raises(RuntimeError, match="worker died") as info:
            f.result()
        errors.append(info.value)
    assert len({id(e) for e in errors}) == 3  # one exception instance per call


def test_blocking_and_non_blocking_calls_share_one_order() -> None:
    calls = Calls()
    early = calls.call()
    mine = calls.blocking()
    calls.reader.add(0, 1, "one")
    calls.reader.add(0, 2, "two")
    calls.order.wait(mine)
    assert mine.outcome() == ["two"]
    assert early.done() and early.result() == ["one"]


def test_a_reply_waiting_exactly_at_the_deadline_is_returned() -> None:
    calls = Calls()
    future = calls.call(timeout=1.0)
    calls.reader.add(0, 1, "just in time", at=1.0)
    calls.clock.now = 1.0  # the deadline, with the reply already there
    assert future.result() == ["just in time"]


def test_no_reply_at_the_deadline_fails_without_waiting_past_it() -> None:
    calls = Calls()
    future = calls.call(timeout=1.0)
    calls.reader.add(0, 1, "late", at=1.5)
    with pytest.raises(TimeoutError, match="timed out after 1s"):
        future.result()
    assert calls.clock.now == pytest.approx(1.0)


def test_an_undecodable_reply_fails_only_its_call() -> None:
    calls = Calls()
    first = calls.call(finish=lambda method, replies: decode_replies(method, replies, False, id))
    second = calls.call()
    original = calls.reader.read_reply

    def undecodable(rank: int, timeout: float | None) -> Reply:
        calls.reader.read_reply = original  # type: ignore[method-assign]
        raise UndecodableReply(rank, 1234, ValueError("no such class here"))

    calls.reader.read_reply = undecodable  # type: ignore[method-assign]
    calls.reader.add(0, 2, "two")
    with pytest.raises(WorkerError, match="rank 0 to call1 could not be unpickled") as info:
        first.result()
    assert info.value.rank == 0 and info.value.pid == 1234
    assert isinstance(info.value.__cause__, ValueError)
    assert second.result() == ["two"]


def test_callbacks_run_without_the_reply_lock() -> None:
    calls = Calls()
    future = calls.call()
    held: list[bool] = []
    future.add_done_callback(lambda f: held.append(calls.order.lock.locked()))
    calls.reader.add(0, 1, "x")
    assert future.result() == ["x"]
    assert held == [False]


def test_a_future_is_counted_in_stats_before_it_completes() -> None:
    from mpexec.executor.stats import CallStats

    calls = Calls()
    calls.order.stats = stats = CallStats()
    seen: list[int] = []
    first = calls.call()
    first.add_done_callback(lambda f: seen.append(stats.snapshot()[f.call.method].calls))
    calls.reader.add(0, first.call_id, "one")
    assert first.result() == ["one"]
    assert seen == [1]  # the done-callback already finds the call counted
    # Resolved by someone else (the reply pump) but not settled yet: the
    # result() that settles it itself still returns after the count.
    second = calls.call()
    calls.order.resolve(second.call, ["two"])
    assert second.result() == ["two"]
    assert stats.snapshot()[second.call.method].calls == 1
