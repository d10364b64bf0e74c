"""MessageQueue behaviour with the writer and its readers in this one process.

Readers normally live in other processes, but nothing in the protocol
depends on that, so the state machine, the error paths and the shared-memory
hygiene are checked here, fast and deterministic.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mpexec.errors import QueueClosedError
from mpexec.ipc import MessageQueue, layout
from tests.conftest import open_fds, shm_entries

_MEMFD = "/memfd:mpexec-"

pytestmark = pytest.mark.usefixtures("leak_check")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


@pytest.fixture
def pair() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4, name="pair")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=5)
    reader.wait_until_ready(timeout=5)
    yield writer, reader
    reader.shutdown()
    writer.shutdown()


def test_messages_arrive_in_order_inline_and_bulk(pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = pair
    sizes = [0, 10, 4000, 4096, 5000, 100_000, 3]
    for round_ in range(3):  # more messages than chunks: the ring wraps
        for size in sizes:
            writer.enqueue((round_, size, b"x" * size))
            assert reader.dequeue(timeout=5) == (round_, size, b"x" * size)


def test_bulk_arrays_are_private_writable_views() -> None:
    second = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2)
    readers = [MessageQueue.create_from_handle(second.export_handle(), r) for r in (0, 1)]
    try:
        second.enqueue(np.arange(100_000, dtype=np.int64))
        a, b = (r.dequeue(timeout=5) for r in readers)
        assert a.flags.writeable and b.flags.writeable
        a[:10] = -1  # copy-on-write: the other reader's view is untouched
        assert b[0] == 0 and a[0] == -1 and b[-1] == 99_999
    finally:
        for r in readers:
            r.shutdown()
        second.shutdown()


def test_bulk_slots_are_reused_only_after_release() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="reuse")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        held = []
        for i in range(layout.BULK_SLOTS + 3):  # more live views than slots: one-offs
            writer.enqueue(np.full(10_000, i))
            held.append(reader.dequeue(timeout=5))
        assert [int(h[0]) for h in held] == list(range(layout.BULK_SLOTS + 3))
        assert all(int(h[-1]) == i for i, h in enumerate(held))  # nothing overwritten
        held.clear()
        gc.collect()
        for i in range(5):  # released slots now serve new messages
            writer.enqueue(np.full(10_000, 100 + i))
            assert int(reader.dequeue(timeout=5)[-1]) == 100 + i
    finally:
        reader.shutdown()
        writer.shutdown()


def test_unpicklable_raises_at_enqueue_and_queue_stays_usable(
        pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = pair
    with pytest.raises(Exception, match=r"pickle|lambda"):
        writer.enqueue(("bad", lambda: 1))
    writer.enqueue("good")
    assert reader.dequeue(timeout=5) == "good"


class _FailsToUnpickle:
    """Pickles fine; unpickling raises (as a class missing in the reader would)."""

    def __init__(self, payload: bytes = b"") -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return (_refuse, (self.payload,))


def _refuse(payload: bytes) -> None:
    raise LookupError("no such class here")


@pytest.mark.parametrize("size", [10, 2 << 20])  # in the chunk, and through a bulk segment
def test_a_message_that_fails_to_unpickle_is_its_own_error_and_the_queue_goes_on(
        pair: tuple[MessageQueue, MessageQueue], size: int) -> None:
    from mpexec.errors import UndecodableMessageError

    writer, reader = pair
    writer.enqueue(("call", _FailsToUnpickle(bytes(size))))
    with pytest.raises(UndecodableMessageError, match="could not be unpickled") as info:
        reader.dequeue(timeout=5)
    assert isinstance(info.value.__cause__, LookupError)
    writer.enqueue("next")
    assert reader.dequeue(timeout=5) == "next"


def test_dequeue_timeout_raises_at_the_deadline(pair: tuple[MessageQueue, MessageQueue]) -> None:
    _, reader = pair
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="dequeue timed out"):
        reader.dequeue(timeout=0.2)
    assert time.monotonic() - start >= 0.2


def test_enqueue_on_full_ring_times_out_and_recovers(
        pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = pair
    for i in range(4):
        writer.enqueue(i, timeout=1)
    with pytest.raises(TimeoutError, match=r"ring full.*behind by 4"):
        writer.enqueue(4, timeout=0.2)
    assert reader.dequeue(timeout=1) == 0
    writer.enqueue(4, timeout=1)
    assert [reader.dequeue(timeout=1) for _ in range(4)] == [1, 2, 3, 4]


def test_wrong_end_and_wrong_rank_are_clear_errors(
        pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = pair
    with pytest.raises(AttributeError, match=r"MessageQueueReader.* no attribute 'enqueue'"):
        reader.enqueue(1)
    with pytest.raises(AttributeError, match=r"MessageQueue.* no attribute 'dequeue'"):
        writer.dequeue(timeout=0.1)
    with pytest.raises(ValueError, match="rank 5 is not a local reader"):
        MessageQueue.create_from_handle(writer.export_handle(), 5)


def test_bad_arguments_name_the_rule() -> None:
    with pytest.raises(ValueError, match="n_reader"):
        MessageQueue(0, 0)
    with pytest.raises(ValueError, match="local_reader_ranks"):
        MessageQueue(2, 2, local_reader_ranks=[0, 0])
    with pytest.raises(ValueError, match="cluster secret"):
        MessageQueue(2, 1)


def test_handle_of_a_shut_down_queue_is_rejected() -> None:
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()
    writer.shutdown()
    with pytest.raises(QueueClosedError, match="gone"):
        MessageQueue.create_from_handle(handle, 0)


@pytest.mark.parametrize("side", ["reader", "writer"])
def test_shutdown_from_another_thread_wakes_a_blocked_call(side: str) -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    target = reader if side == "reader" else writer
    if side == "writer":
        writer.enqueue(0)  # the one chunk is now full
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            if side == "reader":
                reader.dequeue(timeout=30)
            else:
                writer.enqueue(1, timeout=30)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=blocked)
    thread.start()
    # Observed, not guessed: the shared header says the call is asleep on the futex.
    asleep = ((lambda: reader.state().sleeping[0]) if side == "reader"
              else (lambda: writer.state().writer_waiting))
    wait_for(asleep, what=f"the {side} to fall asleep")
    target.shutdown()
    thread.join(timeout=10)  # its own deadline is 30 s: only the wake-up ends it sooner
    assert not thread.is_alive()
    assert isinstance(outcome[0], QueueClosedError), outcome
    reader.shutdown()
    writer.shutdown()


def test_writer_shutdown_reaches_a_blocked_reader(pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = pair
    writer.enqueue("last")
    writer.shutdown()
    assert reader.dequeue(timeout=5) == "last"  # what was published is still delivered
    with pytest.raises(QueueClosedError, match="writer shut"):
        reader.dequeue(timeout=5)


def _progress_lines(caplog: pytest.LogCaptureFixture, reader: MessageQueue,
                    wake: Callable[[], None], indefinite: bool) -> list[Any]:
    """Park ``reader`` in a dequeue on a thread until its first progress line
    is logged, then end the wait with ``wake`` (a message); the messages read.

    Waits for the line as an event, never for a duration: on a loaded machine
    the reader's fast polls alone (``sched_yield`` hands the CPU to every
    other runnable process) may outlast any short timeout, and a wait that
    ends in its first look logs nothing."""
    got: list[Any] = []
    thread = threading.Thread(
        target=lambda: got.append(reader.dequeue(timeout=60, indefinite=indefinite)))
    thread.start()
    deadline = time.monotonic() + 60
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.01)
    wake()
    thread.join(60)
    assert not thread.is_alive()
    return got


def test_idle_reader_logs_who_is_behind(caplog: pytest.LogCaptureFixture) -> None:
    writer = MessageQueue(2, 2, name="logged")
    handle = writer.export_handle()
    reader = MessageQueue.create_from_handle(handle, 0, log_interval_s=0.1)
    other = MessageQueue.create_from_handle(handle, 1)
    try:
        writer.enqueue(1)
        assert reader.dequeue(timeout=1) == 1
        with caplog.at_level(logging.WARNING, logger="mpexec.ipc.message_queue"):
            assert _progress_lines(caplog, reader, lambda: writer.enqueue(2), False) == [2]
        assert "rank 1 read 0 (behind by 2)" in caplog.text or \
            "rank 1 read 0 (behind by 1)" in caplog.text
    finally:
        for q in (reader, other, writer):
            q.shutdown()


def _memfds() -> tuple[set[str], set[str]]:
    """This process's mpexec memfds: open descriptors, and mapped segments."""
    fds = {target for target in open_fds().values() if target.startswith(_MEMFD)}
    mapped = {entry for entry in shm_entries(skip=lambda pid: True)
              if entry.startswith(_MEMFD)}
    return fds, mapped


