"""The driver's side of the reply queues: every reply read once, in call order.

Each worker answers, on its own reply queue, the calls it replies to in the
order it received them.  :class:`ReplyRouter` is the one place the driver
reads those queues from.  Whoever holds its ``lock`` may read; a reply read
ahead of need (while the driver makes room on a full broadcast ring, see
``multiproc``) goes into a per-rank *stash*, which every later read empties
first, so the order of each rank's replies is never disturbed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from mpexec.errors import QueueClosedError
from mpexec.executor.futures import Reply
from mpexec.ipc import MessageQueue


class ReplyRouter:
    """Reads replies for the futures and the direct path; see the module docstring."""

    def __init__(self, on_closed: Callable[[int | None, QueueClosedError], Exception]) -> None:
        # on_closed(rank, error) turns a closed queue into the caller's error
        # (WorkerDiedError when the worker is gone, say).
        self._on_closed = on_closed
        self.lock = threading.Lock()
        self._queues: Sequence[MessageQueue] = ()
        self._stash: list[deque[Reply]] = []

    def attach(self, queues: Sequence[MessageQueue]) -> None:
        self._queues = queues
        self._stash = [deque() for _ in queues]

    # ReplyReader (see futures), called with ``lock`` held
    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        stash = self._stash[rank]
        if stash:
            return stash.popleft()
        try:
            reply: Reply = self._queues[rank].dequeue(timeout=timeout)
        except QueueClosedError as exc:
            raise self._on_closed(rank, exc) from exc
        return reply

    def unread_reply(self, rank: int, reply: Reply) -> None:
        self._stash[rank].appendleft(reply)

    def read_call(self, call_id: int, ranks: tuple[int, ...], deadline: float | None,
                  name: str, timeout: float | None) -> dict[int, Reply]:
        """The replies of ``call_id`` from ``ranks`` (with ``lock`` held).

        A reply to an earlier call - one that timed out - is dropped.
        """
        replies: dict[int, Reply] = {}
        for rank in ranks:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    reply = self.read_reply(rank, remaining)
                except TimeoutError:
                    raise TimeoutError(
                        f"RPC call to {name} timed out after {timeout:g}s") from None
                if reply[0] == call_id:
                    replies[rank] = reply
                    break
                if reply[0] > call_id:
                    self.unread_reply(rank, reply)
                    raise RuntimeError(f"rank {rank} answered call {reply[0]} before call "
                                       f"{call_id} ({name})")
        return replies

    def drain(self) -> None:
        """Move every reply already waiting into the stash, unless a reader is busy."""
        if not self.lock.acquire(blocking=False):
            return  # whoever holds it is reading already
        try:
            for rank, mq in enumerate(self._queues):
                stash = self._stash[rank]
                while True:
                    try:
                        stash.append(mq.dequeue(timeout=0))
                    except TimeoutError:
                        break
                    except QueueClosedError as exc:
                        raise self._on_closed(rank, exc) from exc
        finally:
            self.lock.release()
