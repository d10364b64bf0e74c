"""Which errors of a call may hide a worker's death, and the wait for the verdict.

A worker that raises because its *peer* died reaches the driver before the
executor has declared that death (the monitor's pidfd poll on one node, the
node channel's heartbeat across nodes).  Raising the worker's error then
would hide the real cause, so for those errors, and only those, the caller
waits - bounded - for the executor's verdict::

    error out of a call                         what the caller raises
    -----------------------------------------   -------------------------------------
    WorkerDiedError                             it, at once
    WorkerError with peer_death_symptom: the    wait up to death_verdict_s(config)
      worker raised a PeerDeathSymptom (a       for the executor to fail: failed ->
      CollectiveFailedError such as             its first failure, the
      PeerDiedInCollectiveError, or a queue's   WorkerDiedError naming the rank
      PeerDiedError)                            that died; else the WorkerError
    any other WorkerError (ValueError, ...)     it, at once
    QueueClosedError (the executor is shut      it, or the executor's WorkerDiedError
      down: the executor already decided)       if it has failed; no wait

A queue closing under a call is the executor's own business: ``_closed_error``
(``driver``) waits, as long as the worker's handle says its death may trail
its queues (``death_lag_s``: the node timeout for a follower node or an
actor on another Ray node), so the caller gets ``WorkerDiedError`` naming
the node.

``Executor.death_verdict_s`` (``death_verdict_s(config)`` unless a backend
knows better): half a second on one node (both the monitor and the
shared-memory collectives see a death through pidfds at once); across nodes
``node_timeout_s`` plus two heartbeats (the node channel's verdict), and the
same for a RayExecutor whose actors span Ray nodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

from mpexec.config import ExecutorConfig
from mpexec.errors import QueueClosedError, WorkerDiedError, WorkerError


class Verdicts(Protocol):
    """What :func:`death_behind` asks of an executor (``abstract.Executor``)."""

    @property
    def is_failed(self) -> bool: ...

    @property
    def failure(self) -> BaseException | None: ...

    @property
    def death_verdict_s(self) -> float: ...


# How long a collective's failure may precede the executor's verdict on one node.
ONE_NODE_VERDICT_S = 0.5
_POLL_S = 0.02


class _Handle(Protocol):
    def is_alive(self) -> bool: ...


H = TypeVar("H", bound=_Handle)


def first_gone(handles: Sequence[H], wait_s: float) -> H | None:
    """The first of ``handles`` found gone within ``wait_s``, or None."""
    deadline = time.monotonic() + wait_s
    while True:
        for handle in handles:
            if not handle.is_alive():
                return handle
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def closing_rank(exc: QueueClosedError, start_rank: int) -> int | None:
    """The global rank whose end of a queue closed, when ``exc`` says
    (``reader_rank``: a local reader that died, a ``PeerDiedError``, or a
    remote reader's CLOSE); else None."""
    if exc.reader_rank is not None:
        return start_rank + exc.reader_rank
    return None


def may_follow_a_death(exc: BaseException) -> bool:
    """True for a worker error that a peer's death can cause (see the table)."""
    return isinstance(exc, WorkerError) and exc.peer_death_symptom


def death_verdict_s(config: ExecutorConfig) -> float:
    """The longest a death may stay undeclared after a symptom of it."""
    if config.parallel.nnodes_within_dp > 1:
        return config.node_timeout_s + 2 * config.node_heartbeat_s
    return ONE_NODE_VERDICT_S


def death_behind(executor: Verdicts, exc: BaseException) -> WorkerDiedError | None:
    """The executor's ``WorkerDiedError`` if a death lies behind ``exc``, else None
    (``exc`` itself a WorkerDiedError: None, raise it as it is).

    Waits (up to ``executor.death_verdict_s``) only for a worker error marked
    ``peer_death_symptom``.  The verdict is the executor's first failure, as
    its death watch recorded it.
    """
    if may_follow_a_death(exc):
        deadline = time.monotonic() + executor.death_verdict_s
        while not executor.is_failed and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    elif not isinstance(exc, QueueClosedError):
        return None
    if not executor.is_failed:
        return None
    failure = executor.failure
    return failure if isinstance(failure, WorkerDiedError) else None


__all__ = ["closing_rank", "death_behind", "death_verdict_s", "first_gone",
           "may_follow_a_death"]