def test_segments_are_anonymous_and_gone_after_shutdown() -> None:
    """Queues live in memfds (no name anywhere); shutdown and dropping the
    views give back every descriptor and every mapping, here in this process."""
    assert _memfds() == (set(), set())
    writer = MessageQueue(2, 2)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in (0, 1)]
    writer.enqueue(np.zeros(1 << 20))
    arrays = [r.dequeue(timeout=5) for r in readers]
    fds, mapped = _memfds()
    assert any("-mq-" in f for f in fds) and any("-mq-bulk-" in f for f in fds)
    assert any("-mq-bulk-" in m for m in mapped)   # the arrays are views of the bulk segment
    assert all(m.endswith("(deleted)") for m in mapped)   # unlinked: nothing to clean up
    for q in (*readers, writer):
        q.shutdown()
        q.shutdown()  # idempotent
    fds, mapped = _memfds()
    assert not fds
    assert mapped and all("-mq-bulk-" in m for m in mapped)   # held views keep their memory
    assert float(arrays[0].sum()) == 0.0
    del arrays
    gc.collect()
    assert _memfds() == (set(), set())


def test_no_room_for_the_segment_names_mib_needed_and_available(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match=r"cannot reserve 4\.\d MiB of shared memory for queue 'mq'"
                       r".*No space left.*the limit that applies: .* leaves [\d.]+ MiB"):
        MessageQueue(1, 1, max_chunk_bytes=512 * 1024, max_chunks=8)


