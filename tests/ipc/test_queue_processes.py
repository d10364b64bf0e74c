"""MessageQueue across real processes: ordering, stress, wake-ups and crashes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mpexec.errors import PeerDiedError, QueueClosedError
from mpexec.ipc import MessageQueue
from tests.ipc import peers

pytestmark = pytest.mark.usefixtures("leak_check")

BOX_TIMEOUT = 30


class Broadcast:
    """A writer here, ``n`` echo readers in child processes, their reply queues."""

    def __init__(self, method: str, n: int, options: dict[str, Any] | None = None,
                 **queue_args: Any) -> None:
        self.ctx = mp.get_context(method)
        self.options = options or {}
        self.queue = MessageQueue(n, n, **queue_args)
        handle = self.queue.export_handle()
        self.boxes = [self.ctx.Queue() for _ in range(n)]
        self.procs = [self.ctx.Process(target=peers.echo_reader,
                                       args=(handle, rank, self.boxes[rank], self.options),
                                       daemon=True)
                      for rank in range(n)]
        self.replies: list[MessageQueue] = []
        try:
            for proc in self.procs:
                proc.start()
            self.replies = [MessageQueue.create_from_handle(box.get(timeout=BOX_TIMEOUT), 0)
                            for box in self.boxes]
            self.queue.wait_until_ready(timeout=BOX_TIMEOUT)
            for reply in self.replies:
                reply.wait_until_ready(timeout=BOX_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for reply in self.replies:
            reply.shutdown()
        self.queue.shutdown()
        for box in self.boxes:
            box.close()
            box.join_thread()


@pytest.fixture
def broadcast(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Broadcast] = []

    def make(*args: Any, **kwargs: Any) -> Broadcast:
        made.append(Broadcast(*args, **kwargs))
        return made[-1]

    yield make
    for b in made:
        b.close()
    made.clear()  # pytest keeps ``make`` alive; drop the pipes and semaphores now


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_reader_sees_every_message_in_order(broadcast: Any, method: str, n: int) -> None:
    b = broadcast(method, n, max_chunk_bytes=4096, max_chunks=4)
    for seq in range(200):
        data = peers.payload(seq, 3 * 4096)
        b.queue.enqueue((seq, data), timeout=10)
        for reply in b.replies:
            assert reply.dequeue(timeout=10) == (seq, peers.digest(data))
    b.queue.enqueue(None, timeout=10)
    assert [r.dequeue(timeout=10) for r in b.replies] == [("done", 200)] * n


# 20,000 lockstep round trips through 3-4 processes that sleep on futexes:
# each costs a few context switches, so the wall time is the scheduler's. On a
# 2-CPU machine under a load of ~15 (busy loops and other test suites) that is
# minutes, not a hang: the process sits in the fast polls' sched_yield.
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 3])
def test_stress_pipelined_random_sizes(broadcast: Any, n: int) -> None:
    """Tens of thousands of messages, up to several chunks each, fully pipelined.

    The writer runs ahead of the readers by up to the whole ring, readers
    pause at random so that every party sleeps and is woken many times; each
    reader checks order and content of everything.
    """
    count = 20_000
    b = broadcast("spawn", n, {"pause_every": 97, "pause_s": 0.003},
                  max_chunk_bytes=2048, max_chunks=4, spin_s=0.0)
    expected = [peers.digest(peers.payload(seq, 5 * 2048)) for seq in range(count)]
    received = [0] * n
    for seq in range(count):
        b.queue.enqueue((seq, peers.payload(seq, 5 * 2048)), timeout=30)
        # Drain replies opportunistically so the reply rings never fill up.
        for rank, reply in enumerate(b.replies):
            while received[rank] <= seq:
                try:
                    got = reply.dequeue(timeout=0 if received[rank] < seq else 30)
                except TimeoutError:
                    break
                assert got == (received[rank], expected[received[rank]]), got
                received[rank] += 1
    b.queue.enqueue(None, timeout=30)
    for rank, reply in enumerate(b.replies):
        while received[rank] < count:
            assert reply.dequeue(timeout=30) == (received[rank], expected[received[rank]])
            received[rank] += 1
        assert reply.dequeue(timeout=30) == ("done", count)


def test_no_lost_wakeups_when_every_wait_sleeps(broadcast: Any) -> None:
    """Force every wait through the futex with a tick far beyond the test's
    deadlines: a single lost wake-up would surface as a TimeoutError."""
    sleepy = {"spin_s": 0.0, "tick_s": 60.0}
    b = broadcast("spawn", 2, {"reader": sleepy, "writer": sleepy, "timeout": 20,
                               "pause_every": 3, "pause_s": 0.001},
                  max_chunk_bytes=1024, max_chunks=2, **sleepy)
    for seq in range(3000):
        b.queue.enqueue((seq, b""), timeout=20)
        for reply in b.replies:
            assert reply.dequeue(timeout=20)[0] == seq
    b.queue.enqueue(None, timeout=20)


def test_writer_sigkill_gives_readers_peer_died() -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    proc = ctx.Process(target=peers.writer_then_hang, args=(box, {"count": 2}), daemon=True)
    proc.start()
    try:
        reader = MessageQueue.create_from_handle(box.get(timeout=BOX_TIMEOUT), 0)
        reader.wait_until_ready(timeout=BOX_TIMEOUT)
        assert box.get(timeout=BOX_TIMEOUT) == "sent"
        os.kill(proc.pid, signal.SIGKILL)
        assert [reader.dequeue(timeout=5), reader.dequeue(timeout=5)] == [0, 1]
        # Noticed by the liveness check, well before the dequeue's own deadline.
        with pytest.raises(PeerDiedError, match=r"writer process .* died") as info:
            reader.dequeue(timeout=30)
        assert info.value.pid == proc.pid
        reader.shutdown()
    finally:
        proc.kill()
        proc.join(timeout=10)
        box.close()
        box.join_thread()


def test_reader_sigkill_gives_a_blocked_writer_peer_died() -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    writer = MessageQueue(2, 2, max_chunk_bytes=1024, max_chunks=2)
    handle = writer.export_handle()
    procs = [ctx.Process(target=peers.slow_reader, args=(handle, rank, box, 1), daemon=True)
             for rank in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        writer.wait_until_ready(timeout=BOX_TIMEOUT)
        for i in range(3):
            writer.enqueue(i, timeout=10)
        pids = {box.get(timeout=BOX_TIMEOUT)[2], box.get(timeout=BOX_TIMEOUT)[2]}
        assert pids == {p.pid for p in procs}
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(PeerDiedError, match=f"reader rank 1 \\(process {procs[1].pid}\\) died"):
            writer.enqueue(3, timeout=10)
        with pytest.raises(ValueError, match="already attached by process"):
            MessageQueue.create_from_handle(handle, 0)  # rank 0 is alive and attached
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)
        writer.shutdown()
        box.close()
        box.join_thread()


def test_writer_shutdown_wakes_a_reader_in_another_process() -> None:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    writer = MessageQueue(1, 1)
    proc = ctx.Process(target=peers.blocked_reader, args=(writer.export_handle(), 0, box),
                       daemon=True)
    proc.start()
    try:
        writer.wait_until_ready(timeout=BOX_TIMEOUT)
        assert box.get(timeout=BOX_TIMEOUT) == "waiting"
        deadline = time.monotonic() + BOX_TIMEOUT
        while not writer.state().sleeping[0]:  # the reader is asleep on the futex
            assert time.monotonic() < deadline, "the reader never fell asleep"
            time.sleep(0.001)
        writer.shutdown()
        assert box.get(timeout=BOX_TIMEOUT) == "QueueClosedError"
    finally:
        proc.join(timeout=10)
        proc.kill()
        proc.join(timeout=5)
        writer.shutdown()
        box.close()
        box.join_thread()


def test_sigkill_of_everyone_leaves_nothing_behind() -> None:
    """A writer and its reader, both SIGKILLed mid-stream: no process on the
    machine still holds or maps a segment either of them made (segment names
    carry the creator's pid); the leak_check fixture checks this process."""
    script = textwrap.dedent("""
        import multiprocessing as mp, os, sys, time
        from mpexec.ipc import MessageQueue
        from tests.ipc import peers
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
            box = ctx.Queue()
            p = ctx.Process(target=peers.echo_reader, args=(q.export_handle(), 0, box, {}))
            p.start()
            box.get(timeout=30)
            q.wait_until_ready(timeout=30)
            print(p.pid, flush=True)
            for i in range(10**9):
                q.enqueue((i, b"x" * (i % 3000)), timeout=30)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        time.sleep(0.3)
        os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")
    assert segments_made_by({proc.pid, child}) == []


def segments_made_by(pids: set[int]) -> list[str]:
    """Every descriptor or mapping, in any process we can see, of a segment
    that one of ``pids`` created."""
    marks = tuple(f"-{pid}-" for pid in pids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            targets = [os.readlink(f"/proc/{entry}/fd/{fd}")
                       for fd in os.listdir(f"/proc/{entry}/fd")]
            with open(f"/proc/{entry}/maps") as maps:
                targets += [line.strip() for line in maps if "memfd:" in line]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        found += [f"{entry}: {t}" for t in targets
                  if "memfd:mpexec-" in t and any(m in t for m in marks)]
    return found


@pytest.mark.parametrize("fence", ["x86-locked-instruction"])
def test_alternative_fence_path(fence: str) -> None:
    """The fallback fence (no libatomic on x86-64) carries a real exchange too."""
    from mpexec.ipc import sync

    if not sync.IS_TSO:
        pytest.skip("the locked-instruction fence exists only on x86")
    script = textwrap.dedent(f"""
        import multiprocessing as mp
        from mpexec.ipc import sync, MessageQueue
        from tests.ipc import peers
        if __name__ == "__main__":
            sync.use_fence({fence!r})
            ctx = mp.get_context("fork")   # the child inherits the choice
            q = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, spin_s=0.0)
            box = ctx.Queue()
            p = ctx.Process(target=peers.echo_reader, args=(q.export_handle(), 0, box, {{}}))
            p.start()
            reply = MessageQueue.create_from_handle(box.get(timeout=30), 0)
            q.wait_until_ready(timeout=30); reply.wait_until_ready(timeout=30)
            for seq in range(2000):
                q.enqueue((seq, b"y" * (seq % 2500)), timeout=20)
                assert reply.dequeue(timeout=20)[0] == seq
            q.enqueue(None, timeout=20)
            assert reply.dequeue(timeout=20) == ("done", 2000)
            p.join(timeout=20)
            reply.shutdown(); q.shutdown()
            print("ok", sync.FENCE_KIND)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ok {fence}"


def test_closed_queue_rejects_calls() -> None:
    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    reader.shutdown()
    writer.shutdown()
    with pytest.raises(QueueClosedError):
        writer.enqueue(1)
    with pytest.raises(QueueClosedError):
        reader.dequeue(timeout=1)
