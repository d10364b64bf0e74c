"""Waiting for started workers to be ready (driver side).

``wait_for_ready`` waits on every ready pipe *and* every worker's death
descriptor with one ``multiprocessing.connection.wait`` (poll-based, so any
descriptor number works), so a worker that dies without a word is noticed
as quickly as one that reports a failure.  Each worker sends exactly one
message: ``Ready`` (the handle of its reply queue, to which the driver then
attaches) or ``StartupFailed`` (its exception, type and traceback).  The
first failure becomes a ``WorkerStartupError``; the caller then tears down
everything started so far.
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from mpexec.errors import WorkerStartupError
from mpexec.executor.launcher import WatchedWorker
from mpexec.executor.local.launcher import LocalWorkerHandle
from mpexec.executor.protocol import Ready, StartupFailed


def _died(handle: LocalWorkerHandle, when: str) -> WorkerStartupError:
    exit = handle.describe_exit()
    return WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.pid}) exited {when} ({exit.how})",
        rank=handle.rank)


def _failed(handle: LocalWorkerHandle, message: StartupFailed) -> WorkerStartupError:
    failure = message.failure
    error = WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.pid}) failed during start-up with "
        f"{failure.exc_type}: {failure.message}",
        rank=handle.rank, remote_traceback=failure.traceback)
    error.__cause__ = failure.exception()
    return error


def wait_for_ready(handles: Sequence[LocalWorkerHandle], deadline: float, timeout_s: float,
                   *, watch: Sequence[WatchedWorker] = (), tick: Callable[[], None] | None = None,
                   tick_s: float = 0.05) -> list[Ready]:
    """Every worker's ``Ready``, in local-rank order; ``WorkerStartupError`` otherwise.

    ``timeout_s`` is the configured start-up timeout, named in the error;
    ``deadline`` is when it runs out (the start itself used some of it).
    ``watch``: handles with no ready pipe (follower nodes) whose death also
    fails the start.  ``tick``, when given, runs at least every ``tick_s``
    while waiting (a follower keeps its heartbeat going); what it raises
    ends the wait.
    """
    pipes: dict[Connection, LocalWorkerHandle] = {}
    for h in handles:
        assert h.ready_conn is not None
        pipes[h.ready_conn] = h
    deaths = {h.death_fd: h for h in handles}
    watched = {h.death_fd: h for h in watch}
    ready: list[Ready | None] = [None] * len(handles)
    try:
        while pipes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = ", ".join(str(h.rank) for h in pipes.values())
                raise WorkerStartupError(
                    f"worker rank(s) {late} did not report READY within {timeout_s:g}s "
                    "(startup_timeout_s)")
            if tick is not None:
                tick()
                remaining = min(remaining, tick_s)
            signalled = multiprocessing.connection.wait([*pipes, *deaths, *watched], remaining)
            for obj in signalled:
                lost = watched.get(obj) if isinstance(obj, int) else None
                if lost is not None:
                    exit = lost.describe_exit()
                    raise WorkerStartupError(f"{exit.sentence()} (during start-up)",
                                             rank=exit.rank,
                                             remote_traceback=exit.remote_traceback)
            # Pipes first: a worker that reported a failure and exited shows
            # up on both, and its message is the better explanation.
            for obj in signalled:
                handle = pipes.pop(obj, None) if isinstance(obj, Connection) else None
                if handle is None:
                    continue
                try:
                    message = handle.ready_conn.recv() if handle.ready_conn else None
                except EOFError:
                    raise _died(handle, "during start-up") from None
                finally:
                    handle.close_ready()
                if isinstance(message, StartupFailed):
                    raise _failed(handle, message)
                if not isinstance(message, Ready):
                    raise WorkerStartupError(
                        f"worker rank {handle.rank} sent {type(message).__name__} instead "
                        "of Ready", rank=handle.rank)
                ready[list(handles).index(handle)] = message
            for obj in signalled:
                handle = deaths.get(obj) if isinstance(obj, int) else None
                conn = None if handle is None else handle.ready_conn
                if handle is not None and not (conn is not None and conn in pipes
                                               and conn.poll()):
                    raise _died(handle, "during start-up")
    finally:
        for handle in handles:
            handle.close_ready()
    return [r for r in ready if r is not None]
