"""The driver: one broadcast queue out, one reply queue back per worker.

::

    driver                                        worker r (worker_proc.py)
    ------                                        -------------------------
    rpc_broadcast_mq (writer) --- every Call ---> dequeue, run
    reply queue r (reader)    <----- Reply ------ reply (if r replies)
    launcher's death watch r  <-- when r is gone -- (pidfd, node lost, actor dead)

:class:`Driver` is the part of every multi-worker executor that does not
depend on how the workers were started: the calls, the failure table and
the end.  A subclass brings the launcher: ``MultiprocExecutor`` (local
processes, and follower nodes when there are several), ``RayExecutor``
(Ray actors).

Construction stores the config and builds the empty parts (lifecycle,
reply router, call order); ``start()`` - which ``SomeExecutor(config)``
calls once every ``__init__`` has run - installs the finalizer
(``_closer``: what ends this executor, with no reference back to it), and
the subclass's ``_start_workers`` starts every worker, attaches to each
reply queue and finishes the handshake; then the monitor starts and the
executor is READY.  Any failure tears everything down (``lifecycle``) and
raises ``WorkerStartupError``.

Calls: ``collective_rpc`` validates its arguments, broadcasts one ``Call``
(``_broadcast``) and appends one ``PendingCall`` to the call order; a
blocking call resolves it at once, a non-blocking one returns its future
(see ``futures``).  The broadcast ring is bounded, and the workers may be
blocked sending replies into full reply rings that only the driver empties;
so the driver never blocks on the broadcast ring for long: between short
enqueue attempts it moves every waiting reply into the router's stash.

End: ``shutdown()`` (idempotent; also run by ``weakref.finalize`` at
interpreter exit) is the lifecycle's orderly close.  A worker dying is seen
by the monitor (the launchers' death descriptors) or by a caller whose
queue closed, whichever comes first: either way the caller gets
``WorkerDiedError``.
"""

from __future__ import annotations

import pickle
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import cloudpickle

from mpexec.config import ExecutorConfig
from mpexec.errors import QueueClosedError
from mpexec.executor.abstract import Executor, check_call
from mpexec.executor.futures import CallOrder, Finish, FutureWrapper, PendingCall, ReplyReader
from mpexec.executor.launcher import WatchedWorker
from mpexec.executor.lifecycle import State
from mpexec.executor.protocol import Reply, aggregate_replies, decode_replies
from mpexec.executor.pump import ReplyPump
from mpexec.executor.ranks import global_start_rank
from mpexec.executor.replies import ReplyRouter
from mpexec.executor.tracing import Tracer
from mpexec.executor.verdict import closing_rank, first_gone
from mpexec.ipc import MessageQueue, QueueReader
from mpexec.outputs import KVOutputAggregator

# How long one enqueue attempt may wait for ring space before the driver
# drains replies and tries again (see the module docstring).
_FIRST_ENQUEUE_WAIT_S = 0.0001
_MAX_ENQUEUE_WAIT_S = 0.005


