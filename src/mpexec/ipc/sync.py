"""Memory ordering and sleeping between processes: fences and futexes.

Python has no atomics, so this module supplies the three things the ring in
``message_queue`` needs from the CPU and the kernel:

* **Word access.**  Counters live in shared memory as aligned 64-bit words and
  are read and written through a ``memoryview`` cast to ``"Q"``.  CPython copies
  such an item with one 8-byte ``memcpy``, which compilers emit as a single
  aligned load or store: a reader never sees half of a counter.

* **Fences.**  ``full_fence()`` orders every earlier load and store of this CPU
  before every later one, as a sequentially consistent fence does.  It calls
  ``atomic_thread_fence(memory_order_seq_cst)`` from ``libatomic`` through
  ctypes (an ``mfence``/``dmb ish``).  A lock private to one process is *not*
  such a fence in the C memory model, so none is used as one, with a single
  exception: on x86-64 without ``libatomic``, the uncontended acquire and release
  of a ``threading.Lock`` executes a LOCK-prefixed instruction, which the x86
  architecture defines as a full barrier for the issuing core whatever memory it
  touches; that is the documented fallback there, and nowhere else.

  ``release_fence()`` / ``acquire_fence()`` are the one-way fences of the
  publish/consume protocol.  On x86-64 (total store order: stores are not
  reordered with stores, loads not with loads, loads not with later stores)
  they cost nothing; everywhere else they are full fences.

* **Futexes.**  ``futex_wait(addr, expected, timeout)`` sleeps while the 32-bit
  word at ``addr`` still holds ``expected``; ``futex_wake(addr)`` wakes every
  sleeper on it.  The kernel compares the word and queues the sleeper
  atomically, and executes a full barrier before the comparison, so a waiter
  that announces itself (stores a "sleeping" flag) and then calls
  ``futex_wait`` pairs with a waker that stores the new value, calls
  ``full_fence()`` and then reads the flag: either the waker sees the flag and
  wakes, or the waiter's kernel comparison sees the new value.  No wake-up is
  lost.  Where the futex syscall is unknown (not Linux, or an unlisted
  architecture) waiting degrades to short sleeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import threading
import time

logger = logging.getLogger(__name__)

_MACHINE = platform.machine().lower()
IS_TSO = _MACHINE in ("x86_64", "amd64", "i386", "i686", "x86")

# syscall numbers of futex(2), by architecture.
_SYS_FUTEX = {
    "x86_64": 202, "amd64": 202, "i386": 240, "i686": 240,
    "aarch64": 98, "arm64": 98, "riscv64": 98, "loongarch64": 98,
    "ppc64le": 221, "ppc64": 221, "s390x": 238, "armv7l": 240,
}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_EAGAIN = 11
_EINTR = 4
_ETIMEDOUT = 110


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libatomic() -> ctypes.CDLL | None:
    names = ["libatomic.so.1"]
    found = ctypes.util.find_library("atomic")
    if found:
        names.append(found)
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_libatomic = _load_libatomic()
_thread_fence = None
if _libatomic is not None and hasattr(_libatomic, "atomic_thread_fence"):
    _thread_fence = _libatomic.atomic_thread_fence
    _thread_fence.argtypes = [ctypes.c_int]
    _thread_fence.restype = None

_SEQ_CST = 5  # memory_order_seq_cst
_fence_lock = threading.Lock()

FENCE_KIND: str
if _thread_fence is not None:
    FENCE_KIND = "libatomic"
elif IS_TSO:
    FENCE_KIND = "x86-locked-instruction"
else:
    FENCE_KIND = "unavailable"


def _fence_libatomic() -> None:
    _thread_fence(_SEQ_CST)  # type: ignore[misc]


def _fence_locked_instruction() -> None:
    # x86 only: LOCK-prefixed RMW instructions are full barriers (see module doc).
    _fence_lock.acquire()
    _fence_lock.release()


def _fence_unavailable() -> None:
    raise RuntimeError(
        f"no memory fence available on {_MACHINE}: install libatomic "
        "(Debian/Ubuntu: libatomic1) so that shared-memory queues are safe"
    )


def _noop() -> None:
    return None


if FENCE_KIND == "libatomic":
    full_fence = _fence_libatomic
elif FENCE_KIND == "x86-locked-instruction":
    full_fence = _fence_locked_instruction
else:
    full_fence = _fence_unavailable

release_fence = _noop if IS_TSO else full_fence
acquire_fence = _noop if IS_TSO else full_fence


def use_fence(kind: str) -> None:
    """Switch the fence implementation (tests use it to exercise every path)."""
    global full_fence, release_fence, acquire_fence, FENCE_KIND
    table = {
        "libatomic": _fence_libatomic if _thread_fence is not None else None,
        "x86-locked-instruction": _fence_locked_instruction if IS_TSO else None,
    }
    fence = table.get(kind)
    if fence is None:
        raise ValueError(f"fence kind {kind!r} is not available on {_MACHINE}")
    FENCE_KIND = kind
    full_fence = fence
    release_fence = _noop if IS_TSO else fence
    acquire_fence = _noop if IS_TSO else fence


def check_fences() -> None:
    """Raise a clear error when this platform cannot order shared memory."""
    if FENCE_KIND == "unavailable":
        _fence_unavailable()


# -- futex ------------------------------------------------------------------

_futex_nr = _SYS_FUTEX.get(_MACHINE) if sys.platform.startswith("linux") else None
_syscall = None
if _futex_nr is not None:
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _syscall = _libc.syscall
        _syscall.restype = ctypes.c_long
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _syscall = None

HAVE_FUTEX = _syscall is not None


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns on a wake-up, a changed word, a signal or the timeout: callers
    re-check their condition after every return.
    """
    if timeout_s <= 0:
        return
    if _syscall is None:
        time.sleep(min(timeout_s, 0.001))
        return
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    _syscall(_futex_nr, ctypes.c_void_p(addr), _FUTEX_WAIT,
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process and thread sleeping on the u32 at ``addr``."""
    if _syscall is None:
        return
    _syscall(_futex_nr, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)


def low_word_offset(offset: int) -> int:
    """Byte offset of the low 32 bits of the u64 at ``offset`` (the futex word)."""
    return offset if sys.byteorder == "little" else offset + 4


def cpu_relax() -> None:
    """Give the CPU to another runnable process while spinning."""
    os.sched_yield()
