"""Waiting for started workers to be ready (driver side).

``wait_for_ready`` waits on every ready pipe *and* every worker's death
descriptor with one ``multiprocessing.connection.wait`` (poll-based, so any
descriptor number works), so a worker that dies without a word is noticed
as quickly as one that reports a failure.  Each worker sends exactly one
message: ``Ready`` (the handle of its reply queue, to which the driver then
attaches) or ``StartupFailed`` (its exception, type and traceback).  The
first failure becomes a ``WorkerStartupError``; the caller then tears down
everything started so far.

``handshake`` is the driver's half of the queue handshake (broadcast queue
first, then each reply queue in rank order: any other order deadlocks).
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from mpexec.errors import PeerDiedError, QueueClosedError, WorkerStartupError
from mpexec.executor.launcher import WorkerHandle
from mpexec.executor.protocol import Ready, StartupFailed
from mpexec.ipc import MessageQueue


def _died(handle: WorkerHandle, when: str) -> WorkerStartupError:
    handle.wait_exitcode()
    return WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.pid}) exited {when} ({handle.describe_exit()})",
        rank=handle.rank)


def _failed(handle: WorkerHandle, message: StartupFailed) -> WorkerStartupError:
    failure = message.failure
    error = WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.pid}) failed during start-up with "
        f"{failure.exc_type}: {failure.message}",
        rank=handle.rank, remote_traceback=failure.traceback)
    error.__cause__ = failure.exception()
    return error


def wait_for_ready(handles: list[WorkerHandle], deadline: float, timeout_s: float, *,
                   watch: Sequence[WorkerHandle] = (), tick: Callable[[], None] | None = None,
                   tick_s: float = 0.05) -> list[Ready]:
    """Every worker's ``Ready``, in local-rank order; ``WorkerStartupError`` otherwise.

    ``timeout_s`` is the configured start-up timeout, named in the error;
    ``deadline`` is when it runs out (the start itself used some of it).
    ``watch``: handles with no ready pipe (follower nodes) whose death also
    fails the start.  ``tick``, when given, runs at least every ``tick_s``
    while waiting (a follower keeps its heartbeat going); what it raises
    ends the wait.
    """
    pipes: dict[Connection, WorkerHandle] = {}
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
                    rank = getattr(lost, "failed_rank", None)
                    raise WorkerStartupError(
                        f"{lost.describe_exit()} (during start-up)",
                        rank=lost.rank if rank is None else rank,
                        remote_traceback=getattr(lost, "remote_traceback", ""))
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
                ready[handles.index(handle)] = message
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


def handshake(broadcast: MessageQueue, replies: list[MessageQueue], deadline: float,
              timeout_s: float, lost: Callable[[], str | None] | None = None,
              explain_closed: Callable[[QueueClosedError], WorkerStartupError | None]
              | None = None) -> None:
    """The driver's half of the queue handshake, bounded by ``deadline``.

    ``lost``, when given, says why the start cannot finish (a follower node
    is gone, a worker stalled) or None; it is asked every
    ``_HANDSHAKE_SLICE_S`` of waiting.  Every way the handshake can fail is a
    ``WorkerStartupError``: a queue shut down under it (a worker closed its
    end, or a monitor tore the executor down meanwhile) included, explained
    by ``explain_closed`` when it knows better (which worker died, and how).
    """
    # Ensure message queues are ready.  Will deadlock if re-ordered: each
    # worker waits on the broadcast queue before its reply queue, so we
    # must finish the broadcast handshake before waiting on any reply queue.
    try:
        for mq in (broadcast, *replies):
            _wait_until_ready(mq, deadline, lost)
    except PeerDiedError as exc:
        raise WorkerStartupError(f"a worker died during the queue handshake: {exc}") from exc
    except QueueClosedError as exc:
        error = None if explain_closed is None else explain_closed(exc)
        if error is None:
            error = WorkerStartupError(f"the queue handshake was cut short: {exc}",
                                       rank=exc.reader_rank)
        raise error from exc
    except TimeoutError as exc:
        raise WorkerStartupError(
            f"the queue handshake did not finish within {timeout_s:g}s "
            f"(startup_timeout_s): {exc}") from exc


# Longer than a remote reader's HELLO repeat (1 s), so that slicing the wait
# never keeps it from saying HELLO again.
_HANDSHAKE_SLICE_S = 1.5


def _wait_until_ready(mq: MessageQueue, deadline: float,
                      lost: Callable[[], str | None] | None) -> None:
    while True:
        now = time.monotonic()
        end = deadline if lost is None else min(deadline, now + _HANDSHAKE_SLICE_S)
        try:
            mq.wait_until_ready(max(0.0, end - now))
            return
        except TimeoutError:
            if lost is None or time.monotonic() >= deadline:
                raise
            why = lost()
            if why is not None:
                raise WorkerStartupError(why) from None
