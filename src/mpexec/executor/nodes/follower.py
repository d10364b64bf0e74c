"""A follower node: ``mpexec node`` and :func:`run_follower`.

A follower runs headless: it has no caller of its own.  It joins the leader
over the node control channel (see ``wire`` for the protocol), receives
the executor's configuration from it - the one source of truth - starts its
local workers with their global ranks (``global_start_rank``), tells the
leader where their reply queues are, and then only watches::

    join (JOIN -> CONFIG)  ->  start local workers  ->  READY  ->  watch loop
    before joining:            nnodes, node rank, port, join timeout, the leader's
                               address resolving: else ValueError (exit status 2)
    join refused:              another secret: AuthenticationError; another mpexec
                               version: NodeVersionError (both: exit status 1);
                               another nnodes, a node rank out of range or taken:
                               NodeLayoutError (exit status 2)
    from CONFIG on (start-up too): a heartbeat thread PINGs the leader every
                               node_heartbeat_s and hears it;
                               leader silent > timeout  -> end (1); BYE -> end (0)
    start-up fails:            FAILED(what, the worker's traceback, rank), end
                               (a stopped or hung worker too: its stall watch)
    watch loop:                a worker died            -> FAILED to the leader, end (1)
                               a worker stopped or hung -> kill it, FAILED(what, "",
                               (the stall watch)           rank, stopped|silent, pid), end (1)
                               BYE from the leader      -> end, BYE back (0)
                               leader silent > timeout  -> end (1)

The follower watches its own workers for stalls (``stall``: a stopped
process in /proc, a silent heartbeat) as the leader watches its local
ones, because only this machine can see them: the leader turns the report
into the ``WorkerStalledError`` that names the rank.

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
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import NodeLayoutError, NodeVersionError, WorkerStartupError
from mpexec.executor.lifecycle import Lifecycle
from mpexec.executor.local.launcher import LocalProcessLauncher, LocalWorkerHandle
from mpexec.executor.local.ready import wait_for_ready
from mpexec.executor.nodes.wire import (
    LAYOUT_REFUSED,
    VERSION_REFUSED,
    Liveness,
    NodeAssignment,
    Session,
    endpoint,
    join_auth,
    join_parts,
    version_mismatch,
)
from mpexec.executor.spec import spec_factories, worker_contexts
from mpexec.executor.stall import Stall, StallWatch, startup_guard
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
    """The follower's end of the node control channel.

    ``join`` runs on the caller's thread; from ``start_heartbeat`` on, one
    thread of its own owns the socket: it PINGs the leader, hears its
    frames and judges its silence (net of its own lateness, see
    ``wire.Liveness``), so the heartbeat goes on however busy the
    follower's main thread is (starting processes, loading).  The main
    thread sends through ``send`` and reads ``bye`` and ``lost``.
    """

    def __init__(self, secret: str, master_addr: str, master_port: int, node_rank: int,
                 nnodes: int, curve: bool = False) -> None:
        import zmq

        self._zmq = zmq
        self.secret = secret
        self.node_rank = node_rank
        self.nnodes = nnodes
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
        self.liveness = Liveness(_POLL_S)
        self.heard = self.liveness.stamp()
        self.bye = threading.Event()  # the leader said BYE
        self.lost = ""  # why the leader counts as gone ("" while it is not)
        self.changed = threading.Event()  # bye or lost: the main thread looks again
        self._outbox: queue.SimpleQueue[tuple[int, list[Any]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self, timeout_s: float) -> NodeAssignment:
        """JOIN, then the leader's CONFIG; a refusal is an ``AuthenticationError``
        (another secret), a ``NodeVersionError`` (another mpexec) or a
        ``NodeLayoutError`` (another nnodes, a node rank out of range or taken)."""
        zmq = self._zmq
        self._sock.send_multipart(join_auth(self.secret, "f2l").seal(
            JOIN, self.node_rank, 1, join_parts(self._nonce, self.nnodes)))
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
            if reason is not None and reason.startswith(LAYOUT_REFUSED):
                raise NodeLayoutError(f"node {self.node_rank}: the leader at {self.address} "
                                      f"refused to admit this node: {reason}")
            if reason is not None:
                raise AuthenticationError(
                    f"node {self.node_rank}: the leader at {self.address} refused to admit "
                    f"this node ({reason}); give it the leader's cluster secret "
                    "(MPEXEC_CLUSTER_SECRET or --secret-file)")
            opened = self.session.open(frames)
            if opened is not None and opened.kind == CONFIG and opened.rank == self.node_rank:
                self.heard = self.liveness.stamp()
                mismatch = version_mismatch(
                    opened.parts[1] if len(opened.parts) > 1 else None, "leader", "follower")
                if mismatch is not None:  # checked before anything is unpickled
                    self.send(FAILED, [mismatch.encode()])
                    raise NodeVersionError(f"node {self.node_rank}: {mismatch}")
                assignment = pickle.loads(opened.parts[0])  # authenticated, in order
                if not isinstance(assignment, NodeAssignment):
                    raise TypeError(f"the leader sent {type(assignment).__name__}")
                return assignment

    def start_heartbeat(self, heartbeat_s: float, timeout_s: float) -> None:
        """Hand the socket to the heartbeat thread (after ``join``)."""
        self.heard = self.liveness.stamp()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s, timeout_s),
                                        daemon=True, name="MpexecNodeHeartbeat")
        self._thread.start()

    def send(self, kind: int, parts: list[Any]) -> None:
        """Send a frame: from the heartbeat thread once it runs (within a poll)."""
        if self._thread is not None:
            self._outbox.put((kind, parts))
            return
        self._send_now(kind, parts)

    def _send_now(self, kind: int, parts: list[Any]) -> None:
        try:
            self._sock.send_multipart(self.session.seal(kind, self.node_rank, parts),
                                      self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
            pass  # backed up: the leader will call us lost, or we it

    def _beat(self, heartbeat_s: float, timeout_s: float) -> None:
        zmq = self._zmq
        next_ping = 0.0
        while True:
            now = self.liveness.tick()
            while not self._outbox.empty():
                self._send_now(*self._outbox.get())
            if self._stop.is_set():
                return
            if now >= next_ping:
                next_ping = now + heartbeat_s
                self._send_now(PING, [])
            # What arrived while this thread was away is heard before any
            # silence is judged.
            while self._sock.poll(0, zmq.POLLIN):
                opened = self.session.open(self._sock.recv_multipart())
                if opened is None:
                    continue
                self.heard = self.liveness.stamp()
                if opened.kind == BYE:
                    self.bye.set()
                    self.changed.set()
            silent = self.liveness.silence(self.heard, now)
            if silent > timeout_s and not self.lost:
                self.lost = (f"the leader at {self.address} is gone (no heartbeat for "
                             f"{silent:.1f} s)")
                self.changed.set()
            self._sock.poll(int(_POLL_S * 1000), zmq.POLLIN)

    def close(self) -> None:
        thread = self._thread
        if thread is not None:
            self._stop.set()  # the thread sends what is queued, then ends
            thread.join(_POLL_S * 20)
        self._sock.close(200)
        self._context.term()


def _check_follower_args(nnodes: int, node_rank: int, master_addr: str, master_port: int,
                         join_timeout_s: float) -> None:
    """Refuse what could never work, at once, naming the value (``ValueError``)."""
    if nnodes < 2:
        raise ValueError(f"nnodes must be at least 2 for a follower node (node 0 is the "
                         f"leader), got {nnodes}")
    if not 0 < node_rank < nnodes:
        raise ValueError(f"node_rank must be in 1..{nnodes - 1} (nnodes={nnodes}; node 0 is "
                         f"the leader) for a follower, got {node_rank}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port must be a TCP port, 1..65535, got {master_port}")
    if not join_timeout_s > 0 or join_timeout_s == float("inf"):
        raise ValueError(f"join_timeout_s must be a positive number of seconds, got "
                         f"{join_timeout_s:g}")
    try:
        socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"the leader's address {master_addr!r} does not resolve: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None


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
    _check_follower_args(nnodes, node_rank, master_addr, master_port, join_timeout_s)
    if curve is None:  # the node channel speaks CURVE before any CONFIG can say so
        from mpexec.envs import load_envs

        curve = load_envs().cluster_curve
    client = NodeClient(secret, master_addr, master_port, node_rank, nnodes, curve=curve)
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
    # From here on the heartbeat has a thread of its own: starting the
    # workers may keep this one busy longer than node_timeout_s.
    client.start_heartbeat(config.node_heartbeat_s, config.node_timeout_s)
    try:
        try:
            workers = _start_workers(life, config, assignment, secret, bind_addr)
            deadline = time.monotonic() + config.startup_timeout_s
            # The heartbeat runs during start-up too: the leader would call
            # this node lost after node_timeout_s, however long loading takes.
            beat = _StartupBeat(client, stop)
            stall = life.stall
            guard = None if stall is None or not stall.enabled else startup_guard(
                stall, workers)
            ready = wait_for_ready(workers, deadline, config.startup_timeout_s,
                                   tick=beat if guard is None else partial(_both, beat, guard),
                                   tick_s=_POLL_S)
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
        return _watch(client, config, life, workers, stop)
    finally:
        life.close()


class _LeaderEnded(Exception):
    """BYE from the leader (or ``stop``) while the workers were starting."""


class _LeaderLost(Exception):
    """The leader fell silent while the workers were starting."""


class _StartupBeat:
    """What the heartbeat thread found, as a ``wait_for_ready`` tick (start-up)."""

    def __init__(self, client: NodeClient, stop: threading.Event) -> None:
        self.client = client
        self.stop = stop

    def __call__(self) -> None:
        if self.client.bye.is_set() or self.stop.is_set():
            raise _LeaderEnded
        if self.client.lost:
            raise _LeaderLost(self.client.lost)


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()


def _start_workers(life: Lifecycle, config: ExecutorConfig, assignment: NodeAssignment,
                   secret: str, bind_addr: str) -> list[LocalWorkerHandle]:
    context = get_mp_context(maybe_force_spawn(config.mp_start_method))
    launcher = LocalProcessLauncher(context)
    contexts = worker_contexts(config, assignment.distributed_init_method)
    stall = life.stall = StallWatch(len(contexts), config.worker_stall_timeout_s,
                                    config.worker_stopped_timeout_s)
    workers: list[LocalWorkerHandle] = []
    for spec_for in spec_factories(config, contexts, assignment.broadcast_handle,
                                   stall.ref(), stall.beat_s,
                                   reply_connect_ip=bind_addr, cluster_secret=secret):
        workers.append(launcher.start(spec_for))
        life.handles.append(workers[-1])
    return workers


def _watch(client: NodeClient, config: ExecutorConfig, life: Lifecycle,
           workers: list[LocalWorkerHandle], stop: threading.Event) -> int:
    stall = life.stall
    tick_s = None if stall is None else stall.tick_s
    next_check = 0.0
    while True:
        # Exit code 0 is a worker leaving because the leader closed the
        # broadcast queue: the leader's BYE is on its way.
        dead = next((h for h in workers if not h.is_alive() and h.exitcode != 0), None)
        if dead is not None:
            what = dead.describe_exit().sentence()
            logger.error("node %d: %s", client.node_rank, what)
            client.send(FAILED, [what.encode()])
            return 1
        if stall is not None and tick_s is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + tick_s
            stalled = stall.check(workers)
            if stalled is not None:
                _report_stall(client, workers[stalled.index], stalled)
                return 1
        if stop.is_set():
            client.send(BYE, [])
            return 0
        if client.bye.is_set():
            logger.info("node %d: the leader ended the executor", client.node_rank)
            life.close()
            client.send(BYE, [])
            return 0
        # The leader's monitor heartbeats from our JOIN on, also while its
        # own workers are still starting, so silence means it is gone.
        if client.lost:
            logger.error("node %d: %s; ending this node", client.node_rank, client.lost)
            return 1
        client.changed.wait(_POLL_S)
        client.changed.clear()


def _report_stall(client: NodeClient, worker: LocalWorkerHandle, stall: Stall) -> None:
    """Kill a worker that stopped answering (a stopped one takes no SIGTERM)
    and tell the leader which rank, what was seen, and its pid here."""
    how = f"on node {client.node_rank} {stall.how}"
    logger.error("node %d: worker rank %d (pid %d) %s; killing it", client.node_rank,
                 stall.rank, stall.pid, stall.how)
    worker.kill()
    client.send(FAILED, [f"worker rank {stall.rank} (pid {stall.pid}) {how}".encode(), b"",
                         str(stall.rank).encode(), stall.seen.encode(), str(stall.pid).encode(),
                         how.encode()])
