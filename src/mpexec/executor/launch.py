"""Starting worker processes and waiting for them to report READY (driver side).

``make_worker_process`` creates two one-way pipes per worker and starts it:

    ready pipe   worker -> driver   one message: READY (+ reply queue handle) or FAILED
    death pipe   driver -> worker   never written; the driver closing it is the message

``wait_for_ready`` waits on every ready pipe *and* every process sentinel
with one ``multiprocessing.connection.wait``, so a worker that dies without a
word is noticed as quickly as one that reports a failure.  The first failure
becomes a ``WorkerStartupError`` carrying the worker's traceback; the caller
then reaps every process started so far.

``Resources`` lists what the driver started (processes, death pipes, queues,
the monitor thread) apart from the executor, so that ``weakref.finalize`` can
release it all - at shutdown, after a failed start, or at interpreter exit -
without keeping the executor alive.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import PeerDiedError, WorkerStartupError, describe_exitcode
from mpexec.executor.handles import UnreadyWorkerProcHandle, WorkerProcHandle
from mpexec.executor.protocol import READY_STR
from mpexec.executor.termination import TerminationPolicy
from mpexec.executor.worker_proc import worker_main
from mpexec.ipc import Handle, MessageQueue
from mpexec.ipc.message_queue import DEFAULT_SPIN_S
from mpexec.system import maybe_force_spawn, set_worker_thread_env, worker_thread_env

_EXITCODE_WAIT_S = 1.0
_MONITOR_JOIN_S = 2.0


def make_worker_process(
    context: Any,
    config: ExecutorConfig,
    local_rank: int,
    rank: int,
    distributed_init_method: str,
    input_shm_handle: Handle | None,
    shared_worker_lock: Any,
    is_driver_worker: bool,
    inherited_fds: list[int] | None = None,
) -> UnreadyWorkerProcHandle:
    """Start one worker process; it is not READY yet."""
    ready_reader, ready_writer = context.Pipe(duplex=False)
    death_reader, death_writer = context.Pipe(duplex=False)
    if inherited_fds is not None:
        # A forked child must drop the driver's ends of its own pipes too, or
        # it would keep its own death pipe open and never see EOF.
        inherited_fds = [*inherited_fds, ready_reader.fileno(), death_writer.fileno()]
    process_kwargs = {
        "config": config,
        "local_rank": local_rank,
        "rank": rank,
        "distributed_init_method": distributed_init_method,
        "input_shm_handle": input_shm_handle,
        "ready_pipe": ready_writer,
        "death_pipe": death_reader,
        "shared_worker_lock": shared_worker_lock,
        "is_driver_worker": is_driver_worker,
        "inherited_fds": inherited_fds if inherited_fds is not None else [],
        "cpu_affinity": config.cpus_for(local_rank),
    }
    proc = context.Process(target=worker_main, kwargs=process_kwargs,
                           name=f"MpexecWorker-{rank}", daemon=True)
    try:
        with _thread_env(config, local_rank):
            proc.start()
    except BaseException:
        for end in (ready_reader, ready_writer, death_reader, death_writer):
            end.close()
        raise
    finally:
        # Whatever happened, these ends belong to the child now.
        ready_writer.close()
        death_reader.close()
    return UnreadyWorkerProcHandle(proc, rank, ready_reader, death_writer)


@contextlib.contextmanager
def _thread_env(config: ExecutorConfig, local_rank: int) -> Iterator[None]:
    threads = config.omp_threads_for(local_rank)
    if threads is None:
        yield
        return
    with worker_thread_env(threads):
        yield


def _exitcode(handle: UnreadyWorkerProcHandle) -> int | None:
    handle.proc.join(_EXITCODE_WAIT_S)
    return handle.proc.exitcode


def _died(handle: UnreadyWorkerProcHandle, when: str) -> WorkerStartupError:
    how = describe_exitcode(_exitcode(handle))
    return WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.proc.pid}) exited {when} ({how})",
        rank=handle.rank,
    )


def _failed(handle: UnreadyWorkerProcHandle, response: dict[str, Any]) -> WorkerStartupError:
    exc_type = response.get("exc_type", "an error")
    return WorkerStartupError(
        f"worker rank {handle.rank} (pid {handle.proc.pid}) failed during start-up "
        f"with {exc_type}",
        rank=handle.rank,
        remote_traceback=response.get("traceback", ""),
    )


def wait_for_response_handle_ready(
    response: dict[str, Any], proc_handle: UnreadyWorkerProcHandle,
    spin_s: float = DEFAULT_SPIN_S,
) -> WorkerProcHandle:
    """Attach to the reply queue a READY worker announced."""
    response_handle: Handle = response["handle"]
    worker_response_mq = None
    if len(response_handle.local_reader_ranks) > 0:
        worker_response_mq = MessageQueue.create_from_handle(response_handle, 0, spin_s=spin_s)
    peer_worker_response_mqs: list[MessageQueue | None] = [
        MessageQueue.create_from_handle(handle, -1)
        if handle.remote_subscribe_addr is not None else None
        for handle in response["peer_response_handles"]
    ]
    return WorkerProcHandle.from_unready_handle(
        proc_handle, worker_response_mq, peer_worker_response_mqs)


def wait_for_ready(
    unready: list[UnreadyWorkerProcHandle], timeout: float, spin_s: float = DEFAULT_SPIN_S,
) -> list[WorkerProcHandle]:
    """Every worker's READY, in rank order; ``WorkerStartupError`` otherwise.

    On failure, the reply queues attached so far are shut down and the ready
    pipes closed; reaping the processes is the caller's job.
    """
    deadline = time.monotonic() + timeout
    pipes: dict[Connection, UnreadyWorkerProcHandle] = {h.ready_pipe: h for h in unready}
    sentinels = {h.proc.sentinel: h for h in unready}
    ready: list[WorkerProcHandle | None] = [None] * len(unready)
    try:
        while pipes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = ", ".join(str(h.rank) for h in pipes.values())
                raise WorkerStartupError(
                    f"worker rank(s) {late} did not report READY within {timeout:g}s")
            signalled = multiprocessing.connection.wait([*pipes, *sentinels], remaining)
            # Pipes first: a worker that reported FAILED and exited shows up
            # on both, and its message is the better explanation.
            for obj in signalled:
                handle = pipes.pop(obj, None) if isinstance(obj, Connection) else None
                if handle is None:
                    continue
                try:
                    response: dict[str, Any] = handle.ready_pipe.recv()
                except EOFError:
                    raise _died(handle, "during start-up") from None
                finally:
                    handle.ready_pipe.close()
                if response.get("status") != READY_STR:
                    raise _failed(handle, response)
                ready[handle.rank % len(ready)] = wait_for_response_handle_ready(
                    response, handle, spin_s)
            for obj in signalled:
                handle = sentinels.get(obj) if isinstance(obj, int) else None
                if handle is not None and not (handle.ready_pipe in pipes
                                               and handle.ready_pipe.poll()):
                    raise _died(handle, "during start-up")
    except BaseException:
        for handle in pipes.values():
            handle.ready_pipe.close()
        for h in ready:
            if h is not None and h.worker_response_mq is not None:
                h.worker_response_mq.shutdown()
        raise
    return [h for h in ready if h is not None]


def handshake(broadcast: MessageQueue | None, replies: list[MessageQueue],
              deadline: float) -> None:
    """The driver's half of the queue handshake, bounded by ``deadline``."""
    # Ensure message queues are ready.  Will deadlock if re-ordered: each
    # worker waits on the broadcast queue before its reply queue, so we
    # must finish the broadcast handshake before waiting on any reply queue.
    try:
        if broadcast is not None:
            broadcast.wait_until_ready(max(0.0, deadline - time.monotonic()))
        for mq in replies:
            mq.wait_until_ready(max(0.0, deadline - time.monotonic()))
    except PeerDiedError as exc:
        raise WorkerStartupError(f"a worker died during the queue handshake: {exc}") from exc
    except TimeoutError as exc:
        raise WorkerStartupError(f"the queue handshake timed out: {exc}") from exc


