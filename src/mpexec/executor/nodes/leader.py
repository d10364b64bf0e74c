"""The leader's side of an executor spanning several nodes.

The protocol is drawn in ``wire``.  :class:`NodeServer` binds the node
control socket at ``master_addr:master_port``; from ``admit`` on, one thread
(the node monitor) owns that socket: it answers every follower's JOIN with
its CONFIG, records the reply-queue handles each READY brings, and runs the
heartbeats, so a follower that joined and then died or fell silent is lost
after ``node_timeout_s`` even while the executor is still starting.  The
executor's thread only waits (``admit``: every node joined; ``collect``:
every node READY) and fails the start at once when a node is lost.  Each
follower is one :class:`RemoteNodeHandle` among the lifecycle's worker
handles, so the lifecycle and the failure table treat a lost node like a
dead worker: its death descriptor becomes readable when the node is lost
(silent for ``node_timeout_s``, or it reported a failed worker), and the
error names the node and its ranks.  Ending a node (``close_death_pipe`` /
``terminate``) asks the heartbeat thread to send BYE; the node counts as
gone once it answers BYE or falls silent.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import cloudpickle

from mpexec.config import ExecutorConfig
from mpexec.errors import WorkerStartupError
from mpexec.executor.launcher import WatchedWorker
from mpexec.executor.local.launcher import LocalWorkerHandle
from mpexec.executor.local.ready import wait_for_ready
from mpexec.executor.nodes.handle import RemoteNodeHandle
from mpexec.executor.nodes.wire import (
    NONCE,
    Liveness,
    NodeAssignment,
    Session,
    endpoint,
    join_auth,
    joined_nnodes,
    layout_mismatch,
    this_version,
    version_mismatch,
)
from mpexec.ipc import Handle
from mpexec.ipc.auth import (
    BYE,
    CONFIG,
    FAILED,
    JOIN,
    PING,
    READY,
    DropCounter,
    generate_secret,
    kind_of,
    refusal,
)
from mpexec.ipc.curve import secure

logger = logging.getLogger("mpexec.executor.multiproc")

_POLL_S = 0.05
_BYE_WAIT_S = 3.0


class NodeServer:
    """The leader's node control socket; see the module docstring."""

    def __init__(self, secret: str, host: str, port: int, nnodes: int, local_world_size: int,
                 heartbeat_s: float, timeout_s: float, curve: bool = False,
                 cluster_nnodes: int | None = None, nodes: range | None = None,
                 first_node: int = 0) -> None:
        """Admit follower nodes ``1..nnodes-1``, or ``nodes`` when given (a data
        parallel replica's); node ``r`` runs ranks from ``(r - first_node) x
        local_world_size`` on."""
        import zmq

        if port == 0:
            raise ValueError("parallel.master_port must name the port followers connect to "
                             "when nnodes > 1 (it cannot be 0)")
        self._zmq = zmq
        self.secret = secret
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.drops = DropCounter(f"node channel {host}:{port}")
        self._join_in = join_auth(secret, "f2l")
        self._context = zmq.Context(1)
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        if curve:
            secure(sock, secret, server=True)
        try:
            sock.bind(endpoint(host, port))
        except zmq.ZMQError as exc:
            sock.close(0)
            self._context.term()
            raise OSError(f"cannot bind the node channel at {host}:{port}: {exc}") from exc
        self._sock = sock
        # A node's queues close before it is declared lost (silent for
        # timeout_s, noticed within two heartbeats): how long a caller waits.
        lag_s = max(1.0, timeout_s + 2 * heartbeat_s)
        followers = range(1, nnodes) if nodes is None else nodes
        self.nodes = {r: RemoteNodeHandle(self, r, range((r - first_node) * local_world_size,
                                                         (r + 1 - first_node) *
                                                         local_world_size), lag_s)
                      for r in followers}
        # What a follower must say it was started with: the executor's
        # nnodes (``nnodes`` above counts only this data parallel rank's).
        self.cluster_nnodes = nnodes if cluster_nnodes is None else cluster_nnodes
        # Why the last follower refused without a node of ours to blame (its
        # node rank out of range, or taken) was refused: named on a timeout.
        self.refused_others = ""
        self._assignment_for: Callable[[int], NodeAssignment] | None = None
        self._changed = threading.Event()  # the monitor saw something: waiters look again
        self.liveness = Liveness(_POLL_S)  # the monitor's own lateness, for judging silence
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._released = 0
        self._closed = False
        self._lock = threading.Lock()

    # -- start-up (the executor's thread waits; the monitor serves) ---------------------

    def admit(self, assignment_for: Callable[[int], NodeAssignment], deadline: float,
              timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Wait for every follower's JOIN (the monitor answers each with its CONFIG).

        Returns early once ``give_up()`` is true (a local worker already
        failed: waiting for the followers would only delay saying so).
        """
        self._assignment_for = assignment_for
        self.start()
        self._wait_until(lambda node: node.session is not None, deadline, timeout_s,
                         "join", give_up)

    def collect(self, deadline: float, timeout_s: float,
                give_up: Callable[[], bool] = lambda: False) -> dict[int, Handle]:
        """Every follower's READY: the reply-queue handle of each remote rank
        (whatever came by then, once ``give_up()`` is true)."""
        self._wait_until(lambda node: len(node.reply_handles) == len(node.ranks),
                         deadline, timeout_s, "report READY", give_up)
        return {rank: h for n in self.nodes.values() for rank, h in n.reply_handles.items()}

    def lost_during_start(self) -> str | None:
        """Why the start cannot finish (a node is lost), or None."""
        gone = next((n for n in self.nodes.values() if n.gone.is_set()), None)
        return None if gone is None else f"{gone.how} (during start-up)"

    def _wait_until(self, node_done: Callable[[RemoteNodeHandle], bool], deadline: float,
                    timeout_s: float, what: str,
                    give_up: Callable[[], bool] = lambda: False) -> None:
        while not (give_up() or all(node_done(n) for n in self.nodes.values())):
            for node in self.nodes.values():
                if node.gone.is_set():
                    rank = node.rank if node.failed_rank is None else node.failed_rank
                    raise WorkerStartupError(f"{node.how} (during start-up)", rank=rank,
                                             remote_traceback=node.remote_traceback)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [n.name + (f" (refused a follower: {n.refused})" if n.refused else "")
                        for n in self.nodes.values() if not node_done(n)]
                also = (f"; also refused a follower: {self.refused_others}"
                        if self.refused_others else "")
                raise WorkerStartupError(f"follower node(s) did not {what} within "
                                         f"{timeout_s:g}s (startup_timeout_s): "
                                         f"{', '.join(late)}{also}")
            self._changed.wait(min(remaining, _POLL_S))
            self._changed.clear()

    # -- frames (the monitor's thread) ---------------------------------------------------

    def _receive(self, wait_s: float) -> None:
        zmq = self._zmq
        if not self._sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return
        while True:
            try:
                identity, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(identity, frames)
            self._changed.set()

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        node = next((n for n in self.nodes.values() if n.identity == identity), None)
        if node is None:
            self._join(identity, frames)
            return
        assert node.session is not None
        opened = node.session.open(frames)
        if opened is None:
            return
        node.heard = self.liveness.stamp()
        if opened.kind == READY:
            handles: dict[int, Handle] = pickle.loads(opened.parts[0])  # authenticated
            node.reply_handles = {r: h for r, h in handles.items() if r in node.ranks}
        elif opened.kind == FAILED:
            # [what happened] or, from start-up, [what, the worker's traceback, its
            # rank]; a stalled worker adds [stopped|silent, its pid, how it was seen]
            text = [bytes(part).decode(errors="replace") for part in opened.parts[:6]]
            node.remote_traceback = text[1] if len(text) > 1 else ""
            if len(text) > 2 and text[2].isdigit() and int(text[2]) in node.ranks:
                node.failed_rank = int(text[2])
            if len(text) > 5 and node.failed_rank is not None and text[4].isdigit():
                node.stalled(text[3], int(text[4]), text[5])
            node.lost(f"reported: {text[0]}")
        elif opened.kind == BYE:
            node.how = node.how or f"{node.name} left"
            node.gone.set()
        # PING: last_heard is all it says

    def _join(self, identity: bytes, frames: list[bytes]) -> None:
        opened = self._join_in.open(frames, self.drops)
        if opened is None:
            if kind_of(frames) == JOIN:
                logger.error("a follower's JOIN failed authentication: its cluster secret "
                             "differs from the leader's; refused")
                self._send(identity, refusal("the cluster secret differs from the leader's"))
            return
        node = self.nodes.get(opened.rank)
        assignment_for = self._assignment_for
        if opened.kind != JOIN or assignment_for is None or len(opened.parts) < 1:
            self.drops.drop("unexpected join")
            return
        if node is not None and node.identity == identity:
            self.drops.drop("second join for a node")  # the same follower, again
            return
        # As for a wrong secret: refuse this one at once, in plain words, and
        # keep waiting for a follower that fits until startup_timeout_s.
        mismatch = version_mismatch(opened.parts[1] if len(opened.parts) > 1 else None,
                                    "follower", "leader") or layout_mismatch(
            opened.rank, joined_nnodes(opened.parts), self.cluster_nnodes,
            taken=node is not None and node.session is not None, nodes=list(self.nodes))
        if mismatch is not None:
            logger.error("a follower that asked to join as node %d was refused: %s",
                         opened.rank, mismatch)
            if node is not None and node.session is None:
                node.refused = mismatch
            else:
                self.refused_others = mismatch
            self._send(identity, refusal(mismatch))
            return
        assert node is not None  # layout_mismatch: the rank is in range and free
        (nonce,) = NONCE.unpack(bytes(opened.parts[0]))
        node.identity = identity
        node.session = Session(self.secret, nonce, "l2f", "f2l", self.drops)
        node.heard = self.liveness.stamp()
        payload = cloudpickle.dumps(assignment_for(node.node_rank),
                                    protocol=pickle.HIGHEST_PROTOCOL)
        self._send(identity, node.session.seal(CONFIG, node.node_rank,
                                               [payload, this_version()]))
        logger.info("follower %s joined", node.name)

    def _send(self, identity: bytes, frames: list[Any]) -> bool:
        zmq = self._zmq
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False  # gone (EHOSTUNREACH) or backed up: the heartbeat decides

    # -- heartbeats (the monitor's thread, from admit() on) -----------------------------

    def start(self) -> None:
        """Start the node monitor (``admit`` does; idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="MpexecNodeMonitor")
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        next_ping = 0.0
        bye_deadline: float | None = None
        while True:
            now = self.liveness.tick()
            # What arrived while this thread was away is heard before any
            # silence is judged.
            self._receive(0)
            if now >= next_ping:
                next_ping = now + self.heartbeat_s
                for node in self.nodes.values():
                    if not node.gone.is_set() and node.session is not None:
                        self._send(node.identity or b"",
                                   node.session.seal(PING, node.node_rank, []))
            for node in self.nodes.values():
                # Only a node that joined has a heartbeat to miss; one that
                # never joins is the start-up timeout's.
                silent = self.liveness.silence(node.heard, now)
                if not node.gone.is_set() and node.session is not None \
                        and silent > self.timeout_s:
                    node.lost(f"lost: no heartbeat for {silent:.1f} s")
                    self._changed.set()
                if node.bye_requested and not node.gone.is_set() and node.session is not None \
                        and node.identity is not None:
                    node.bye_requested = False
                    self._send(node.identity, node.session.seal(BYE, node.node_rank, []))
                    bye_deadline = bye_deadline or now + _BYE_WAIT_S
            if self._stop.is_set() and (bye_deadline is None or now >= bye_deadline or all(
                    n.gone.is_set() for n in self.nodes.values())):
                return
            self._receive(_POLL_S)

    # -- the end -------------------------------------------------------------------------

    def request_bye(self, node: RemoteNodeHandle) -> None:
        """Tell ``node`` to end; without a heartbeat thread, at once from here."""
        if node.gone.is_set():
            return
        if node.session is None:  # never joined: nothing to tell, nothing to wait for
            node.how = node.how or f"{node.name} never joined"
            node.gone.set()
            return
        if self._thread is not None and self._thread.is_alive():
            node.bye_requested = True
            return
        with self._lock:
            if not self._closed and node.session is not None and node.identity is not None:
                self._send(node.identity, node.session.seal(BYE, node.node_rank, []))
        node.how = node.how or f"{node.name} was told to end"
        node.gone.set()

    def release(self, node: RemoteNodeHandle) -> None:
        """A node handle was closed; with the last one, the socket goes."""
        with self._lock:
            self._released += 1
            last = self._released == len(self.nodes)
        if last:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for node in self.nodes.values():
            node.bye_requested = node.bye_requested or not node.gone.is_set()
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_BYE_WAIT_S + 2)
        elif thread is None:
            for node in self.nodes.values():  # never started: say BYE from here
                if node.session is not None and node.identity is not None:
                    self._send(node.identity, node.session.seal(BYE, node.node_rank, []))
        self._sock.close(200)
        self._context.term()


