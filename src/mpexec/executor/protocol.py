"""What the driver and a worker say to each other.

Ready pipe (worker -> driver, exactly one message)::

    Ready(rank, reply_handle)                 the worker is built; attach to its reply queue
    StartupFailed(rank, RemoteFailure)        it raised before READY (the cause travels along)

Broadcast queue (driver -> every worker), one ``Call`` per call::

    (call_id, method, args, kwargs, output_rank)
    (call_id, method, args, kwargs, output_rank, traceparent)   only when tracing

``method`` is a method name, or the bytes of a cloudpickled callable that
takes the worker as its first argument; ``output_rank`` None means every
worker replies.  ``call_id`` grows by exactly one per broadcast, starting at
1, so a worker always knows which call a message was even when the message
itself cannot be unpickled (it then answers that call with a failure).
``traceparent`` (a W3C carrier dict, or None) is the driver's span for the
call; an executor and its workers agree on the shape through
``ExecutorConfig.trace`` (see ``tracing``).

Reply queue (worker -> driver), one ``Reply`` per call this worker answers,
in call order::

    (call_id, True, result)            success
    (call_id, False, RemoteFailure)    the method (or decoding its arguments) raised

``Call`` and ``Reply`` are plain tuples on the wire on purpose: a NamedTuple
or dataclass pickles through ``copyreg`` in Python, 2.9 us against 0.4 us
for a tuple (measured), which would add a tenth to a 17 us round trip.  The
aliases below give them their names and types.

The conversation ends when the driver closes the broadcast queue or the death
pipe (or dies): the worker leaves its loop and exits.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from mpexec.errors import PeerDeathSymptom, WorkerError
from mpexec.ipc import Handle
from mpexec.outputs import KVOutputAggregator

Call = tuple[int, "str | bytes", tuple[Any, ...], dict[str, Any], "int | None"]
Reply = tuple[int, bool, Any]


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised in a worker, in a form that always pickles."""

    exc_type: str
    message: str
    traceback: str
    # cloudpickle of the exception itself, None when it could not be pickled
    pickled: bytes | None
    # the exception was a PeerDeathSymptom (known even when it did not pickle)
    peer_death_symptom: bool = False

    def exception(self) -> BaseException | None:
        """The original exception, when it survives the trip."""
        if self.pickled is None:
            return None
        try:
            exc = cloudpickle.loads(self.pickled)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None


@dataclass(frozen=True)
class Ready:
    """The worker is built and its reply queue exists."""

    rank: int
    reply_handle: Handle


@dataclass(frozen=True)
class StartupFailed:
    """The worker raised before it was ready."""

    rank: int
    failure: RemoteFailure


def qualified_type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def capture_failure(exc: BaseException, context: str = "") -> RemoteFailure:
    """Describe ``exc`` (call inside the ``except`` block that caught it)."""
    try:
        pickled: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    message = str(exc)
    return RemoteFailure(
        exc_type=qualified_type_name(exc),
        message=f"{context}: {message}" if context else message,
        traceback="".join(traceback.format_exception(exc)),
        pickled=pickled,
        peer_death_symptom=isinstance(exc, PeerDeathSymptom),
    )


def worker_error(rank: int, pid: int, method: str, failure: RemoteFailure) -> WorkerError:
    """The caller's view of a failure: typed, with the remote traceback and cause."""
    error = WorkerError(
        f"worker rank {rank} raised {failure.exc_type} in {method}: {failure.message}",
        rank=rank, pid=pid, method=method, exc_type=failure.exc_type,
        remote_traceback=failure.traceback, peer_death_symptom=failure.peer_death_symptom)
    error.__cause__ = failure.exception()
    return error


def decode_replies(method: str, replies: dict[int, Reply], single: bool,
                   pid_of: Callable[[int], int]) -> Any:
    """One call's replies as the caller gets them: one result (``single``) or a
    list in rank order; the first failure, in rank order, is raised instead.

    ``replies`` maps rank to reply in ascending rank order, the order in
    which the driver reads them.
    """
    for rank, (_, ok, payload) in replies.items():
        if not ok:
            if isinstance(payload, BaseException):  # made in the driver (undecodable reply)
                raise payload
            raise worker_error(rank, pid_of(rank), method, payload)
    if single:
        return next(iter(replies.values()))[2]
    return [reply[2] for reply in replies.values()]


def aggregate_replies(aggregator: KVOutputAggregator, output_rank: int,
                      pid_of: Callable[[int], int], method: str,
                      replies: dict[int, Reply]) -> Any:
    """Every worker's reply merged by the KV output aggregator."""
    return aggregator.aggregate(decode_replies(method, replies, False, pid_of), output_rank)
