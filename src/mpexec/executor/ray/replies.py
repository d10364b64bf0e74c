"""The reply reader of RayExecutor's "ray" call path: Ray object refs in call order.

``submit`` sends one call to every actor (``actor.execute.remote``; the call
``ray.put`` once when there are several actors) and keeps, per rank, the
refs of the replies the call order will read.  ``read_reply`` is
``ReplyRouter``'s reading side for ``CallOrder``: the oldest ref of a rank,
``ray.get`` in slices so that a failed or closed executor is noticed, a
timeout as ``TimeoutError``, a dead actor as the executor's closed error
(``WorkerDiedError``), a result Ray could not send as that call's failure.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from mpexec.errors import QueueClosedError
from mpexec.executor.lifecycle import Lifecycle, State
from mpexec.executor.protocol import Reply, capture_failure


class RayOwner(Protocol):
    """What the reply reader needs of ``ray.RayExecutor``."""

    lifecycle: Lifecycle

    def _closed_error(self, rank: int, exc: QueueClosedError) -> Exception: ...


class ActorHandle(Protocol):
    """A worker's handle as the reply reader sees it (``ray.RayWorkerHandle``)."""

    actor: Any

_READ_SLICE_S = 0.1    # a reader rechecks the executor's state this often


class RayReplies:
    """The reply reader of the "ray" path: each rank's refs, in call order."""

    def __init__(self, executor: RayOwner) -> None:
        # The lifecycle holds this reader: a weak reference back keeps the
        # executor collectable.
        self_ref = weakref.ref(executor)

        def closed_error(rank: int, exc: QueueClosedError) -> Exception:
            owner = self_ref()
            return exc if owner is None else owner._closed_error(rank, exc)

        self._closed_error = closed_error
        self._life = executor.lifecycle
        self.ray: Any = None
        self._actors: list[Any] = []
        self._refs: list[deque[Any]] = []

    def attach(self, ray: Any, handles: Sequence[ActorHandle]) -> None:
        self.ray = ray
        self._actors = [h.actor for h in handles]
        self._refs = [deque() for _ in handles]

    def submit(self, message: tuple[Any, ...]) -> None:
        call_id, output_rank = message[0], message[4]
        # One copy in the object store for every actor, not one per actor.
        payload = self.ray.put(message) if len(self._actors) > 1 else message
        for rank, actor in enumerate(self._actors):
            ref = actor.execute.remote(payload)
            if output_rank is None or output_rank == rank:
                self._refs[rank].append((call_id, ref))

    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        ray, queue = self.ray, self._refs[rank]
        if not queue:
            raise RuntimeError(f"rank {rank}: no call waits for a reply")
        call_id, ref = queue[0]
        if ref is None:  # a reply put back (unread_reply)
            return queue.popleft()[2]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._life.state not in (State.READY, State.STARTING):
                raise self._life.closed_error()
            wait_s = _READ_SLICE_S if deadline is None else min(
                _READ_SLICE_S, max(0.0, deadline - time.monotonic()))
            try:
                reply: Reply = ray.get(ref, timeout=wait_s)
            except ray.exceptions.GetTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"rank {rank}: no reply to call {call_id}") from None
                continue
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                raise self._closed_error(rank, QueueClosedError(str(exc))) from exc
            except ray.exceptions.RayError as exc:  # e.g. the result could not be sent
                queue.popleft()
                cause = getattr(exc, "cause", None)
                return (call_id, False, capture_failure(
                    cause if isinstance(cause, BaseException) else exc,
                    "the result cannot be sent"))
            queue.popleft()
            return reply

    def unread_reply(self, rank: int, reply: Reply) -> None:
        self._refs[rank].appendleft((reply[0], None, reply))


__all__ = ["RayReplies"]
