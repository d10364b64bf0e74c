"""Forged, truncated, replayed and oversized frames at a remote reader and at
its writer's port: none is ever unpickled, each is counted, and the real
writer and reader keep being served (loopback only)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from mpexec.ipc import MessageQueue  # noqa: E402
from mpexec.ipc.auth import DATA, DropCounter, FrameAuth, derive_key  # noqa: E402
from tests.multinode.remote_helpers import SECRET, ready_all, trio_queues  # noqa: E402

pytestmark = pytest.mark.usefixtures("leak_check")


@pytest.fixture
def trio() -> Iterator[tuple[MessageQueue, MessageQueue, MessageQueue]]:
    """A writer with one local reader (rank 0) and one remote reader (rank 1)."""
    yield from trio_queues()


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
        self.append_to_next: list[bytes] = []  # frames glued to the writer's next message
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
                with self.lock:
                    extra, self.append_to_next = self.append_to_next, []
                self.front.send_multipart([self.reader_id, *frames, *extra])
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


@pytest.fixture
def tapped() -> Iterator[tuple[MessageQueue, MessageQueue, _Tap]]:
    """A writer and its remote reader (rank 0), ready, talking through a :class:`_Tap`."""
    writer = MessageQueue(1, 0, secret=SECRET, name="sec")  # the forgeries name "sec"
    handle = writer.export_handle()
    assert handle.remote_subscribe_addr is not None
    tap = _Tap(handle.remote_subscribe_addr)
    reader = MessageQueue.create_from_handle(
        dataclasses.replace(handle, remote_subscribe_addr=tap.addr), 0, secret=SECRET)
    try:
        ready_all(writer, [reader])
        yield writer, reader, tap
    finally:
        reader.shutdown()
        tap.close()
        writer.shutdown()


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
        tmp_path: Path, tapped: Any) -> None:
    canary = tmp_path / "created-by-unpickling"
    writer, reader, tap = tapped
    token = writer.export_handle().remote_token or 0
    for i in range(5):
        writer.enqueue(("real", i))
        assert reader.dequeue(10) == ("real", i)
    tap.send(_forgeries(str(canary), tap.recorded, 10_000, token))
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
    assert not canary.exists()


def test_frames_glued_to_a_real_message_are_dropped_and_it_is_still_taken(
        tapped: Any) -> None:
    # The reader takes the frame it expects next without asking whether more
    # follow (ZMQ_RCVMORE costs a lookup): what is glued after it is read as
    # a message of its own (its frames together), dropped, counted, never
    # unpickled.
    writer, reader, tap = tapped
    writer.enqueue("before")
    assert reader.dequeue(10) == "before"
    with tap.lock:
        tap.append_to_next = [pickle.dumps("glued 1"), os.urandom(100)]
    writer.enqueue("real")
    assert reader.dequeue(10) == "real"
    writer.enqueue("next")
    assert reader.dequeue(10) == "next"
    assert reader.drops.total == 1 and set(reader.drops.by_reason) <= {
        "truncated", "bad header"}


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
        while writer.transport.drops.total < 1000 and time.monotonic() < deadline:
            writer.enqueue("tick")
            assert local.dequeue(5) == "tick" and remote.dequeue(5) == "tick"
        assert writer.transport.drops.total == 1000
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


