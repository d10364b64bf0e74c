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
travels through a bulk segment (see ``bulk``): one copy in, none out for
arrays and tensors (``bytes`` and ``bytearray`` own their memory, so each
reader copies them once; see ``serialization``).  Memory for the ring and
for bulk segments is checked against the process's limits before it is
reserved (see ``limits``).

Two ends, two types.  ``MessageQueue(n_reader, n_local_reader, ...)``
creates the writer end, a :class:`~mpexec.ipc.writer.MessageQueueWriter`
(its steps: ``MessageQueueWriter.enqueue``);
``MessageQueue.create_from_handle(handle, rank)`` returns a reader end, a
:class:`~mpexec.ipc.reader.MessageQueueReader` (``dequeue``).  Both are
``MessageQueue`` instances; calling the other end's operation on one raises a
``RuntimeError`` that says so.

Encoded once: ``writer.encode(obj)`` pickles into an :class:`EncodedMessage`
that ``enqueue`` accepts as is, so a caller retrying a full ring with short
timeouts (draining its own replies between tries) pickles the message once.
A timed-out ``enqueue`` has published nothing and left nothing behind.

Start-up: the writer creates the segment and exports a :class:`Handle`; each
reader attaches with :meth:`MessageQueue.create_from_handle` (announcing its
pid); :meth:`wait_until_ready` is the collective handshake: the writer waits
for every local reader, then sets ``ready``; readers wait for ``ready``.
:meth:`MessageQueue.create_from_process_group` does all of that over any
group object that can broadcast a Python object (see there).

End: :meth:`shutdown` on either side marks that side closed in shared memory
and wakes every sleeper, so blocked calls in this process raise
:class:`~mpexec.errors.QueueClosedError` at once, and the other side's calls
raise it at their next wake-up.  Because the segment is an anonymous memfd,
nothing remains anywhere once the processes are gone.

