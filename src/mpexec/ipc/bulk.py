"""Large messages: one copy into shared memory, none out.

A message too large for a ring chunk is written into a *bulk segment* (a
memfd of its own) and the chunk carries only its descriptor.

Writer side (:class:`BulkWriter`): fresh shared pages are expensive to
allocate, so segments are reused: the writer keeps up to ``BULK_SLOTS`` of
them, each mapped once and populated when it grows, so that writing a
message into one is a single ``memcpy`` of its pieces (``pwrite`` would cost
a page-cache lookup per page, about twice that).  Each slot has a
generation number that grows on every use.  A slot may be reused once every reader has *released*
the generation it last carried (see below).  When every slot is still held,
the message goes to a one-off segment (written with ``os.pwritev``, one
system call, never mapped by the writer) that the writer closes as soon as all
readers have consumed the message; the kernel frees it once the readers let
go too.  Released slots beyond ``CACHE_CAP_BYTES`` in all are closed, so a
burst of huge messages does not pin their memory for the queue's lifetime.

Reader side (:func:`map_bulk`): the reader opens the writer's descriptor
through ``/proc`` and maps it copy-on-write (``MAP_PRIVATE``).  The objects it
unpickles are views of that mapping: zero copies, writable, and private —
a write by the reader copies just that page.  When the last of those objects
is gone, the mapping is freed and a finalizer stores the generation into the
reader's release cell; that store is what lets the writer reuse the slot.
Until then the slot's pages stay as the reader saw them, so a view held for
an hour is never overwritten.

Memory: before a message needs new shared memory (a one-off, a new slot, a
slot that grows) the writer checks it against the process's limits
(``limits``); a payload that does not fit fails its own ``enqueue`` with the
documented ``OSError`` before anything is published, and the queue goes on.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

from mpexec.ipc import layout, sync
from mpexec.ipc.limits import check_reservation, reservation_failed
from mpexec.ipc.serialization import Frame, iter_pieces, write_into
from mpexec.ipc.shm import (
    GrowableMapping,
    Segment,
    create_memfd,
    map_private,
    open_peer_fd,
    reservation_error,
    segment_name,
)

MIN_SEGMENT = 1 << 20
# Released bulk slots kept beyond this are closed (their memory freed).
CACHE_CAP_BYTES = 256 << 20
_IOV_MAX = 1024


def _capacity_for(size: int) -> int:
    capacity = MIN_SEGMENT
    while capacity < size:
        capacity *= 2
    return capacity


def write_frame(fd: int, frame: Frame, what: str) -> None:
    pieces = iter_pieces(frame)
    offset = 0
    for start in range(0, len(pieces), _IOV_MAX):
        batch = pieces[start:start + _IOV_MAX]
        want = sum(memoryview(p).nbytes for p in batch)
        try:
            done = os.pwritev(fd, batch, offset)
        except OSError as err:
            raise reservation_error(err, frame.nbytes, what) from None
        if done != want:  # short write: finish piece by piece
            _finish_short_write(fd, batch, offset, done)
        offset += want


def _finish_short_write(fd: int, batch: list[Any], offset: int, done: int) -> None:
    pos = offset
    for piece in batch:
        view = memoryview(piece).cast("B")
        end = pos + view.nbytes
        if end <= offset + done:
            pos = end
            continue
        skip = max(offset + done - pos, 0)
        view = view[skip:]
        pos += skip
        while view.nbytes:
            n = os.pwrite(fd, view, pos)
            view = view[n:]
            pos += n


class _Slot:
    """A reusable bulk segment, kept mapped by the writer (see GrowableMapping)."""

    __slots__ = ("fd", "inode", "capacity", "generation", "memory")

    def __init__(self, fd: int, capacity: int, what: str) -> None:
        self.fd = fd
        self.inode = os.fstat(fd).st_ino
        self.capacity = capacity
        self.generation = 0
        self.memory = GrowableMapping(fd, capacity, what)

    def close(self) -> None:
        self.memory.close()
        os.close(self.fd)


class BulkWriter:
    """The writer's bulk segments: reusable slots plus one-offs in flight."""

    def __init__(self, name: str, is_released: Callable[[int, int], bool]) -> None:
        self._name = name
        self._is_released = is_released        # (slot, generation) -> all readers let go
        self._slots: list[_Slot | None] = [None] * layout.BULK_SLOTS
        self._one_offs: deque[tuple[int, int]] = deque()   # (seq, fd)

    def put(self, frame: Frame, seq: int, what: str) -> tuple[int, int, int, int]:
        """Write ``frame``; return (fd, inode, slot or NO_SLOT, generation)."""
        index = self._free_slot(frame.nbytes, what)
        if index is None:
            check_reservation(frame.nbytes, what, mapped=False)
            fd = create_memfd(segment_name(self._name + "-bulk"), 0, what)
            try:
                write_frame(fd, frame, what)
                inode = os.fstat(fd).st_ino
            except BaseException:
                os.close(fd)
                raise
            self._one_offs.append((seq, fd))
            return fd, inode, layout.NO_SLOT, 0
        slot = self._slots[index]
        assert slot is not None
        slot.memory.grow(frame.nbytes, what)
        assert slot.memory.view is not None
        write_into(frame, slot.memory.view[:frame.nbytes])
        slot.generation += 1
        self._trim(keep=index)
        return slot.fd, slot.inode, index, slot.generation

    def _trim(self, keep: int) -> None:
        """Drop released slots, largest first, while the cache exceeds its cap."""
        cached = sum(slot.capacity for slot in self._slots if slot is not None)
        if cached <= CACHE_CAP_BYTES:
            return
        free = sorted((slot.capacity, index) for index, slot in enumerate(self._slots)
                      if slot is not None and index != keep
                      and self._is_released(index, slot.generation))
        while cached > CACHE_CAP_BYTES and free:
            capacity, index = free.pop()
            slot = self._slots[index]
            assert slot is not None
            slot.close()
            self._slots[index] = None
            cached -= capacity

    def _free_slot(self, size: int, what: str) -> int | None:
        best: int | None = None
        empty: int | None = None
        small_free: int | None = None
        for index, slot in enumerate(self._slots):
            if slot is None:
                empty = index if empty is None else empty
                continue
            if slot.generation and not self._is_released(index, slot.generation):
                continue
            if slot.capacity >= size:
                if best is None or slot.capacity < self._capacity(best):
                    best = index
            elif small_free is None:
                small_free = index
        if best is not None:
            return best
        target = empty if empty is not None else small_free
        if target is None:
            return None
        old = self._slots[target]
        if old is not None:
            old.close()
            self._slots[target] = None
        capacity = _capacity_for(size)
        fd = create_memfd(segment_name(self._name + "-bulk"), 0, what)
        try:
            self._slots[target] = _Slot(fd, capacity, what)
        except BaseException:
            os.close(fd)
            raise
        return target

    def _capacity(self, index: int) -> int:
        slot = self._slots[index]
        return 0 if slot is None else slot.capacity

    def reclaim(self, consumed_by_all: int) -> None:
        """Close one-off segments of messages every reader has consumed."""
        while self._one_offs and self._one_offs[0][0] < consumed_by_all:
            os.close(self._one_offs.popleft()[1])

    def close(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._slots = [None] * layout.BULK_SLOTS
        while self._one_offs:
            os.close(self._one_offs.popleft()[1])


def map_bulk(pid: int, fd: int, inode: int, size: int, what: str,
             on_release: Callable[[], None] | None) -> memoryview:
    """Map a writer's bulk segment copy-on-write; ``on_release`` runs when unused."""
    own = open_peer_fd(pid, fd, inode, os.O_RDONLY, what)
    try:
        return map_private(own, size, on_release)
    except OSError as err:  # e.g. RLIMIT_AS of this reader: the message is lost, not the queue
        if on_release is not None:
            on_release()   # nothing of it is held here: the writer may reuse the slot
        raise reservation_failed(err, size, f"mapping a {size / 2**20:.1f} MiB message "
                                 f"from {what}") from None
    finally:
        os.close(own)


class BulkRelease:
    """Finalizer of a bulk mapping: tells the writer this reader let go."""

    __slots__ = ("segment", "cell", "generation")

    def __init__(self, segment: Segment, cell: int, generation: int) -> None:
        self.segment = segment
        self.cell = cell
        self.generation = generation

    def __call__(self) -> None:
        # The queue may have been shut down meanwhile, in another thread: the
        # segment checks that and writes under one lock.
        sync.release_fence()
        self.segment.store(self.cell, self.generation)
