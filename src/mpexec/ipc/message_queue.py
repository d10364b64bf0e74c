"""MessageQueue: one writer broadcasts to N reader processes through shared memory.

The protocol
============

One segment (see ``layout``) holds a ring of ``max_chunks`` chunks and one
counter per party.  ``write_seq`` counts the messages the writer has
published; ``read_seq[r]`` counts those reader ``r`` has consumed.  Message
``k`` lives in chunk ``k % max_chunks``.  Counters only grow, so every state
is a pair of numbers and no flag is ever reset::

    writer, message k                         reader r, message k
    -----------------                         -------------------
    wait: min(read_seq) > k - max_chunks      wait: write_seq > k
    [acquire fence]                           [acquire fence]
    write chunk k % max_chunks                read chunk k % max_chunks
    [release fence]                           [release fence]
    write_seq = k + 1                         read_seq[r] = k + 1
    [full fence]                              [full fence]
    wake readers flagged sleeping             wake the writer if flagged waiting

The release fence makes the chunk visible before the counter that publishes
it; the acquire fence keeps the chunk reads after the counter read that
allowed them; the reader's release fence keeps its chunk reads before the
store that lets the writer overwrite the chunk.  On x86-64 those three are
free (total store order); on weakly ordered CPUs they are real fences (see
``sync``).  The full fence before checking a sleeping flag is needed
everywhere: it is the store-then-load half of the wake-up handshake.

Waiting costs nothing when idle.  A waiter polls its counter for a few
microseconds, then polls with ``sched_yield`` for ``spin_s`` (so a busy
partner on a shared core gets the CPU), then sets its sleeping flag and sleeps
on the futex of the counter it waits for, at most ``tick_s`` at a time.  Every
tick it checks its deadline, ``shutdown()``, the writer's closed flag and
whether the peer process still lives, and every ``log_interval_s`` it logs
which parties are behind.

Message bodies: a frame that fits a chunk is copied into it, and the reader
copies it out into private memory before releasing the chunk.  A larger frame
travels through a bulk segment (see ``bulk``): one copy in, none out.

Start-up: the writer creates the segment and exports a :class:`Handle`; each
reader attaches with :meth:`MessageQueue.create_from_handle` (announcing its
pid); :meth:`wait_until_ready` is the collective handshake: the writer waits
for every local reader, then sets ``ready``; readers wait for ``ready``.

End: :meth:`shutdown` on either side marks that side closed in shared memory
and wakes every sleeper, so blocked calls in this process raise
:class:`~mpexec.errors.QueueClosedError` at once, and the other side's calls
raise it at their next wake-up.  Because the segment is an anonymous memfd,
nothing remains anywhere once the processes are gone.

Threads: one thread may enqueue and one may dequeue on a given end at a time;
``shutdown()`` may come from any thread.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import time
from dataclasses import dataclass
from typing import Any

from mpexec.errors import QueueClosedError
from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkRelease, BulkWriter, map_bulk
from mpexec.ipc.endpoint import QueueEnd
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.peers import PeerWatch
from mpexec.ipc.serialization import Frame, decode, frame_of, write_into
from mpexec.ipc.shm import Segment, SegmentRef, segment_name

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 512 * 1024
DEFAULT_MAX_CHUNKS = 8
DEFAULT_SPIN_S = 0.001
DEFAULT_TICK_S = 0.05
DEFAULT_LOG_INTERVAL_S = 60.0
_FAST_POLLS = 32
_CLOSE_GRACE_S = 2.0


@dataclass
class Handle:
    """What a reader needs to attach to a queue; small and picklable."""

    local_reader_ranks: list[int]
    buffer: SegmentRef | None
    n_reader: int
    max_chunks: int
    max_chunk_bytes: int
    token: int
    name: str = "mq"
    remote_subscribe_addr: str | None = None


class MessageQueue(QueueEnd):
    """One writer, ``n_reader`` readers, messages delivered to all in order."""

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
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
            raise NotImplementedError(
                "remote readers (n_local_reader < n_reader) need the multi-node transport, "
                "which this version of mpexec does not have yet")
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
                                 f"queue {name!r} ({geometry.total_bytes / 2**20:.1f} MiB)")
        token = secrets.randbits(63)
        cells = segment.cells
        cells[layout.N_READERS_CELL] = n_local_reader
        cells[layout.MAX_CHUNKS_CELL] = max_chunks
        cells[layout.CHUNK_BYTES_CELL] = max_chunk_bytes
        cells[layout.WRITER_PID_CELL] = os.getpid()
        cells[layout.TOKEN_CELL] = token
        sync.full_fence()
        cells[layout.MAGIC_CELL] = layout.MAGIC
        self._setup(segment, geometry, name, reader_index=None, writer_pid=os.getpid(),
                    spin_s=spin_s, tick_s=tick_s, log_interval_s=log_interval_s)
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = list(local_reader_ranks)
        self.connect_ip = connect_ip
        self._token = token
        self._bulk = BulkWriter(name, self._bulk_released)

    # -- construction on the reader side -------------------------------------

    def export_handle(self) -> Handle:
        """The handle readers pass to :meth:`create_from_handle`."""
        self._require_writer("export_handle")
        return Handle(
            local_reader_ranks=list(self.local_reader_ranks),
            buffer=self._segment.ref(),
            n_reader=self.n_reader,
            max_chunks=self._layout.max_chunks,
            max_chunk_bytes=self._layout.chunk_bytes,
            token=self._token,
            name=self.name,
        )

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, *,
                           spin_s: float = DEFAULT_SPIN_S, tick_s: float = DEFAULT_TICK_S,
                           log_interval_s: float = DEFAULT_LOG_INTERVAL_S) -> MessageQueue:
        """Attach as the reader of global rank ``rank`` (any process, same machine)."""
        if handle.buffer is None:
            raise NotImplementedError("this handle has no local buffer (remote readers)")
        if rank not in handle.local_reader_ranks:
            raise ValueError(f"rank {rank} is not a local reader of queue {handle.name!r}; "
                             f"its local reader ranks are {handle.local_reader_ranks}")
        sync.check_fences()
        what = f"queue {handle.name!r}"
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
            queue = cls.__new__(cls)
            queue._setup(segment, geometry, handle.name, reader_index=index,
                         writer_pid=handle.buffer.pid, spin_s=spin_s, tick_s=tick_s,
                         log_interval_s=log_interval_s)
        except BaseException:
            segment.close()
            raise
        queue.n_reader = handle.n_reader
        queue.local_reader_ranks = list(handle.local_reader_ranks)
        queue._token = handle.token
        queue._seq = int(cells[geometry.reader_cell(index, layout.READ_SEQ)])
        cells[geometry.reader_cell(index, layout.PID)] = os.getpid()
        sync.release_fence()
        cells[state_cell] = layout.STATE_ATTACHED
        sync.full_fence()
        return queue

    # -- handshake ------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective start: the writer waits for every reader, readers for the writer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cells = self._cells
        if self._is_writer:
            state_cells = [self._layout.reader_cell(r, layout.STATE)
                           for r in range(self._layout.n_readers)]
            self._wait(lambda: all(cells[c] == layout.STATE_ATTACHED for c in state_cells),
                       None, None, deadline, self._check_all_readers,
                       "wait_until_ready (readers attaching)")
            sync.release_fence()
            cells[layout.READY_CELL] = 1
            sync.full_fence()
            sync.futex_wake(self._ready_addr)
        else:
            ready_addr = self._ready_addr
            self._wait(lambda: cells[layout.READY_CELL] == 1, lambda: (ready_addr, 0), None,
                       deadline, self._check_writer, "wait_until_ready (writer)")
            sync.acquire_fence()

    # -- writer ---------------------------------------------------------------

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

    # -- reader ---------------------------------------------------------------

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
                # Poll briefly here, cheaply, before the general wait.
                for _ in range(_FAST_POLLS):
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

    # -- closing --------------------------------------------------------------

    def shutdown(self) -> None:
        """Close this end; wakes blocked calls here at once, the other side soon."""
        if self._closed:
            return
        self._closed = True
        segment = self._segment
        if self._pid == os.getpid() and not segment.closed:
            cells = self._cells
            if self._is_writer:
                cells[layout.CLOSED_CELL] = 1
            else:
                assert self._reader is not None
                cells[self._layout.reader_cell(self._reader, layout.STATE)] = layout.STATE_CLOSED
            sync.full_fence()
            sync.futex_wake(self._write_seq_addr)
            sync.futex_wake(self._ready_addr)
            for cell in self._read_seq_cells:
                sync.futex_wake(segment.address + sync.low_word_offset(cell * 8))
            # A call blocked in another thread is waking up now; let it leave
            # the shared memory before the mapping goes away.
            deadline = time.monotonic() + _CLOSE_GRACE_S
            while self._busy and time.monotonic() < deadline:
                time.sleep(0.0005)
            if self._busy:
                logger.warning("queue %r: a call is still inside the queue after %.0f s; "
                               "leaving its memory mapped", self.name, _CLOSE_GRACE_S)
                return
        if self._bulk is not None:
            self._bulk.close()
        self._finalizer()

    def __repr__(self) -> str:
        role = "writer" if self._is_writer else f"reader {self._reader}"
        state = "closed" if self._closed else "open"
        return (f"<MessageQueue {self.name!r} {role} {state} readers={self._layout.n_readers} "
                f"chunks={self._layout.max_chunks}x{self._layout.chunk_bytes}>")