Threads: one thread at a time may use an end (``enqueue`` on the writer,
``dequeue`` on a reader, ``wait_until_ready`` on either); ``shutdown()`` and
``state()`` may come from any thread, during such a call.  The call then
raises ``QueueClosedError``: the shared memory is released by whoever leaves
last, never under a call (``endpoint.EndGuard``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from mpexec.ipc import sync
from mpexec.ipc.endpoint import QueueEnd
from mpexec.ipc.serialization import EncodedMessage
from mpexec.ipc.shm import SegmentRef

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 512 * 1024
DEFAULT_MAX_CHUNKS = 8
DEFAULT_SPIN_S = 0.001
DEFAULT_TICK_S = 0.05
DEFAULT_LOG_INTERVAL_S = 60.0
# create_from_process_group: how long every rank of the group may take to
# attach.  The ranks arrive together (it is collective), so minutes mean one
# of them died or never got there.
GROUP_READY_TIMEOUT_S = 300.0
_CLOSE_GRACE_S = 2.0


@dataclass
class Handle:
    """What a reader needs to attach to a queue; small and picklable."""

    local_reader_ranks: list[int]
    buffer: SegmentRef | None   # None when every reader is remote
    n_reader: int
    max_chunks: int
    max_chunk_bytes: int
    token: int
    name: str = "mq"
    # Remote readers (see ``remote``): where they connect, and the token that
    # names the queue's authentication keys.  None: every reader is local.
    connect_ip: str | None = None
    remote_subscribe_addr: str | None = None
    remote_token: int | None = None
    # Remote readers: the writer's socket speaks CURVE (``curve``), keys from the secret.
    remote_curve: bool = False


class ProcessGroup(Protocol):
    """What :meth:`MessageQueue.create_from_process_group` needs of a group."""

    @property
    def rank_in_group(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


class MessageQueue(QueueEnd):
    """One writer, ``n_reader`` readers, messages delivered to all in order.

    ``MessageQueue(...)`` builds the writer end (see
    :class:`~mpexec.ipc.writer.MessageQueueWriter` for the arguments);
    :meth:`create_from_handle` attaches a reader end.
    """

    def __new__(
        cls,
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
        connect_ip: str | None = None,
        secret: str | bytes | None = None,
        curve: bool = False,
        **options: Any,
    ) -> MessageQueue:
        if cls is MessageQueue:
            if n_local_reader < n_reader:
                from mpexec.ipc.remote import RemoteWriter

                cls = RemoteWriter
            else:
                from mpexec.ipc.writer import MessageQueueWriter

                cls = MessageQueueWriter
        return object.__new__(cls)

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, *,
                           spin_s: float = DEFAULT_SPIN_S, tick_s: float = DEFAULT_TICK_S,
                           log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                           secret: str | bytes | None = None) -> MessageQueue:
        """Attach as the reader of rank ``rank``: through shared memory when the
        rank is one of ``handle.local_reader_ranks``, else over the network
        (``remote``; ``secret`` is the cluster secret)."""
        from mpexec.ipc.reader import MessageQueueReader

        if rank not in handle.local_reader_ranks and handle.remote_subscribe_addr is not None:
            from mpexec.ipc.remote_reader import RemoteReader

            return RemoteReader.attach(handle, rank, secret, tick_s=tick_s)

        return MessageQueueReader.attach(handle, rank, spin_s=spin_s, tick_s=tick_s,
                                         log_interval_s=log_interval_s)

    @classmethod
    def create_from_process_group(
        cls, group: ProcessGroup, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS, writer_rank: int = 0, *,
        name: str = "group", timeout: float | None = GROUP_READY_TIMEOUT_S,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> MessageQueue:
        """A queue from ``writer_rank`` to every other rank of ``group`` (one node).

        Collective: every rank of the group calls it.  ``group`` is duck-typed
        (``rank_in_group``, ``world_size``, ``broadcast_object(obj, src)`` with
        ``src`` a rank within the group), so any process-group wrapper serves
        and nothing here imports torch.  The writer rank creates the writer
        (``world_size - 1`` readers, all local), the group broadcasts its
        handle, the others attach as readers, and all wait until ready (that
        handshake is the barrier).  Returns the writer on ``writer_rank`` and a
        reader elsewhere.

        ``timeout`` bounds that handshake (``GROUP_READY_TIMEOUT_S``, 300 s, by
        default; ``None`` waits forever): past it the writer raises
        ``TimeoutError`` naming the ranks that never attached (one died, or
        never called this), and a reader one saying the writer did not finish.
        """
        world, rank = int(group.world_size), int(group.rank_in_group)
        if world < 2:
            raise ValueError(f"a queue over a group needs >= 2 ranks, this group has {world}")
        if not 0 <= writer_rank < world:
            raise ValueError(f"writer_rank must be in [0, {world}), got {writer_rank}")
        queue: MessageQueue
        if rank == writer_rank:
            readers = [r for r in range(world) if r != writer_rank]
            queue = MessageQueue(world - 1, world - 1, readers, max_chunk_bytes, max_chunks,
                                 name=name, spin_s=spin_s)
            try:
                group.broadcast_object(queue.export_handle(), src=writer_rank)
                try:
                    queue.wait_until_ready(timeout)
                except TimeoutError as exc:
                    missing: list[int] = getattr(queue, "unattached_ranks", list)()
                    raise TimeoutError(
                        f"queue {name!r} over the group: rank(s) {missing} did not attach "
                        f"within {timeout:g}s (each rank of the group must call "
                        "create_from_process_group; one may have died)") from exc
            except BaseException:
                queue.shutdown()
                raise
        else:
            handle = group.broadcast_object(None, src=writer_rank)
            queue = MessageQueue.create_from_handle(handle, rank, spin_s=spin_s)
            try:
                try:
                    queue.wait_until_ready(timeout)
                except TimeoutError as exc:
                    raise TimeoutError(
                        f"queue {name!r} over the group, rank {rank}: the writer (rank "
                        f"{writer_rank}) did not finish the handshake within {timeout:g}s "
                        "(another rank did not attach, or the writer died)") from exc
            except BaseException:
                queue.shutdown()
                raise
        return queue

    # -- what one end or the other does (the wrong end says so) --------------

    def export_handle(self) -> Handle:
        """The handle readers pass to :meth:`create_from_handle` (writer only)."""
        raise self._wrong_end("export_handle", "writer")

    def encode(self, obj: Any) -> EncodedMessage:
        """Pickle ``obj`` once, for one or more ``enqueue`` tries (writer only)."""
        raise self._wrong_end("encode", "writer")

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` (or an :class:`EncodedMessage`) to every reader."""
        raise self._wrong_end("enqueue", "writer")

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message, in order (reader only)."""
        raise self._wrong_end("dequeue", "reader")

    def lagging_ranks(self) -> list[int]:
        """The reader ranks a full ring waits for (writer only)."""
        raise self._wrong_end("lagging_ranks", "writer")

    def broadcast_object(self, obj: Any = None) -> Any:
        """Writer: enqueue ``obj`` and return it.  Reader: return the next message."""
        raise NotImplementedError

    def _wrong_end(self, operation: str, end: str) -> RuntimeError:
        other = "reader" if end == "writer" else "writer"
        return RuntimeError(f"{operation}() called on the {other} end of queue {self.name!r}; "
                            f"only the {end} may call it")

    # -- handshake ------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective start: the writer waits for every reader, readers for the writer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._handshake(deadline)

    def _handshake(self, deadline: float | None) -> None:
        raise NotImplementedError

    # -- closing --------------------------------------------------------------

    def shutdown(self) -> None:
        """Close this end; wakes blocked calls here at once, the other side soon.

        Any thread may call it, while another is blocked in a call on this
        end: that call raises ``QueueClosedError``, and the shared memory is
        released only once it has left (see ``endpoint.EndGuard``).
        """
        guard = self._guard
        with guard.lock:
            if guard.closed:
                return
            guard.closed = True
            if self._pid != os.getpid():
                # A forked copy: no thread of this process is inside; let go of
                # the inherited mapping without telling the parent's peers.
                guard.busy = False
            elif not guard.released:
                segment = self._segment
                self._mark_closed()
                sync.full_fence()
                sync.futex_wake(self._write_seq_addr)
                sync.futex_wake(self._ready_addr)
                for cell in self._read_seq_cells:
                    sync.futex_wake(segment.address + sync.low_word_offset(cell * 8))
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
            self._finalizer.detach()

    def _mark_closed(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        role = "writer" if self._is_writer else f"reader {self._reader}"
        state = "closed" if self._guard.closed else "open"
        return (f"<MessageQueue {self.name!r} {role} {state} readers={self._layout.n_readers} "
                f"chunks={self._layout.max_chunks}x{self._layout.chunk_bytes}>")
