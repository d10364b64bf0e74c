"""A reader end of a queue: attach to the writer's segment, wait for a message, take it.

See ``message_queue`` for the protocol as a whole; the reader's column of the
table there is the body of :meth:`MessageQueueReader.dequeue`.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any

from mpexec.errors import QueueClosedError, UndecodableMessageError
from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkRelease, map_bulk
from mpexec.ipc.endpoint import QueueState, RingEnd
from mpexec.ipc.handle import DEFAULT_LOG_INTERVAL_S, DEFAULT_SPIN_S, DEFAULT_TICK_S, Handle
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.peers import PeerWatch
from mpexec.ipc.serialization import decode
from mpexec.ipc.shm import Segment

_FAST_POLLS = 32


class MessageQueueReader:
    """A shared-memory reader end (a :class:`~mpexec.ipc.ends.QueueReader`); made by
    :meth:`attach`, which maps the writer's segment and announces this process."""

    def __init__(self, ring: RingEnd, handle: Handle, first_seq: int) -> None:
        assert ring.reader_index is not None
        self.name = handle.name
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self._ring = ring
        self._reader: int = ring.reader_index
        self._token = handle.token
        self._seq = first_seq
        # The hot path's references, held here to spare a lookup through the ring.
        self._guard = ring.guard
        self._segment = ring.segment
        self._cells = ring.cells
        self._bytes = ring.bytes
        self._write_seq_addr = ring.write_seq_addr
        self._read_seq_cells = ring.read_seq_cells
        self._sleeping_cells = ring.sleeping_cells
        self._chunk_offsets = ring.chunk_offsets
        self._max_chunks = ring.layout.max_chunks
        self._writer_pid = ring.writer_pid

    @classmethod
    def attach(cls, handle: Handle, rank: int, *, spin_s: float = DEFAULT_SPIN_S,
               tick_s: float = DEFAULT_TICK_S,
               log_interval_s: float = DEFAULT_LOG_INTERVAL_S) -> MessageQueueReader:
        """Attach as the reader of rank ``rank`` (see ``create_from_handle``)."""
        if rank not in handle.local_reader_ranks:
            raise ValueError(f"rank {rank} is not a local reader of queue {handle.name!r}; "
                             f"its local reader ranks are {handle.local_reader_ranks}")
        sync.check_fences()
        what = f"queue {handle.name!r}"
        assert handle.buffer is not None  # a local rank has a ring
        segment = Segment.attach(handle.buffer, what)
        try:
            cells = segment.cells
            if cells[layout.MAGIC_CELL] != layout.MAGIC or cells[layout.TOKEN_CELL] != handle.token:
                raise QueueClosedError(f"{what}: the segment does not belong to this handle")
            sync.acquire_fence()
            geometry = RingLayout(int(cells[layout.N_READERS_CELL]),
                                  int(cells[layout.MAX_CHUNKS_CELL]),
                                  int(cells[layout.CHUNK_BYTES_CELL]))
            index = handle.local_reader_ranks.index(rank)
            state_cell = geometry.reader_cell(index, layout.STATE)
            if cells[state_cell] == layout.STATE_ATTACHED:
                other = int(cells[geometry.reader_cell(index, layout.PID)])
                watch = PeerWatch(other)
                holder_alive = watch.alive()
                watch.close()
                if other != os.getpid() and holder_alive:
                    raise ValueError(f"{what}: reader rank {rank} is already attached "
                                     f"by process {other}")
            ring = RingEnd(segment, geometry, handle.name, handle.local_reader_ranks,
                           reader_index=index, writer_pid=handle.buffer.pid, spin_s=spin_s,
                           tick_s=tick_s, log_interval_s=log_interval_s)
        except BaseException:
            segment.close()
            raise
        queue = cls(ring, handle, int(cells[geometry.reader_cell(index, layout.READ_SEQ)]))
        cells[geometry.reader_cell(index, layout.PID)] = os.getpid()
        sync.release_fence()
        cells[state_cell] = layout.STATE_ATTACHED
        sync.full_fence()
        return queue

    @property
    def closed(self) -> bool:
        return self._guard.closed

    def state(self) -> QueueState:
        """What the shared header says now (see :meth:`RingEnd.state`)."""
        return self._ring.state()

    def broadcast_object(self, obj: Any = None) -> Any:
        """The next message (the writer's ``broadcast_object`` sent it)."""
        return self.dequeue()

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message, in order; waits up to ``timeout`` (None: no limit).

        A message published by the deadline is returned, even when the wait
        noticed it only at the deadline; ``TimeoutError`` means none had
        arrived then.  A ``timeout`` of zero or less is one look.

        Every ``log_interval_s`` of waiting a line says who is behind: at
        WARNING, or for an ``indefinite`` wait (an idle worker waiting for its
        next call) at INFO when some reader lags behind the writer - a stuck
        peer - and at DEBUG when everyone is merely idle.
        """
        reader = self._reader
        # Inside from here (see EndGuard): announced before closed is looked at.
        guard = self._guard
        guard.busy = True
        if guard.closed:
            guard.leave()
            self._ring.check_open()
        try:
            seq = self._seq
            cells = self._cells
            if cells[layout.WRITE_SEQ_CELL] <= seq:
                # The deadline counts from the call, not from after the polls.
                deadline = None if timeout is None else time.monotonic() + timeout
                # A few polls here cost less than setting up the general wait;
                # a zero timeout (a poll, as when the driver drains replies)
                # goes straight to it, which answers at once.
                polls = _FAST_POLLS if timeout is None or timeout > 0 else 0
                for _ in range(polls):
                    sync.cpu_relax()
                    if cells[layout.WRITE_SEQ_CELL] > seq:
                        break
                else:
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
                    try:
                        obj = pickle.loads(self._bytes[start:start + size])
                    except Exception as exc:
                        raise self._undecodable(seq, exc) from exc
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
            guard.busy = False
            if guard.closed:
                guard.release_if_idle()
        if view is None:
            return obj
        try:
            return decode(view)
        except OSError:
            raise  # no memory for the message: the documented OSError, as is
        except Exception as exc:
            raise self._undecodable(seq, exc) from exc

    def _undecodable(self, seq: int, exc: Exception) -> UndecodableMessageError:
        return UndecodableMessageError(
            f"queue {self.name!r}: message {seq} could not be unpickled: "
            f"{type(exc).__name__}: {exc}")

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until the writer has seen every reader attach."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ring = self._ring
        guard = ring.enter()
        try:
            cells = self._cells
            ready_addr = ring.ready_addr
            ring.wait(lambda: cells[layout.READY_CELL] == 1, lambda: (ready_addr, 0), None,
                      deadline, ring.check_writer, "wait_until_ready (writer)")
            sync.acquire_fence()
        finally:
            guard.leave()

    def shutdown(self) -> None:
        """Leave the queue: this reader consumes no more (the writer's waits for
        it end), and a call blocked here raises ``QueueClosedError`` at once."""
        ring = self._ring
        ring.shutdown(ring.layout.reader_cell(self._reader, layout.STATE), layout.STATE_CLOSED)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"<MessageQueueReader {self.name!r} rank "
                f"{self.local_reader_ranks[self._reader]} {state}>")

    def _map_bulk(self, head: int, size: int, reader: int) -> memoryview:
        cells = self._cells
        slot = int(cells[head + layout.BULK_SLOT])
        on_release = None
        if slot != layout.NO_SLOT:
            on_release = BulkRelease(self._segment, self._ring.layout.release_cell(reader, slot),
                                  int(cells[head + layout.BULK_GENERATION]))
        return map_bulk(self._writer_pid, int(cells[head + layout.BULK_FD]),
                        int(cells[head + layout.BULK_INODE]), size,
                        f"queue {self.name!r}", on_release)

    def _wait_for_message(self, seq: int, deadline: float | None, indefinite: bool) -> None:
        cells = self._cells
        ws = layout.WRITE_SEQ_CELL
        ws_addr = self._write_seq_addr
        ring = self._ring
        ring.wait(lambda: cells[ws] > seq, lambda: (ws_addr, cells[ws]),
                  self._sleeping_cells[self._reader], deadline, ring.check_writer, "dequeue",
                  self._idle_log_level if indefinite else logging.WARNING)

    def _idle_log_level(self) -> int:
        """An idle reader's progress line matters only when a peer lags behind
        the writer: in lockstep that peer is stuck, so say it at INFO."""
        cells = self._cells
        written = cells[layout.WRITE_SEQ_CELL]
        behind = any(cells[c] < written for c in self._read_seq_cells)
        return logging.INFO if behind else logging.DEBUG