def start_cluster(config: ExecutorConfig, life: Any) -> NodeServer:
    """The leader's node channel, bound (the secret: configured, or generated)."""
    secret = config.cluster_secret
    if secret is None:
        secret = generate_secret()
        logger.warning("no cluster secret configured: generated one; start each follower "
                       "with MPEXEC_CLUSTER_SECRET=%s", secret)
    parallel = config.parallel
    # Each data parallel replica's nodes dial its own port (master_port + DP rank).
    return NodeServer(secret, parallel.master_addr, parallel.node_port,
                      parallel.nnodes_within_dp, parallel.world_size // parallel.nnodes_within_dp,
                      config.node_heartbeat_s, config.node_timeout_s,
                      curve=config.cluster_curve, cluster_nnodes=parallel.nnodes,
                      nodes=parallel.follower_nodes, first_node=parallel.replica_nodes.start)


def node_assignment(config: ExecutorConfig, broadcast: Handle, init_method: str,
                    node_rank: int) -> NodeAssignment:
    """What follower ``node_rank`` is sent: the leader's config (its own node
    rank set, not a ``remote_replica``: it runs its workers; the secret left
    out: the frame is authenticated, not encrypted)."""
    parallel = dataclasses.replace(config.parallel, node_rank=node_rank, remote_replica=False)
    return NodeAssignment(config.replace(parallel=parallel, cluster_secret=None), broadcast,
                          init_method)


