"""Futures that resolve strictly in call order.

Protocol.  The driver broadcasts call ``n`` (a growing ``call_id``) and
creates one :class:`FutureWrapper` for it, which it puts at the left end of a
deque shared by all futures of the executor.  Worker ``r`` answers the calls
it replies to in the order it received them, each reply tagged with the
``call_id`` it answers, on its own reply queue.  Whoever wants a result -
``result()`` on any future - takes the shared lock and completes the
*oldest* pending future first (the right end of the deque), reading that
call's missing replies rank by rank, until its own future is done.  So
futures resolve in call order whichever of them is asked first.

Deadlines.  A call may carry one deadline for all of its replies; when it
passes, the call fails with ``TimeoutError`` and leaves the deque, and a reply
that arrives for it later is recognised by its ``call_id`` (smaller than the
call being read) and dropped - it never answers a later call.
``result(timeout=...)`` is a separate, per-wait limit: when it passes,
``TimeoutError`` is raised but the call stays pending with the replies
collected so far, and a later ``result()`` carries on where this one stopped.

The replies come from a :class:`ReplyReader` (the executor's reply queues in
production, a fake in tests), whose ``read_reply`` raises ``TimeoutError`` at
the timeout it is given.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from typing import Any, Protocol

# A reply as the worker sends it: (call_id, ok, payload).
Reply = tuple[int, bool, Any]


class ReplyReader(Protocol):
    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        """The next reply from ``rank``; ``TimeoutError`` at ``timeout`` seconds."""

    def unread_reply(self, rank: int, reply: Reply) -> None:
        """Put ``reply`` back so that the next ``read_reply(rank)`` returns it."""


def _earliest(*deadlines: float | None) -> float | None:
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


class FutureWrapper(Future[Any]):
    """The result of one broadcast call; see the module docstring."""

    def __init__(
        self,
        futures_queue: deque[FutureWrapper],
        lock: threading.Lock,
        reader: ReplyReader,
        *,
        call_id: int,
        ranks: Sequence[int],
        deadline: float | None,
        finish: Callable[[dict[int, Reply]], Any],
        method: str = "call",
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.call_id = call_id
        self.method = method
        self.deadline = deadline
        self._timeout = timeout
        self._futures_queue = futures_queue
        self._lock = lock
        self._reader = reader
        self._finish = finish
        self._clock = clock
        self._missing = list(ranks)
        self._replies: dict[int, Reply] = {}
        futures_queue.appendleft(self)

    def result(self, timeout: float | None = None) -> Any:
        wait_deadline = None if timeout is None else self._clock() + timeout
        while not self.done():
            self._advance(wait_deadline)
        return super().result(timeout=0)

    def fail(self, exc: BaseException) -> None:
        """Fail this call (if still pending) and take it out of the order.

        Safe from any thread; the monitor uses it to fail every pending call
        when a worker dies.
        """
        with suppress(InvalidStateError):
            self.set_exception(exc)
        self._leave_queue()

    def _leave_queue(self) -> None:
        queue = self._futures_queue
        if queue and queue[-1] is self:
            queue.pop()
        else:
            with suppress(ValueError):
                queue.remove(self)

    def _advance(self, wait_deadline: float | None) -> None:
        """Make one step of progress towards this future being done."""
        if wait_deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=max(0.0, wait_deadline - self._clock())):
            raise TimeoutError(f"result() of {self.method} (call {self.call_id}) timed out")
        try:
            if self.done():
                return
            if self.deadline is not None and self._clock() >= self.deadline:
                self._expire()
                return
            if not self._futures_queue:
                self.fail(RuntimeError(f"{self.method} (call {self.call_id}) lost its place"))
                return
            oldest = self._futures_queue[-1]
            if oldest.done():
                oldest._leave_queue()
                return
            limit = _earliest(wait_deadline, self.deadline, oldest.deadline)
            try:
                oldest._collect(limit)
            except TimeoutError:
                now = self._clock()
                if oldest.deadline is not None and now >= oldest.deadline:
                    oldest._expire()
                elif self.deadline is not None and now >= self.deadline:
                    self._expire()
                elif wait_deadline is not None and now >= wait_deadline:
                    raise TimeoutError(
                        f"result() of {self.method} (call {self.call_id}) timed out"
                    ) from None
            except Exception as exc:  # the reader failed (e.g. a worker died)
                oldest.fail(exc)
        finally:
            self._lock.release()

    def _collect(self, limit: float | None) -> None:
        """Read this (oldest) call's missing replies; resolve it when complete."""
        while self._missing:
            rank = self._missing[0]
            timeout = None if limit is None else max(0.0, limit - self._clock())
            reply = self._reader.read_reply(rank, timeout)
            if reply[0] < self.call_id:
                continue  # answers a call that already timed out
            if reply[0] > self.call_id:
                self._reader.unread_reply(rank, reply)
                raise RuntimeError(
                    f"rank {rank} answered call {reply[0]} before call {self.call_id} "
                    f"({self.method}); its reply to call {self.call_id} is missing"
                )
            self._replies[rank] = reply
            del self._missing[0]
        self._leave_queue()
        try:
            value = self._finish(self._replies)
        except Exception as exc:
            with suppress(InvalidStateError):
                self.set_exception(exc)
        else:
            with suppress(InvalidStateError):
                self.set_result(value)
        finally:
            self._replies = {}

    def _expire(self) -> None:
        after = "" if self._timeout is None else f" after {self._timeout:g}s"
        self._replies = {}
        self.fail(TimeoutError(f"RPC call to {self.method} timed out{after}"))
