"""Shared-memory segments that cannot leak: anonymous memfds shared through /proc.

A queue's memory is a ``memfd_create`` file.  It has no name in ``/dev/shm`` or
anywhere else, so there is nothing to unlink and nothing to leave behind: the
kernel frees it when the last descriptor and the last mapping are gone, however
the processes holding them ended (SIGKILL included).  Its pages are charged to
memory, not to the size of ``/dev/shm``, which therefore cannot fill up.

Sharing: the creator keeps the descriptor open; another process opens
``/proc/<creator pid>/fd/<fd>``, which the kernel allows only to the same user
(the ptrace "read" check), and the file itself is mode 0600.  The inode number
travels with the handle, so a descriptor number reused for another file after
the creator closed the segment is detected instead of mapped.

Space is reserved when the segment is made (``posix_fallocate``), after a
check against every limit on this process's memory (``limits``): a segment
that cannot fit fails construction with an ``OSError`` naming what it was
for, the MiB needed and the limit that applies, never with the OOM killer or
a SIGBUS at first touch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from mpexec.errors import PeerDiedError, QueueClosedError
from mpexec.ipc.limits import check_reservation, memory_limits, reservation_failed, tightest

_counter = itertools.count()
MiB = 1 << 20

# Python >= 3.13 can map without keeping a duplicate descriptor per mapping.
_MMAP_NO_TRACKFD: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def segment_name(kind: str) -> str:
    """A name for ``/proc/<pid>/fd`` listings: ``mpexec-<kind>-<pid>-<n>``."""
    return f"mpexec-{kind}-{os.getpid()}-{next(_counter)}"


def available_memory_bytes() -> int | None:
    """Bytes of new shared memory this process may still take (the tightest
    of MemAvailable, its cgroups and its rlimits; see ``limits``)."""
    limit = tightest(memory_limits())
    return None if limit is None else limit.headroom


def reservation_error(err: OSError, size: int, what: str) -> OSError:
    """The documented error for a reservation the kernel refused."""
    return reservation_failed(err, size, what)


def create_memfd(name: str, size: int, what: str, allocate: bool = True) -> int:
    """A 0600 memfd of ``size`` bytes whose pages are already allocated
    (unless ``allocate`` is false).

    ``size`` is checked against every memory limit first (see ``limits``), so
    an impossible size fails here, at once, instead of feeding the OOM killer.
    ``allocate=False`` leaves the pages to be allocated as they are first
    touched (as an anonymous ``torch.empty`` would: a large KV cache of which
    a run may use a small part).
    """
    check_reservation(size, what)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
        if size and not allocate:
            os.ftruncate(fd, size)
        elif size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                raise reservation_error(err, size, what) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_peer_fd(pid: int, fd: int, inode: int, flags: int, what: str) -> int:
    """Open another process's descriptor ``fd`` and check it is still ``inode``."""
    try:
        own = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise PeerDiedError(
                f"{what}: its writer process {pid} has exited", pid=pid, role="writer"
            ) from None
        raise QueueClosedError(f"{what}: the segment is gone (its writer shut it down)") from None
    except PermissionError as err:
        raise PermissionError(
            err.errno,
            f"{what}: cannot open /proc/{pid}/fd/{fd}; readers must run as the same user "
            "as the writer, and the writer must be dumpable (run `mpexec doctor`)",
        ) from None
    if os.fstat(own).st_ino != inode:
        os.close(own)
        raise QueueClosedError(f"{what}: the segment is gone (descriptor reused)")
    return own


@dataclass(frozen=True)
class SegmentRef:
    """Where to find a segment: the creator's pid, descriptor and inode."""

    pid: int
    fd: int
    inode: int
    size: int


