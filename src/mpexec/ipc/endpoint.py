"""The state one end of a MessageQueue holds, and how it watches the other end.

:class:`QueueEnd` sets every attribute of a queue end in one place (writer and
reader alike), and carries what both ends share: the slow-path wait, the
liveness checks run on every tick of a wait, and the progress line that says
who is behind.  :class:`EndGuard` is the one owner of an end's shared memory:
who is inside it, whether it is closed, and its one release.  The protocol
itself is in ``message_queue``.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from mpexec.errors import PeerDiedError, QueueClosedError
from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkWriter
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.peers import PeerWatch
from mpexec.ipc.serialization import Encoder
from mpexec.ipc.shm import Segment
from mpexec.ipc.waiting import wait_until


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


class QueueEnd:
    """Attributes and shared plumbing of either end of a queue."""

    local_reader_ranks: list[int]
    _bulk: BulkWriter | None
    _peers: dict[int, PeerWatch]

    def _setup(self, segment: Segment, geometry: RingLayout, name: str,
               reader_index: int | None, writer_pid: int, spin_s: float, tick_s: float,
               log_interval_s: float) -> None:
        """Every attribute, for both ends (so no attribute exists on one path only)."""
        self.name = name
        self.n_reader = geometry.n_readers
        self.n_local_reader = geometry.n_readers
        self.local_reader_ranks = list(range(geometry.n_readers))
        self._segment = segment
        self._layout = geometry
        self._cells = segment.cells
        self._bytes = segment.bytes
        self._reader = reader_index
        self._is_writer = reader_index is None
        self._writer_pid = writer_pid
        self._pid = os.getpid()
        self._token = 0
        self._seq = 0
        self._peers = {}
        self._guard = EndGuard(segment, self._peers)
        self._spin_s = spin_s
        self._tick_s = tick_s
        self._log_interval_s = log_interval_s
        self._encoder = Encoder()
        self._bulk = None
        self._write_seq_addr = segment.address + sync.low_word_offset(
            layout.WRITE_SEQ_CELL * 8)
        self._ready_addr = segment.address + sync.low_word_offset(layout.READY_CELL * 8)
        self._read_seq_cells = [geometry.reader_cell(r, layout.READ_SEQ)
                                for r in range(geometry.n_readers)]
        self._sleeping_cells = [geometry.reader_cell(r, layout.SLEEPING)
                                for r in range(geometry.n_readers)]
        self._chunk_offsets = [geometry.chunk_offset(i) for i in range(geometry.max_chunks)]
        self._max_chunks = geometry.max_chunks
        self._chunk_bytes = geometry.chunk_bytes
        # The writer may publish every seq below this without looking at readers.
        self._free_until = geometry.max_chunks
        self._finalizer = weakref.finalize(self, self._guard.finalize)

    def _wait(self, ready: Callable[[], bool], futex_word: Callable[[], tuple[int, int]] | None,
              sleeping_cell: int | None, deadline: float | None, check: Callable[[], None],
              what: str, log_level: int | Callable[[], int] = logging.WARNING) -> None:
        cells = self._cells

        def set_sleeping(value: int) -> None:
            assert sleeping_cell is not None
            cells[sleeping_cell] = value

        def on_tick() -> None:
            self._check_open()
            check()

        wait_until(ready, futex_word=futex_word,
                   set_sleeping=None if sleeping_cell is None else set_sleeping,
                   deadline=deadline, spin_s=self._spin_s, tick_s=self._tick_s,
                   log_interval_s=self._log_interval_s, on_tick=on_tick,
                   describe=self._describe_progress, what=f"queue {self.name!r}: {what}",
                   log_level=log_level)

    def _check_open(self) -> None:
        if self._guard.closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")

    def _enter(self) -> EndGuard:
        """Announce the user inside (see :class:`EndGuard`); closed: leave and raise."""
        guard = self._guard
        guard.busy = True
        if guard.closed:
            guard.leave()
            self._check_open()
        return guard

    def _observe(self) -> EndGuard:
        """For a reader of shared memory from any thread: take ``guard.lock``
        (release it after the read) and raise once the ring is released."""
        guard = self._guard
        guard.lock.acquire()
        if guard.released:
            guard.lock.release()
            raise QueueClosedError(f"queue {self.name!r} was shut down")
        return guard

    def _check_writer(self) -> None:
        if self._cells[layout.CLOSED_CELL]:
            raise QueueClosedError(f"queue {self.name!r}: the writer shut the queue down")
        if not self._peer(self._writer_pid).alive():
            raise PeerDiedError(f"queue {self.name!r}: writer process {self._writer_pid} died",
                                pid=self._writer_pid, role="writer")

    def _check_reader(self, reader: int) -> None:
        geometry = self._layout
        rank = self.local_reader_ranks[reader]
        state = self._cells[geometry.reader_cell(reader, layout.STATE)]
        if state == layout.STATE_CLOSED:
            raise QueueClosedError(f"queue {self.name!r}: reader rank {rank} shut down "
                                   "and will not consume more messages")
        pid = int(self._cells[geometry.reader_cell(reader, layout.PID)])
        if state == layout.STATE_ATTACHED and not self._peer(pid).alive():
            raise PeerDiedError(f"queue {self.name!r}: reader rank {rank} (process {pid}) died",
                                pid=pid, role=f"reader {rank}")

    def _check_all_readers(self) -> None:
        for reader in range(self._layout.n_readers):
            self._check_reader(reader)

    def _peer(self, pid: int) -> PeerWatch:
        watch = self._peers.get(pid)
        if watch is None:
            watch = self._peers[pid] = PeerWatch(pid)
        return watch

    def _describe_progress(self) -> str:
        cells = self._cells
        written = int(cells[layout.WRITE_SEQ_CELL])
        parts = []
        for r, cell in enumerate(self._read_seq_cells):
            read = int(cells[cell])
            behind = f" (behind by {written - read})" if read < written else ""
            parts.append(f"rank {self.local_reader_ranks[r]} read {read}{behind}")
        return f"writer published {written}; " + ", ".join(parts)

    @property
    def closed(self) -> bool:
        return self._guard.closed

    def state(self) -> QueueState:
        """What the shared header says now (either end may ask, from any thread;
        tests and progress lines use it to observe, e.g., that a reader is
        asleep).  ``QueueClosedError`` once this end is shut down and released."""
        guard = self._observe()
        try:
            cells = self._cells
            return QueueState(
                published=int(cells[layout.WRITE_SEQ_CELL]),
                consumed=tuple(int(cells[c]) for c in self._read_seq_cells),
                sleeping=tuple(bool(cells[c]) for c in self._sleeping_cells),
                writer_waiting=bool(cells[layout.WRITER_WAITING_CELL]),
                writer_closed=bool(cells[layout.CLOSED_CELL]),
            )
        finally:
            guard.lock.release()


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
