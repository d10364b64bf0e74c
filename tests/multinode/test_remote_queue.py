"""Remote readers over authenticated ZeroMQ (loopback only): ordering,
back-pressure, large payloads, the wrong secret, and forged frames."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
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
from mpexec.ipc import MessageQueue  # noqa: E402
from mpexec.ipc.auth import (  # noqa: E402
    DATA,
    AuthenticationError,
    DropCounter,
    FrameAuth,
    derive_key,
)

SECRET = "a-test-cluster-secret-0123456789"


def _ready_all(writer: MessageQueue, readers: list[MessageQueue]) -> None:
    threads = [threading.Thread(target=r.wait_until_ready, args=(10,)) for r in readers]
    for t in threads:
        t.start()
    writer.wait_until_ready(10)
    for t in threads:
        t.join(10)


@pytest.fixture
def trio() -> Iterator[tuple[MessageQueue, MessageQueue, MessageQueue]]:
    """A writer with one local reader (rank 0) and one remote reader (rank 1)."""
    writer = MessageQueue(2, 1, secret=SECRET, name="trio", max_chunks=4)
    handle = writer.export_handle()
    local = MessageQueue.create_from_handle(handle, 0)
    remote = MessageQueue.create_from_handle(handle, 1, secret=SECRET)
    _ready_all(writer, [local, remote])
    yield writer, local, remote
    for q in (remote, local, writer):
        q.shutdown()


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


def test_every_reader_gets_every_message_in_order(trio: Any) -> None:
    writer, local, remote = trio
    got_local, got_remote = [], []
    for i in range(200):
        writer.enqueue({"i": i})
        got_local.append(local.dequeue(5)["i"])
        got_remote.append(remote.dequeue(5)["i"])
    assert got_local == got_remote == list(range(200))
    assert remote.drops.total == 0 and writer.drops.total == 0


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
        assert writer.drops.by_reason["bad mac"] >= 1
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


def test_reader_shutdown_from_another_thread_wakes_dequeue(trio: Any) -> None:
    _, _, remote = trio
    timer = threading.Timer(0.2, remote.shutdown)
    timer.start()
    with pytest.raises(QueueClosedError):
        remote.dequeue(60)
    timer.join()


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


# -- forged frames ---------------------------------------------------------------------


class _MakesAFile:
    """Unpickling this creates a file: the proof that something was deserialised."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


class _Tap:
    """A man in the middle between a remote reader and its writer: forwards the
    real traffic both ways, records the writer's frames, and injects frames."""

    def __init__(self, writer_addr: str) -> None:
        self.context = zmq.Context(1)
        self.front = self.context.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops at its HWM
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.back = self.context.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(writer_addr)
        self.recorded: list[list[bytes]] = []
        self.reader_id: bytes | None = None
        self.inject: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(20))
            if self.front in events:
                rid, *frames = self.front.recv_multipart()
                self.reader_id = rid
                self.back.send_multipart(frames)
            if self.back in events:
                frames = self.back.recv_multipart()
                self.recorded.append(frames)
                assert self.reader_id is not None
                self.front.send_multipart([self.reader_id, *frames])
            with self.lock:
                batch, self.inject = self.inject, []
            for frames in batch:
                assert self.reader_id is not None
                self.front.send_multipart([self.reader_id, *frames])

    def send(self, frames_list: list[list[bytes]]) -> None:
        with self.lock:
            self.inject.extend(frames_list)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.front.close(0)
        self.back.close(0)
        self.context.term()


