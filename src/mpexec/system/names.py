"""A worker's name, shown as its process title and in front of its output."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

logger = logging.getLogger(__name__)

# Linux keeps 16 bytes for a thread name, the last one a NUL.
_TASK_COMM_LEN = 15
_PR_SET_NAME = 15


def worker_process_name(
    *,
    dp: tuple[int, int],
    pp: tuple[int, int],
    pcp: tuple[int, int],
    tp: tuple[int, int],
    dcp: tuple[int, int],
    ep: tuple[int, int] | None,
) -> str:
    """``Worker`` plus one ``_<DIM><rank>`` per parallel dimension in use.

    Each argument is ``(rank, size)``.  A dimension appears only when its size
    is above one, in the order DP, PP, PCP, TP, DCP; EP appears whenever it is
    given (expert parallelism enabled).  ``Worker_DP0_PP2_TP3`` is rank 0 of
    data parallel, stage 2 of the pipeline and shard 3 of tensor parallel.
    """
    name = "Worker"
    for label, (rank, size) in (("DP", dp), ("PP", pp), ("PCP", pcp), ("TP", tp), ("DCP", dcp)):
        if size > 1:
            name += f"_{label}{rank}"
    if ep is not None:
        name += f"_EP{ep[0]}"
    return name


def set_process_title(name: str, prefix: str = "mpexec") -> None:
    """Show ``prefix::name`` as this process's title in ``ps`` and ``top``.

    Uses ``setproctitle`` (the full title, in ``ps -f`` too); where it could
    not change the command line (see below) the argument area is rewritten
    directly, as long as it fits.  The Linux thread name is set too
    (``prctl(PR_SET_NAME)``, truncated to 15 bytes).  Never raises: a
    missing title is not worth failing a worker for.
    """
    title = f"{prefix}::{name}" if prefix else name
    try:
        import setproctitle  # optional

        setproctitle.setproctitle(title)
    except Exception:
        pass
    try:
        # setproctitle finds the command line's memory through the original
        # environment; a process whose environment changed before its first
        # call (a fork server's child, a driver that set a variable before
        # forking) keeps its old command line.  Then the area the kernel
        # shows is rewritten directly.
        if sys.platform.startswith("linux") and _cmdline_title() != title:
            _rewrite_cmdline(title)
    except Exception as exc:
        logger.debug("Could not rewrite the command line for %r: %s", title, exc)
    try:
        _prctl_set_name(title)
    except Exception as exc:
        logger.debug("Could not set process title %r: %s", title, exc)


def _cmdline_title() -> str:
    with open("/proc/self/cmdline", "rb") as f:
        return f.read().split(b"\0", 1)[0].decode(errors="replace")


def _rewrite_cmdline(title: str) -> None:
    """Write ``title`` over this process's argument area (its bounds are
    fields 48 and 49 of ``/proc/self/stat``), NUL-padded, truncated to fit."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[48 - 3]), int(fields[49 - 3])  # fields[0] is field 3
    size = end - start
    if start <= 0 or size <= 1:
        return
    raw = title.encode("utf-8", "replace")[:size - 1]
    ctypes.memmove(start, raw + b"\0" * (size - len(raw)), size)


def _prctl_set_name(title: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    raw = title.encode("utf-8", "replace")[:_TASK_COMM_LEN]
    if libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class PrefixedStream:
    """A text stream that starts every line written through it with a prefix.

    Writes may split a line anywhere (``print(..., end="")``, a traceback
    written piecewise): the prefix goes in only where a line really starts.
    A lock keeps the line-start state consistent between threads.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self._at_line_start = True
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            pieces = []
            for line in text.splitlines(keepends=True):
                if self._at_line_start:
                    pieces.append(self.prefix)
                pieces.append(line)
                self._at_line_start = line.endswith(("\n", "\r"))
            self.stream.write("".join(pieces))
        return len(text)

    def writelines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        # fileno, isatty, encoding, buffer, ...: whatever the wrapped stream has.
        return getattr(self.stream, name)


def decorate_logs(prefix: str) -> None:
    """Start every line this process prints or logs with ``(prefix pid=N) ``.

    Wraps ``sys.stdout`` and ``sys.stderr`` in a :class:`PrefixedStream` and
    points the logging handlers that wrote to the bare streams at the
    wrapped ones, so both ``print`` and ``logging`` output are prefixed once.
    Calling it again replaces the prefix (and picks up a new pid after fork)
    rather than prefixing twice.
    """
    full = f"({prefix} pid={os.getpid()}) "
    for attr in ("stdout", "stderr"):
        current = getattr(sys, attr)
        if current is None:  # pythonw, or closed by the embedding program
            continue
        if isinstance(current, PrefixedStream):
            current.prefix = full
            continue
        wrapped = PrefixedStream(current, full)
        setattr(sys, attr, wrapped)
        _repoint_log_handlers(current, wrapped)


def _fresh_locks_after_fork() -> None:
    # A thread of the parent may have held a stream's lock at fork time; in
    # the child that thread does not exist and the lock would never be freed.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, PrefixedStream):
            stream._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)


def _repoint_log_handlers(old: TextIO, new: PrefixedStream) -> None:
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(new)
