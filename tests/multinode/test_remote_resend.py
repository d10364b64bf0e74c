"""Delivery across dropped connections: a TCP proxy between a remote reader
and its writer is cut mid-stream; every message arrives once, in order."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.errors import QueueClosedError
from mpexec.ipc import MessageQueue
from mpexec.ipc.remote.resend import ResendLog
from tests.multinode.tcp_proxy import TcpProxy

pytestmark = pytest.mark.usefixtures("leak_check")

SECRET = "a-test-cluster-secret-0123456789"


@pytest.fixture
def proxied() -> Iterator[tuple[MessageQueue, MessageQueue, TcpProxy]]:
    """A writer whose one remote reader (rank 0) reaches it through a proxy."""
    writer = MessageQueue(1, 0, secret=SECRET, name="resend", max_chunks=8)
    handle = writer.export_handle()
    assert handle.remote_subscribe_addr is not None
    port = int(handle.remote_subscribe_addr.rsplit(":", 1)[1])
    proxy = TcpProxy("127.0.0.1", port)
    reader = MessageQueue.create_from_handle(
        dataclasses.replace(handle, remote_subscribe_addr=proxy.addr), 0, secret=SECRET)
    ready = threading.Thread(target=reader.wait_until_ready, args=(10,))
    ready.start()
    writer.wait_until_ready(10)
    ready.join(10)
    yield writer, reader, proxy
    reader.shutdown()
    writer.shutdown()
    proxy.close()


@pytest.mark.timeout(90)
def test_every_message_arrives_once_in_order_across_cut_connections(proxied: Any) -> None:
    writer, reader, proxy = proxied
    n = 3000
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            for i in range(n):
                writer.enqueue(("m", i, b"x" * (i % 300)), timeout=60)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=publish)
    thread.start()
    got = []
    for i in range(n):
        if i % 600 == 300:
            proxy.cut(refuse_s=0.05 * (i // 600))  # mid-stream, longer each time
        got.append(reader.dequeue(30)[1])
    thread.join(30)
    assert not errors
    assert got == list(range(n))
    assert proxy.cuts == 5 and proxy.accepted >= 2
    # Resent copies of what did arrive are duplicates, not forgeries.
    assert reader.drops.total == 0 and writer.transport.drops.total == 0


def _lose_in_flight(writer: MessageQueue, reader: MessageQueue, proxy: TcpProxy,
                    message: str) -> None:
    """One message delivered, then ``message`` certainly lost: the proxy
    swallows its bytes and the connection is cut."""
    writer.enqueue("first")
    assert reader.dequeue(10) == "first"
    proxy.swallow = True  # the writer's next bytes never reach the reader
    writer.enqueue(message)
    deadline = time.monotonic() + 10
    while proxy.swallowed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.swallowed > 0
    proxy.cut()


@pytest.mark.timeout(60)
def test_the_last_message_lost_is_resent_though_the_writer_is_idle(proxied: Any) -> None:
    writer, reader, proxy = proxied
    _lose_in_flight(writer, reader, proxy, "lost in flight")
    # The writer publishes nothing more: the reader's RESUME (after silence)
    # reaches the writer's service thread, which resends.
    assert reader.dequeue(20) == "lost in flight"
    assert writer.transport.resent >= 1 and reader.recovery["resume after silence"] >= 1
    writer.enqueue("after")
    assert reader.dequeue(10) == "after"
    assert reader.drops.total == 0


@pytest.mark.timeout(60)
def test_a_message_lost_just_before_close_is_resent_before_the_reader_stops(
        proxied: Any) -> None:
    writer, reader, proxy = proxied
    _lose_in_flight(writer, reader, proxy, "lost just before close")
    # CLOSE says two messages were published; the reader has one, so it asks
    # for the other (RESUME) and the closing writer resends it first.
    closing = threading.Thread(target=writer.shutdown)
    closing.start()
    try:
        assert reader.dequeue(20) == "lost just before close"
        with pytest.raises(QueueClosedError, match=r"writer shut the queue down$"):
            reader.dequeue(20)
    finally:
        closing.join(20)
    assert writer.transport.resent >= 1 and reader.drops.total == 0


def test_writer_keeps_at_most_a_window_and_refuses_old_control_frames() -> None:
    log = ResendLog([1, 2], window=4)
    for seq in range(4):
        assert log.has_credit_for(seq)
        log.keep(seq, [b"a%d" % seq, b"b%d" % seq], [])
    assert not log.has_credit_for(4) and len(log) == 4
    assert log.fresh_control(1, 1)
    log.ack(1, 3)
    assert len(log) == 4  # rank 2 still lacks everything
    assert log.fresh_control(2, 1)
    log.ack(2, 2)
    assert len(log) == 2 and log.floor == 2 and log.has_credit_for(5)
    assert log.frames_from(2, 2) == [[b"b2"], [b"b3"]]
    assert not log.fresh_control(2, 1)  # a replayed ACK/RESUME
    log.ack(2, 1)  # never backwards
    assert log.acked[2] == 2
