"""The writer end of a queue: create the segment, publish messages, wait for space.

See ``message_queue`` for the protocol as a whole; the writer's column of the
table there is the body of :meth:`MessageQueueWriter.enqueue`.
"""

from __future__ import annotations

import os
import secrets
import time
from functools import partial
from typing import Any

from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkWriter
from mpexec.ipc.endpoint import QueueState, RingEnd
from mpexec.ipc.handle import (
    DEFAULT_LOG_INTERVAL_S,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    DEFAULT_SPIN_S,
    DEFAULT_TICK_S,
    Handle,
)
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.serialization import EncodedMessage, Encoder, Frame, frame_of, write_into
from mpexec.ipc.shm import Segment, segment_name


class MessageQueueWriter:
    """The shared-memory writer end (a :class:`~mpexec.ipc.ends.QueueWriter`).

    ``n_reader`` readers in all, ``n_local_reader`` of them on this machine
    (here the two are equal: ``MessageQueue(...)`` picks a
    :class:`~mpexec.ipc.remote.RemoteWriter` when some readers are remote);
    ``local_reader_ranks`` are the ranks readers attach as
    (default ``0..n_local_reader-1``).  The segment holds ``max_chunks``
    chunks of ``max_chunk_bytes``; a larger message goes through a bulk
    segment of its own.  A segment that cannot fit in the memory this process
    may use fails here with an ``OSError`` naming the queue, the MiB needed
    and the limit that applies.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        *,
        name: str = "mq",
        spin_s: float = DEFAULT_SPIN_S,
        tick_s: float = DEFAULT_TICK_S,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
    ) -> None:
        if n_reader < 1:
            raise ValueError(f"n_reader must be >= 1, got {n_reader}")
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(
                f"n_local_reader must be in [0, n_reader={n_reader}], got {n_local_reader}")
        if n_local_reader != n_reader:
            raise ValueError(f"queue {name!r}: remote readers are served by a RemoteWriter "
                             "(build it with MessageQueue(...))")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader or len(set(local_reader_ranks)) != len(
                local_reader_ranks):
            raise ValueError(
                f"local_reader_ranks must be {n_local_reader} distinct ranks, "
                f"got {local_reader_ranks}")
        sync.check_fences()
        geometry = RingLayout(n_local_reader, max_chunks, max_chunk_bytes)
        segment = Segment.create(segment_name(name), geometry.total_bytes,
                                 f"queue {name!r} ({max_chunks} chunks of {max_chunk_bytes} "
                                 "bytes)")
        token = secrets.randbits(63)
        cells = segment.cells
        cells[layout.N_READERS_CELL] = n_local_reader
        cells[layout.MAX_CHUNKS_CELL] = max_chunks
        cells[layout.CHUNK_BYTES_CELL] = max_chunk_bytes
        cells[layout.WRITER_PID_CELL] = os.getpid()
        cells[layout.TOKEN_CELL] = token
        sync.full_fence()
        cells[layout.MAGIC_CELL] = layout.MAGIC
        ring = RingEnd(segment, geometry, name, local_reader_ranks, reader_index=None,
                       writer_pid=os.getpid(), spin_s=spin_s, tick_s=tick_s,
                       log_interval_s=log_interval_s)
        self.name = name
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = list(local_reader_ranks)
        self._ring = ring
        self._token = token
        self._seq = 0
        self._encoder = Encoder()
        # The hot path's references, held here to spare a lookup through the ring.
        self._guard = ring.guard
        self._segment = segment
        self._cells = segment.cells
        self._bytes = segment.bytes
        self._write_seq_addr = ring.write_seq_addr
        self._read_seq_cells = ring.read_seq_cells
        self._sleeping_cells = ring.sleeping_cells
        self._chunk_offsets = ring.chunk_offsets
        self._max_chunks = max_chunks
        self._chunk_bytes = max_chunk_bytes
        # The writer may publish every seq below this without looking at readers.
        self._free_until = max_chunks
        # Not a bound method: the guard (held by the finalizer) owns the bulk
        # writer, and must not keep this queue alive through it.
        self._bulk = BulkWriter(name, partial(_bulk_released, cells, geometry))
        ring.guard.bulk = self._bulk

    @property
    def closed(self) -> bool:
        return self._guard.closed

    def state(self) -> QueueState:
        """What the shared header says now (see :meth:`RingEnd.state`)."""
        return self._ring.state()

    def unattached_ranks(self) -> list[int]:
        """The local reader ranks that have not attached yet (for a clear error)."""
        guard = self._ring.observe()
        try:
            cells = self._cells
            return [rank for index, rank in enumerate(self.local_reader_ranks)
                    if cells[self._ring.layout.reader_cell(index, layout.STATE)]
                    != layout.STATE_ATTACHED]
        finally:
            guard.lock.release()

    def lagging_ranks(self) -> list[int]:
        """The reader ranks a full ring waits for: a whole ring behind the writer
        (for a deadline's error: who did not take the call)."""
        guard = self._ring.observe()
        try:
            cells = self._cells
            behind = cells[layout.WRITE_SEQ_CELL] - self._max_chunks
            return [rank for rank, cell in zip(self.local_reader_ranks, self._read_seq_cells,
                                               strict=True) if cells[cell] <= behind]
        finally:
            guard.lock.release()

    def export_handle(self) -> Handle:
        """What readers attach with (``MessageQueue.create_from_handle``)."""
        guard = self._ring.observe()
        try:
            buffer = self._segment.ref()
        finally:
            guard.lock.release()
        return Handle(
            local_reader_ranks=list(self.local_reader_ranks),
            buffer=buffer,
            n_reader=self.n_reader,
            max_chunks=self._max_chunks,
            max_chunk_bytes=self._chunk_bytes,
            token=self._token,
            name=self.name,
        )

    def encode(self, obj: Any) -> EncodedMessage:
        """Pickle ``obj`` now; ``enqueue`` of the result pickles nothing.

        The message refers to the buffers of ``obj`` (arrays, tensors, large
        ``bytes``) without copying them until it is enqueued: do not change
        them in between.  Raises the pickling error, as ``enqueue`` would.
        """
        self._ring.check_open()
        return EncodedMessage(self._encoder.dump(obj))

    def broadcast_object(self, obj: Any = None) -> Any:
        self.enqueue(obj)
        return obj

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader; blocks while the ring is full.

        ``obj`` may be an :class:`EncodedMessage` from :meth:`encode`, sent as
        encoded.  On ``TimeoutError`` nothing was published: retrying the
        same encoded message is safe and pickles nothing again.
        """
        guard = self._guard
        if guard.closed:
            self._ring.check_open()
        data = obj.data if obj.__class__ is EncodedMessage else self._encoder.dump(obj)
        # Inside from here (see EndGuard): announced before closed is looked at.
        guard.busy = True
        if guard.closed:
            guard.leave()
            self._ring.check_open()
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
            guard.busy = False
            if guard.closed:
                guard.release_if_idle()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until every reader has attached, then let them start."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ring = self._ring
        guard = ring.enter()
        try:
            cells = self._cells
            state_cells = [ring.layout.reader_cell(r, layout.STATE)
                           for r in range(ring.layout.n_readers)]
            ring.wait(lambda: all(cells[c] == layout.STATE_ATTACHED for c in state_cells),
                      None, None, deadline, ring.check_all_readers,
                      "wait_until_ready (readers attaching)")
            sync.release_fence()
            cells[layout.READY_CELL] = 1
            sync.full_fence()
            sync.futex_wake(ring.ready_addr)
        finally:
            guard.leave()

    def shutdown(self) -> None:
        """Close the queue; wakes blocked calls here at once, the readers soon.

        Any thread may call it, while another is blocked in a call on this
        end: that call raises ``QueueClosedError``, and the shared memory is
        released only once it has left (see ``endpoint.EndGuard``).
        """
        self._ring.shutdown(layout.CLOSED_CELL, 1)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"<MessageQueueWriter {self.name!r} {state} readers={self.n_reader} "
                f"chunks={self._max_chunks}x{self._chunk_bytes}>")

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
        ring = self._ring

        def futex_word() -> tuple[int, int]:
            laggard = min(read_cells, key=cells.__getitem__)
            return base + sync.low_word_offset(laggard * 8), cells[laggard]

        def check_behind() -> None:
            for reader, cell in enumerate(read_cells):
                if cells[cell] <= must_exceed:
                    ring.check_reader(reader)

        ring.wait(lambda: min(cells[c] for c in read_cells) > must_exceed, futex_word,
                   layout.WRITER_WAITING_CELL, deadline, check_behind, "enqueue (ring full)")



def _bulk_released(cells: memoryview, geometry: RingLayout, slot: int, generation: int) -> bool:
    """Has every reader still reading let go of ``generation`` of bulk ``slot``?
    (Asked by the bulk writer, inside ``enqueue``.)"""
    for r in range(geometry.n_readers):
        if cells[geometry.reader_cell(r, layout.STATE)] == layout.STATE_CLOSED:
            continue
        if cells[geometry.release_cell(r, slot)] < generation:
            return False
    return True
