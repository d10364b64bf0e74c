"""Calls in flight, resolved strictly in call order: one path for every call.

Protocol.  The driver broadcasts call ``n`` (``call_id`` grows by one per
call) and appends one :class:`PendingCall` for it to the :class:`CallOrder`
of the executor, blocking or not.  Worker ``r`` answers the calls it replies
to in the order it received them, each reply tagged with its ``call_id``, on
its own reply queue.  Whoever wants an outcome - a blocking caller, a
``result()`` on a future, or the reply pump - takes ``CallOrder.lock`` and
resolves the *oldest* pending call first, reading that call's missing
replies rank by rank, until the call it waits for is resolved.  So calls
resolve in call order whichever is asked first.

A blocking call is a record and nothing more: its caller resolves it
itself, holding the lock, which is as fast as reading the replies directly.
A non-blocking call also gets a :class:`FutureWrapper`; while at least one
such future is pending, the reply pump thread (``pump``) resolves calls as
their replies arrive, so ``done()``, ``add_done_callback``,
``concurrent.futures.wait`` and ``asyncio.wrap_future`` work without anyone
calling ``result()``.  The pump sleeps on a condition whenever no future is
pending, so blocking calls never share the replies with it.

Death.  ``fail_all`` resolves every pending call at once with an error of its
own (one exception instance per call), without the lock: the reader holding
it is woken by its queue closing and finds its call already resolved.

Deadlines.  A call may carry one deadline for all of its replies.  Replies
are always read first: a reply that is waiting when the deadline comes is
returned; only a read that times out at the deadline fails the call with
``TimeoutError``.  A reply that arrives for it later is recognised by its
``call_id`` (smaller than the call being read) and dropped.
``result(timeout=...)`` is a separate, per-wait limit: when it passes,
``TimeoutError`` is raised but the call stays pending.

Futures are completed (``set_result``, and so their callbacks) only after
the lock is released, so a callback may call the executor again.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from typing import Any, Protocol

from mpexec.errors import WorkerError
from mpexec.executor.protocol import Reply, qualified_type_name
from mpexec.executor.stats import CallStats


class Wakeable(Protocol):
    """The reply pump (``pump.ReplyPump``) as the call order and its owner see it."""

    def wake(self) -> None: ...

    def stop(self, join_s: float) -> None: ...


class UndecodableReply(Exception):
    """A reply that could not be unpickled in the driver (the read consumed it)."""

    def __init__(self, rank: int, pid: int, cause: BaseException) -> None:
        super().__init__(f"rank {rank}: {cause}")
        self.rank = rank
        self.pid = pid
        self.cause = cause


class ReplyReader(Protocol):
    def read_reply(self, rank: int, timeout: float | None) -> Reply:
        """The next reply from ``rank``; ``TimeoutError`` at ``timeout`` seconds,
        ``UndecodableReply`` when it could not be unpickled."""

    def unread_reply(self, rank: int, reply: Reply) -> None:
        """Put ``reply`` back so that the next ``read_reply(rank)`` returns it."""


# How a call's replies become its value: ``finish(method, replies)``.
Finish = Callable[[str, dict[int, Reply]], Any]


def _finished(method: str, replies: dict[int, Reply]) -> Any:
    raise RuntimeError(f"{method}: this call is already resolved")


def _earliest(*deadlines: float | None) -> float | None:
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


class PendingCall:
    """One broadcast call until its outcome is known (created on every call's path)."""

    __slots__ = ("call_id", "method", "ranks", "replies", "deadline", "timeout", "finish",
                 "started", "done", "value", "error", "future")

    def __init__(self, call_id: int, method: str, ranks: Sequence[int], deadline: float | None,
                 finish: Finish, timeout: float | None = None, started: float = 0.0) -> None:
        self.call_id = call_id
        self.method = method
        self.ranks = ranks  # those with no entry in replies yet are missing
        self.replies: dict[int, Reply] = {}
        self.deadline = deadline
        self.timeout = timeout
        self.finish = finish
        self.started = started
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.future: FutureWrapper | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class FutureWrapper(Future[Any]):
    """The ``concurrent.futures.Future`` of one non-blocking call."""

    def __init__(self, order: CallOrder, call: PendingCall) -> None:
        super().__init__()
        self._order = order
        self.call = call
        call.future = self

    @property
    def call_id(self) -> int:
        return self.call.call_id

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            wait_deadline = None if timeout is None else self._order.clock() + timeout
            self._order.wait(self.call, wait_deadline)
            settle(self.call)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            with suppress(Exception):
                self.result(timeout)
        return super().exception(timeout=0)


def settle(call: PendingCall) -> None:
    """Complete ``call``'s future from its outcome (whoever comes first)."""
    future = call.future
    if future is None or not call.done:
        return
    with suppress(InvalidStateError):
        if call.error is not None:
            future.set_exception(call.error)
        else:
            future.set_result(call.value)


class CallOrder:
    """The pending calls of one executor, oldest first; see the module docstring.

    Who touches what: callers append (under the executor's broadcast lock);
    only the holder of ``lock`` removes, and only from the left, once the
    oldest call is resolved; ``resolve`` and ``fail_all`` only mark calls.
    So the deque needs no lock of its own, and a blocking call costs no more
    than its reads.  A future's outcome is set under ``_mutex`` (its count
    and its completion must happen once); a blocking call's outcome may race
    only with ``fail_all``, and then the error wins (``outcome``).
    """

    def __init__(self, reader: ReplyReader, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()   # whoever holds it reads replies
        # Where a resolved future's latency is recorded (the executor's stats);
        # held here, not as a callback into the executor, so nothing here
        # keeps the executor alive.
        self.stats: CallStats | None = None
        self.clock = clock
        self._reader = reader
        # Callers append here (under the executor's broadcast lock).
        self.pending: deque[PendingCall] = deque()
        self._mutex = threading.Lock()  # futures: their outcome, count and settling
        self._futures_pending = 0
        self._settle_later: list[PendingCall] = []
        self.pump: Wakeable | None = None

    def __len__(self) -> int:
        """Calls not resolved yet."""
        return sum(not call.done for call in list(self.pending))

    def add(self, call: PendingCall) -> None:
        self.pending.append(call)
        if call.future is None:
            return
        with self._mutex:
            self._futures_pending += 1
        if self.pump is not None:
            self.pump.wake()

    @property
    def futures_pending(self) -> int:
        return self._futures_pending

    def newest_future(self) -> PendingCall | None:
        for call in reversed(list(self.pending)):
            if call.future is not None and not call.done:
                return call
        return None

    # -- outcomes ------------------------------------------------------------------

    def resolve(self, call: PendingCall, value: Any = None,
                error: BaseException | None = None) -> bool:
        """Set ``call``'s outcome once (the lock holder then drops it from the order)."""
        if call.future is not None:
            with self._mutex:
                if call.done:
                    return False
                # Counted before it is done: a result() that returns (it may
                # settle the future itself) is followed by stats() with it.
                stats = self.stats
                if stats is not None:
                    stats.record(call.method, self.clock() - call.started, error is None)
                call.value, call.error, call.done, call.finish = value, error, True, _finished
                self._futures_pending -= 1
                self._settle_later.append(call)
            return True
        if call.done:
            return False
        # _finished: drop the executor the finish function may refer to
        call.value, call.error, call.done, call.finish = value, error, True, _finished
        return True

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Fail every pending call, each with its own error; safe from any thread."""
        for call in list(self.pending):
            if not call.done:
                self.resolve(call, error=make_error())
        self._settle_all()

    def _settle_all(self) -> None:
        with self._mutex:
            calls, self._settle_later = self._settle_later, []
        for call in calls:
            settle(call)

    # -- progress (with ``lock`` held) ----------------------------------------------------

    def resolve_own(self, call: PendingCall) -> None:
        """A blocking caller's fast step: ``call`` is the oldest and the caller
        holds ``lock``; read its replies now (the same ``_collect`` as always)."""
        try:
            self._collect(call, call.deadline)
        except TimeoutError:
            self._expire(call)
        except Exception as exc:  # the reader failed (e.g. a worker died)
            self.resolve(call, error=exc)
        pending = self.pending
        if pending and pending[0] is call:
            pending.popleft()

    def wait(self, call: PendingCall, wait_deadline: float | None = None) -> None:
        """Make progress until ``call`` is resolved (or ``wait_deadline`` passes)."""
        lock = self.lock
        pending = self.pending
        while not call.done:
            if wait_deadline is None:
                lock.acquire()
            elif not lock.acquire(timeout=max(0.0, wait_deadline - self.clock())):
                raise TimeoutError(f"result() of {call.method} (call {call.call_id}) timed "
                                   f"out{_unanswered(call)}")
            try:
                if wait_deadline is None and pending and pending[0] is call:
                    self.resolve_own(call)
                else:
                    self._step(call, wait_deadline)
            finally:
                lock.release()
                if self._settle_later:
                    self._settle_all()

    def _step(self, call: PendingCall, wait_deadline: float | None) -> None:
        """One step towards ``call`` being resolved."""
        pending = self.pending
        while pending and pending[0].done:
            pending.popleft()
        if call.done:
            return
        if not pending:
            self.resolve(call, error=RuntimeError(
                f"{call.method} (call {call.call_id}) lost its place"))
            return
        oldest = pending[0]
        if oldest is not call and call.deadline is not None and self.clock() >= call.deadline:
            self._expire(call)
            return
        limit = _earliest(wait_deadline, call.deadline, oldest.deadline)
        try:
            self._collect(oldest, limit)
        except TimeoutError:
            now = self.clock()
            if oldest.deadline is not None and now >= oldest.deadline:
                self._expire(oldest)
            elif call.deadline is not None and now >= call.deadline:
                self._expire(call)
            elif wait_deadline is not None and now >= wait_deadline:
                raise TimeoutError(f"result() of {call.method} (call {call.call_id}) timed "
                                   f"out{_unanswered(call)}") from None
        except Exception as exc:  # the reader failed (e.g. a worker died)
            self.resolve(oldest, error=exc)
        while pending and pending[0].done:
            pending.popleft()

    def _collect(self, call: PendingCall, limit: float | None) -> None:
        """Read this (oldest) call's missing replies; resolve it when complete.

        On every call's path: locals over attribute lookups on purpose.
        """
        replies = call.replies
        read = self._reader.read_reply
        call_id = call.call_id
        for rank in call.ranks:
            if rank in replies:
                continue  # read by an earlier, interrupted _collect
            while True:
                try:
                    reply = read(rank, None if limit is None else max(0.0, limit - self.clock()))
                except UndecodableReply as exc:
                    # Still this call's reply (it was consumed): keep reading the
                    # other ranks' so that none is left to be taken for the next call.
                    reply = (call_id, False, _undecodable_error(call.method, exc))
                if reply[0] == call_id:
                    break
                if reply[0] > call_id:
                    self._reader.unread_reply(rank, reply)
                    raise RuntimeError(
                        f"rank {rank} answered call {reply[0]} before call {call_id} "
                        f"({call.method}); its reply to call {call_id} is missing")
                # else: it answers a call that already timed out; read on
            replies[rank] = reply
        try:
            value = call.finish(call.method, replies)
        except Exception as exc:
            self.resolve(call, error=exc)
            return
        if call.future is None and not call.done:  # resolve(), inlined: every call's path
            call.value, call.done, call.finish = value, True, _finished
        else:
            self.resolve(call, value)

    def _expire(self, call: PendingCall) -> None:
        after = "" if call.timeout is None else f" after {call.timeout:g}s"
        self.resolve(call, error=TimeoutError(
            f"RPC call to {call.method} timed out{after}{_unanswered(call)}"))


def _unanswered(call: PendingCall) -> str:
    """For a deadline's error: the ranks whose reply to ``call`` is not in."""
    missing = [rank for rank in call.ranks if rank not in call.replies]
    return f"; no reply from rank(s) {missing}" if missing else ""


def _undecodable_error(method: str, exc: UndecodableReply) -> WorkerError:
    cause = exc.cause
    error = WorkerError(
        f"the reply of worker rank {exc.rank} to {method} could not be unpickled in the "
        f"driver: {qualified_type_name(cause)}: {cause}",
        rank=exc.rank, pid=exc.pid, method=method, exc_type=qualified_type_name(cause),
        remote_traceback="".join(traceback.format_exception(cause)))
    error.__cause__ = cause
    return error
