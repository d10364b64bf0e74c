"""Remote readers over authenticated ZeroMQ (loopback only): ordering,
back-pressure, large payloads, the wrong secret, CURVE and the MAC's form
(forged frames: ``test_forged_frames``)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
np = pytest.importorskip("numpy")

from mpexec.errors import QueueClosedError, UndecodableMessageError  # noqa: E402
from mpexec.ipc import (  # noqa: E402
    MessageQueue,
    MessageQueueReader,
    MessageQueueWriter,
    QueueReader,
    QueueWriter,
)
from mpexec.ipc.auth import (  # noqa: E402
    DATA,
    AuthenticationError,
    DropCounter,
    FrameAuth,
    derive_key,
)
from mpexec.ipc.remote import RemoteReader, RemoteWriter  # noqa: E402
from tests.multinode.remote_helpers import SECRET, trio_queues  # noqa: E402


@pytest.fixture
def trio() -> Iterator[tuple[MessageQueue, MessageQueue, MessageQueue]]:
    """A writer with one local reader (rank 0) and one remote reader (rank 1)."""
    yield from trio_queues()


def test_handle_names_where_remote_readers_connect() -> None:
    writer = MessageQueue(2, 0, secret=SECRET, connect_ip="127.0.0.1")
    try:
        handle = writer.export_handle()
        assert handle.local_reader_ranks == [] and handle.buffer is None
        assert handle.connect_ip == "127.0.0.1"
        assert handle.remote_subscribe_addr is not None
        assert handle.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
        assert not handle.remote_subscribe_addr.endswith(":0")
        assert SECRET not in repr(handle) and SECRET.encode() not in pickle.dumps(handle)
        with pytest.raises(ValueError, match="cluster secret"):
            MessageQueue.create_from_handle(handle, 0)
        with pytest.raises(ValueError, match="not a remote reader"):
            MessageQueue.create_from_handle(handle, 7, secret=SECRET)
    finally:
        writer.shutdown()


def test_remote_ends_are_their_own_types_each_with_its_protocol(trio: Any) -> None:
    """The remote writer holds a shared-memory writer for its local ranks (it
    does not inherit one); the remote reader holds no ring at all."""
    writer, local, remote = trio
    assert type(writer.transport) is RemoteWriter and type(remote) is RemoteReader
    assert type(local) is MessageQueueReader
    assert isinstance(writer.transport._local, MessageQueueWriter)
    assert isinstance(writer.transport, QueueWriter)
    assert not isinstance(writer.transport, QueueReader)
    assert isinstance(remote, QueueReader) and not isinstance(remote, QueueWriter)
    assert not hasattr(remote, "enqueue") and not hasattr(writer.transport, "dequeue")
    assert not hasattr(remote, "_ring") and not hasattr(remote, "_guard")
    for cls in (RemoteWriter, RemoteReader):
        assert MessageQueue not in cls.__mro__ and MessageQueueWriter not in cls.__mro__
    assert writer.unattached_ranks() == []


def test_every_reader_gets_every_message_in_order(trio: Any) -> None:
    writer, local, remote = trio
    got_local, got_remote = [], []
    for i in range(200):
        writer.enqueue({"i": i})
        got_local.append(local.dequeue(5)["i"])
        got_remote.append(remote.dequeue(5)["i"])
    assert got_local == got_remote == list(range(200))
    assert remote.drops.total == 0 and writer.transport.drops.total == 0


def test_slow_remote_reader_slows_the_writer_and_loses_nothing(trio: Any) -> None:
    writer, local, remote = trio
    sent = 0
    with pytest.raises(TimeoutError, match="window behind"):
        for sent in range(100):
            writer.enqueue(sent, timeout=0.3)
            local.dequeue(5)
    assert sent == 4  # the window (max_chunks): then the writer waits
    # The timed-out message was not published anywhere: a retry is the next one.
    assert [remote.dequeue(5) for _ in range(4)] == [0, 1, 2, 3]
    writer.enqueue(4, timeout=5)
    assert local.dequeue(5) == 4 and remote.dequeue(5) == 4


def test_large_payload_arrives_whole_as_out_of_band_frames(trio: Any) -> None:
    writer, local, remote = trio
    big = np.arange(8 * 2**20, dtype=np.int64)  # 64 MiB
    writer.enqueue({"array": big, "tag": "x" * 100})
    for reader in (local, remote):
        out = reader.dequeue(30)
        assert out["tag"] == "x" * 100
        assert np.array_equal(out["array"], big)
    big[:] = 0  # the writer returned: ZeroMQ is done with the caller's memory
    writer.enqueue(b"y" * (3 << 20))
    assert local.dequeue(5) == remote.dequeue(5) == b"y" * (3 << 20)


def test_wrong_secret_is_refused_with_a_clear_error() -> None:
    writer = MessageQueue(1, 0, secret=SECRET, name="auth")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0,
                                             secret="not-the-cluster-secret-at-all")
    try:
        with pytest.raises(TimeoutError):
            writer.wait_until_ready(0.5)  # it never counts the impostor as a reader
        with pytest.raises(AuthenticationError, match="cluster secret differs"):
            reader.wait_until_ready(30)
        assert writer.transport.drops.by_reason["bad mac"] >= 1
    finally:
        reader.shutdown()
        writer.shutdown()


def _refuse_to_load() -> None:
    raise RuntimeError("this object cannot be rebuilt here")


class _Unloadable:
    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())


def test_a_message_that_does_not_unpickle_is_reported_and_the_reader_goes_on(
        trio: Any) -> None:
    writer, local, remote = trio
    writer.enqueue(_Unloadable())
    for reader in (local, remote):
        with pytest.raises(UndecodableMessageError, match="could not be unpickled") as info:
            reader.dequeue(5)
        assert isinstance(info.value.__cause__, RuntimeError)
    writer.enqueue("next")
    assert local.dequeue(5) == remote.dequeue(5) == "next"
    assert remote.drops.total == 0


def test_writer_shutdown_ends_remote_reader(trio: Any) -> None:
    writer, _, remote = trio
    writer.enqueue("last")
    writer.shutdown()
    assert remote.dequeue(5) == "last"
    with pytest.raises(QueueClosedError, match="writer shut"):
        remote.dequeue(5)


def test_a_remote_reader_that_shuts_down_is_named_to_the_writer(trio: Any) -> None:
    writer, local, remote = trio
    remote.shutdown()  # says CLOSE to the writer
    deadline = time.monotonic() + 10
    with pytest.raises(QueueClosedError, match="reader rank 1 shut down") as closed:
        while time.monotonic() < deadline:  # until the CLOSE has been read
            writer.enqueue("more", timeout=1)
            assert local.dequeue(5) == "more"
    assert closed.value.reader_rank == 1  # the executor maps it to that rank's node


def test_a_look_at_an_empty_remote_reader_does_not_wait_a_tick(trio: Any) -> None:
    # The executor's drain() looks at every reply queue with timeout=0; each
    # look waiting a tick (50 ms) stalled calls.  200 looks must beat a
    # deadline that 200 ticks would miss by half.
    writer, local, remote = trio
    looked: list[int] = []

    def look() -> None:
        for _ in range(200):
            with pytest.raises(TimeoutError):
                remote.dequeue(timeout=0)
            looked.append(1)

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive() and len(looked) == 200
    writer.enqueue("after the looks")
    assert local.dequeue(5) == remote.dequeue(5) == "after the looks"


def test_reader_shutdown_from_another_thread_wakes_dequeue(trio: Any) -> None:
    _, _, remote = trio
    timer = threading.Timer(0.2, remote.shutdown)
    timer.start()
    with pytest.raises(QueueClosedError):
        remote.dequeue(60)
    timer.join(5)


def _remote_child(handle: Any, conn: Any) -> None:
    reader = MessageQueue.create_from_handle(handle, 1, secret=SECRET)
    reader.wait_until_ready(20)
    total = 0
    for _ in range(500):
        total += reader.dequeue(20)
    conn.send(total)
    reader.shutdown()


@pytest.mark.timeout(60)
def test_remote_reader_in_another_process(leak_check: None) -> None:
    ctx = multiprocessing.get_context("spawn")
    writer = MessageQueue(2, 1, secret=SECRET, name="proc")
    handle = writer.export_handle()
    local = MessageQueue.create_from_handle(handle, 0)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_remote_child, args=(handle, child))
    proc.start()
    try:
        local_ready = threading.Thread(target=local.wait_until_ready, args=(30,))
        local_ready.start()
        writer.wait_until_ready(30)
        local_ready.join(30)
        for i in range(500):
            writer.enqueue(i, timeout=20)
            assert local.dequeue(20) == i
        assert parent.poll(30) and parent.recv() == sum(range(500))
    finally:
        proc.join(30)
        for q in (local, writer):
            q.shutdown()
        parent.close()
        child.close()
    assert proc.exitcode == 0


# -- CURVE ----------------------------------------------------------------------------


def test_curve_encrypts_and_a_plaintext_or_wrong_secret_peer_gets_nothing(
        tmp_path: Path) -> None:
    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE")
    writer = MessageQueue(2, 0, secret=SECRET, name="curve", curve=True)
    handle = writer.export_handle()
    assert handle.remote_curve
    reader = MessageQueue.create_from_handle(handle, 0, secret=SECRET)
    plain = MessageQueue.create_from_handle(dataclasses.replace(handle, remote_curve=False),
                                            1, secret=SECRET)
    wrong = MessageQueue.create_from_handle(handle, 1, secret="not-the-cluster-secret-at-all")
    try:
        ready = threading.Thread(target=reader.wait_until_ready, args=(60,))
        ready.start()
        with pytest.raises(TimeoutError):
            writer.wait_until_ready(1.0)  # neither impostor ever says HELLO to it
        for impostor in (plain, wrong):
            with pytest.raises(AuthenticationError, match=r"handshake .* failed: CURVE"):
                impostor.wait_until_ready(30)
        assert writer.transport.drops.total == 0  # refused inside ZeroMQ, before any frame
        right = MessageQueue.create_from_handle(handle, 1, secret=SECRET)
        try:
            ready2 = threading.Thread(target=right.wait_until_ready, args=(10,))
            ready2.start()
            writer.wait_until_ready(10)
            ready.join(10)
            ready2.join(10)
            big = np.arange(1 << 18, dtype=np.int64)
            writer.enqueue({"i": 1, "big": big})
            for r in (reader, right):
                out = r.dequeue(10)
                assert out["i"] == 1 and np.array_equal(out["big"], big)
        finally:
            right.shutdown()
    finally:
        for q in (reader, plain, wrong, writer):
            q.shutdown()


def test_the_frame_mac_is_plain_hmac_sha256_of_the_header_and_the_part() -> None:
    # The sealing keeps a keyed OpenSSL state and copies it per frame; the
    # MAC must still be exactly the documented HMAC-SHA256(key, header || part).
    import hashlib
    import hmac

    from mpexec.ipc.auth import HEADER, PREFIX

    key = derive_key(SECRET, "mq/test", "w2r")
    (frame,) = FrameAuth(key, 4096).seal(DATA, 3, 7, [b"a small message"])
    header, mac, part = frame[:HEADER.size], frame[HEADER.size:PREFIX], frame[PREFIX:]
    assert part == b"a small message"
    assert mac == hmac.new(key, header + part, hashlib.sha256).digest()
    opened = FrameAuth(key, 4096).open([frame], DropCounter("test"))
    assert opened is not None and (opened.rank, opened.seq) == (3, 7)
