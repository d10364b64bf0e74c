"""A large ``bytes`` object made in memory that faults in 2 MiB at a time.

Unpickling a 64 MiB ``bytes`` allocates it with ``malloc``: fresh anonymous
memory whose 16,384 pages each take a page fault on first write, which costs
several times the copy itself (and most of a reader's time on a large
``bytes`` payload).  :func:`bytes_from` instead makes the object empty
(``PyBytes_FromStringAndSize(NULL, n)``, the C API's way to build a
``bytes`` in place), asks for transparent huge pages on the 2 MiB-aligned
part of it (``madvise(MADV_HUGEPAGE)``: 32 faults instead of 16,384 where the
kernel's THP setting is ``madvise`` or ``always``), then copies into it once.
Nobody else sees the object before it is full, which is what makes writing
into a ``bytes`` legitimate.  Where any of this is unavailable, it is just
``bytes(view)``.
"""

from __future__ import annotations

import ctypes

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

try:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    _bytes_address = ctypes.pythonapi.PyBytes_AsString
    _bytes_address.restype = ctypes.c_void_p
    _bytes_address.argtypes = [ctypes.py_object]
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.restype = ctypes.c_int
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    AVAILABLE = True
except (AttributeError, OSError):  # pragma: no cover - not CPython, or no libc
    AVAILABLE = False


def bytes_from(view: memoryview) -> bytes:
    """``bytes(view)``, with the destination in huge pages where possible."""
    size = view.nbytes
    if not AVAILABLE or size < 2 * _HUGE or view.readonly or not view.c_contiguous:
        return bytes(view)
    out: bytes = _new_bytes(None, size)
    address = _bytes_address(out)
    start = (address + _HUGE - 1) // _HUGE * _HUGE
    end = (address + size) // _HUGE * _HUGE
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)   # a hint: failure only costs speed
    source = ctypes.addressof(ctypes.c_char.from_buffer(view))
    ctypes.memmove(address, source, size)
    return out
