"""Choosing how workers start: the start method, and when fork is unsafe.

``fork`` is the default because it is fast: the worker inherits everything
the driver imported.  It is unsafe in two cases, and each has its own way
out (``maybe_force_spawn``)::

    CUDA initialised here            -> spawn, always (a forked child would
                                        inherit a CUDA context it cannot use)
    other threads running here       -> forkserver: a server process started
                                        by exec (single-threaded, whatever
                                        runs here) with mpexec's worker
                                        modules preloaded forks each worker
    neither                          -> fork

Why not fork with threads: a lock another thread holds at the moment of the
fork (inside libzmq, OpenMP, a logging handler) stays held forever in the
child.  The fork server never has those threads, so forking *it* is safe,
and it starts once per driver process: later workers and later executors
cost a fork, not an interpreter start and mpexec's imports.  When the driver
has imported torch, the server imports it too (a worker would import it
anyway; for a model worker that import is most of its start).  That is safe
to fork from: importing torch initialises no CUDA and starts no thread pool
of torch's own; the one thread it brings is OpenBLAS's (through numpy),
which shuts its pool down in a ``pthread_atfork`` handler before each fork -
the same reason PyTorch's DataLoader may fork after ``import torch``.  The
worker's own module is never preloaded: it is the user's code, and may
start threads at import.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import sys
import threading
from multiprocessing.process import BaseProcess
from typing import Any, cast

logger = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")


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


# What the fork server imports once, so that a worker forked from it starts
# with the worker entry point (and the queues, the executor's protocol)
# already loaded.  None of these starts a thread at import.
FORKSERVER_PRELOAD = ("mpexec.executor.worker_proc",)

_told_forkserver = False


def maybe_force_spawn(method: str) -> str:
    """The start method to use for ``method``: ``"fork"`` only where it is safe.

    ``"fork"`` becomes ``"spawn"`` once this process has initialised CUDA,
    and ``"forkserver"`` while other threads run (see the module docstring);
    other methods are returned as they are.  Whenever the answer is
    ``"forkserver"``, ``prepare_forkserver`` has been applied.  The switch
    to spawn is logged at WARNING; the one to the fork server, which costs
    little, once at INFO and then at DEBUG.
    """
    global _told_forkserver
    if method == "forkserver":
        prepare_forkserver()
    if method != "fork":
        return method
    if _cuda_initialised():
        logger.warning("Using start method 'spawn' instead of 'fork': CUDA is already "
                       "initialised in this process.")
        return "spawn"
    threads = running_thread_count()
    if threads <= 1 or "forkserver" not in multiprocessing.get_all_start_methods():
        if threads > 1:
            logger.warning("Using start method 'spawn' instead of 'fork': %s.",
                           _threads_running(threads))
            return "spawn"
        return method
    prepare_forkserver()
    level = logging.DEBUG if _told_forkserver else logging.INFO
    _told_forkserver = True
    logger.log(level, "Using start method 'forkserver' instead of 'fork': %s.",
               _threads_running(threads))
    return "forkserver"


def prepare_forkserver() -> None:
    """Preload ``FORKSERVER_PRELOAD`` (and torch, if imported here) in the fork
    server, if it has not started yet.

    ``multiprocessing`` starts the server on the first forkserver start;
    the preload list only counts until then.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        torch = ["torch"] if "torch" in sys.modules else []
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            # __main__ first: multiprocessing's own default
            ["__main__", *FORKSERVER_PRELOAD, *torch])


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a half-imported or stubbed torch: no CUDA to worry about
        return False


def _threads_running(threads: int) -> str:
    names = ", ".join(t.name for t in threading.enumerate())
    return f"{threads} threads are running (Python threads: {names})"


def running_thread_count() -> int:
    """Threads of this process, native ones included where the OS tells."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serialize_exit_status(proc: BaseProcess) -> None:
    """Make reading ``proc``'s exit status safe from several threads at once.

    A process started by the fork server is not this process's child: its
    exit status comes as four bytes on a pipe from the server, and
    ``multiprocessing`` reads them in ``Popen.poll`` with no lock.  Two
    threads that poll at the moment of death (the death monitor, a caller's
    ``is_alive``, ``Process.start``'s sweep of finished children) both see
    the pipe readable; one reads the status, the other reads EOF and records
    255, which may overwrite the real status ("exit code 255" for a worker
    killed by SIGKILL).  Here the started process's ``poll`` runs under a
    lock, so the second caller finds the status the first one read.  Fork
    and spawn ``poll`` with ``waitpid``, which is safe already; they get the
    same lock, which costs nothing measurable.
    """
    popen: Any = getattr(proc, "_popen", None)
    if popen is None:
        return
    unlocked = popen.poll
    lock = threading.Lock()

    def poll(flag: int = os.WNOHANG) -> int | None:
        if flag != os.WNOHANG:
            # A blocking poll waits for the exit outside the lock, so that
            # other threads' non-blocking polls are never held up by it.
            multiprocessing.connection.wait([popen.sentinel])
        with lock:
            return cast("int | None", unlocked(flag))

    popen.poll = poll