def _forgeries(path: str, recorded: list[list[bytes]], n: int, token: int) -> list[list[bytes]]:
    payload = pickle.dumps(_MakesAFile(path))
    wrong = FrameAuth(derive_key("an-attacker-guessed-this-secret!", f"mq/sec/{token:x}",
                                 "w2r"), 1 << 40)
    valid_data = [f for f in recorded if f[0][4] == DATA]
    assert valid_data
    out: list[list[bytes]] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:  # well formed, signed with the wrong key
            out.append(wrong.seal(DATA, 0, i, [payload], aux=1))
        elif kind == 1:  # a random MAC
            (first,) = wrong.seal(DATA, 0, 0, [payload], aux=1)
            out.append([first[:36] + os.urandom(32) + first[68:]])
        elif kind == 2:  # truncated: a real frame cut short
            real = valid_data[i % len(valid_data)]
            out.append([real[0][: len(real[0]) - 1 - i % 7]])
        elif kind == 3:  # replayed: a real frame, verbatim
            out.append(list(valid_data[i % len(valid_data)]))
        elif kind == 4:  # oversized: claims more than any message may be
            (first,) = wrong.seal(DATA, 0, 1, [payload], aux=1)
            out.append([first[:28] + (1 << 62).to_bytes(8, "little") + first[36:]])
        else:  # garbage of every length, a bare pickle
            out.append([payload] if i % 12 == 5 else [os.urandom(i % 64), payload])
    return out


@pytest.mark.timeout(120)
def test_forged_truncated_replayed_oversized_frames_are_never_unpickled(
        tmp_path: Path) -> None:
    canary = tmp_path / "created-by-unpickling"
    writer = MessageQueue(1, 0, secret=SECRET, name="sec")
    handle = writer.export_handle()
    tap = _Tap(handle.remote_subscribe_addr)
    reader = MessageQueue.create_from_handle(
        dataclasses.replace(handle, remote_subscribe_addr=tap.addr), 0, secret=SECRET)
    try:
        _ready_all(writer, [reader])
        for i in range(5):
            writer.enqueue(("real", i))
            assert reader.dequeue(10) == ("real", i)
        tap.send(_forgeries(str(canary), tap.recorded, 10_000, handle.remote_token or 0))
        # Interleaved with the flood, the real writer keeps being served in order.
        for i in range(5, 50):
            writer.enqueue(("real", i))
            assert reader.dequeue(30) == ("real", i)
        deadline = time.monotonic() + 60
        while reader.drops.total < 10_000 and time.monotonic() < deadline:
            with pytest.raises(TimeoutError):
                reader.dequeue(0.2)
        assert reader.drops.total == 10_000
        assert set(reader.drops.by_reason) <= {"bad mac", "truncated", "replayed",
                                                "oversized", "bad header"}
        assert not canary.exists()
        writer.enqueue("after the flood")
        assert reader.dequeue(10) == "after the flood"
    finally:
        reader.shutdown()
        tap.close()
        writer.shutdown()
    assert not canary.exists()


def test_forged_control_frames_at_the_writer_port_are_dropped(trio: Any) -> None:
    writer, local, remote = trio
    handle = writer.export_handle()
    context = zmq.Context(1)
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(handle.remote_subscribe_addr)
    forger = FrameAuth(derive_key("an-attacker-guessed-this-secret!", "x", "r2w"), 4096)
    try:
        for i in range(1000):
            attacker.send_multipart(forger.seal(4, 1, 10**6 + i, []) if i % 2
                                    else [os.urandom(36), os.urandom(32)])
        deadline = time.monotonic() + 30
        while writer.drops.total < 1000 and time.monotonic() < deadline:
            writer.enqueue("tick")
            assert local.dequeue(5) == "tick" and remote.dequeue(5) == "tick"
        assert writer.drops.total == 1000
        # A forged ACK gave no credit: back-pressure still follows the real reader.
        writer.enqueue("still fine")
        assert remote.dequeue(5) == "still fine" and local.dequeue(5) == "still fine"
    finally:
        attacker.close(0)
        context.term()


def test_drop_counter_logs_at_most_once_per_interval(caplog: Any) -> None:
    drops = DropCounter("q", log_interval_s=3600)
    with caplog.at_level("WARNING"):
        for _ in range(100):
            drops.drop("bad mac")
    assert drops.total == 100
    assert len([r for r in caplog.records if "dropped" in r.message]) == 1


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
        assert writer.drops.total == 0  # refused inside ZeroMQ, before any frame
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
