"""A follower node: ``mpexec node`` and :func:`run_follower`.

A follower runs headless: it has no caller of its own.  It joins the leader
over the node control channel (see ``nodewire`` for the protocol), receives
the executor's configuration from it - the one source of truth - starts its
local workers with their global ranks (``global_start_rank``), tells the
leader where their reply queues are, and then only watches::

    join (JOIN -> CONFIG)  ->  start local workers  ->  READY  ->  watch loop
    join refused:              another secret: AuthenticationError; another mpexec
                               version: NodeVersionError (both: exit status 1)
    from JOIN on (start-up too): PING the leader every node_heartbeat_s;
                               leader silent > timeout  -> end (1); BYE -> end (0)
    start-up fails:            FAILED(what, the worker's traceback, rank), end
    watch loop, every poll:    PING the leader every node_heartbeat_s
                               a worker died            -> FAILED to the leader, end (1)
                               BYE from the leader      -> end, BYE back (0)
                               leader silent > timeout  -> end (1)

The workers read the leader's broadcast queue as remote readers and serve
their replies from reply queues the leader reads remotely (``ipc.remote``);
the follower process itself carries no calls.  Ending is the lifecycle's
one teardown order (death pipes, wait, SIGTERM, SIGKILL), so nothing the
follower started outlives it; its workers also end on their own if the
follower process is killed (parent-death signal, death pipe).
"""

from __future__ import annotations

