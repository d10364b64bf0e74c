"""The two ends of a queue as types, encode-once, deadlines, and queues over a group."""

from __future__ import annotations

import multiprocessing as mp
import types
from typing import Any, ClassVar

import pytest

from mpexec.ipc import (
    EncodedMessage,
    MessageQueue,
    MessageQueueReader,
    MessageQueueWriter,
    QueueReader,
    QueueWriter,
    waiting,
)
from tests.ipc import peers

pytestmark = pytest.mark.usefixtures("leak_check")


class CountsPickles:
    pickled: ClassVar[int] = 0

    def __reduce__(self) -> Any:
        CountsPickles.pickled += 1
        return CountsPickles, ()


def test_writer_and_reader_are_two_types_each_with_its_own_operations() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        assert type(writer.transport) is MessageQueueWriter and type(reader) is MessageQueueReader
        for end in (writer, writer.transport):
            assert isinstance(end, QueueWriter) and not isinstance(end, QueueReader)
        assert isinstance(reader, QueueReader) and not isinstance(reader, QueueWriter)
        # No end carries the other's operations, not even as a stub that refuses.
        for name in ("dequeue",):
            assert not hasattr(writer, name) and not hasattr(writer.transport, name)
        for name in ("enqueue", "encode", "export_handle", "lagging_ranks"):
            assert not hasattr(reader, name)
        with pytest.raises(AttributeError):
            reader.encode(1)  # type: ignore[attr-defined]
        assert writer.export_handle().remote_subscribe_addr is None  # all local
    finally:
        reader.shutdown()
        writer.shutdown()


def test_the_ends_compose_their_shared_memory_state_rather_than_inherit_it() -> None:
    """Neither shared-memory end inherits from the other, nor from MessageQueue:
    each holds a RingEnd (the mapping, the guard, the waits)."""
    from mpexec.ipc.endpoint import RingEnd

    assert MessageQueueWriter.__mro__ == (MessageQueueWriter, object)
    assert MessageQueueReader.__mro__ == (MessageQueueReader, object)
    assert MessageQueue.__mro__ == (MessageQueue, object)
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        assert isinstance(writer.transport._ring, RingEnd)
        assert isinstance(reader, MessageQueueReader) and isinstance(reader._ring, RingEnd)
        assert writer.transport._ring is not reader._ring
    finally:
        reader.shutdown()
        writer.shutdown()


def test_back_pressure_retries_never_pickle_again() -> None:
    """The executor's loop: enqueue with a zero timeout, drain, try again."""
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.enqueue("fills the ring")
        CountsPickles.pickled = 0
        message = writer.encode(("call", CountsPickles(), b"x" * 10_000))
        assert isinstance(message, EncodedMessage) and CountsPickles.pickled == 1
        for _ in range(5):
            with pytest.raises(TimeoutError):
                writer.enqueue(message, timeout=0)
        assert reader.dequeue(timeout=5) == "fills the ring"
        writer.enqueue(message, timeout=5)
        got = reader.dequeue(timeout=5)
        assert got[0] == "call" and isinstance(got[1], CountsPickles) and len(got[2]) == 10_000
        assert CountsPickles.pickled == 1
        writer.enqueue(writer.encode("small"))   # the bare-pickle kind too
        assert reader.dequeue(timeout=5) == "small"
    finally:
        reader.shutdown()
        writer.shutdown()


def test_a_message_there_at_the_deadline_is_returned() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.enqueue(1)
        writer.enqueue(2)
        assert reader.dequeue(timeout=0) == 1     # a poll
        assert reader.dequeue(timeout=-1) == 2    # a deadline already past: still one look
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0)
    finally:
        reader.shutdown()
        writer.shutdown()


def test_wait_returns_what_arrived_exactly_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a fake clock: the message lands as the clock reaches the deadline
    (during the last check of the wait); the wait returns it, no TimeoutError."""
    clock = [0.0]

    def monotonic() -> float:
        clock[0] += 0.125
        return clock[0]

    monkeypatch.setattr(waiting, "time", types.SimpleNamespace(monotonic=monotonic,
                                                               sleep=lambda s: None))
    deadline = 2.0
    waiting.wait_until(lambda: clock[0] >= deadline, futex_word=None, set_sleeping=None,
                       deadline=deadline, spin_s=0.5, tick_s=0.05, log_interval_s=60,
                       on_tick=lambda: None, describe=lambda: "", what="test")
    assert clock[0] >= deadline
    with pytest.raises(TimeoutError):   # and one that never comes times out
        clock[0] = 0.0
        waiting.wait_until(lambda: False, futex_word=None, set_sleeping=None,
                           deadline=deadline, spin_s=0.5, tick_s=0.05, log_interval_s=60,
                           on_tick=lambda: None, describe=lambda: "", what="test")


class FakeGroup:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank_in_group = rank
        self.world_size = world_size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise AssertionError("not reached")


def test_group_queue_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=">= 2 ranks"):
        MessageQueue.create_from_process_group(FakeGroup(0, 1), 4096, 2)
    with pytest.raises(ValueError, match=r"writer_rank must be in \[0, 2\)"):
        MessageQueue.create_from_process_group(FakeGroup(0, 2), 4096, 2, writer_rank=2)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize(("world", "writer_rank"), [(2, 0), (3, 1)])
def test_queue_over_a_process_group(method: str, world: int, writer_rank: int) -> None:
    ctx = mp.get_context(method)
    inboxes = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=peers.group_member,
                         args=(rank, inboxes, writer_rank, results), daemon=True)
             for rank in range(world)]
    try:
        for proc in procs:
            proc.start()
        reports = sorted(results.get(timeout=60) for _ in range(world))
        for proc in procs:
            proc.join(timeout=30)
        assert [proc.exitcode for proc in procs] == [0] * world
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for box in (*inboxes, results):
            box.close()
            box.join_thread()
    kinds = [kind for _, kind, _ in reports]
    assert kinds == ["MessageQueue" if r == writer_rank else "MessageQueueReader"
                     for r in range(world)]
    assert len({tuple(got) for _, _, got in reports}) == 1   # every rank got the same
