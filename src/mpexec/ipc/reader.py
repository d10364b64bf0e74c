"""The reader's half of the queue protocol: wait for a message, take it.

See ``message_queue`` for the protocol as a whole; the numbered steps there
are the body of :meth:`ReaderEnd.dequeue`.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkRelease, map_bulk
from mpexec.ipc.endpoint import QueueEnd
from mpexec.ipc.serialization import decode

_FAST_POLLS = 32


class ReaderEnd(QueueEnd):
    """``dequeue`` and what it needs; mixed into ``MessageQueue``."""

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message, in order; waits up to ``timeout`` (None: no limit).

        Every ``log_interval_s`` of waiting a line says who is behind: at
        WARNING, or for an ``indefinite`` wait (an idle worker waiting for its
        next call) at INFO when some reader lags behind the writer - a stuck
        peer - and at DEBUG when everyone is merely idle.
        """
        reader = self._reader
        if reader is None or self._closed:
            if reader is None:
                raise RuntimeError(f"dequeue() called on the writer end of queue {self.name!r}")
            self._check_open()
        self._busy = True
        try:
            seq = self._seq
            cells = self._cells
            if cells[layout.WRITE_SEQ_CELL] <= seq:
                # A few polls here cost less than setting up the general wait;
                # a zero timeout (a poll, as when the driver drains replies)
                # goes straight to it, which answers at once.
                polls = _FAST_POLLS if timeout is None or timeout > 0 else 0
                for _ in range(polls):
                    sync.cpu_relax()
                    if cells[layout.WRITE_SEQ_CELL] > seq:
                        break
                else:
                    deadline = None if timeout is None else time.monotonic() + timeout
                    self._wait_for_message(seq, deadline, indefinite)
            sync.acquire_fence()
            base = self._chunk_offsets[seq % self._max_chunks]
            head = base // 8
            size = int(cells[head + layout.FRAME_LEN])
            kind = cells[head + layout.KIND]
            obj: Any = None
            view: memoryview | None = None
            start = base + layout.CHUNK_HEADER
            try:
                if kind == layout.KIND_PICKLE:
                    # Unpickled straight from the chunk, which stays ours until
                    # read_seq moves: the objects made are copies.
                    obj = pickle.loads(self._bytes[start:start + size])
                elif kind == layout.KIND_INLINE:
                    view = memoryview(bytearray(self._bytes[start:start + size]))
                else:
                    view = self._map_bulk(head, size, reader)
            finally:
                sync.release_fence()
                read_cell = self._read_seq_cells[reader]
                cells[read_cell] = seq + 1
                self._seq = seq + 1
                sync.full_fence()
                if cells[layout.WRITER_WAITING_CELL]:
                    sync.futex_wake(self._segment.address + sync.low_word_offset(read_cell * 8))
        finally:
            self._busy = False
        return obj if view is None else decode(view)

    def _map_bulk(self, head: int, size: int, reader: int) -> memoryview:
        cells = self._cells
        slot = int(cells[head + layout.BULK_SLOT])
        on_release = None
        if slot != layout.NO_SLOT:
            on_release = BulkRelease(self._segment, self._layout.release_cell(reader, slot),
                                  int(cells[head + layout.BULK_GENERATION]))
        return map_bulk(self._writer_pid, int(cells[head + layout.BULK_FD]),
                        int(cells[head + layout.BULK_INODE]), size,
                        f"queue {self.name!r}", on_release)

    def _wait_for_message(self, seq: int, deadline: float | None, indefinite: bool) -> None:
        assert self._reader is not None
        cells = self._cells
        ws = layout.WRITE_SEQ_CELL
        ws_addr = self._write_seq_addr
        self._wait(lambda: cells[ws] > seq, lambda: (ws_addr, cells[ws]),
                   self._sleeping_cells[self._reader], deadline, self._check_writer, "dequeue",
                   self._idle_log_level if indefinite else logging.WARNING)

    def _idle_log_level(self) -> int:
        """An idle reader's progress line matters only when a peer lags behind
        the writer: in lockstep that peer is stuck, so say it at INFO."""
        cells = self._cells
        written = cells[layout.WRITE_SEQ_CELL]
        behind = any(cells[c] < written for c in self._read_seq_cells)
        return logging.INFO if behind else logging.DEBUG