def set_multiprocessing_worker_envs(config: ExecutorConfig) -> str:
    """Prepare this process to start workers; returns the start method to use."""
    method = maybe_force_spawn(config.mp_start_method)
    if config.device_type != "cpu" and config.omp_num_threads is None:
        # Accelerator workers: one OpenMP thread each unless the user tuned it.
        set_worker_thread_env(None)
    return method


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Resources:
    """What must be released when the executor goes, held apart from it so
    that ``weakref.finalize`` can release them without keeping it alive."""

    def __init__(self, policy: TerminationPolicy) -> None:
        self.policy = policy
        self.owner_pid = os.getpid()
        self.procs: list[BaseProcess] = []
        self.death_writers: list[Connection] = []
        self.queues: list[MessageQueue] = []
        self.monitor: threading.Thread | None = None

    def release(self) -> None:
        if os.getpid() != self.owner_pid:
            return  # a forked copy must not touch the parent's workers
        for conn in self.death_writers:
            conn.close()
        self.policy.terminate(self.procs)
        for mq in self.queues:
            mq.shutdown()
        monitor = self.monitor
        on_monitor = monitor is threading.current_thread()
        if monitor is not None and not on_monitor:
            monitor.join(_MONITOR_JOIN_S)
        if monitor is None or on_monitor or not monitor.is_alive():
            # Only once the monitor no longer waits on the sentinels these close.
            for proc in self.procs:
                if proc.exitcode is not None:
                    proc.close()
