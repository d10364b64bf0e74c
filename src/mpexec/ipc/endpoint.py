"""The state one end of a MessageQueue holds, and how it watches the other end.

:class:`QueueEnd` sets every attribute of a queue end in one place (writer and
reader alike), and carries what both ends share: the slow-path wait, the
liveness checks run on every tick of a wait, and the progress line that says
who is behind.  The protocol itself is in ``message_queue``.
"""

from __future__ import annotations

import logging
import os
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
        self._closed = False
        self._busy = False
        self._spin_s = spin_s
        self._tick_s = tick_s
        self._log_interval_s = log_interval_s
        self._encoder = Encoder()
        self._bulk = None
        self._peers = {}
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
        self._finalizer = weakref.finalize(self, _release_local, segment, self._peers)

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
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")

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
        return self._closed

    def state(self) -> QueueState:
        """What the shared header says now (either end may ask; tests and
        progress lines use it to observe, e.g., that a reader is asleep)."""
        cells = self._cells
        return QueueState(
            published=int(cells[layout.WRITE_SEQ_CELL]),
            consumed=tuple(int(cells[c]) for c in self._read_seq_cells),
            sleeping=tuple(bool(cells[c]) for c in self._sleeping_cells),
            writer_waiting=bool(cells[layout.WRITER_WAITING_CELL]),
            writer_closed=bool(cells[layout.CLOSED_CELL]),
        )


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
