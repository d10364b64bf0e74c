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
  architecture) or refused (``ENOSYS``/``EPERM``: a seccomp filter, as some
  container runtimes install) waiting degrades to timed sleeps of at most
  ``FALLBACK_SLEEP_S``: once refused, the syscall is never tried again, and
  one WARNING says so.  Every other errno of ``FUTEX_WAIT`` (``EAGAIN``: the
  word already changed; ``EINTR``; ``ETIMEDOUT``) is an ordinary return, since
  callers re-check their condition anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
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

HAVE_FUTEX = _syscall is not None   # the syscall exists (it may still be refused)

# Longest sleep of a waiter once futexes are unavailable: the wake-up latency
# an idle queue pays then, and a rate of ~1,000 wake-ups/s, not a spin.
FALLBACK_SLEEP_S = 0.001
_REFUSED = (errno.ENOSYS, errno.EPERM)
_futex_refused: str | None = None if _syscall is not None else "no futex syscall here"


def futex_available() -> bool:
    """False once futexes are unknown or were refused (waits are timed sleeps)."""
    return _futex_refused is None


def _refuse(reason: str) -> None:
    global _futex_refused
    if _futex_refused is None:
        _futex_refused = reason
        logger.warning("futex %s; shared-memory waits fall back to sleeps of %.0f ms "
                       "(idle readers wake up to %.0f times a second, and a wake-up takes "
                       "up to that long)", reason, FALLBACK_SLEEP_S * 1e3, 1 / FALLBACK_SLEEP_S)


def _check_result(result: int, op: str) -> None:
    if result != -1:
        return
    err = ctypes.get_errno()
    if err in _REFUSED:
        _refuse(f"{op} was refused ({errno.errorcode.get(err, err)}: {os.strerror(err)}), "
                "probably by a seccomp filter")


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns on a wake-up, a changed word, a signal or the timeout: callers
    re-check their condition after every return.
    """
    if timeout_s <= 0:
        return
    if _futex_refused is not None:
        time.sleep(min(timeout_s, FALLBACK_SLEEP_S))
        return
    assert _syscall is not None
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    result = _syscall(_futex_nr, ctypes.c_void_p(addr), _FUTEX_WAIT,
                      ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)
    _check_result(result, "FUTEX_WAIT")
    if _futex_refused is not None:  # refused just now: this wait still sleeps
        time.sleep(min(timeout_s, FALLBACK_SLEEP_S))


def futex_wake(addr: int) -> None:
    """Wake every process and thread sleeping on the u32 at ``addr``."""
    if _futex_refused is not None:
        return
    assert _syscall is not None
    result = _syscall(_futex_nr, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)
    _check_result(result, "FUTEX_WAKE")


def low_word_offset(offset: int) -> int:
    """Byte offset of the low 32 bits of the u64 at ``offset`` (the futex word)."""
    return offset if sys.byteorder == "little" else offset + 4


def cpu_relax() -> None:
    """Give the CPU to another runnable process while spinning."""
    os.sched_yield()
