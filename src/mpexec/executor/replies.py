"""The driver's side of the reply queues: every reply read once, in call order.

Each worker answers, on its own reply queue, the calls it replies to in the
order it received them.  :class:`ReplyRouter` is the one place the driver
reads those queues from.  Whoever holds the call order's lock may read; a
reply read ahead of need (while the driver makes room on a full broadcast
ring, see ``driver``) goes into a per-rank *stash*, which every later
read empties first, so the order of each rank's replies is never disturbed.

A queue that closes under a read becomes the caller's error through
``on_closed`` (``WorkerDiedError`` when the worker is gone); a reply that
cannot be unpickled becomes :class:`~mpexec.executor.futures.UndecodableReply`
for the call being read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from mpexec.errors import QueueClosedError
from mpexec.executor.futures import UndecodableReply
from mpexec.executor.protocol import Reply
from mpexec.ipc import QueueReader


class _Undecodable:
    """Stands in the stash for a reply that failed to unpickle while draining."""

    __slots__ = ("cause",)

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class ReplyRouter:
    """Reads replies for the call order; see the module docstring."""

    def __init__(self, on_closed: Callable[[int, QueueClosedError], Exception],
                 pid_of: Callable[[int], int]) -> None:
        self._on_closed = on_closed
        self._pid_of = pid_of
        self._queues: Sequence[QueueReader] = ()
        self._stash: list[deque[Reply | _Undecodable]] = []
        self.lock: threading.Lock | None = None

    def attach(self, queues: Sequence[QueueReader], lock: threading.Lock) -> None:
        self._queues = queues
        self._stash = [deque() for _ in queues]
        self.lock = lock

    # ReplyReader (see futures), called with the lock held
    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        stash = self._stash[rank]
        if stash:
            item = stash.popleft()
            if isinstance(item, _Undecodable):
                raise UndecodableReply(rank, self._pid_of(rank), item.cause)
            return item
        try:
            reply: Reply = self._queues[rank].dequeue(timeout=timeout)
        except TimeoutError:
            raise
        except QueueClosedError as exc:
            raise self._on_closed(rank, exc) from exc
        except Exception as exc:  # the reply itself: it was consumed, unpickling failed
            raise UndecodableReply(rank, self._pid_of(rank), exc) from exc
        return reply

    def unread_reply(self, rank: int, reply: Reply) -> None:
        self._stash[rank].appendleft(reply)

    def drain(self) -> None:
        """Move every reply already waiting into the stash, unless a reader is busy."""
        lock = self.lock
        if lock is None or not lock.acquire(blocking=False):
            return  # whoever holds it is reading already
        try:
            for rank, mq in enumerate(self._queues):
                stash = self._stash[rank]
                while True:
                    try:
                        stash.append(mq.dequeue(timeout=0))
                    except TimeoutError:
                        break
                    except QueueClosedError:
                        break  # the next read of this rank reports it
                    except Exception as exc:
                        stash.append(_Undecodable(exc))
        finally:
            lock.release()
