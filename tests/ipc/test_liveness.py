"""Liveness and waiting where the usual primitives fail: many descriptors, no futex."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mpexec.ipc import MessageQueue, sync
from mpexec.ipc.peers import PeerWatch

pytestmark = pytest.mark.usefixtures("leak_check")


@pytest.fixture
def many_fds() -> Iterator[None]:
    """More than 1,024 descriptors open, so new ones are numbered above select's limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("many_fds")
def test_peer_watch_with_descriptors_above_1024() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = PeerWatch(child.pid)
        assert watch._fd > 1024  # the case select() refuses
        assert watch.alive()
        child.kill()
        child.wait(timeout=10)
        assert not watch.alive()
        watch.close()
    finally:
        child.kill()
        child.wait(timeout=10)


@pytest.mark.usefixtures("many_fds")
def test_queue_works_with_descriptors_above_1024() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0, tick_s=0.01)
    try:
        writer.enqueue(b"x" * 100_000)   # a bulk segment, its descriptor above 1024
        assert len(reader.dequeue(timeout=5)) == 100_000
        with pytest.raises(TimeoutError):   # the wait's liveness checks poll the writer's pidfd
            reader.dequeue(timeout=0.1)
    finally:
        reader.shutdown()
        writer.shutdown()


@pytest.fixture
def refused_futex(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """futex(2) answering ENOSYS, as under a seccomp filter; the calls it got."""
    calls: list[Any] = []

    def refuse(*args: Any) -> int:
        calls.append(args)
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(sync, "_syscall", refuse)
    monkeypatch.setattr(sync, "_futex_refused", None)
    yield calls


def test_refused_futex_falls_back_to_sleeps_once_with_a_warning(
        refused_futex: list[Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    real_sleep = time.sleep

    def recorded_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(sync.time, "sleep", recorded_sleep)
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, spin_s=0.0)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0, spin_s=0.0)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(reader.dequeue(timeout=30)))
    try:
        with caplog.at_level(logging.WARNING, logger="mpexec.ipc.sync"):
            thread.start()
            deadline = time.monotonic() + 10
            while len(sleeps) < 20:   # the reader sleeps, in timed sleeps, again and again
                assert time.monotonic() < deadline
                real_sleep(0.001)
            writer.enqueue("woken by its own timed sleep")
            thread.join(timeout=10)
        assert got == ["woken by its own timed sleep"]
        assert not sync.futex_available()
        assert len(refused_futex) == 1   # refused once, never asked again
        assert all(0 < s <= sync.FALLBACK_SLEEP_S for s in sleeps)
        warnings = [r for r in caplog.records if "futex" in r.getMessage()]
        assert len(warnings) == 1 and "ENOSYS" in warnings[0].getMessage()
    finally:
        thread.join(timeout=10)
        reader.shutdown()
        writer.shutdown()


def test_other_futex_errors_are_ordinary_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    def busy(*args: Any) -> int:
        ctypes.set_errno(errno.EAGAIN)   # the word changed before we slept
        return -1

    monkeypatch.setattr(sync, "_syscall", busy)
    monkeypatch.setattr(sync, "_futex_refused", None)
    word = ctypes.c_uint32(0)
    sync.futex_wait(ctypes.addressof(word), 1, 0.01)
    assert sync.futex_available()