import logging
import pickle
import secrets
import threading
import time
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import NodeVersionError, WorkerStartupError
from mpexec.executor.launch import wait_for_ready
from mpexec.executor.launcher import LocalProcessLauncher
from mpexec.executor.lifecycle import Lifecycle
from mpexec.executor.nodewire import (
    NONCE,
    VERSION_REFUSED,
    NodeAssignment,
    Session,
    endpoint,
    join_auth,
    this_version,
    version_mismatch,
)
from mpexec.executor.spec import spec_factories, worker_contexts
from mpexec.executor.termination import TerminationPolicy
from mpexec.ipc.auth import (
    BYE,
    CONFIG,
    FAILED,
    JOIN,
    PING,
    READY,
    AuthenticationError,
    DropCounter,
    is_refusal,
)
from mpexec.ipc.curve import secure
from mpexec.system import get_mp_context, maybe_force_spawn

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class NodeClient:
    """The follower's end of the node control channel."""

    def __init__(self, secret: str, master_addr: str, master_port: int, node_rank: int,
                 curve: bool = False) -> None:
        import zmq

        self._zmq = zmq
        self.secret = secret
        self.node_rank = node_rank
        self.address = f"{master_addr}:{master_port}"
        self.drops = DropCounter(f"node channel to {self.address}")
        self._context = zmq.Context(1)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        if ":" in master_addr:
            sock.setsockopt(zmq.IPV6, 1)
        if curve:
            secure(sock, secret, server=False)
        sock.connect(endpoint(master_addr, master_port))
        self._sock = sock
        self._nonce = secrets.randbits(63)
        self.session = Session(secret, self._nonce, "f2l", "l2f", self.drops)
        self.last_heard = time.monotonic()

    def join(self, timeout_s: float) -> NodeAssignment:
        """JOIN, then the leader's CONFIG; a refusal is an ``AuthenticationError``
        (another secret) or a ``NodeVersionError`` (another mpexec)."""
        zmq = self._zmq
        self._sock.send_multipart(join_auth(self.secret, "f2l").seal(
            JOIN, self.node_rank, 1, [NONCE.pack(self._nonce), this_version()]))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"node {self.node_rank}: no answer from the leader at "
                                   f"{self.address} within {timeout_s:g}s")
            if not self._sock.poll(int(min(remaining, _POLL_S) * 1000), zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            reason = is_refusal(frames)
            if reason is not None and reason.startswith(VERSION_REFUSED):
                raise NodeVersionError(f"node {self.node_rank}: the leader at {self.address} "
                                       f"refused to admit this node: {reason}")
            if reason is not None:
                raise AuthenticationError(
                    f"node {self.node_rank}: the leader at {self.address} refused to admit "
                    f"this node ({reason}); give it the leader's cluster secret "
                    "(MPEXEC_CLUSTER_SECRET or --secret-file)")
            opened = self.session.open(frames)
            if opened is not None and opened.kind == CONFIG and opened.rank == self.node_rank:
                self.last_heard = time.monotonic()
                mismatch = version_mismatch(
                    opened.parts[1] if len(opened.parts) > 1 else None, "leader", "follower")
                if mismatch is not None:  # checked before anything is unpickled
                    self.send(FAILED, [mismatch.encode()])
                    raise NodeVersionError(f"node {self.node_rank}: {mismatch}")
                assignment = pickle.loads(opened.parts[0])  # authenticated, in order
                if not isinstance(assignment, NodeAssignment):
                    raise TypeError(f"the leader sent {type(assignment).__name__}")
                return assignment

    def send(self, kind: int, parts: list[Any]) -> None:
        try:
            self._sock.send_multipart(self.session.seal(kind, self.node_rank, parts),
                                      self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
            pass  # backed up: the leader will call us lost, or we it

    def poll(self, wait_s: float) -> int | None:
        """The kind of the next authentic frame within ``wait_s``, or None."""
        zmq = self._zmq
        if not self._sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return None
        opened = self.session.open(self._sock.recv_multipart())
        if opened is None:
            return None
        self.last_heard = time.monotonic()
        return opened.kind

    def close(self) -> None:
        self._sock.close(200)
        self._context.term()


def run_follower(nnodes: int, node_rank: int, master_addr: str, master_port: int, *,
                 secret: str | None = None, bind_addr: str | None = None,
                 join_timeout_s: float = 300.0,
                 stop: threading.Event | None = None, curve: bool | None = None) -> int:
    """Serve as follower ``node_rank`` of the executor led from ``master_addr:master_port``.

    Returns the exit status: 0 when the leader ended the executor, 1 when a
    worker failed or the leader was lost.  ``secret`` defaults to
    ``MPEXEC_CLUSTER_SECRET``; ``bind_addr`` (where this node's reply queues
    listen, default the leader's ``node_bind_addr``) must be reachable from
    the leader.  ``stop`` set from another thread ends the node as a BYE would.
    """
    if secret is None:
        from mpexec.envs import load_envs

        secret = load_envs().cluster_secret
    if not secret:
        raise ValueError("a follower node needs the leader's cluster secret "
                         "(secret=, MPEXEC_CLUSTER_SECRET or --secret-file)")
    if not 0 < node_rank < nnodes:
        raise ValueError(f"node_rank must be in [1, nnodes={nnodes}) for a follower, "
                         f"got {node_rank}")
    if curve is None:  # the node channel speaks CURVE before any CONFIG can say so
        from mpexec.envs import load_envs

        curve = load_envs().cluster_curve
    client = NodeClient(secret, master_addr, master_port, node_rank, curve=curve)
    try:
        assignment = client.join(join_timeout_s)
        config = assignment.config
        if config.parallel.nnodes != nnodes or config.parallel.node_rank != node_rank:
            raise ValueError(f"the leader runs nnodes={config.parallel.nnodes}, this node was "
                             f"started with nnodes={nnodes}, node_rank={node_rank}")
        return _serve(client, config, assignment, secret, bind_addr or config.node_bind_addr,
                      stop or threading.Event())
    finally:
        client.close()


def _serve(client: NodeClient, config: ExecutorConfig, assignment: NodeAssignment,
           secret: str, bind_addr: str, stop: threading.Event) -> int:
    life = Lifecycle(TerminationPolicy(config.shutdown_grace_s, config.shutdown_term_s))
    try:
        try:
            _start_workers(life, config, assignment, secret, bind_addr)
            deadline = time.monotonic() + config.startup_timeout_s
            # The heartbeat runs during start-up too: the leader would call
            # this node lost after node_timeout_s, however long loading takes.
            ready = wait_for_ready(life.handles, deadline, config.startup_timeout_s,
                                   tick=_StartupBeat(client, config, stop), tick_s=_POLL_S)
        except WorkerStartupError as exc:
            rank = "" if exc.rank is None else str(exc.rank)
            client.send(FAILED, [exc.args[0].encode(), exc.remote_traceback.encode(),
                                 rank.encode()])
            raise
        except _LeaderEnded:
            logger.info("node %d: the leader ended the executor during start-up",
                        client.node_rank)
            life.close()
            client.send(BYE, [])
            return 0
        except _LeaderLost as exc:
            logger.error("node %d: %s; ending this node", client.node_rank, exc)
            return 1
        client.send(READY, [pickle.dumps({m.rank: m.reply_handle for m in ready})])
        logger.info("node %d: ranks %s ready", client.node_rank,
                    [h.rank for h in life.handles])
        return _watch(client, config, life, stop)
    finally:
        life.close()


class _LeaderEnded(Exception):
    """BYE from the leader (or ``stop``) while the workers were starting."""


class _LeaderLost(Exception):
    """The leader fell silent while the workers were starting."""


class _StartupBeat:
    """The watch loop's heartbeat, as a ``wait_for_ready`` tick (start-up)."""

    def __init__(self, client: NodeClient, config: ExecutorConfig,
                 stop: threading.Event) -> None:
        self.client = client
        self.config = config
        self.stop = stop
        self.next_ping = 0.0

    def __call__(self) -> None:
        client = self.client
        now = time.monotonic()
        if now >= self.next_ping:
            self.next_ping = now + self.config.node_heartbeat_s
            client.send(PING, [])
        while (kind := client.poll(0)) is not None:
            if kind == BYE:
                raise _LeaderEnded
        if self.stop.is_set():
            raise _LeaderEnded
        silent = time.monotonic() - client.last_heard
        if silent > self.config.node_timeout_s:
            raise _LeaderLost(f"the leader at {client.address} is gone (no heartbeat for "
                              f"{silent:.1f} s)")


def _start_workers(life: Lifecycle, config: ExecutorConfig, assignment: NodeAssignment,
                   secret: str, bind_addr: str) -> None:
    context = get_mp_context(maybe_force_spawn(config.mp_start_method))
    launcher = LocalProcessLauncher(context)
    contexts = worker_contexts(config, assignment.distributed_init_method)
    for spec_for in spec_factories(config, contexts, assignment.broadcast_handle,
                                   reply_connect_ip=bind_addr, cluster_secret=secret):
        life.handles.append(launcher.start(spec_for))


def _watch(client: NodeClient, config: ExecutorConfig, life: Lifecycle,
           stop: threading.Event) -> int:
    next_ping = 0.0
    while True:
        now = time.monotonic()
        if now >= next_ping:
            next_ping = now + config.node_heartbeat_s
            client.send(PING, [])
        # Exit code 0 is a worker leaving because the leader closed the
        # broadcast queue: the leader's BYE is on its way.
        dead = next((h for h in life.handles if not h.is_alive() and h.exitcode != 0), None)
        if dead is not None:
            what = (f"worker rank {dead.rank} (pid {dead.pid}) died: "
                    f"{dead.describe_exit()}")
            logger.error("node %d: %s", client.node_rank, what)
            client.send(FAILED, [what.encode()])
            return 1
        if stop.is_set():
            client.send(BYE, [])
            return 0
        # The leader's monitor heartbeats from our JOIN on, also while its
        # own workers are still starting, so silence means it is gone.
        silent = now - client.last_heard
        if silent > config.node_timeout_s:
            logger.error("node %d: the leader at %s is gone (no heartbeat for %.1f s); "
                         "ending this node", client.node_rank, client.address, silent)
            return 1
        kind = client.poll(_POLL_S)
        if kind == BYE:
            logger.info("node %d: the leader ended the executor", client.node_rank)
            life.close()
            client.send(BYE, [])
            return 0
