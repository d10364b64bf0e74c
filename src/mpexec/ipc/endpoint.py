"""What a shared-memory end of a queue holds, and how it watches the other end.

:class:`RingEnd` is one process's view of the ring, held (not inherited) by
the shared-memory writer and by each shared-memory reader: the mapping, the
peers it watches, and what both ends share: the slow-path wait, the
liveness checks run on every tick of a wait, the progress line that says
who is behind, and the end's teardown.  :class:`EndGuard` is the one owner
of an end's shared memory: who is inside it, whether it is closed, and its
one release.  The protocol itself is in ``message_queue``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from mpexec.errors import PeerDiedError, QueueClosedError
from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkWriter
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.peers import PeerWatch
from mpexec.ipc.shm import Segment
from mpexec.ipc.waiting import wait_until

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 2.0


class EndGuard:
    """Who is inside one end's shared memory, and the one release of it.

    Teardown (``shutdown``, from any thread) and the end's user (one thread at
    a time: ``enqueue``, ``dequeue`` or the handshake) meet here, so that the
    memory is never unmapped under a call::

        user                                   shutdown
        ----                                   --------
        busy = True                            closed = True (under lock:
        if closed: leave, QueueClosedError       mark closed in shared memory, wake)
        ... touch the ring ...                 wait (bounded) until not busy
        busy = False                           release_if_idle()
        if closed: release_if_idle()

    Under the GIL each thread's stores are seen in order by the others, so
    either the user sees ``closed`` before it touches anything and leaves, or
    shutdown sees it inside and waits; a waiting user sees ``closed`` within a
    tick and leaves.  Whoever comes last releases (``release_if_idle`` under
    ``lock``; it runs once): shutdown, or the user on its way out should it
    still be inside when shutdown stops waiting.  Readers from other threads
    (``state()``, ``export_handle()``) hold ``lock`` and check ``released``.
    The hot path pays two stores and two loads, no lock.
    """

    __slots__ = ("lock", "busy", "closed", "released", "_segment", "_peers", "bulk")

    def __init__(self, segment: Segment, peers: dict[int, PeerWatch]) -> None:
        self.lock = threading.RLock()  # a GC finalizer may re-enter a release
        self.busy = False
        self.closed = False
        self.released = False
        self._segment = segment
        self._peers = peers
        self.bulk: BulkWriter | None = None

    def leave(self) -> None:
        """The user is out; the last one out after a shutdown releases."""
        self.busy = False
        if self.closed:
            self.release_if_idle()

    def release_if_idle(self) -> None:
        """Unmap the ring and close what it holds, once, unless someone is inside."""
        with self.lock:
            if self.released or self.busy:
                return
            self.released = True
            if self.bulk is not None:
                self.bulk.close()
            _release_local(self._segment, self._peers)

    def finalize(self) -> None:
        """Garbage collection or interpreter exit: close and release if idle (a
        daemon thread still inside at exit keeps it until the process ends)."""
        self.closed = True
        self.release_if_idle()


class RingEnd:
    """One end's view of a queue's ring: the mapping, the guard, the peers.

    A shared-memory writer or reader holds one (composition: neither end
    inherits it) and keeps its own counters; this object has what both need
    on the slow path: the wait, the liveness checks run on every tick of a
    wait, the progress line that says who is behind, the header snapshot
    (``state``) and the one teardown of the end (``shutdown``).
    """

    def __init__(self, segment: Segment, geometry: RingLayout, name: str,
                 local_reader_ranks: list[int], reader_index: int | None, writer_pid: int,
                 spin_s: float, tick_s: float, log_interval_s: float) -> None:
        self.name = name
        self.local_reader_ranks = list(local_reader_ranks)
        self.segment = segment
        self.layout = geometry
        self.cells = segment.cells
        self.bytes = segment.bytes
        self.reader_index = reader_index
        self.writer_pid = writer_pid
        self.pid = os.getpid()
        self.peers: dict[int, PeerWatch] = {}
        self.guard = EndGuard(segment, self.peers)
        self.spin_s = spin_s
        self.tick_s = tick_s
        self.log_interval_s = log_interval_s
        self.write_seq_addr = segment.address + sync.low_word_offset(layout.WRITE_SEQ_CELL * 8)
        self.ready_addr = segment.address + sync.low_word_offset(layout.READY_CELL * 8)
        self.read_seq_cells = [geometry.reader_cell(r, layout.READ_SEQ)
                               for r in range(geometry.n_readers)]
        self.sleeping_cells = [geometry.reader_cell(r, layout.SLEEPING)
                               for r in range(geometry.n_readers)]
        self.chunk_offsets = [geometry.chunk_offset(i) for i in range(geometry.max_chunks)]
        # Released with this object (garbage collection, interpreter exit) at the latest.
        self.finalizer = weakref.finalize(self, self.guard.finalize)

    def wait(self, ready: Callable[[], bool], futex_word: Callable[[], tuple[int, int]] | None,
             sleeping_cell: int | None, deadline: float | None, check: Callable[[], None],
             what: str, log_level: int | Callable[[], int] = logging.WARNING) -> None:
        cells = self.cells

        def set_sleeping(value: int) -> None:
            assert sleeping_cell is not None
            cells[sleeping_cell] = value

        def on_tick() -> None:
            self.check_open()
            check()

        wait_until(ready, futex_word=futex_word,
                   set_sleeping=None if sleeping_cell is None else set_sleeping,
                   deadline=deadline, spin_s=self.spin_s, tick_s=self.tick_s,
                   log_interval_s=self.log_interval_s, on_tick=on_tick,
                   describe=self.describe_progress, what=f"queue {self.name!r}: {what}",
                   log_level=log_level)

    def check_open(self) -> None:
        if self.guard.closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")

    def enter(self) -> EndGuard:
        """Announce the user inside (see :class:`EndGuard`); closed: leave and raise."""
        guard = self.guard
        guard.busy = True
        if guard.closed:
            guard.leave()
            self.check_open()
        return guard

    def observe(self) -> EndGuard:
        """For a reader of shared memory from any thread: take ``guard.lock``
        (release it after the read) and raise once the ring is released."""
        guard = self.guard
        guard.lock.acquire()
        if guard.released:
            guard.lock.release()
            raise QueueClosedError(f"queue {self.name!r} was shut down")
        return guard

    def check_writer(self) -> None:
        if self.cells[layout.CLOSED_CELL]:
            raise QueueClosedError(f"queue {self.name!r}: the writer shut the queue down")
        if not self.peer(self.writer_pid).alive():
            raise PeerDiedError(f"queue {self.name!r}: writer process {self.writer_pid} died",
                                pid=self.writer_pid, role="writer")

    def check_reader(self, reader: int) -> None:
        geometry = self.layout
        rank = self.local_reader_ranks[reader]
        state = self.cells[geometry.reader_cell(reader, layout.STATE)]
        if state == layout.STATE_CLOSED:
            raise QueueClosedError(f"queue {self.name!r}: reader rank {rank} shut down "
                                   "and will not consume more messages")
        pid = int(self.cells[geometry.reader_cell(reader, layout.PID)])
        if state == layout.STATE_ATTACHED and not self.peer(pid).alive():
            raise PeerDiedError(f"queue {self.name!r}: reader rank {rank} (process {pid}) died",
                                pid=pid, role=f"reader {rank}", reader_rank=rank)

    def check_all_readers(self) -> None:
        for reader in range(self.layout.n_readers):
            self.check_reader(reader)

    def peer(self, pid: int) -> PeerWatch:
        watch = self.peers.get(pid)
        if watch is None:
            watch = self.peers[pid] = PeerWatch(pid)
        return watch

    def describe_progress(self) -> str:
        cells = self.cells
        written = int(cells[layout.WRITE_SEQ_CELL])
        parts = []
        for r, cell in enumerate(self.read_seq_cells):
            read = int(cells[cell])
            behind = f" (behind by {written - read})" if read < written else ""
            parts.append(f"rank {self.local_reader_ranks[r]} read {read}{behind}")
        return f"writer published {written}; " + ", ".join(parts)

    @property
    def closed(self) -> bool:
        return self.guard.closed

    def state(self) -> QueueState:
        """What the shared header says now (either end may ask, from any thread;
        tests and progress lines use it to observe, e.g., that a reader is
        asleep).  ``QueueClosedError`` once this end is shut down and released."""
        guard = self.observe()
        try:
            cells = self.cells
            return QueueState(
                published=int(cells[layout.WRITE_SEQ_CELL]),
                consumed=tuple(int(cells[c]) for c in self.read_seq_cells),
                sleeping=tuple(bool(cells[c]) for c in self.sleeping_cells),
                writer_waiting=bool(cells[layout.WRITER_WAITING_CELL]),
                writer_closed=bool(cells[layout.CLOSED_CELL]),
            )
        finally:
            guard.lock.release()

    def shutdown(self, closed_cell: int, closed_value: int) -> None:
        """Close this end: write ``closed_value`` into ``closed_cell`` (the
        writer's closed flag, or this reader's state), wake every sleeper, and
        release the memory once no call is inside (see :class:`EndGuard`).

        Any thread may call it, while another is blocked in a call on this
        end: that call raises ``QueueClosedError``, and the shared memory is
        released only once it has left.
        """
        guard = self.guard
        with guard.lock:
            if guard.closed:
                return
            guard.closed = True
            if self.pid != os.getpid():
                # A forked copy: no thread of this process is inside; let go of
                # the inherited mapping without telling the parent's peers.
                guard.busy = False
            elif not guard.released:
                self.cells[closed_cell] = closed_value
                sync.full_fence()
                sync.futex_wake(self.write_seq_addr)
                sync.futex_wake(self.ready_addr)
                for cell in self.read_seq_cells:
                    sync.futex_wake(self.segment.address + sync.low_word_offset(cell * 8))
        # A call blocked in another thread is waking up now; let it leave the
        # shared memory, then release it here.  Should it still be inside
        # after the grace, it releases the memory itself on its way out.
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while guard.busy and time.monotonic() < deadline:
            time.sleep(0.0005)
        if guard.busy:
            logger.warning("queue %r: a call is still inside the queue after %.0f s; it "
                           "releases the memory when it leaves", self.name, _CLOSE_GRACE_S)
        guard.release_if_idle()
        if guard.released:
            self.finalizer.detach()


@dataclass(frozen=True)
class QueueState:
    """A snapshot of a queue's shared header, reader by reader (index order)."""

    published: int                 # messages the writer has published
    consumed: tuple[int, ...]      # messages each reader has consumed
    sleeping: tuple[bool, ...]     # each reader is asleep on the futex, waiting
    writer_waiting: bool           # the writer is asleep, waiting for space
    writer_closed: bool            # the writer shut the queue down


def _release_local(segment: Segment, peers: dict[int, PeerWatch]) -> None:
    for watch in peers.values():
        watch.close()
    peers.clear()
    segment.close()
