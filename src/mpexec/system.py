"""Process plumbing shared by the driver and its workers.

Nothing here knows about executors or queues; these are the small,
operating-system-facing steps that every worker start goes through:

* choosing the start method (``get_mp_context``, ``maybe_force_spawn``);
* naming a worker (``worker_process_name``), showing that name in ``ps``
  (``set_process_title``) and in front of everything it prints
  (``decorate_logs``);
* shaping the environment a worker starts with (``set_worker_thread_env``,
  ``worker_thread_env``);
* tidying what a forked child inherited (``close_inherited_fds``) and pinning
  it to CPUs (``apply_cpu_affinity``).

This module never imports torch.  Where torch matters (CUDA already
initialised, the intra-op thread count) it looks at ``sys.modules`` and only
acts when the caller's process has imported torch already.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

logger = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# Linux keeps 16 bytes for a thread name, the last one a NUL.
_TASK_COMM_LEN = 15
_PR_SET_NAME = 15


# --------------------------------------------------------------------------
# start method


def get_mp_context(method: str | None = None) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context for ``method`` (``"spawn"`` when None).

    Raises ``ValueError`` for a name other than spawn, fork or forkserver, and
    for a method this platform does not offer.
    """
    method = method or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {', '.join(START_METHODS)}; got {method!r}")
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start method {method!r} is not available on this platform")
    return multiprocessing.get_context(method)


def maybe_force_spawn(method: str) -> str:
    """Return ``"spawn"`` where ``"fork"`` would be unsafe, else ``method``.

    Forking is unsafe once this process has initialised CUDA (the child
    inherits a CUDA context it cannot use) or runs more than one thread (a
    lock held by another thread at fork time stays locked in the child
    forever).  The reason is logged at WARNING.
    """
    if method != "fork":
        return method
    reason = _fork_hazard()
    if reason is None:
        return method
    logger.warning("Using start method 'spawn' instead of 'fork': %s.", reason)
    return "spawn"


def _fork_hazard() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            cuda_ready = bool(torch.cuda.is_initialized())
        except Exception:  # a half-imported or stubbed torch: no CUDA to worry about
            cuda_ready = False
        if cuda_ready:
            return "CUDA is already initialised in this process"
    threads = running_thread_count()
    if threads > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        return f"{threads} threads are running (Python threads: {names})"
    return None


def running_thread_count() -> int:
    """Threads of this process, native ones included where the OS tells."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# --------------------------------------------------------------------------
# names, titles and log prefixes


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

    Uses ``setproctitle`` when it is installed (the full title, in ``ps -f``
    too); otherwise sets the Linux thread name with ``prctl(PR_SET_NAME)``,
    which the kernel truncates to 15 bytes.  Never raises: a missing title is
    not worth failing a worker for.
    """
    title = f"{prefix}::{name}" if prefix else name
    try:
        import setproctitle  # optional

        setproctitle.setproctitle(title)
        return
    except Exception:
        pass
    try:
        _prctl_set_name(title)
    except Exception as exc:
        logger.debug("Could not set process title %r: %s", title, exc)


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


# --------------------------------------------------------------------------
# thread-count environment

_warned_thread_reduction = False


def _thread_vars(num_threads: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables to add to ``environ`` for a worker.

    ``None`` means an accelerator worker (one thread: the device does the
    work); an integer is a CPU worker's own share of the cores.  Variables the
    user set are never overridden: ``OMP_NUM_THREADS`` in the environment
    means the user is tuning, and nothing is added.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1; got {num_threads}")
    if "OMP_NUM_THREADS" in environ:
        return {}
    value = str(1 if num_threads is None else num_threads)
    return {var: value for var in THREAD_ENV_VARS if var not in environ}


def set_worker_thread_env(num_threads: int | None) -> None:
    """Set this process's thread-count environment for the workers it starts.

    Called once in the driver, before any worker starts, so that every worker
    inherits it.  ``None`` is for accelerator workers: when the user has not
    set ``OMP_NUM_THREADS``, it and ``MKL_NUM_THREADS`` become 1 (a WARNING
    says so, once per process), and if torch is already imported its thread
    pool shrinks to match (forked workers inherit that pool size).  An integer
    is for CPU workers that share the machine equally; for a different count
    per worker use :func:`worker_thread_env` around each start.
    """
    global _warned_thread_reduction
    updates = _thread_vars(num_threads, os.environ)
    if not updates:
        return
    torch = sys.modules.get("torch")
    if num_threads is None:
        current = torch.get_num_threads() if torch is not None else (os.cpu_count() or 1)
        if current > 1 and not _warned_thread_reduction:
            _warned_thread_reduction = True
            logger.warning(
                "Reducing parallelism from %d threads to 1 per worker to avoid CPU "
                "contention between workers; set OMP_NUM_THREADS to tune.",
                current,
            )
    os.environ.update(updates)
    if torch is not None and "OMP_NUM_THREADS" in updates:
        torch.set_num_threads(int(updates["OMP_NUM_THREADS"]))


@contextlib.contextmanager
def worker_thread_env(num_threads: int | None) -> Iterator[dict[str, str]]:
    """Hold one worker's thread-count variables in ``os.environ`` for a start.

    A started process copies the environment at start time, so wrapping one
    ``Process.start()`` gives that worker its own count (CPU workers with
    unequal shares) while the driver's environment is restored afterwards.
    Yields the variables it set (empty when the user set ``OMP_NUM_THREADS``).
    """
    updates = _thread_vars(num_threads, os.environ)
    os.environ.update(updates)
    try:
        yield updates
    finally:
        for var in updates:
            os.environ.pop(var, None)


# --------------------------------------------------------------------------
# descriptors and CPUs


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or only its zombie left."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in {"Z", "X"}


def close_inherited_fds(fds: Sequence[int]) -> None:
    """Close descriptors a forked worker inherited but must not hold.

    A forked child holds copies of its siblings' pipe ends; while it does,
    the driver's end never sees EOF.  An already closed descriptor (EBADF) is
    fine; any other error is logged at WARNING and the rest are still closed.
    """
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                logger.warning("Could not close inherited descriptor %d: %s", fd, exc)


def apply_cpu_affinity(cpus: Sequence[int] | None) -> None:
    """Pin this process to ``cpus`` (no change when None).

    Raises ``ValueError`` naming the CPUs that do not exist on this machine,
    or when the set is empty or not allowed to this process (cgroup cpuset).
    """
    if cpus is None:
        return
    wanted = set(cpus)
    if not wanted:
        raise ValueError("cpu affinity needs at least one CPU; got an empty list")
    known = online_cpus()
    missing = sorted(c for c in wanted if c not in known)
    if missing:
        raise ValueError(
            f"CPU(s) {missing} do not exist on this machine; online CPUs: {_ranges(known)}"
        )
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU affinity is not supported on %s; ignoring %s", sys.platform, cpus)
        return
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        raise ValueError(f"cannot pin to CPUs {sorted(wanted)}: {exc.strerror}") from exc


def online_cpus() -> set[int]:
    """CPU numbers the kernel has online (all of ``os.cpu_count()`` elsewhere)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return _parse_ranges(f.read())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def _parse_ranges(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _ranges(cpus: set[int]) -> str:
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and spans[-1][1] == cpu - 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)
