"""The "shm" call path of RayExecutor across Ray nodes: which queue end is where.

The placement group is placed before any queue exists, so the driver knows
each bundle's Ray node (and so each rank's) up front.  A rank whose bundle is
on the driver's Ray node reads shared memory; any other rank reads over the
network, through the remote readers of ``ipc.remote``, exactly as a follower
node's workers do::

    driver (its Ray node D)                       actor r
    -----------------------                       -------
    QueuePlan: node of every bundle, Ray node addresses, a fresh cluster secret
    broadcast = MessageQueue(N, #ranks on D, local ranks,
                             connect_ip = D's address, secret)
                                   ----- handle, plan.for_rank(r) ---->  constructor args
                                                  attach the broadcast queue
                                                  (on D: shared memory; else a
                                                  RemoteReader, with the secret)
                                                  reply queue: local, or served from
                                                  r's node address (a RemoteWriter)
    reply r = create_from_handle(handle_r, 0, secret)  <--  reply handle (start())

"Same node" means the same Ray node id, never the same IP: several raylets
on one machine (``ray.cluster_utils.Cluster``) are distinct nodes, and their
actors take the remote path.  Every address is the one Ray itself uses for
that node (``NodeManagerAddress``), which every other node reaches by
construction.  The secret is generated per executor (or
``ExecutorConfig.cluster_secret``) and reaches the actors in their
constructor arguments, that is through Ray's own channels.

``ExecutorConfig.cluster_curve`` (``MPEXEC_CLUSTER_CURVE``) encrypts these
remote queues as it does multi-node mp's: the broadcast queue's writer and
each remote actor's reply-queue writer (``WorkerProc``, from the config the
actor is given) speak CURVE with keys derived from that secret, and every
reader learns it from the queue's ``Handle`` (``remote_curve``).  Queues
that stay on the driver's Ray node are shared memory and need none.

Liveness is Ray's: the executor's watcher sees an actor or its node die and
tears down, which shuts every queue and wakes every reader (remote readers
within one tick).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.executor.ray.cluster import bundle_nodes
from mpexec.ipc import MessageQueue, QueueReader
from mpexec.ipc.auth import generate_secret


@dataclass(frozen=True)
class ActorQueues:
    """What one actor is told about its queues (a constructor argument)."""

    # Set for an actor on another Ray node: its reply queue is served from here.
    reply_connect_ip: str | None = None
    cluster_secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class QueuePlan:
    """Which ranks share the driver's Ray node, and the addresses of the others."""

    driver_node: str
    driver_ip: str
    rank_nodes: tuple[str, ...]
    node_ips: dict[str, str]
    secret: str | None = field(default=None, repr=False)

    @property
    def local_ranks(self) -> list[int]:
        return [r for r, node in enumerate(self.rank_nodes) if node == self.driver_node]

    @property
    def remote(self) -> bool:
        return len(self.local_ranks) < len(self.rank_nodes)

    def for_rank(self, rank: int) -> ActorQueues:
        node = self.rank_nodes[rank]
        if node == self.driver_node:
            return ActorQueues(cluster_secret=self.secret)
        return ActorQueues(self.node_ips[node], self.secret)


def plan_queues(ray: Any, group: Any, driver_node: str, world_size: int,
                config: ExecutorConfig) -> QueuePlan:
    """The plan for a placed group (one bundle per rank, bundle index = rank)."""
    rank_nodes = bundle_nodes(ray, group, world_size)
    node_ips = {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in ray.nodes()
                if n.get("Alive", True)}
    driver_ip = node_ips.get(driver_node) or ray.util.get_node_ip_address()
    secret = None
    if any(node != driver_node for node in rank_nodes):
        secret = config.cluster_secret or generate_secret()
    return QueuePlan(driver_node, driver_ip, rank_nodes, node_ips, secret)


def broadcast_queue(config: ExecutorConfig, plan: QueuePlan) -> MessageQueue:
    """The driver's broadcast ring: shared memory for its node's ranks, remote
    readers for the others."""
    world = len(plan.rank_nodes)
    local = plan.local_ranks
    return MessageQueue(world, len(local), local,
                        max_chunk_bytes=config.mq_max_chunk_bytes,
                        max_chunks=config.mq_max_chunks, name="broadcast",
                        spin_s=config.mq_spin_s,
                        connect_ip=plan.driver_ip if plan.remote else None,
                        secret=plan.secret, curve=config.cluster_curve and plan.remote)


def reply_queue(config: ExecutorConfig, plan: QueuePlan, handle: Any) -> QueueReader:
    """The driver's reader of one actor's reply queue (remote when the actor is)."""
    return MessageQueue.create_from_handle(handle, 0, spin_s=config.mq_spin_s,
                                           secret=plan.secret)


__all__ = ["ActorQueues", "QueuePlan", "broadcast_queue", "plan_queues", "reply_queue"]
