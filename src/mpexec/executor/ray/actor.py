"""The worker side of RayExecutor: one :class:`RayWorkerActor` per Ray actor.

``ray.py`` turns this plain class into a Ray actor class (``ray.remote``)
when the executor starts, so importing this module never imports Ray.  The
actor hosts the same pieces a worker process does::

    start()            build the worker from its WorkerContext, init_device,
                       load_model; on the "shm" path also attach the broadcast
                       queue and create the reply queue (WorkerProc does all of
                       it; remote ends for an actor off the driver's Ray node,
                       as ``queues`` says, see ``queues``); returns
                       (pid, node id, reply handle or None)
    serve()            "shm" path: the queue handshake, then WorkerProc's busy
                       loop until the driver closes the broadcast queue
    execute(call)      "ray" path: run one Call, return its Reply
    shutdown_worker()  the worker's own shutdown() (an orderly end)
    wait_exit()        never returns while the actor lives: the driver's
                       liveness probe (it runs in its own concurrency group,
                       so it does not block the calls)

From its constructor on, a ``Heartbeat`` thread stamps the actor's cell
(its local rank) in the heartbeat segment of whoever watches its Ray node
for stalls (the driver, or the node's watch actor: ``watch``), beside the
thread that serves the calls.

Calls and replies have exactly the shapes of ``protocol`` (``Call`` in,
``Reply`` out, failures as ``RemoteFailure``), so the driver decodes them
with the same code as for worker processes.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from typing import Any, cast

import cloudpickle

from mpexec.errors import QueueClosedError
from mpexec.executor.context import WorkerContext
from mpexec.executor.protocol import Reply, capture_failure
from mpexec.executor.ray.queues import ActorQueues
from mpexec.executor.spec import WorkerSpec
from mpexec.executor.tracing import Tracer
from mpexec.executor.watcher import Heartbeat
from mpexec.executor.worker_base import WorkerWrapperBase
from mpexec.executor.worker_proc import WorkerProc, release_distributed
from mpexec.ipc import Handle
from mpexec.ipc.shm import SegmentRef
from mpexec.outputs import AsyncModelRunnerOutput

logger = logging.getLogger(__name__)

SUPERVISE_GROUP = "supervise"


class RayWorkerActor:
    """One worker inside a Ray actor; see the module docstring."""

    def __init__(self, context: WorkerContext, broadcast_handle: Handle | None,
                 driver_pid: int, queues: ActorQueues | None = None,
                 niceness: int | None = None, heartbeat: SegmentRef | None = None,
                 heartbeat_s: float = 1.0) -> None:
        self.context = context
        self.broadcast_handle = broadcast_handle
        self.driver_pid = driver_pid
        self.queues = queues or ActorQueues()
        self.niceness = niceness
        self.proc: WorkerProc | None = None
        self.wrapper: WorkerWrapperBase | None = None
        config = context.config
        self.tracer = Tracer.create(config.trace, f"Worker_{context.rank}",
                                    config.trace_exporter)
        self._exit = threading.Event()
        self.heartbeat: Heartbeat | None = None
        if heartbeat is not None:
            self.heartbeat = Heartbeat(heartbeat, context.local_rank, heartbeat_s)
            self.heartbeat.start()

    def start(self) -> tuple[int, str, Handle | None]:
        import ray  # only ever runs inside a Ray worker

        node_id = ray.get_runtime_context().get_node_id()
        ctx = self.context
        set_niceness(self.niceness)
        if self.broadcast_handle is None:
            wrapper = WorkerWrapperBase(rpc_rank=ctx.local_rank, global_rank=ctx.rank)
            wrapper.init_worker_from_context(ctx)
            wrapper.init_device()
            wrapper.load_model()
            self.wrapper = wrapper
            return os.getpid(), node_id, None
        # WorkerProc reads only the context, the broadcast handle and the
        # settings of its spec: an actor has no ready or death pipe (Ray
        # reports start-up and death to the driver itself).
        spec = WorkerSpec(context=ctx, broadcast_handle=self.broadcast_handle,
                          ready_pipe=cast(Any, None), death_pipe=cast(Any, None),
                          driver_pid=self.driver_pid, parent_death_signal=False,
                          trace=ctx.config.trace,
                          reply_connect_ip=self.queues.reply_connect_ip,
                          cluster_secret=self.queues.cluster_secret)
        self.proc = WorkerProc(spec, self.tracer, threading.Event())
        self.wrapper = self.proc.worker
        assert self.proc.worker_response_mq is not None
        return os.getpid(), node_id, self.proc.worker_response_mq.export_handle()

    # -- the "shm" path ------------------------------------------------------------

    def serve(self) -> None:
        proc = self.proc
        assert proc is not None and proc.rpc_broadcast_mq is not None
        assert proc.worker_response_mq is not None
        set_niceness(self.niceness)  # this thread may be new since start()
        try:
            # The driver's order: broadcast queue first, then the reply queues.
            proc.rpc_broadcast_mq.wait_until_ready()
            proc.worker_response_mq.wait_until_ready()
            proc.worker_busy_loop()
        except QueueClosedError:
            logger.debug("rank %d: the driver closed the queues", self.context.rank)
        finally:
            proc.shutdown()
            self._stop_heartbeat()

    # -- the "ray" path ------------------------------------------------------------

    def execute(self, call: tuple[Any, ...]) -> Reply:
        # A traced driver adds a sixth element: its span, this call's parent.
        call_id, method, args, kwargs = call[:4]
        wrapper = self.wrapper
        assert wrapper is not None
        try:
            if isinstance(method, str):
                func = wrapper.resolve(method)
            else:
                func = partial(cloudpickle.loads(method), wrapper)
            if len(call) > 5:
                with self.tracer.span("worker.call", parent=call[5], rank=self.context.rank,
                                      call_id=call_id,
                                      method=method if isinstance(method, str) else "callable"):
                    output = func(*args, **kwargs)
            else:
                output = func(*args, **kwargs)
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()
        except (Exception, SystemExit) as exc:
            return (call_id, False, capture_failure(exc))
        return (call_id, True, output)

    def shutdown_worker(self) -> None:
        if self.wrapper is not None and self.proc is None:
            self.wrapper.shutdown()
            release_distributed(self.context.rank)  # as WorkerProc.shutdown does
        self._stop_heartbeat()

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    # -- supervision ------------------------------------------------------------------

    def wait_exit(self) -> None:
        self._exit.wait()


def set_niceness(niceness: int | None) -> None:
    """Every thread of this process at ``niceness`` (the driver's).

    Ray starts its workers at nice 15 (``worker_niceness``) so that its own
    daemons win the CPU.  A worker of ours runs each call in lockstep with
    the driver, and at nice 15 on a busy machine it waits behind every other
    process for its turn: it gets the driver's niceness, as a worker process
    does.  Linux keeps niceness per thread, hence every thread; lowering it
    needs CAP_SYS_NICE (or RLIMIT_NICE), and without it the actor stays as
    Ray made it.
    """
    if niceness is None:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError as exc:
            logger.debug("cannot set thread %d to nice %d: %s", tid, niceness, exc)
            return
