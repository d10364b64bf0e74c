"""What the driver and a worker say to each other.

Ready pipe (worker -> driver, once)::

    {"status": "READY", "handle": <reply queue Handle>, "peer_response_handles": [...]}
    {"status": "FAILED", "rank": r, "exc_type": "...", "traceback": "..."}

Broadcast queue (driver -> every worker), one message per call::

    (call_id, method, args, kwargs, output_rank)

``method`` is a method name, or the bytes of a cloudpickled callable that
takes the worker as its first argument; ``output_rank`` None means every
worker replies.  Reply queue (worker -> driver), one message per call this
worker replies to, in call order::

    (call_id, True, result)            success
    (call_id, False, RemoteFailure)    the method raised

The conversation ends when the driver closes the death pipe (or dies): the
worker shuts its queues down, which wakes its blocked dequeue, and exits.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from mpexec.errors import WorkerError

READY_STR = "READY"
FAILED_STR = "FAILED"


@dataclass
class RemoteFailure:
    """An exception raised in a worker, in a form that always pickles."""

    exc_type: str
    message: str
    traceback: str
    # cloudpickle of the exception itself, None when it could not be pickled
    pickled: bytes | None

    def exception(self) -> BaseException | None:
        """The original exception, when it survives the trip."""
        if self.pickled is None:
            return None
        try:
            exc = cloudpickle.loads(self.pickled)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None


def qualified_type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def capture_failure(exc: BaseException) -> RemoteFailure:
    """Describe ``exc`` (call inside the ``except`` block that caught it)."""
    try:
        pickled: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    return RemoteFailure(
        exc_type=qualified_type_name(exc),
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        pickled=pickled,
    )


def worker_error(rank: int, pid: int, method: str, failure: RemoteFailure) -> WorkerError:
    """The caller's view of a failure: typed, with the remote traceback and cause."""
    error = WorkerError(
        f"worker rank {rank} raised {failure.exc_type} in {method}: {failure.message}",
        rank=rank, pid=pid, method=method, exc_type=failure.exc_type,
        remote_traceback=failure.traceback)
    error.__cause__ = failure.exception()
    return error


def decode_replies(method: str, single: bool, replies: dict[int, tuple[int, bool, Any]],
                   pid_of: Callable[[int], int]) -> Any:
    """One call's replies as the caller gets them: one result (``single``) or a
    list in rank order; the first failure, in rank order, is raised instead.

    ``replies`` maps rank to reply in ascending rank order, the order in
    which the driver reads them.
    """
    for rank, (_, ok, payload) in replies.items():
        if not ok:
            raise worker_error(rank, pid_of(rank), method, payload)
    if single:
        return next(iter(replies.values()))[2]
    return [reply[2] for reply in replies.values()]
