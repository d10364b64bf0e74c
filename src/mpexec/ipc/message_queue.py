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

Two ends, two types (``ends``: the :class:`~mpexec.ipc.ends.QueueWriter`
and :class:`~mpexec.ipc.ends.QueueReader` protocols).
``MessageQueue(n_reader, n_local_reader, ...)`` creates the writer end: it
holds a :class:`~mpexec.ipc.writer.MessageQueueWriter` (its steps:
``MessageQueueWriter.enqueue``), or a :class:`~mpexec.ipc.remote.RemoteWriter`
when some readers are on other hosts (the sub-package ``remote``).
``MessageQueue.create_from_handle(handle, rank)`` returns a reader end, a
:class:`~mpexec.ipc.reader.MessageQueueReader` (``dequeue``) or a
:class:`~mpexec.ipc.remote.RemoteReader`.  Each end has only its own
operations; the shared-memory ends each hold an ``endpoint.RingEnd`` (the
mapping, the guard, the waits), they do not inherit it.

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

from typing import Any, Protocol

from mpexec.ipc.endpoint import QueueState
from mpexec.ipc.ends import QueueReader
from mpexec.ipc.handle import (
    DEFAULT_LOG_INTERVAL_S,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    DEFAULT_SPIN_S,
    DEFAULT_TICK_S,
    Handle,
)
from mpexec.ipc.reader import MessageQueueReader
from mpexec.ipc.remote import RemoteReader, RemoteWriter
from mpexec.ipc.serialization import EncodedMessage
from mpexec.ipc.writer import MessageQueueWriter

__all__ = [
    "DEFAULT_LOG_INTERVAL_S",
    "DEFAULT_MAX_CHUNKS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_SPIN_S",
    "DEFAULT_TICK_S",
    "GROUP_READY_TIMEOUT_S",
    "Handle",
    "MessageQueue",
    "ProcessGroup",
]

# create_from_process_group: how long every rank of the group may take to
# attach.  The ranks arrive together (it is collective), so minutes mean one
# of them died or never got there.
GROUP_READY_TIMEOUT_S = 300.0


class ProcessGroup(Protocol):
    """What :meth:`MessageQueue.create_from_process_group` needs of a group."""

    @property
    def rank_in_group(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


class MessageQueue:
    """The writer end of a queue, as callers build it (a :class:`~mpexec.ipc.ends.QueueWriter`).

    ``MessageQueue(n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes,
    max_chunks, ...)``: one writer, ``n_reader`` readers, messages delivered
    to all in order.  It picks the transport from its arguments and holds it
    as :attr:`transport`: a :class:`~mpexec.ipc.writer.MessageQueueWriter`
    when every reader is local (see there for the arguments), a
    :class:`~mpexec.ipc.remote.RemoteWriter` when some are on other hosts
    (``connect_ip``, ``secret``, ``curve``; see there).  Every operation is
    the transport's.  :meth:`create_from_handle` attaches a reader end.
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
        connect_ip: str | None = None,
        secret: str | bytes | None = None,
        curve: bool = False,
        **options: Any,
    ) -> None:
        self.transport: MessageQueueWriter | RemoteWriter
        if n_local_reader < n_reader:
            self.transport = RemoteWriter(
                n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes, max_chunks,
                name=name, connect_ip=connect_ip, secret=secret, tick_s=tick_s, curve=curve,
                spin_s=spin_s, log_interval_s=log_interval_s, **options)
        else:
            # connect_ip, secret and curve matter only with remote readers.
            self.transport = MessageQueueWriter(
                n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes, max_chunks,
                name=name, spin_s=spin_s, tick_s=tick_s, log_interval_s=log_interval_s,
                **options)
        self.name = name

    @staticmethod
    def create_from_handle(handle: Handle, rank: int, *,
                           spin_s: float = DEFAULT_SPIN_S, tick_s: float = DEFAULT_TICK_S,
                           log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                           secret: str | bytes | None = None) -> QueueReader:
        """Attach as the reader of rank ``rank``: through shared memory when the
        rank is one of ``handle.local_reader_ranks``, else over the network
        (``remote``; ``secret`` is the cluster secret)."""
        if rank not in handle.local_reader_ranks and handle.remote_subscribe_addr is not None:
            return RemoteReader(handle, rank, secret, tick_s=tick_s)
        return MessageQueueReader.attach(handle, rank, spin_s=spin_s, tick_s=tick_s,
                                         log_interval_s=log_interval_s)

    @staticmethod
    def create_from_process_group(
        group: ProcessGroup, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS, writer_rank: int = 0, *,
        name: str = "group", timeout: float | None = GROUP_READY_TIMEOUT_S,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> MessageQueue | QueueReader:
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
        if rank == writer_rank:
            readers = [r for r in range(world) if r != writer_rank]
            writer = MessageQueue(world - 1, world - 1, readers, max_chunk_bytes, max_chunks,
                                  name=name, spin_s=spin_s)
            try:
                group.broadcast_object(writer.export_handle(), src=writer_rank)
                try:
                    writer.wait_until_ready(timeout)
                except TimeoutError as exc:
                    raise TimeoutError(
                        f"queue {name!r} over the group: rank(s) {writer.unattached_ranks()} "
                        f"did not attach within {timeout:g}s (each rank of the group must "
                        "call create_from_process_group; one may have died)") from exc
            except BaseException:
                writer.shutdown()
                raise
            return writer
        handle = group.broadcast_object(None, src=writer_rank)
        reader = MessageQueue.create_from_handle(handle, rank, spin_s=spin_s)
        try:
            try:
                reader.wait_until_ready(timeout)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"queue {name!r} over the group, rank {rank}: the writer (rank "
                    f"{writer_rank}) did not finish the handshake within {timeout:g}s "
                    "(another rank did not attach, or the writer died)") from exc
        except BaseException:
            reader.shutdown()
            raise
        return reader

    # -- the writer's operations: its transport's ------------------------------

    @property
    def closed(self) -> bool:
        return self.transport.closed

    def export_handle(self) -> Handle:
        """The handle readers pass to :meth:`create_from_handle`."""
        return self.transport.export_handle()

    def encode(self, obj: Any) -> EncodedMessage:
        """Pickle ``obj`` once, for one or more ``enqueue`` tries."""
        return self.transport.encode(obj)

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` (or an :class:`EncodedMessage`) to every reader;
        on ``TimeoutError`` nothing was published."""
        self.transport.enqueue(obj, timeout)

    def broadcast_object(self, obj: Any = None) -> Any:
        """``enqueue(obj)``, then ``obj``."""
        self.transport.enqueue(obj)
        return obj

    def lagging_ranks(self) -> list[int]:
        """The reader ranks a full ring waits for."""
        return self.transport.lagging_ranks()

    def unattached_ranks(self) -> list[int]:
        """The reader ranks that have not attached yet (for a clear error)."""
        return self.transport.unattached_ranks()

    def state(self) -> QueueState:
        """The shared-memory ring's header now (see ``endpoint.RingEnd.state``)."""
        return self.transport.state()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective start: wait for every reader, then let them start."""
        self.transport.wait_until_ready(timeout)

    def shutdown(self) -> None:
        """Close the queue; wakes blocked calls here at once, the readers soon.
        Any thread may call it, during a call on this end."""
        self.transport.shutdown()

    def __repr__(self) -> str:
        return f"<MessageQueue {self.name!r} {self.transport!r}>"
