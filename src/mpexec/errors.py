"""The error types that mpexec callers catch.

Every error raised on purpose by mpexec derives from :class:`MpexecError`, so
``except MpexecError`` catches all of them.  Each also derives from the builtin
that describes it best (``RuntimeError``, ``ValueError``), so code written
against a plain executor keeps working.

=======================  ==========================================================
error                    raised when
=======================  ==========================================================
QueueClosedError         a MessageQueue was shut down (locally, or by the writer)
UndecodableMessageError  a message arrived whole but could not be unpickled
PeerDiedError            the process at the other end of a MessageQueue died
WorkerError              a worker raised inside a method called on it
WorkerDiedError          a worker process died; every pending and later call
WorkerStalledError       a worker stopped answering (stopped by a signal, or its
                         heartbeat silent): a WorkerDiedError, it was ended
WorkerStartupError       a worker failed before it reported READY
CollectiveFailedError    (inside a worker) a process group's collective failed,
                         most often because a peer of the group is gone
DataParallelGroupError   (inside a worker) the data parallel group that lives
                         outside the replica's world (``replica_restart``)
                         failed, timed out or did not form
StaleGroupError          (inside a worker) a collective on such a group whose
                         generation was retired or replaced
NodeVersionError         a follower node and its leader run different mpexec
                         versions (or node protocols); the follower is refused
NodeLayoutError          a follower node's nnodes or node rank does not fit its
                         leader's; the follower is refused
=======================  ==========================================================

``TimeoutError`` (the builtin) is raised when a call or a queue operation
passes its deadline.
"""

from __future__ import annotations

import signal


class MpexecError(Exception):
    """Base class of every error mpexec raises on purpose."""


class PeerDeathSymptom(MpexecError):
    """Marker base class: an error a worker may raise *because a peer died*.

    A collective whose peer exited (:class:`CollectiveFailedError`), a queue
    whose other end died (:class:`PeerDiedError`).  Such an error can reach
    the driver before the executor has declared the death behind it, so the
    driver waits, bounded, for that verdict before raising it (see
    ``mpexec.executor.verdict``).  A worker's error carries the mark across
    the process boundary as ``WorkerError.peer_death_symptom``.
    """


class QueueClosedError(MpexecError, RuntimeError):
    """The queue was shut down; nothing more can be sent or received on it.

    ``reader_rank`` is the reader that shut its end, when a writer learns of
    it from that reader (a remote reader's CLOSE); None otherwise.
    """

    reader_rank: int | None = None


class UndecodableMessageError(MpexecError, ValueError):
    """A queue reader consumed a message but could not unpickle it.

    The message is gone from the ring and the queue stays usable; the
    unpickling error is the ``__cause__``.
    """


class PeerDiedError(QueueClosedError, PeerDeathSymptom):
    """The writer (seen from a reader) or a reader (seen from the writer) died.

    ``pid`` is the process that died and ``role`` says which end it was
    (``"writer"`` or ``"reader <rank>"``, for people); ``reader_rank`` is that
    reader's rank among the queue's readers (None for the writer).
    """

    def __init__(self, message: str, *, pid: int, role: str,
                 reader_rank: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.role = role
        self.reader_rank = reader_rank

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_peer_died, (str(self), self.pid, self.role, self.reader_rank))


def _rebuild_peer_died(message: str, pid: int, role: str,
                       reader_rank: int | None = None) -> PeerDiedError:
    return PeerDiedError(message, pid=pid, role=role, reader_rank=reader_rank)


