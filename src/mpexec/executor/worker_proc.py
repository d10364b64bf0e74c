"""The worker side of MultiprocExecutor: one WorkerProc per child process.

Start-up, in the child (``worker_main``)::

    install SIGTERM/SIGINT handlers (each turns into one SystemExit)
    close the siblings' pipe ends inherited through fork; pin CPUs
    start the death-pipe watcher
    WorkerProc(): build the worker, init_device, load_model,
                  attach the broadcast queue (reader), create the reply queue (writer)
    ready pipe  -> {"status": "READY", "handle": reply queue handle}
    broadcast queue wait_until_ready, then reply queue wait_until_ready
    worker_busy_loop()

If anything fails before READY, the worker sends ``{"status": "FAILED",
"traceback": ...}`` on the ready pipe and exits with code 1, so the driver
can report the cause at once.

The busy loop: dequeue a call (waiting indefinitely), run it, and if this
rank replies (``output_rank`` is None or this rank) send ``(call_id, ok,
payload)`` on the reply queue - directly, or through the output thread when
async scheduling is on, so that the next call starts while the reply (maybe
an ``AsyncModelRunnerOutput`` still copying) goes out.

What ends it: the driver closes the death pipe (normal shutdown) or dies.
The death-pipe watcher then shuts both queues down, the blocked dequeue
raises ``QueueClosedError``, and the worker cleans up and exits.  If that
happens before the queues exist (still in start-up), the watcher SIGTERMs
its own process instead.  See ``protocol`` for the message formats.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from functools import partial
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import cloudpickle

from mpexec.config import ExecutorConfig
from mpexec.errors import QueueClosedError
from mpexec.executor import tracing
from mpexec.executor.protocol import (
    FAILED_STR,
    READY_STR,
    RemoteFailure,
    capture_failure,
    qualified_type_name,
)
from mpexec.executor.ranks import worker_name
from mpexec.executor.worker_base import WorkerWrapperBase
from mpexec.ipc import Handle, MessageQueue
from mpexec.outputs import AsyncModelRunnerOutput
from mpexec.system import apply_cpu_affinity, close_inherited_fds, decorate_logs, set_process_title

logger = logging.getLogger(__name__)

_STOP = object()  # tells the output thread to finish
_THREAD_JOIN_S = 2.0


class WorkerProc:
    """Wrapper that runs one worker in this (child) process."""

    READY_STR = READY_STR

    def __init__(
        self,
        config: ExecutorConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        shared_worker_lock: Any,
        is_driver_worker: bool,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.worker_response_mq: MessageQueue | None = None
        self.peer_response_handles: list[Handle] = []
        self.use_async_scheduling = config.scheduler.async_scheduling
        self.async_output_queue: queue.Queue[Any] = queue.Queue()
        self.async_output_copy_thread: threading.Thread | None = None
        self.worker = WorkerWrapperBase(rpc_rank=local_rank, global_rank=rank)
        self._is_shut_down = False
        try:
            self._start(distributed_init_method, input_shm_handle, shared_worker_lock,
                        is_driver_worker)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, distributed_init_method: str, input_shm_handle: Handle,
               shared_worker_lock: Any, is_driver_worker: bool) -> None:
        config = self.config
        all_kwargs: list[dict[str, Any]] = [{} for _ in range(config.parallel.local_world_size)]
        all_kwargs[self.local_rank] = {
            "config": config,
            "local_rank": self.local_rank,
            "rank": self.rank,
            "distributed_init_method": distributed_init_method,
            "is_driver_worker": is_driver_worker,
            "shared_worker_lock": shared_worker_lock,
        }
        self.worker.init_worker(all_kwargs)
        # Our process groups do not exist yet, so the name comes from the
        # rank arithmetic rather than from the groups (it is the same name).
        self.setup_proc_title_and_log_prefix(self.rank, config)
        with tracing.span("worker.init_device", rank=self.rank):
            self.worker.init_device()
        with tracing.span("worker.load_model", rank=self.rank):
            self.worker.load_model()
        if self.use_async_scheduling:
            self.async_output_copy_thread = threading.Thread(
                target=self.async_output_busy_loop, daemon=True, name="WorkerAsyncOutputCopy")
            self.async_output_copy_thread.start()
        # Last, so a multi-node setup could build them over its process groups.
        self._init_message_queues(input_shm_handle)

    def _init_message_queues(self, input_shm_handle: Handle) -> None:
        if self.config.parallel.nnodes_within_dp != 1:
            raise NotImplementedError("workers on several nodes are not supported yet")
        spin_s = self.config.mq_spin_s
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, self.rank,
                                                                spin_s=spin_s)
        self.worker_response_mq = MessageQueue(
            1, 1,
            max_chunk_bytes=self.config.mq_max_chunk_bytes,
            max_chunks=self.config.mq_max_chunks,
            name=f"reply{self.rank}",
            spin_s=spin_s,
        )

    @staticmethod
    def setup_proc_title_and_log_prefix(rank: int, config: ExecutorConfig) -> None:
        name = worker_name(rank, config.parallel)
        set_process_title(name)
        decorate_logs(name)

    # -- replies ----------------------------------------------------------------

    def enqueue_output(self, call_id: int, output: Any) -> None:
        if output is not None and isinstance(output, AsyncModelRunnerOutput):
            try:
                output = output.get_output()
            except Exception as exc:
                output = capture_failure(exc)
        mq = self.worker_response_mq
        if mq is None:
            return
        ok = not isinstance(output, RemoteFailure)
        try:
            mq.enqueue((call_id, ok, output))
        except QueueClosedError:
            raise
        except Exception as exc:  # the result could not be pickled: say so instead
            mq.enqueue((call_id, False, capture_failure(exc)))

    def handle_output(self, call_id: int, output: Any) -> None:
        if self.use_async_scheduling:
            self.async_output_queue.put((call_id, output))
        else:
            self.enqueue_output(call_id, output)

    def async_output_busy_loop(self) -> None:
        # A new thread starts without the main thread's device binding; a
        # worker that needs one (a CUDA device) provides bind_output_thread().
        bind = getattr(self.worker.worker, "bind_output_thread", None)
        if bind is not None:
            bind()
        while True:
            item = self.async_output_queue.get()
            if item is _STOP:
                return
            try:
                self.enqueue_output(*item)
            except QueueClosedError:
                return

    def worker_busy_loop(self) -> None:
        """Serve calls until the broadcast queue is shut down."""
        mq = self.rpc_broadcast_mq
        assert mq is not None
        rank = self.rank
        worker = self.worker
        # Synchronous replies skip the handle_output() indirection.
        handle_output = self.handle_output if self.use_async_scheduling else self.enqueue_output
        traced = tracing.is_enabled()  # switched on (or not) before the loop starts
        while True:
            call_id, method, args, kwargs, output_rank = mq.dequeue(indefinite=True)
            replies = output_rank is None or output_rank == rank
            try:
                if isinstance(method, str):
                    func = worker.resolve(method)
                else:
                    func = partial(cloudpickle.loads(method), worker)
                if traced:
                    with tracing.span("worker.call", rank=rank, call_id=call_id,
                                      method=method if isinstance(method, str) else "callable"):
                        output = func(*args, **kwargs)
                else:
                    output = func(*args, **kwargs)
            except Exception as exc:
                logger.warning("rank %d: call %d raised %s: %s", rank, call_id,
                               qualified_type_name(exc), exc)
                if replies:
                    handle_output(call_id, capture_failure(exc))
                continue
            if replies:
                handle_output(call_id, output)

    # -- end ----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        # Queues first: that wakes the output thread if it is blocked sending.
        for mq in (self.rpc_broadcast_mq, self.worker_response_mq):
            if mq is not None:
                mq.shutdown()
        thread = self.async_output_copy_thread
        if thread is not None:
            self.async_output_queue.put(_STOP)
            thread.join(_THREAD_JOIN_S)
        try:
            self.worker.shutdown()
        except Exception:
            logger.exception("rank %d: worker.shutdown() failed", self.rank)


class DeathPipeWatcher:
    """Notices the driver going away (EOF on the death pipe) and ends the worker."""

    def __init__(self, death_pipe: Connection | None) -> None:
        self._death_pipe = death_pipe
        # Deliberately not the signal handler's flag: a worker still busy in
        # a long method when the driver leaves must stay interruptible by
        # the SIGTERM that follows, or only SIGKILL could end it.
        self.stopping = threading.Event()
        self._queues: list[MessageQueue] | None = None
        self._lock = threading.Lock()
        self._driver_gone = False

    def start(self) -> None:
        if self._death_pipe is None:
            return
        threading.Thread(target=self._run, daemon=True, name="DeathPipeMonitor").start()

    def watch(self, queues: list[MessageQueue | None]) -> None:
        """From now on, the driver going away shuts these queues down."""
        with self._lock:
            self._queues = [q for q in queues if q is not None]
            driver_gone = self._driver_gone
        if driver_gone:
            self._shut_down_queues()

    def _run(self) -> None:
        assert self._death_pipe is not None
        try:
            self._death_pipe.recv()
        except EOFError:
            pass
        except OSError:  # our own end was closed at exit
            return
        logger.debug("Death pipe closed (driver gone or shutting down); stopping queues")
        with self._lock:
            self._driver_gone = True
            queues = self._queues
        if queues is None:
            # Still starting up: interrupt whatever the main thread is doing.
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._shut_down_queues()

    def _shut_down_queues(self) -> None:
        self.stopping.set()
        for mq in self._queues or ():
            mq.shutdown()


def _configure_logging(config: ExecutorConfig) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mpexec").setLevel(config.log_level)


def _report_startup_failure(ready_writer: Connection, rank: int, exc: BaseException) -> None:
    failure = capture_failure(exc)
    try:
        ready_writer.send({"status": FAILED_STR, "rank": rank, "exc_type": failure.exc_type,
                           "traceback": failure.traceback})
    except OSError:  # the driver is gone or stopped listening
        pass


def worker_main(**kwargs: Any) -> None:
    """Entry point of a worker process (see the module docstring)."""
    shutdown_requested = threading.Event()

    def signal_handler(signum: int, frame: FrameType | None) -> None:
        if not shutdown_requested.is_set():
            shutdown_requested.set()
            logger.debug("WorkerProc handling signal %d, raising SystemExit", signum)
            raise SystemExit()

    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal_handler)

    ready_writer: Connection | None = kwargs.pop("ready_pipe")
    death_pipe: Connection | None = kwargs.pop("death_pipe", None)
    close_inherited_fds(kwargs.pop("inherited_fds", []))
    cpus = kwargs.pop("cpu_affinity", None)
    config: ExecutorConfig = kwargs["config"]
    rank: int = kwargs["rank"]
    watcher = DeathPipeWatcher(death_pipe)
    worker: WorkerProc | None = None
    failed = False
    try:
        watcher.start()
        _configure_logging(config)
        apply_cpu_affinity(cpus)
        if config.trace:
            tracing.enable(f"Worker_{rank}")
        with tracing.span("worker.start", rank=rank):
            worker = WorkerProc(**kwargs)
        assert worker.rpc_broadcast_mq is not None and worker.worker_response_mq is not None
        watcher.watch([worker.rpc_broadcast_mq, worker.worker_response_mq])
        assert ready_writer is not None
        ready_writer.send({
            "status": READY_STR,
            "handle": worker.worker_response_mq.export_handle(),
            "peer_response_handles": worker.peer_response_handles,
        })
        # Keep this order in step with MultiprocExecutor: the driver waits on
        # the broadcast queue first, then on each reply queue in rank order.
        # Waiting on our reply queue first would leave the driver stuck on
        # the broadcast queue (which needs us as a reader) while we wait for
        # it as the reader of our reply queue: a deadlock.
        worker.rpc_broadcast_mq.wait_until_ready()
        worker.worker_response_mq.wait_until_ready()
        ready_writer.close()
        ready_writer = None
        worker.worker_busy_loop()
    except Exception as exc:
        if ready_writer is not None:
            logger.exception("WorkerProc failed to start.")
            _report_startup_failure(ready_writer, rank, exc)
            failed = True
        elif shutdown_requested.is_set() or watcher.stopping.is_set():
            logger.info("WorkerProc shutting down.")
        elif isinstance(exc, QueueClosedError):
            # The driver shut the broadcast queue or died (the queue noticed
            # before the death pipe did): the same end as an EOF there.
            logger.info("WorkerProc shutting down: %s", exc)
        else:
            logger.exception("WorkerProc failed.")
            failed = True
        # No SystemExit from a signal from now on: cleanup must finish.
        shutdown_requested.set()
    except SystemExit:
        logger.warning("WorkerProc was terminated")
        raise
    finally:
        if ready_writer is not None:
            ready_writer.close()
        if death_pipe is not None:
            death_pipe.close()
        if worker is not None:
            worker.shutdown()
    if failed:
        sys.exit(1)