class Segment:
    """A shared read-write mapping of a memfd, with its base address for futexes."""

    def __init__(self, fd: int, size: int, owner: bool) -> None:
        self.fd = fd if owner else -1
        self.size = size
        self.map = mmap.mmap(fd, size, **_MMAP_NO_TRACKFD)
        self.bytes = memoryview(self.map)
        self.cells = self.bytes.cast("Q")
        self._anchor: ctypes.Array[ctypes.c_char] | None = (
            ctypes.c_char * size).from_buffer(self.map)
        self.address = ctypes.addressof(self._anchor)
        self.closed = False
        # close() against store() from another thread; reentrant, as a GC finalizer
        # (a reader's bulk view let go) may run store() inside close() itself.
        self._lock = threading.RLock()

    @classmethod
    def create(cls, name: str, size: int, what: str, allocate: bool = True) -> Segment:
        fd = create_memfd(name, size, what, allocate)
        try:
            return cls(fd, size, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, ref: SegmentRef, what: str) -> Segment:
        fd = open_peer_fd(ref.pid, ref.fd, ref.inode, os.O_RDWR, what)
        try:
            return cls(fd, ref.size, owner=False)
        finally:
            os.close(fd)

    def ref(self) -> SegmentRef:
        return SegmentRef(os.getpid(), self.fd, os.fstat(self.fd).st_ino, self.size)

    def store(self, cell: int, value: int) -> bool:
        """Write one cell from any thread (a finalizer's); False once closed."""
        with self._lock:
            if self.closed:
                return False
            self.cells[cell] = value
            return True

    def let_go(self) -> None:
        """Close the descriptor and drop this object's own views, leaving the
        mapping to those who hold views of ``bytes`` (a tensor made on it): it is
        unmapped when the last of them goes, never under them."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.cells.release()
            self._anchor = None
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap and close.  A view that holds a buffer export (a memoryview or
        numpy array of ``bytes``) keeps the memory mapped until it goes; a
        tensor from ``torch.frombuffer`` holds no export and would be left on
        unmapped memory: a segment under such a tensor is let go
        (:meth:`let_go`), not closed."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.cells.release()
            self.bytes.release()
            self._anchor = None
            try:
                self.map.close()
            except BufferError:
                pass  # someone still holds a view; the mapping goes with it
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = -1


def map_private(fd: int, size: int, on_unmap: Callable[[], None] | None = None) -> memoryview:
    """A copy-on-write mapping of ``fd`` as a writable byte view.

    ``mmap.mmap`` (before Python 3.13) keeps a duplicate descriptor for every
    mapping, so a reader holding many arrays from large messages would run
    out of descriptors.  This maps with libc directly: the mapping lives as
    long as some view of it does, holds no descriptor, and is unmapped (then
    ``on_unmap`` runs) when the last view is gone.
    """
    # ctypes keeps every array type it ever made, so lengths come in powers
    # of two: a few dozen types, however many sizes pass.  The pages past
    # the end of the file are reserved, never touched (the view stops at size).
    length = 1 << max(size - 1, 4095).bit_length()
    address = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    memory = (ctypes.c_ubyte * length).from_address(address)
    finalizer = weakref.finalize(memory, _unmap, address, length, on_unmap)
    # Never at interpreter exit: objects still alive then may yet be read
    # (by other finalizers), and unmapping under them would crash the process.
    finalizer.atexit = False
    return memoryview(memory).cast("B")[:size]


def _unmap(address: int, size: int, on_unmap: Callable[[], None] | None) -> None:
    _munmap(address, size)
    if on_unmap is not None:
        on_unmap()


_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23   # Linux >= 5.14; older kernels say EINVAL and fault lazily
PAGE = mmap.PAGESIZE


class GrowableMapping:
    """A writer's shared mapping of its own memfd, reserved at ``capacity``
    bytes of address space and backed only up to ``filled``.

    Writing a message with ``memcpy`` into pages that are already mapped
    costs one copy; ``pwrite`` into the same file costs about two (a page
    cache lookup per 4 KiB page).  So a bulk slot is mapped once, grown with
    ``posix_fallocate`` (after the limits check) and its new pages populated
    in one call; every later message in it is a plain copy.  Pages past
    ``filled`` are never touched: that would be a SIGBUS.
    """

    def __init__(self, fd: int, capacity: int, what: str) -> None:
        self.fd = fd
        self.capacity = capacity
        self.filled = 0
        address = _mmap(None, capacity, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                        fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()   # ENOMEM here is address space (RLIMIT_AS), not pages
            raise reservation_error(OSError(err, os.strerror(err)), capacity,
                                    f"the address space of {what}")
        self.address: int = address
        self.view: memoryview | None = memoryview(
            (ctypes.c_ubyte * capacity).from_address(address)).cast("B")

    def grow(self, size: int, what: str) -> None:
        """Back the first ``size`` bytes with memory (no-op when they are)."""
        if size <= self.filled:
            return
        if size > self.capacity:
            raise ValueError(f"{size} bytes exceed the mapping's capacity {self.capacity}")
        check_reservation(size - self.filled, what)
        try:
            os.posix_fallocate(self.fd, self.filled, size - self.filled)
        except OSError as err:
            raise reservation_error(err, size - self.filled, what) from None
        start = self.filled // PAGE * PAGE
        _madvise(self.address + start, size - start, MADV_POPULATE_WRITE)
        self.filled = size

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
            _munmap(self.address, self.capacity)