class WorkerError(MpexecError, RuntimeError):
    """A worker raised an exception inside a method the driver called.

    The remote exception is described by ``exc_type`` (its qualified type name)
    and ``remote_traceback`` (the formatted traceback, as text).  When the
    exception could be pickled it is also attached as ``__cause__``.
    ``peer_death_symptom`` is True when the remote exception was a
    :class:`PeerDeathSymptom`.  The executor stays usable after this error.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        pid: int,
        method: str,
        exc_type: str,
        remote_traceback: str,
        peer_death_symptom: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.method = method
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.peer_death_symptom = peer_death_symptom

    def __str__(self) -> str:
        base = super().__str__()
        if not self.remote_traceback:
            return base
        where = f"rank {self.rank}, pid {self.pid}"
        return f"{base}\n\nRemote traceback ({where}):\n{self.remote_traceback}"


class WorkerDiedError(MpexecError, RuntimeError):
    """A worker process died; the executor is failed from then on.

    ``exitcode`` is the process exit code as ``multiprocessing`` reports it:
    negative for a signal (``-9`` is SIGKILL), ``None`` when unknown.
    """

    def __init__(self, message: str, *, rank: int | None, pid: int | None,
                 exitcode: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` and the like when the worker was ended by a signal."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        return describe_signal(-self.exitcode)


class WorkerStalledError(WorkerDiedError):
    """A worker stopped answering: stopped by a signal (``SIGSTOP``, state ``T``
    in ``/proc``) or silent on its heartbeat (hung, or holding the GIL in one
    C call) past its bound.  The executor killed it and has failed, as for a
    death; ``seen`` says what was observed (``"stopped"`` or ``"silent"``).
    """

    def __init__(self, message: str, *, rank: int | None, pid: int | None,
                 seen: str) -> None:
        super().__init__(message, rank=rank, pid=pid, exitcode=None)
        self.seen = seen


def root_failure(errors: list[BaseException]) -> BaseException:
    """Of several ranks' failures in one call, the one that names the cause: a
    worker that died or froze (``WorkerDiedError``) before its peers' broken
    collectives; else the first."""
    return next((e for e in errors if isinstance(e, WorkerDiedError)), errors[0])


class WorkerStartupError(MpexecError, RuntimeError):
    """A worker failed during start-up, before it reported READY.

    ``remote_traceback`` holds the worker's traceback when it could send one.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        base = super().__str__()
        if not self.remote_traceback:
            return base
        return f"{base}\n\nWorker traceback (rank {self.rank}):\n{self.remote_traceback}"


class CollectiveFailedError(PeerDeathSymptom, RuntimeError):
    """A collective or point-to-point call of a process group failed.

    Raised inside a worker by ``mpexec.distributed`` when torch.distributed
    (gloo, NCCL) or a shared-memory channel of a group fails, usually because
    a peer of the group died or lost its connection.  The original exception
    is the ``__cause__`` and its message is part of this one.  A
    :class:`PeerDeathSymptom`: the driver sees it as a :class:`WorkerError`
    with ``peer_death_symptom`` set and waits for the executor's verdict on
    the death behind it (see ``mpexec.executor.verdict``).
    """


class DataParallelGroupError(MpexecError, RuntimeError):
    """The data parallel group of a replica that keeps its own world failed.

    With ``replica_restart`` each dense replica's TP and PP groups live in a
    world of its own and the DP group is a separate gloo group, rebuilt by
    generation whenever a replica is rebuilt (``mpexec.models.dp_world``).
    Raised inside a worker when that group's collective fails or passes its
    timeout (a peer replica died or froze) or when a new generation does not
    form.  Not a :class:`PeerDeathSymptom`: the peer belongs to another
    replica, whose own executor judges its health, so this replica's
    executor stays usable.
    """


class StaleGroupError(DataParallelGroupError):
    """A collective on a data parallel group generation that no longer holds.

    The group was retired (a replica of it failed) or replaced by a newer
    generation, or never formed: the message says which generation and why.
    ``generation`` is the stale one (``-1``: none formed yet).
    """

    def __init__(self, message: str, *, generation: int) -> None:
        super().__init__(message)
        self.generation = generation


class NodeVersionError(MpexecError, RuntimeError):
    """A follower node and its leader speak different versions of mpexec.

    Raised on the follower (which then exits non-zero) when the leader
    refuses its JOIN, or when the leader's CONFIG names another version; the
    message names both versions.  Run the same mpexec on every node.
    """


class NodeLayoutError(MpexecError, ValueError):
    """A follower node does not fit its leader's layout: another ``nnodes``, a
    node rank outside 1..nnodes-1, or a node rank another follower already
    joined as.

    Raised on the follower (``mpexec node`` exits 2) when the leader refuses
    its JOIN; the message names the leader's values and the follower's.  The
    leader logs the refusal and keeps waiting for a follower that fits.
    """


def describe_signal(signum: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers come back as ``"signal 99"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exitcode(exitcode: int | None) -> str:
    """A short human phrase for a ``multiprocessing`` exit code."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        return f"killed by {describe_signal(-exitcode)}"
    return f"exit code {exitcode}"
