"""The writer's half of the queue protocol: publish a message, wait for space.

See ``message_queue`` for the protocol as a whole; the numbered steps there
are the body of :meth:`WriterEnd.enqueue`.
"""

from __future__ import annotations

import time
from typing import Any

from mpexec.ipc import layout, sync
from mpexec.ipc.endpoint import QueueEnd
from mpexec.ipc.serialization import Frame, frame_of, write_into


class WriterEnd(QueueEnd):
    """``enqueue`` and what it needs; mixed into ``MessageQueue``."""

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader; blocks while the ring is full."""
        if self._closed or not self._is_writer:
            self._require_writer("enqueue")
            self._check_open()
        data = self._encoder.dump(obj)
        self._busy = True
        try:
            seq = self._seq
            cells = self._cells
            if seq >= self._free_until:
                self._free_until = self._min_read_seq() + self._max_chunks
                if seq >= self._free_until:
                    deadline = None if timeout is None else time.monotonic() + timeout
                    self._wait_for_space(seq - self._max_chunks, deadline)
                    self._free_until = self._min_read_seq() + self._max_chunks
            sync.acquire_fence()
            base = self._chunk_offsets[seq % self._max_chunks]
            head = base // 8
            if data.__class__ is bytes and len(data) <= self._chunk_bytes:
                size = len(data)
                start = base + layout.CHUNK_HEADER
                self._bytes[start:start + size] = data
                cells[head + layout.KIND] = layout.KIND_PICKLE
            else:
                frame = frame_of(data) if data.__class__ is bytes else data
                assert isinstance(frame, Frame)
                size = frame.nbytes
                if size <= self._chunk_bytes:
                    start = base + layout.CHUNK_HEADER
                    write_into(frame, self._bytes[start:start + size])
                    cells[head + layout.KIND] = layout.KIND_INLINE
                else:
                    self._put_bulk(frame, seq, head)
            cells[head + layout.FRAME_LEN] = size
            sync.release_fence()
            cells[layout.WRITE_SEQ_CELL] = seq + 1
            self._seq = seq + 1
            sync.full_fence()
            for cell in self._sleeping_cells:
                if cells[cell]:
                    sync.futex_wake(self._write_seq_addr)
                    break
        finally:
            self._busy = False

    def _put_bulk(self, frame: Frame, seq: int, head: int) -> None:
        assert self._bulk is not None
        self._bulk.reclaim(self._min_read_seq())
        fd, inode, slot, generation = self._bulk.put(
            frame, seq, f"a {frame.nbytes / 2**20:.1f} MiB message on queue {self.name!r}")
        cells = self._cells
        cells[head + layout.BULK_FD] = fd
        cells[head + layout.BULK_INODE] = inode
        cells[head + layout.BULK_SLOT] = slot
        cells[head + layout.BULK_GENERATION] = generation
        cells[head + layout.KIND] = layout.KIND_BULK

    def _min_read_seq(self) -> int:
        cells = self._cells
        return min(cells[c] for c in self._read_seq_cells)

    def _wait_for_space(self, must_exceed: int, deadline: float | None) -> None:
        cells = self._cells
        read_cells = self._read_seq_cells
        base = self._segment.address

        def futex_word() -> tuple[int, int]:
            laggard = min(read_cells, key=cells.__getitem__)
            return base + sync.low_word_offset(laggard * 8), cells[laggard]

        def check_behind() -> None:
            for reader, cell in enumerate(read_cells):
                if cells[cell] <= must_exceed:
                    self._check_reader(reader)

        self._wait(lambda: min(cells[c] for c in read_cells) > must_exceed, futex_word,
                   layout.WRITER_WAITING_CELL, deadline, check_behind, "enqueue (ring full)")

    def _bulk_released(self, slot: int, generation: int) -> bool:
        cells = self._cells
        geometry = self._layout
        for r in range(geometry.n_readers):
            if cells[geometry.reader_cell(r, layout.STATE)] == layout.STATE_CLOSED:
                continue
            if cells[geometry.release_cell(r, slot)] < generation:
                return False
        return True
