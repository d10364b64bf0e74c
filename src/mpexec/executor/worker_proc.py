"""The worker side of MultiprocExecutor: one WorkerProc per child process.

Start-up, in the child (``worker_main(spec)``)::

    install SIGTERM/SIGINT handlers (each turns into one SystemExit), and
    their backstop: unhandled within a second (the main thread stuck in
    native code), the signal's default action ends the process
    set the process title (``mpexec::Worker_TP1``), before anything else
    lead a new process group; arm the parent-death signal (SIGTERM) when asked
    close the siblings' pipe ends inherited through fork; thread counts; pin CPUs
    start the death-pipe watcher (``watcher``)
    WorkerProc(spec): worker_cls(spec.context, **worker_kwargs), init_device,
                      load_model, attach the broadcast queue, create the reply queue
    ready pipe  -> Ready(rank, reply handle)      (StartupFailed(rank, failure) on error)
    broadcast queue wait_until_ready, then reply queue wait_until_ready
    worker_busy_loop()

The busy loop: dequeue a call (waiting indefinitely), run it, and if this
rank replies (``output_rank`` is None or this rank) send a ``Reply`` on the
reply queue - directly, or through the output thread when async scheduling
is on, so that the next call starts while the reply goes out.  A call whose
message cannot be unpickled here is still answered: call ids grow by one,
so the worker knows which call it was and replies with the failure (every
rank does; a reply the driver does not wait for is dropped as stale).
``SystemExit`` raised by a method is an error reply like any other; only the
one our own signal handler raises ends the worker.

What ends it: the driver closes the broadcast queue or the death pipe, or
dies (see ``watcher``).  See ``protocol`` for the message formats.
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

from mpexec.errors import QueueClosedError, UndecodableMessageError
from mpexec.executor.protocol import (
    Ready,
    RemoteFailure,
    StartupFailed,
    capture_failure,
    qualified_type_name,
)
from mpexec.executor.ranks import worker_name
from mpexec.executor.spec import WorkerSpec
from mpexec.executor.tracing import NO_TRACER, Tracer
from mpexec.executor.watcher import DeathPipeWatcher, Heartbeat, SignalBackstop, end_own_group
from mpexec.executor.worker_base import WorkerWrapperBase
from mpexec.ipc import MessageQueue, QueueReader
from mpexec.outputs import AsyncModelRunnerOutput
from mpexec.system import (
    apply_cpu_affinity,
    apply_thread_env_in_child,
    become_group_leader,
    close_inherited_fds,
    decorate_logs,
    set_parent_death_signal,
    set_process_title,
)

logger = logging.getLogger(__name__)

_STOP = object()  # tells the output thread to finish
_THREAD_JOIN_S = 2.0


class WorkerProc:
    """Runs one worker in this (child) process."""

    def __init__(self, spec: WorkerSpec, tracer: Tracer, is_stopping: threading.Event) -> None:
        self.spec = spec
        self.config = spec.config
        self.rank = spec.rank
        self.local_rank = spec.context.local_rank
        self.tracer = tracer
        self._signalled = is_stopping
        self.rpc_broadcast_mq: QueueReader | None = None
        self.worker_response_mq: MessageQueue | None = None
        self.use_async_scheduling = self.config.scheduler.async_scheduling
        self.async_output_queue: queue.Queue[Any] = queue.Queue()
        self.async_output_copy_thread: threading.Thread | None = None
        self.worker = WorkerWrapperBase(rpc_rank=self.local_rank, global_rank=self.rank)
        self._is_shut_down = False
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        spec = self.spec
        self.worker.init_worker_from_context(spec.context)
        name = worker_name(self.rank, self.config.parallel)
        set_process_title(name)  # again: a Ray actor runs WorkerProc without worker_main
        decorate_logs(name)
        with self.tracer.span("worker.init_device", rank=self.rank):
            self.worker.init_device()
        with self.tracer.span("worker.load_model", rank=self.rank):
            self.worker.load_model()
        if self.use_async_scheduling:
            self.async_output_copy_thread = threading.Thread(
                target=self.async_output_busy_loop, daemon=True, name="WorkerAsyncOutputCopy")
            self.async_output_copy_thread.start()
        spin_s = self.config.mq_spin_s
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(
            spec.broadcast_handle, self.rank, spin_s=spin_s, secret=spec.cluster_secret)
        # On a follower node the driver is on another host: the reply queue's
        # one reader is remote (n_local_reader 0).
        remote_driver = spec.reply_connect_ip is not None
        self.worker_response_mq = MessageQueue(
            1, 0 if remote_driver else 1, max_chunk_bytes=self.config.mq_max_chunk_bytes,
            max_chunks=self.config.mq_max_chunks, name=f"reply{self.rank}", spin_s=spin_s,
            connect_ip=spec.reply_connect_ip, secret=spec.cluster_secret,
            curve=self.config.cluster_curve)

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
            mq.enqueue((call_id, False, capture_failure(exc, "the result cannot be sent")))

    def handle_output(self, call_id: int, output: Any) -> None:
        if self.use_async_scheduling:
            self.async_output_queue.put((call_id, output))
        else:
            self.enqueue_output(call_id, output)

    def async_output_busy_loop(self) -> None:
        # A new thread starts without the main thread's device binding: a
        # CUDA worker's replies are copied from its device in this thread, so
        # it binds the worker's device first (or the worker's own
        # bind_output_thread() does it).
        bind = getattr(self.worker.worker, "bind_output_thread", None)
        if bind is not None:
            bind()
        else:
            bind_device(self.spec.context.device)
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
        traced = self.tracer.enabled
        last_call_id = 0
        parent = None
        while True:
            try:
                if traced:  # a sixth element: the driver's span (W3C traceparent)
                    call_id, method, args, kwargs, output_rank, parent = mq.dequeue(
                        indefinite=True)
                else:
                    call_id, method, args, kwargs, output_rank = mq.dequeue(indefinite=True)
            except (UndecodableMessageError, OSError) as exc:
                # A message the transport consumed but could not deliver (its
                # unpickling failed, or no memory to map it): the call fails,
                # the worker serves the next one.  Anything else propagates.
                last_call_id += 1
                logger.warning("rank %d: call %d could not be unpickled: %s", rank,
                               last_call_id, exc)
                # The caller wants the unpickling error itself, not the wrapper.
                cause = exc.__cause__ if isinstance(exc, UndecodableMessageError) else None
                handle_output(last_call_id, capture_failure(
                    cause if isinstance(cause, Exception) else exc,
                    f"the arguments of call {last_call_id} could not be unpickled"))
                continue
            last_call_id = call_id
            replies = output_rank is None or output_rank == rank
            try:
                if isinstance(method, str):
                    func = worker.resolve(method)
                else:
                    func = partial(cloudpickle.loads(method), worker)
                if traced:
                    with self.tracer.span("worker.call", parent=parent, rank=rank,
                                          call_id=call_id,
                                          method=method if isinstance(method, str)
                                          else "callable"):
                        output = func(*args, **kwargs)
                else:
                    output = func(*args, **kwargs)
            except (Exception, SystemExit) as exc:
                if isinstance(exc, SystemExit) and self._signalled.is_set():
                    raise  # our own signal handler: leave
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
        release_distributed(self.rank)


def bind_device(device: str) -> None:
    """Make ``device`` (``"cuda:N"``) the current CUDA device of this thread.

    Nothing for a CPU device; looked up in ``sys.modules`` so that this
    module stays importable without torch (a CUDA worker has imported it).
    """
    torch = sys.modules.get("torch")
    if not device.startswith("cuda") or torch is None:
        return
    torch.cuda.set_device(device)


def release_distributed(rank: int) -> None:
    """Leave torch.distributed if this worker joined it and is still in it.

    Any worker class may initialise ``torch.distributed`` (or build
    ``mpexec.distributed`` groups); one that does not tear it down in its own
    ``shutdown()`` would leave its process groups (and their sockets, or NCCL
    communicators) to the exit of the process.  Looked up in ``sys.modules``
    only: a worker that never imported torch pays nothing, and this module
    stays importable without torch.
    """
    state = sys.modules.get("mpexec.distributed.parallel_state")
    try:
        if state is not None:
            state.destroy_distributed_environment()
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            logger.debug("rank %d: left torch.distributed at shutdown", rank)
    except Exception as exc:  # a peer already gone: nothing left to free
        logger.debug("rank %d: leaving torch.distributed failed: %s", rank, exc)


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mpexec").setLevel(level)


def _report_startup_failure(ready_writer: Connection, rank: int, exc: BaseException) -> None:
    try:
        ready_writer.send(StartupFailed(rank, capture_failure(exc)))
    except OSError:  # the driver is gone or stopped listening
        pass


def _prepare_process(spec: WorkerSpec) -> None:
    if spec.environ is not None:  # forked from the fork server: the driver's environment
        os.environ.clear()
        os.environ.update(spec.environ)
    become_group_leader()
    armed = spec.parent_death_signal and set_parent_death_signal(signal.SIGTERM,
                                                                 spec.driver_pid)
    if spec.parent_death_signal and not armed and os.getppid() != spec.driver_pid:
        raise SystemExit("the driver exited before this worker started")
    close_inherited_fds(spec.inherited_fds)
    apply_thread_env_in_child(spec.thread_env)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process (see the module docstring)."""
    signalled = threading.Event()
    backstop = SignalBackstop()

    def signal_handler(signum: int, frame: FrameType | None) -> None:
        backstop.handled()
        if not signalled.is_set():
            signalled.set()
            logger.debug("WorkerProc handling signal %d, raising SystemExit", signum)
            raise SystemExit()

    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal_handler)
    backstop.install()  # a main thread stuck in native code still ends on SIGTERM
    # The title first, whatever the start method: a child of the fork server
    # replaces its environment next, and setproctitle, once the environment
    # has moved, no longer finds the memory it rewrites (``ps`` would show
    # the fork server's command line).
    set_process_title(worker_name(spec.rank, spec.config.parallel))
    _prepare_process(spec)
    heartbeat = None if spec.heartbeat is None else Heartbeat(
        spec.heartbeat, spec.heartbeat_index, spec.heartbeat_s)
    ready_writer: Connection = spec.ready_pipe
    reported = False
    rank = spec.rank
    watcher = DeathPipeWatcher(spec.death_pipe, spec.driver_pid)
    worker: WorkerProc | None = None
    tracer = NO_TRACER
    failed = False
    try:
        if heartbeat is not None:
            heartbeat.start()  # first: the driver judges start-up by it too (``stall``)
        watcher.start()
        _configure_logging(spec.config.log_level)
        apply_cpu_affinity(spec.cpu_affinity)
        tracer = Tracer.create(spec.trace, f"Worker_{rank}", spec.config.trace_exporter)
        with tracer.span("worker.start", parent=spec.trace_parent, rank=rank):
            worker = WorkerProc(spec, tracer, signalled)
        assert worker.rpc_broadcast_mq is not None and worker.worker_response_mq is not None
        watcher.watch([worker.rpc_broadcast_mq, worker.worker_response_mq])
        try:
            ready_writer.send(Ready(rank, worker.worker_response_mq.export_handle()))
        except BrokenPipeError as exc:
            raise QueueClosedError("the driver stopped waiting for this worker's "
                                   "start-up") from exc
        # Keep this order in step with the driver: it waits on the broadcast
        # queue first, then on each reply queue in rank order.  Waiting on our
        # reply queue first would leave the driver stuck on the broadcast
        # queue (which needs us as a reader) while we wait for it as the
        # reader of our reply queue: a deadlock.
        worker.rpc_broadcast_mq.wait_until_ready()
        worker.worker_response_mq.wait_until_ready()
        ready_writer.close()
        reported = True
        worker.worker_busy_loop()
    except Exception as exc:
        # The driver shut the broadcast queue, closed the death pipe or died:
        # what failed here is a consequence (a QueueClosedError), not news.
        ended_by_driver = signalled.is_set() or watcher.stopping.is_set() or isinstance(
            exc, QueueClosedError)
        if not reported:
            if ended_by_driver:
                # Another rank failed its start and the driver gave up on all.
                logger.info("WorkerProc start-up abandoned by the driver: %s", exc)
            else:
                logger.exception("WorkerProc failed to start.")
            _report_startup_failure(ready_writer, rank, exc)
            failed = True
        elif ended_by_driver:
            # The orderly end.
            logger.debug("WorkerProc shutting down: %s", exc)
        else:
            logger.exception("WorkerProc failed.")
            failed = True
        # No SystemExit from a signal from now on: cleanup must finish.
        signalled.set()
    except SystemExit:
        logger.debug("WorkerProc was terminated")
        raise
    finally:
        if not reported:
            ready_writer.close()
        if worker is not None:
            worker.shutdown()
        tracer.shutdown()
        spec.death_pipe.close()
        if heartbeat is not None:
            heartbeat.stop()
        watcher.main_done.set()
        if watcher.driver_gone():
            end_own_group()  # nobody else will end what we started
    if failed:
        sys.exit(1)
