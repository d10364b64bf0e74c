"""MultiprocExecutor: the driver side of one-process-per-worker execution.

::

    driver                                        worker r (worker_proc.py)
    ------                                        -------------------------
    rpc_broadcast_mq (writer) --- every call ---> dequeue, run
    response_mqs[r] (reader)  <-- (call_id, ok, payload) --- reply (if r replies)
    death_writer[r] --------------- EOF on close / driver death ---> exit

Start-up: create the broadcast queue, start every worker (``launch``), wait
for all READY messages, attach to each reply queue, then the handshake -
broadcast queue first, then the reply queues in rank order (the worker does
the same; any other order deadlocks).

Calls: ``collective_rpc`` broadcasts ``(call_id, method, args, kwargs,
output_rank)`` and returns a :class:`FutureWrapper`; futures resolve in call
order (see ``futures``).  The broadcast ring is bounded, so a caller that
runs far ahead blocks in ``enqueue``; but the workers may in turn be blocked
sending replies into full reply rings that only the driver empties.  So the
driver never blocks on the broadcast ring for long: it enqueues with a short
timeout and, between tries, moves every reply that is waiting into a per-rank
stash that the futures read first.  Workers always make progress, and 10,000
outstanding calls cannot wedge.

End: ``shutdown()`` (idempotent; also the ``weakref.finalize`` of the
executor, so it runs at interpreter exit) fails pending calls, closes the
death pipes, escalates wait -> SIGTERM -> SIGKILL (``termination``) and shuts
the queues down.  A worker dying unexpectedly is seen by the monitor thread
(or by a caller reading its reply queue): the executor becomes failed, every
pending and later call gets ``WorkerDiedError``, and the failure callback runs
once.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import cloudpickle

from mpexec.config import ExecutorConfig
from mpexec.errors import (
    PeerDiedError,
    QueueClosedError,
    WorkerDiedError,
    describe_exitcode,
)
from mpexec.executor import tracing
from mpexec.executor.abstract import Executor
from mpexec.executor.futures import FutureWrapper, Reply
from mpexec.executor.handles import UnreadyWorkerProcHandle, WorkerProcHandle
from mpexec.executor.launch import (
    Resources,
    get_open_port,
    handshake,
    make_worker_process,
    set_multiprocessing_worker_envs,
    wait_for_ready,
)
from mpexec.executor.protocol import decode_replies
from mpexec.executor.ranks import global_start_rank, is_driver_worker
from mpexec.executor.replies import ReplyRouter
from mpexec.executor.termination import TerminationPolicy
from mpexec.ipc import Handle, MessageQueue
from mpexec.outputs import KVOutputAggregator
from mpexec.system import get_mp_context

logger = logging.getLogger(__name__)

# How long one enqueue attempt may wait for ring space before the driver
# drains replies and tries again (see the module docstring); the wait grows
# while the workers are busy rather than blocked.
_FIRST_ENQUEUE_WAIT_S = 0.0001
_MAX_ENQUEUE_WAIT_S = 0.005
_EXITCODE_WAIT_S = 1.0
_CALLBACK_JOIN_S = 2.0


class MultiprocExecutor(Executor):
    """One worker process per local rank; see the module docstring."""

    supports_pp: bool = True

    def __init__(self, config: ExecutorConfig, monitor_workers: bool | None = None) -> None:
        self.monitor_workers = config.monitor_workers if monitor_workers is None \
            else monitor_workers
        self.world_size = config.parallel.world_size
        self.local_world_size = config.parallel.local_world_size
        self.workers: list[WorkerProcHandle] = []
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.response_mqs: list[MessageQueue] = []
        self.shared_worker_lock: Any = None
        self.shutting_down = False
        self.futures_queue: deque[FutureWrapper] = deque()
        self.termination = TerminationPolicy(config.shutdown_grace_s, config.shutdown_term_s)
        self._resources = Resources(self.termination)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._state_lock = threading.Lock()
        self._shutdown_thread: threading.Thread | None = None
        self._shutdown_done = threading.Event()
        policy = self.termination
        self._teardown_bound_s = policy.grace_s + policy.term_s + policy.kill_s + 10.0
        self._broadcast_lock = threading.Lock()
        self.replies = ReplyRouter(self._closed_error)
        self._next_call_id = 0
        self._all_ranks = tuple(range(self.world_size))
        self._death: tuple[int, int | None, int | None] | None = None
        super().__init__(config)

    # -- start-up ---------------------------------------------------------------

    def _init_executor(self) -> None:
        parallel = self.parallel_config
        if parallel.nnodes_within_dp > 1:
            raise NotImplementedError(
                f"nnodes_within_dp = {parallel.nnodes_within_dp}: executors spanning several "
                "nodes are not supported yet")
        traced = self.config.trace and tracing.enable("Executor")
        method = set_multiprocessing_worker_envs(self.config)
        distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
        deadline = time.monotonic() + self.config.startup_timeout_s
        unready: list[UnreadyWorkerProcHandle] = []
        success = False
        try:
            with tracing.span("executor.start", world_size=self.world_size):
                handle = self._create_broadcast_queue()
                context = get_mp_context(method)
                self.shared_worker_lock = context.Lock()
                inherited_fds: list[int] | None = (
                    [] if context.get_start_method() == "fork" else None)
                start_rank = global_start_rank(parallel)
                for local_rank in range(self.local_world_size):
                    rank = start_rank + local_rank
                    unready_handle = make_worker_process(
                        context, self.config, local_rank, rank, distributed_init_method,
                        handle, self.shared_worker_lock, is_driver_worker(rank, parallel),
                        inherited_fds)
                    unready.append(unready_handle)
                    self._resources.procs.append(unready_handle.proc)
                    assert unready_handle.death_writer is not None
                    self._resources.death_writers.append(unready_handle.death_writer)
                    if inherited_fds is not None:
                        inherited_fds.append(unready_handle.death_writer.fileno())
                        inherited_fds.append(unready_handle.ready_pipe.fileno())
                # Every worker exists before we wait for any: a real worker's
                # init_device joins a collective with all of its peers.
                self.workers[:] = wait_for_ready(unready, deadline - time.monotonic(),
                                                self.config.mq_spin_s)
                self._handshake(deadline)
            if traced:
                # Only a traced executor pays for the span around each call.
                self.collective_rpc = self._traced_collective_rpc  # type: ignore[method-assign]
            if self.monitor_workers:
                self.start_worker_monitor()
            self._post_init_executor()
            success = True
        finally:
            if not success:
                self.shutting_down = True
                self._finalizer()
                self._shutdown_done.set()

    def _create_broadcast_queue(self) -> Handle | None:
        if self.parallel_config.node_rank_within_dp != 0:
            return None  # followers get calls from the leader (multi-node)
        mq = MessageQueue(self.world_size, self.local_world_size,
                          max_chunk_bytes=self.config.mq_max_chunk_bytes,
                          max_chunks=self.config.mq_max_chunks, name="broadcast",
                          spin_s=self.config.mq_spin_s)
        self.rpc_broadcast_mq = mq
        self._resources.queues.append(mq)
        return mq.export_handle()

    def _handshake(self, deadline: float) -> None:
        for w in self.workers:
            assert w.worker_response_mq is not None
            self.response_mqs.append(w.worker_response_mq)
            self._resources.queues.append(w.worker_response_mq)
        self.replies.attach(self.response_mqs)
        handshake(self.rpc_broadcast_mq, self.response_mqs, deadline)

    # -- health ---------------------------------------------------------------------

    def start_worker_monitor(self, inline: bool = False) -> None:
        """Watch the worker processes; ``inline`` runs the watch in this thread."""
        workers = list(self.workers)
        self_ref = weakref.ref(self)

        def monitor_workers() -> None:
            sentinels = [h.proc.sentinel for h in workers]
            died = multiprocessing.connection.wait(sentinels)
            _self = self_ref()
            if _self is None or _self.shutting_down:
                logger.debug("MultiprocWorkerMonitor: shutdown already initiated")
                return
            dead = next(h for h in workers if h.proc.sentinel == died[0])
            _self._on_worker_died(dead)

        if inline:
            monitor_workers()
            return
        thread = threading.Thread(target=monitor_workers, daemon=True,
                                  name="MultiprocWorkerMonitor")
        self._resources.monitor = thread
        thread.start()

    def _on_worker_died(self, handle: WorkerProcHandle) -> None:
        """Fail the executor because ``handle``'s process died (once)."""
        handle.proc.join(_EXITCODE_WAIT_S)
        with self._state_lock:
            if self.is_failed or self.shutting_down:
                return
            self.is_failed = True
            self._death = (handle.rank, handle.proc.pid, handle.proc.exitcode)
        logger.error("Worker proc %s died unexpectedly (%s), shutting down executor.",
                     handle.proc.name, describe_exitcode(handle.proc.exitcode))
        for future in list(self.futures_queue):
            future.fail(self._died_error())
        self.shutdown()
        self._fire_failure_callback()

    def _died_error(self) -> WorkerDiedError:
        assert self._death is not None
        rank, pid, exitcode = self._death
        return WorkerDiedError(
            f"worker rank {rank} (pid {pid}) died: {describe_exitcode(exitcode)}; "
            "the executor has failed", rank=rank, pid=pid, exitcode=exitcode)

    def _closed_error(self, rank: int | None, exc: QueueClosedError) -> Exception:
        """What a caller sees when a queue closed under it."""
        if not self.is_failed and not self.shutting_down and rank is not None:
            local = rank - global_start_rank(self.parallel_config)
            if isinstance(exc, PeerDiedError) or not self.workers[local].proc.is_alive():
                self._on_worker_died(self.workers[local])
        if self.is_failed:
            return self._died_error()
        if self.shutting_down:
            return QueueClosedError("the executor was shut down before this call completed")
        return exc

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
        if self.is_failed:
            raise self._died_error()
        mq = self.rpc_broadcast_mq
        if mq is None or self.shutting_down:
            raise QueueClosedError("collective_rpc on an executor that is shut down "
                                   "(or on a follower node, which has no broadcast queue)")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        name = method if isinstance(method, str) else getattr(method, "__qualname__", "callable")
        if kv_output_aggregator is not None:
            output_rank = None  # the aggregator needs every worker's reply
            ranks: tuple[int, ...] = self._all_ranks
        else:
            output_rank = unique_reply_rank
            ranks = self._all_ranks if output_rank is None else (output_rank,)
        if isinstance(method, str):
            send_method: str | bytes = method
        else:
            send_method = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
        with self._broadcast_lock:
            call_id = self._next_call_id + 1
            message = (call_id, send_method, args, kwargs or {}, output_rank)
            try:
                mq.enqueue(message, timeout=0.0)  # the ring has room: the usual case
            except TimeoutError:
                self._broadcast(message, deadline, name)
            except QueueClosedError as exc:
                raise self._closed_error(None, exc) from exc
            self._next_call_id = call_id
            # Fast path: a blocking call with no call pending before it reads
            # its replies itself, without a Future.  It takes the reply lock
            # before the next call can be broadcast, so replies are still
            # read in call order.
            direct = (not non_block and not self.futures_queue
                      and self.replies.lock.acquire(blocking=False))
            if not direct:
                future = FutureWrapper(
                    self.futures_queue, self.replies.lock, self.replies, call_id=call_id,
                    ranks=ranks,
                    deadline=deadline, method=name, timeout=timeout,
                    finish=partial(self._complete, name, unique_reply_rank,
                                   kv_output_aggregator))
        if direct:
            ok = False
            try:
                replies = self.replies.read_call(call_id, ranks, deadline, name, timeout)
                value = self._complete(name, unique_reply_rank, kv_output_aggregator, replies)
                ok = True
                return value
            finally:
                self.replies.lock.release()
                self.call_stats.record(name, time.monotonic() - started, ok)
        stats = self.call_stats
        future.add_done_callback(
            lambda f: stats.record(name, time.monotonic() - started, f.exception() is None))
        return future if non_block else future.result()

    def _traced_collective_rpc(self, method: str | Callable[..., Any], *args: Any,
                               **kwargs: Any) -> Any:
        name = method if isinstance(method, str) else getattr(method, "__qualname__", "callable")
        with tracing.span("executor.collective_rpc", method=name):
            return MultiprocExecutor.collective_rpc(self, method, *args, **kwargs)

    def _complete(self, name: str, unique_reply_rank: int | None,
                  aggregator: KVOutputAggregator | None, replies: dict[int, Reply]) -> Any:
        if aggregator is not None:
            outputs = decode_replies(name, False, replies, self._pid_of)
            return aggregator.aggregate(outputs, unique_reply_rank or 0)
        return decode_replies(name, unique_reply_rank is not None, replies, self._pid_of)

    def _broadcast(self, message: tuple[Any, ...], deadline: float | None, name: str) -> None:
        mq = self.rpc_broadcast_mq
        assert mq is not None
        # The first try does not wait: if the ring is full, the workers may be
        # stuck on full reply rings, and only draining them lets them move.
        wait_s = 0.0
        while True:
            try:
                mq.enqueue(message, timeout=wait_s)
                return
            except TimeoutError:
                pass
            except QueueClosedError as exc:
                raise self._closed_error(None, exc) from exc
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"RPC call to {name} timed out: the workers did not "
                                   "take it from the broadcast queue in time")
            self.replies.drain()
            wait_s = min(max(2 * wait_s, _FIRST_ENQUEUE_WAIT_S), _MAX_ENQUEUE_WAIT_S)

    def _pid_of(self, rank: int) -> int:
        local = rank - global_start_rank(self.parallel_config)
        pid = self.workers[local].proc.pid if 0 <= local < len(self.workers) else None
        return pid or -1

    # -- end --------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._state_lock:
            first = not self.shutting_down
            self.shutting_down = True
            if first:
                self._shutdown_thread = threading.current_thread()
        if not first:
            # Another thread (the monitor, after a worker died) is tearing
            # down: return only once it is done, so that no worker outlives
            # this call - unless this *is* that thread (a failure callback).
            if threading.current_thread() is not self._shutdown_thread:
                self._shutdown_done.wait(self._teardown_bound_s)
                monitor = self._resources.monitor
                if monitor is not None and monitor is not threading.current_thread():
                    # It may still be running the failure callback; a thread
                    # left behind would make the next executor spawn, not fork.
                    monitor.join(_CALLBACK_JOIN_S)
            return
        logger.debug("Triggering shutdown of workers")
        try:
            for future in list(self.futures_queue):
                future.fail(QueueClosedError(
                    "the executor was shut down before this call completed"))
            self._finalizer()
            self.shared_worker_lock = None
        finally:
            self._shutdown_done.set()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
