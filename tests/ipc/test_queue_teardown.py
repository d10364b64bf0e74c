"""Teardown racing a call on the same queue end: the call gets ``QueueClosedError``,
never an error from memory (or a socket) released under it, and nothing is left.

Each race is made deterministic: the call is parked where it waits (a thread
blocked in the handshake or in ``dequeue``), or the shutdown is run from the
one place between the call's first look and its first touch of the ring (the
pickling of the message being enqueued).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from mpexec.errors import QueueClosedError
from mpexec.ipc import MessageQueue, endpoint

pytestmark = pytest.mark.usefixtures("leak_check")

SECRET = "teardown-test-secret-0123456789"
_JOIN_S = 10.0


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``call`` in a thread; what it raised lands in the list."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def _parked(queue: MessageQueue, sleeping: Callable[[], bool] | None = None) -> None:
    """Give the thread time to be inside its wait (asleep, when we can tell)."""
    if sleeping is None:
        time.sleep(0.2)
        return
    deadline = time.monotonic() + 5.0
    while not sleeping() and time.monotonic() < deadline:
        time.sleep(0.01)


def _shut_down_under(queue: MessageQueue, call: Callable[[], Any],
                     sleeping: Callable[[], bool] | None = None) -> BaseException:
    thread, raised = _in_thread(call)
    _parked(queue, sleeping)
    queue.shutdown()
    thread.join(_JOIN_S)
    assert not thread.is_alive()
    assert len(raised) == 1, "the call returned instead of failing"
    return raised[0]


def test_writer_handshake_shut_down_under_it() -> None:
    """The start-up race: the writer waits for readers that never attach and
    another thread (a death monitor) tears the queue down."""
    writer = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2, name="hs")
    error = _shut_down_under(writer, lambda: writer.wait_until_ready(30))
    assert isinstance(error, QueueClosedError), repr(error)


def test_reader_handshake_shut_down_under_it() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="hs-reader")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        error = _shut_down_under(reader, lambda: reader.wait_until_ready(30))
        assert isinstance(error, QueueClosedError), repr(error)
    finally:
        writer.shutdown()


def test_dequeue_shut_down_under_it_from_another_thread() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="dq")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        error = _shut_down_under(reader, lambda: reader.dequeue(timeout=30),
                                 lambda: writer.state().sleeping[0])
        assert isinstance(error, QueueClosedError), repr(error)
    finally:
        writer.shutdown()


def test_enqueue_on_a_full_ring_shut_down_under_it() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1, name="full")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.enqueue("fills the ring")
        error = _shut_down_under(writer, lambda: writer.enqueue("waits", timeout=30),
                                 lambda: reader.state().writer_waiting)
        assert isinstance(error, QueueClosedError), repr(error)
    finally:
        reader.shutdown()


class ShutsDownWhilePickled:
    """Pickled by ``enqueue`` after its first look at ``closed``: shuts the
    queue down from another thread right there."""

    queue: MessageQueue | None = None

    def __reduce__(self) -> Any:
        assert self.queue is not None
        thread = threading.Thread(target=self.queue.shutdown)
        thread.start()
        thread.join(_JOIN_S)
        return int, (0,)


def test_shutdown_between_enqueues_first_look_and_its_write() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="between")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        message = ShutsDownWhilePickled()
        message.queue = writer
        with pytest.raises(QueueClosedError):
            writer.enqueue(message)
    finally:
        reader.shutdown()


def test_a_call_still_inside_after_the_grace_releases_on_its_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """shutdown() stops waiting for the call; the call, leaving, releases."""
    monkeypatch.setattr(endpoint, "_CLOSE_GRACE_S", 0.0)
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="grace")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        thread, raised = _in_thread(lambda: reader.dequeue(timeout=30))
        _parked(reader, lambda: writer.state().sleeping[0])
        reader.shutdown()
        thread.join(_JOIN_S)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], QueueClosedError), raised
    finally:
        writer.shutdown()


def test_observers_after_shutdown_say_closed() -> None:
    writer = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2, name="observed")
    writer.shutdown()
    for look in (writer.state, writer.export_handle, writer.unattached_ranks,
                 writer.lagging_ranks, lambda: writer.wait_until_ready(1),
                 lambda: writer.enqueue(1)):
        with pytest.raises(QueueClosedError):
            look()


def test_many_shutdowns_against_a_busy_reader() -> None:
    """Shutdown lands anywhere in a stream of dequeues: always a clean close."""
    for round_ in range(30):
        writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4, name=f"r{round_}")
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        stop = threading.Event()

        def feed(writer: MessageQueue = writer, stop: threading.Event = stop) -> None:
            try:
                while not stop.is_set():
                    writer.enqueue(b"x", timeout=0.05)
            except (TimeoutError, QueueClosedError):
                pass

        def drain(reader: MessageQueue = reader) -> None:
            while True:
                try:
                    reader.dequeue(timeout=5)
                except TimeoutError:
                    continue

        feeder, _ = _in_thread(feed)
        thread, raised = _in_thread(drain)
        time.sleep(0.001 * (round_ % 7))
        reader.shutdown()
        thread.join(_JOIN_S)
        stop.set()
        feeder.join(_JOIN_S)
        writer.shutdown()
        assert not thread.is_alive() and not feeder.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], QueueClosedError), raised


# -- remote ends ------------------------------------------------------------------------


def test_remote_reader_handshake_shut_down_under_it() -> None:
    pytest.importorskip("zmq")
    writer = MessageQueue(2, 0, secret=SECRET, name="remote-hs")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0, secret=SECRET)
    try:
        # Rank 1 never says HELLO: the writer never WELCOMEs, the reader waits.
        error = _shut_down_under(reader, lambda: reader.wait_until_ready(30))
        assert isinstance(error, QueueClosedError), repr(error)
        with pytest.raises(QueueClosedError):
            reader.wait_until_ready(1)
        with pytest.raises(QueueClosedError):
            reader.dequeue(timeout=0)
    finally:
        writer.shutdown()


def test_remote_writer_with_local_readers_handshake_shut_down_under_it() -> None:
    """The Ray start-up race: the shared-memory half of a writer with remote
    readers waits for its local readers while the watcher tears it down."""
    pytest.importorskip("zmq")
    writer = MessageQueue(2, 1, secret=SECRET, name="mixed-hs")
    error = _shut_down_under(writer, lambda: writer.wait_until_ready(30))
    assert isinstance(error, QueueClosedError), repr(error)
