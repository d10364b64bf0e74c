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

Waiting costs nothing when idle.  A waiter polls its counter between
``sched_yield`` calls for ``spin_s`` (pure spinning collapses once spinners
outnumber cores; yielding hands a shared core to the partner at once), then
sets its sleeping flag and sleeps on the futex of the counter it waits for,
at most ``tick_s`` at a time.  Every tick it checks its deadline,
``shutdown()``, the writer's closed flag and whether the peer process still
lives, and every ``log_interval_s`` it logs which parties are behind (see
``waiting``).

Message bodies (chunk kinds in ``layout``): a small message without
out-of-band buffers is a bare pickle in the chunk, unpickled in place before
the reader releases the chunk; a frame with buffers that fits is copied in,
and copied out into private memory before the release; a larger frame
travels through a bulk segment (see ``bulk``): one copy in, none out.

The writer's steps are ``writer.WriterEnd.enqueue``, the reader's
``reader.ReaderEnd.dequeue``; both are mixed into :class:`MessageQueue`.

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
import secrets
import time
from dataclasses import dataclass

from mpexec.errors import QueueClosedError
from mpexec.ipc import layout, sync
from mpexec.ipc.bulk import BulkWriter
from mpexec.ipc.layout import RingLayout
from mpexec.ipc.peers import PeerWatch
from mpexec.ipc.reader import ReaderEnd
from mpexec.ipc.shm import Segment, SegmentRef, segment_name
from mpexec.ipc.writer import WriterEnd

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


class MessageQueue(WriterEnd, ReaderEnd):
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
