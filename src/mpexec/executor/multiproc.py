"""MultiprocExecutor: the driver with one local process per worker.

::

    driver (driver.Driver)                        worker r (worker_proc.py)
    ----------------------                        -------------------------
    rpc_broadcast_mq (writer) --- every Call ---> dequeue, run
    reply queue r (reader)    <----- Reply ------ reply (if r replies)
    death pipe r ------------- EOF on close / driver death ---> exit
    pidfd r  <----------------- readable when r exits (monitor)

Start-up (``_start_workers``): reserve the rendezvous port, create the
broadcast queue, build every ``WorkerContext`` and ``WorkerSpec``, start
every worker through the local launcher (``executor.local``), admit the
follower nodes when there are several (``executor.nodes``), wait for every
``Ready``, attach to each reply queue, then the handshake - broadcast queue
first, then the reply queues in rank order.

A queue whose far end is on a follower node waits (bounded by the node
timeout) for the node monitor's verdict, so the error names the node.
Every wait of the start also gives up once ``start``'s ``cancel`` event is
set (``Executor.start``): for the nodes and the workers within 50 ms, in the
handshake within its 1.5 s slice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from mpexec.config import ExecutorConfig
from mpexec.errors import WorkerStartupError
from mpexec.executor.driver import Driver
from mpexec.executor.handshake import handshake
from mpexec.executor.launcher import WatchedWorker
from mpexec.executor.local.launcher import LocalProcessLauncher, LocalWorkerHandle
from mpexec.executor.nodes.handle import RemoteNodeHandle
from mpexec.executor.nodes.leader import (
    NodeServer,
    admit_followers,
    reply_handles_when_ready,
    start_cluster,
)
from mpexec.executor.spec import PortReservation, spec_factories, worker_contexts
from mpexec.executor.stall import StallWatch, startup_guard
from mpexec.ipc import MessageQueue
from mpexec.system import get_mp_context, maybe_force_spawn


class MultiprocExecutor(Driver):
    """One worker process per local rank; see the module docstring."""

    def __init__(self, config: ExecutorConfig, monitor_workers: bool | None = None, *,
                 cancel: threading.Event | None = None) -> None:
        super().__init__(config, monitor_workers, cancel=cancel)
        # Several nodes: the leader's node channel and one handle per follower.
        self.cluster: NodeServer | None = None
        self._remote_handles: dict[int, RemoteNodeHandle] = {}

    # -- start-up ---------------------------------------------------------------

    def _start_workers(self, deadline: float) -> None:
        config, life = self.config, self.lifecycle
        parallel = self.parallel_config
        self.raise_if_start_cancelled()
        if parallel.nnodes_within_dp > 1 and parallel.node_rank_within_dp != 0:
            raise ValueError(
                f"node_rank {parallel.node_rank} is a follower node: run `mpexec node` (or "
                "mpexec.executor.nodes.run_follower) there; the executor lives on node 0")
        # Followers: this replica's other nodes, or every node of a replica
        # driven from here with no worker of its own (remote_replica).
        multinode = bool(parallel.follower_nodes)
        if multinode:
            self.cluster = start_cluster(config, life)
        # Several nodes: master_port and the ports above it are the replicas'
        # node channels; torch gets a port of its own.
        life.port = PortReservation(parallel.master_addr, 0 if parallel.nnodes > 1
                                    else parallel.master_port)
        mq = MessageQueue(self.world_size, self.local_world_size,
                          max_chunk_bytes=config.mq_max_chunk_bytes,
                          max_chunks=config.mq_max_chunks, name="broadcast",
                          spin_s=config.mq_spin_s,
                          connect_ip=parallel.master_addr if multinode else None,
                          secret=None if self.cluster is None else self.cluster.secret,
                          curve=config.cluster_curve)
        self.rpc_broadcast_mq = mq
        life.queues.append(mq)
        context = get_mp_context(maybe_force_spawn(config.mp_start_method))
        if config.shared_worker_lock:
            self.shared_worker_lock = context.Lock()
        contexts = worker_contexts(config, life.port.init_method, self.shared_worker_lock)
        launcher = LocalProcessLauncher(context)
        handle = mq.export_handle()
        stall = life.stall = StallWatch(self.local_world_size, config.worker_stall_timeout_s,
                                        config.worker_stopped_timeout_s)
        local_handles: list[LocalWorkerHandle] = []
        for spec_for in spec_factories(config, contexts, handle, stall.ref(), stall.beat_s):
            local_handles.append(launcher.start(spec_for))
            life.handles.append(local_handles[-1])
        # Every worker exists before we wait for any: a real worker's
        # init_device joins a collective with all of its peers (followers'
        # included: they get their configuration before we wait).
        cluster = self.cluster
        if cluster is not None:
            self._remote_handles = admit_followers(cluster, life.handles, config, handle,
                                                   life.port.init_method, deadline,
                                                   cancelled=self.start_cancelled)
        self.raise_if_start_cancelled()
        # A stopped or hung worker fails the start within its bound, not at the deadline.
        stalled = startup_guard(stall, local_handles) if stall.enabled else None
        tick = partial(_cancelled_or_stalled, self.raise_if_start_cancelled, stalled)
        reply_handles = reply_handles_when_ready(local_handles, cluster, deadline,
                                                 config.startup_timeout_s, tick,
                                                 stall.tick_s or 0.05,
                                                 cancelled=self.start_cancelled)
        self.raise_if_start_cancelled()
        for rank in range(self._start_rank, self._start_rank + self.world_size):
            # Remote ranks' reply queues are read over the network (the
            # seed's peer_worker_response_mqs); local ones through shared memory.
            reply_mq = MessageQueue.create_from_handle(
                reply_handles[rank], 0, spin_s=config.mq_spin_s,
                secret=None if cluster is None else cluster.secret)
            self.response_mqs.append(reply_mq)
            life.queues.append(reply_mq)
        self.replies.attach(self.response_mqs, self.calls.lock)
        lost = None if cluster is None else cluster.lost_during_start
        handshake(mq, self.response_mqs, deadline, config.startup_timeout_s,
                  partial(_lost_or_stalled, tick, lost), explain_closed=life.handshake_failure)

    # -- failure -------------------------------------------------------------------

    def _handle(self, rank: int) -> WatchedWorker:
        remote = self._remote_handles.get(rank)
        if remote is not None:
            return remote  # a follower node's handle
        return super()._handle(rank)



def _cancelled_or_stalled(cancelled: Callable[[], None],
                          stalled: Callable[[], None] | None) -> None:
    """A start-up wait's tick: raises WorkerStartupError once the start is
    cancelled, or for a stalled worker."""
    cancelled()
    if stalled is not None:
        stalled()


def _lost_or_stalled(tick: Callable[[], None],
                     lost: Callable[[], str | None] | None) -> str | None:
    tick()  # raises WorkerStartupError: cancelled, or a stalled worker
    return None if lost is None else lost()


__all__ = ["MultiprocExecutor", "WorkerStartupError"]