# -- the leader's multi-node steps of MultiprocExecutor's start-up -----------------------

def admit_followers(cluster: NodeServer, handles: list[WatchedWorker], config: ExecutorConfig,
                    broadcast: Handle, init_method: str, deadline: float,
                    cancelled: Callable[[], bool] = lambda: False,
                    ) -> dict[int, RemoteNodeHandle]:
    """Add each follower node to ``handles`` (the lifecycle's), then wait for
    every JOIN; returns each remote rank's node handle.

    Stops waiting as soon as one of the local workers already in ``handles``
    is gone: its own error (``wait_for_ready``) says more than a late JOIN;
    or once ``cancelled()`` is true (the caller raises).
    """
    local = list(handles)
    remote: dict[int, RemoteNodeHandle] = {}
    for node in cluster.nodes.values():
        handles.append(node)  # a WorkerHandle too
        remote.update(dict.fromkeys(node.ranks, node))
    cluster.admit(partial(node_assignment, config, broadcast, init_method),
                  deadline, config.startup_timeout_s,
                  give_up=lambda: cancelled() or not all(h.is_alive() for h in local))
    return remote


def reply_handles_when_ready(local: list[LocalWorkerHandle], cluster: NodeServer | None,
                             deadline: float, timeout_s: float,
                             tick: Callable[[], None] | None = None,
                             tick_s: float = 0.05,
                             cancelled: Callable[[], bool] = lambda: False) -> dict[int, Handle]:
    """Every rank's reply-queue handle: the local workers' ``Ready`` (a lost
    follower fails this wait too), then every follower's READY.  ``tick``
    runs every ``tick_s`` of the local wait (what it raises ends it); the
    followers' wait ends early once ``cancelled()`` is true (the caller raises)."""
    nodes = [] if cluster is None else list(cluster.nodes.values())
    ready = wait_for_ready(local, deadline, timeout_s, watch=nodes, tick=tick, tick_s=tick_s)
    handles = {message.rank: message.reply_handle for message in ready}
    if cluster is not None:
        handles.update(cluster.collect(deadline, timeout_s, give_up=cancelled))
    return handles