class Driver(Executor):
    """The executor over workers that read one broadcast queue; see the module
    docstring.  A subclass starts the workers (``_start_workers``)."""

    supports_pp = True

    def __init__(self, config: ExecutorConfig, monitor_workers: bool | None = None, *,
                 cancel: threading.Event | None = None) -> None:
        super().__init__(config, cancel=cancel)
        self.monitor_workers = config.monitor_workers if monitor_workers is None \
            else monitor_workers
        self.world_size = config.parallel.world_size
        self.local_world_size = config.parallel.local_world_size
        self.tracer = Tracer.create(config.trace, "Executor", config.trace_exporter)
        if self.tracer.enabled:
            # Only a traced executor pays for the span around each call and
            # for the traceparent that travels with it.
            self.collective_rpc = self._traced_collective_rpc  # type: ignore[method-assign]
            self._broadcast = self._traced_broadcast  # type: ignore[method-assign]
        self.workers: list[WatchedWorker] = self.lifecycle.handles
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.response_mqs: list[QueueReader] = []
        self.shared_worker_lock: Any = None
        # The router outlives calls (the lifecycle holds it); weak references
        # back to the executor keep the executor collectable.
        self_ref = weakref.ref(self)

        def closed_error(rank: int, exc: QueueClosedError) -> Exception:
            executor = self_ref()
            return exc if executor is None else executor._closed_error(rank, exc)

        def pid_of(rank: int) -> int:
            executor = self_ref()
            return -1 if executor is None else executor._pid_of(rank)

        self.replies = ReplyRouter(closed_error, pid_of)
        # The two usual ways replies become a value, built once (no executor
        # reference: they live as long as pending calls do).
        def finish_single(method: str, replies: dict[int, Reply]) -> Any:
            return decode_replies(method, replies, True, pid_of)

        def finish_list(method: str, replies: dict[int, Reply]) -> Any:
            return decode_replies(method, replies, False, pid_of)

        self._finish_single: Finish = finish_single
        self._finish_list: Finish = finish_list
        self.calls = CallOrder(self._reply_reader())
        self.calls.stats = self.call_stats
        self.lifecycle.calls = self.calls
        self._broadcast_lock = threading.Lock()
        self._next_call_id = 0
        self._all_ranks = tuple(range(self.world_size))
        self._start_rank = global_start_rank(config.parallel)
        # Ends everything at shutdown(), interpreter exit or collection; set
        # by start(), so that it can end what a subclass holds too.
        self._finalizer: Callable[[], Any] | None = None

    # -- start-up ---------------------------------------------------------------

    def _reply_reader(self) -> ReplyReader:
        """What the call order reads replies from: the reply queues."""
        return self.replies

    def _closer(self) -> Callable[[], None]:
        """What ends this executor (no reference back to it): the lifecycle's close."""
        return self.lifecycle.close

    def _init_executor(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.startup_timeout_s
        life = self.lifecycle
        finalizer = self._finalizer = weakref.finalize(self, self._closer())
        try:
            with self.tracer.span("executor.start", world_size=self.world_size):
                self._start_workers(deadline)
            if self.monitor_workers:
                life.start_monitor()
            life.mark_ready()
            self._post_init_executor()
        except BaseException:
            finalizer()
            raise
        if life.port is not None:
            life.port.close()  # the workers have their rendezvous; free the port

    def _start_workers(self, deadline: float) -> None:
        """Start every worker, attach to its queues and finish the handshake by
        ``deadline``; whatever it started is in the lifecycle already."""
        raise NotImplementedError

    # -- health ---------------------------------------------------------------------

    def start_worker_monitor(self, inline: bool = False) -> None:
        """Watch the worker processes; ``inline`` runs the watch in this thread."""
        if inline:
            self.lifecycle.watch()
        else:
            self.lifecycle.start_monitor()

    def _handle(self, rank: int) -> WatchedWorker:
        return self.workers[rank - self._start_rank]

    def _pid_of(self, rank: int) -> int:
        local = rank - self._start_rank
        # Only this node's workers have a pid here; remote ranks say -1.
        pid = self.workers[local].pid if 0 <= local < self.local_world_size else None
        return -1 if pid is None else pid

    def _closed_error(self, rank: int | None, exc: QueueClosedError) -> Exception:
        """What a caller sees when a queue closed under it: if a worker is
        gone (or going), the executor fails here and now, ``WorkerDiedError``."""
        life = self.lifecycle
        handle = self._dead_worker(rank, exc) if life.state in (
            State.READY, State.STARTING) else None
        if handle is not None:
            # Closed its queue yet alive (a follower node not declared lost in
            # time): unusable all the same, the error says what it did, and no
            # monitor will see a death to tear down after.
            lives = handle.is_alive()
            how = f"closed its queue ({exc})" if lives else ""
            life.worker_gone(handle, how, teardown=not self.monitor_workers or lives)
        return life.closed_error()


    def _dead_worker(self, rank: int | None, exc: QueueClosedError) -> WatchedWorker | None:
        if rank is None:
            rank = closing_rank(exc, self._start_rank)
        candidates = self.workers if rank is None else [self._handle(rank)]
        # A follower node's or a remote actor's queues close well before its
        # death is known: each handle says how long that may take.
        gone = first_gone(candidates, max((h.death_lag_s for h in candidates), default=0.0))
        # A rank that closed its queue yet is still there: unusable all the same.
        return candidates[0] if gone is None and rank is not None else gone

    # -- calls -----------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        kv_output_aggregator: KVOutputAggregator | None = None,
    ) -> Any:
        if not self.lifecycle.usable:
            raise self.lifecycle.closed_error()
        if (args.__class__ is not tuple or timeout is not None or unique_reply_rank is not None
                or (kwargs is not None and kwargs.__class__ is not dict)):
            check_call(args, kwargs, timeout, unique_reply_rank, self.world_size)
        aggregator = kv_output_aggregator
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        if isinstance(method, str):
            name = method
            send_method: str | bytes = method
        else:
            name = getattr(method, "__qualname__", "callable")
            send_method = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
        if aggregator is not None:
            output_rank = None  # the aggregator needs every worker's reply
            ranks: tuple[int, ...] = self._all_ranks
        else:
            output_rank = unique_reply_rank
            ranks = self._all_ranks if output_rank is None else (output_rank,)
        if aggregator is not None:
            finish: Finish = partial(aggregate_replies, aggregator, unique_reply_rank or 0,
                                     self._pid_of)
        elif unique_reply_rank is None:
            finish = self._finish_list
        else:
            finish = self._finish_single
        calls = self.calls
        # Everything that can be done before the broadcast is: once the call
        # is out, every instruction here delays reading its replies (and, on
        # a shared core, the worker answering it).
        call = PendingCall(0, name, ranks, deadline, finish, timeout, started)
        future = FutureWrapper(calls, call) if non_block else None
        kwargs = kwargs or {}
        with self._broadcast_lock:
            call.call_id = call_id = self._next_call_id + 1
            if future is None:
                calls.pending.append(call)  # before the broadcast: nothing after it
                try:
                    self._broadcast((call_id, send_method, args, kwargs, output_rank),
                                    deadline, name)
                except BaseException:
                    calls.pending.pop()  # ours: appended under this lock, never sent
                    raise
            else:
                self._broadcast((call_id, send_method, args, kwargs, output_rank),
                                deadline, name)
                if calls.pump is None:
                    ReplyPump(calls)
                calls.add(call)
            self._next_call_id = call_id
        if not non_block:
            ok = False
            try:
                lock = calls.lock
                # Nothing older pending and no one reading: resolve it here
                # and now (the usual case, as fast as reading the replies).
                pending = calls.pending
                if pending[0] is call and lock.acquire(False):
                    try:
                        if pending and pending[0] is call and not call.done:
                            calls.resolve_own(call)
                    finally:
                        lock.release()
                if not call.done:
                    calls.wait(call)
                if call.error is not None:
                    raise call.error
                ok = True
                return call.value
            finally:
                self.call_stats.record(name, time.monotonic() - started, ok)
        assert future is not None
        return future

    def _traced_collective_rpc(self, method: str | Callable[..., Any], *args: Any,
                               **kwargs: Any) -> Any:
        name = method if isinstance(method, str) else "callable"
        with self.tracer.span("executor.collective_rpc", method=name):
            return Driver.collective_rpc(self, method, *args, **kwargs)

    def _traced_broadcast(self, message: tuple[Any, ...], deadline: float | None,
                          name: str) -> None:
        # The call's span (executor.collective_rpc) goes with it: the parent
        # of each worker's worker.call span.
        type(self)._broadcast(self, (*message, self.tracer.carrier()), deadline, name)

    def _broadcast(self, message: tuple[Any, ...], deadline: float | None, name: str) -> None:
        """Put one call on the broadcast ring (the one place that does)."""
        mq = self.rpc_broadcast_mq
        assert mq is not None
        try:
            # Pickled once here (a pickling error is the caller's, raised now);
            # every retry below sends these same bytes.
            encoded = mq.encode(message)
        except QueueClosedError as exc:
            raise self._closed_error(None, exc) from exc
        # The first try does not wait: if the ring is full, the workers may be
        # stuck on full reply rings, and only draining them lets them move.
        wait_s = 0.0
        while True:
            try:
                mq.enqueue(encoded, timeout=wait_s)
                return
            except TimeoutError:
                pass
            except QueueClosedError as exc:
                raise self._closed_error(None, exc) from exc
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"RPC call to {name} timed out: rank(s) "
                                   f"{_lagging(mq)} did not take it from the broadcast "
                                   "queue in time")
            self.replies.drain()
            wait_s = min(max(2 * wait_s, _FIRST_ENQUEUE_WAIT_S), _MAX_ENQUEUE_WAIT_S)

    # -- end --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers and release everything; idempotent, any thread."""
        if self._finalizer is not None:
            self._finalizer()
        self.lifecycle.close()  # returns only once a teardown elsewhere is done
        self.shared_worker_lock = None
        self.tracer.shutdown()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True


def _lagging(mq: MessageQueue) -> list[int] | str:
    try:
        return mq.lagging_ranks()
    except QueueClosedError:
        return "?"


__all__ = ["Driver"]