def test_segments_are_private_to_the_user() -> None:
    import stat

    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        mode = os.fstat(writer.transport._segment.fd).st_mode
        assert stat.S_IMODE(mode) == 0o600
        target = os.readlink(f"/proc/self/fd/{writer.transport._segment.fd}")
        assert target.startswith("/memfd:mpexec-") and target.endswith("(deleted)")
    finally:
        reader.shutdown()
        writer.shutdown()


@pytest.mark.torch
def test_torch_tensors_through_the_bulk_path() -> None:
    torch = pytest.importorskip("torch")
    writer = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in (0, 1)]
    try:
        sent = {"w": torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512),
                "b": torch.ones(3, dtype=torch.bfloat16)}
        writer.enqueue(sent)
        a, b = (r.dequeue(timeout=5) for r in readers)
        assert torch.equal(a["w"], sent["w"]) and torch.equal(b["b"], sent["b"])
        a["w"][0, 0] = -1.0  # private to reader 0
        assert b["w"][0, 0] == 0.0 and sent["w"][0, 0] == 0.0
    finally:
        for r in readers:
            r.shutdown()
        writer.shutdown()


def test_idle_reader_logs_at_info_only_when_a_peer_lags(caplog: pytest.LogCaptureFixture) -> None:
    writer = MessageQueue(2, 2, name="idle")
    handle = writer.export_handle()
    reader = MessageQueue.create_from_handle(handle, 0, log_interval_s=0.1)
    other = MessageQueue.create_from_handle(handle, 1)
    try:
        with caplog.at_level(logging.DEBUG, logger="mpexec.ipc.message_queue"):
            # Everyone idle: DEBUG.
            assert _progress_lines(caplog, reader, lambda: writer.enqueue(1), True) == [1]
            assert {r.levelno for r in caplog.records} == {logging.DEBUG}
            caplog.clear()
            # Rank 1 has not read message 1: a stuck peer, INFO.
            assert _progress_lines(caplog, reader, lambda: writer.enqueue(2), True) == [2]
        assert {r.levelno for r in caplog.records} == {logging.INFO}
        assert "rank 1 read 0 (behind by 1)" in caplog.text
    finally:
        for q in (reader, other, writer):
            q.shutdown()


def test_held_bulk_views_cost_no_descriptor_each() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        held = []
        for i in range(3):  # warm the writer's cached bulk slots
            writer.enqueue(np.full(2000, i))
            held.append(reader.dequeue(timeout=5))
        before = len(os.listdir("/proc/self/fd"))
        for i in range(100):
            writer.enqueue(np.full(2000, i))
            held.append(reader.dequeue(timeout=5))
        # The writer may cache up to BULK_SLOTS segments; the reader adds none.
        assert len(os.listdir("/proc/self/fd")) - before <= layout.BULK_SLOTS
        assert [int(h[0]) for h in held[3:]] == list(range(100))
    finally:
        reader.shutdown()
        writer.shutdown()


def test_bulk_cache_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.ipc import bulk

    monkeypatch.setattr(bulk, "CACHE_CAP_BYTES", 4 << 20)
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        held = []
        for i in range(6):  # six 2 MiB messages held at once: six slots
            writer.enqueue(np.full(1 << 18, i))
            held.append(reader.dequeue(timeout=5))
        held.clear()
        gc.collect()
        writer.enqueue(np.zeros(10))
        assert reader.dequeue(timeout=5).sum() == 0
        writer.enqueue(np.full(1 << 18, 9))
        assert int(reader.dequeue(timeout=5)[-1]) == 9
        assert writer.transport._bulk is not None
        cached = sum(s.capacity for s in writer.transport._bulk._slots if s is not None)
        assert cached <= 4 << 20
    finally:
        reader.shutdown()
        writer.shutdown()
