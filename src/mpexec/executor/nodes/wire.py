"""The node control channel: what a leader and its follower nodes say to each other.

::

    leader (MultiprocExecutor, node 0)             follower node R (``follower``)
    ----------------------------------             ------------------------------
    NodeServer: ROUTER bound at                    NodeClient: DEALER connects to
    master_addr:master_port                        master_addr:master_port
                          <------- JOIN(R, nonce, version, nnodes)   (join key)
    wrong MAC: REFUSED (plain text) ------->       AuthenticationError, exit 1
    other version: REFUSED naming both ---->       NodeVersionError, exit 1
    other nnodes, R not in 1..nnodes-1, or
    R already joined: REFUSED naming both
    values ("layout mismatch") ------------>       NodeLayoutError, exit 2
    (each logged; the leader keeps waiting
    for a follower that fits)
    CONFIG(R, assignment, version) -------->       version checked (NodeVersionError,
                                                   exit 1), then unpickled: config,
                                                   broadcast handle, init method
                                                   start the local workers
                          <------- READY(R, reply handles of its ranks)
                          <------- FAILED(R, text[, traceback, rank
                                           [, stopped|silent, pid, how]])
                                                   a local worker failed or died (or
                                                   stopped answering: its stall watch)
    PING every node_heartbeat_s  <--------->       PING every node_heartbeat_s
    (from JOIN on: start-up included)              (from CONFIG on: start-up included)
    (each end's heartbeat has a thread of its own; silence is judged net of
    that thread's own lateness: see ``Liveness``)
    silent > node_timeout_s: node lost             leader silent > node_timeout_s: end
    (during start-up: WorkerStartupError)
    BYE (shutdown) ------------------------>       end the workers
                          <------- BYE             then exit

Every frame is sealed with ``mpexec.ipc.auth``.  JOIN uses a key derived
from the secret for joining; everything after it a key derived from the
secret *and the follower's nonce*, so frames of an earlier session cannot be
replayed into this one, and each side drops any frame whose sequence number
is not above the last one it accepted.  Nothing is unpickled before its MAC
and sequence number check out.

``version`` is ``"<NODE_PROTOCOL> <mpexec.__version__>"``, in the clear
inside the sealed frame.  Both ends require both numbers to match theirs
(the frames, the MAC layout and the pickled assignment may change between
releases); a JOIN without one comes from an mpexec older than the check.
A refusal is plain text (``REFUSED``, the one frame every version reads),
so a mismatched follower learns why even where sealing has changed; its
reason starts with its type (``VERSION_REFUSED``, ``LAYOUT_REFUSED``, or a
wrong secret's text), which the follower turns into its error.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.ipc import Handle
from mpexec.ipc.auth import DropCounter, FrameAuth, Opened, derive_key
from mpexec.version import __version__

MAX_CONTROL_BYTES = 64 << 20
NONCE = struct.Struct("<Q")
# The node channel's protocol: raise it whenever a frame, a MAC or the
# assignment changes (together with mpexec's version it must match across nodes).
NODE_PROTOCOL = 5
VERSION_REFUSED = "version mismatch"
LAYOUT_REFUSED = "layout mismatch"


def this_version() -> bytes:
    """What this process puts in a JOIN or CONFIG: the protocol and mpexec's version."""
    return f"{NODE_PROTOCOL} {__version__}".encode()


def describe_version(version: bytes | None) -> str:
    """``b"2 0.1.0"`` -> ``"mpexec 0.1.0 (node protocol 2)"``."""
    if version is None:
        return "an mpexec older than the node protocol check"
    protocol, _, release = bytes(version).decode(errors="replace").partition(" ")
    return f"mpexec {release or '?'} (node protocol {protocol})"


def version_mismatch(theirs: bytes | None, their_role: str, our_role: str) -> str | None:
    """None if ``theirs`` matches this process; else a line naming both versions."""
    if theirs is not None and bytes(theirs) == this_version():
        return None
    return (f"{VERSION_REFUSED}: the {our_role} runs {describe_version(this_version())}, "
            f"the {their_role} {describe_version(theirs)}; run the same mpexec on every "
            "node")


def layout_mismatch(node_rank: int, their_nnodes: int | None, our_nnodes: int,
                    taken: bool, followers: int | None = None,
                    nodes: list[int] | None = None) -> str | None:
    """None if a follower that says ``node_rank`` of ``their_nnodes`` fits this
    leader (``taken``: a follower already joined as that node); else a line,
    in plain words, naming both sides' values.  ``followers``: the leader's
    follower nodes, 1..followers (``our_nnodes - 1``); ``nodes``, when given:
    exactly those (one data parallel replica's, which dial their own port)."""
    last = our_nnodes - 1 if followers is None else followers
    admitted = list(range(1, last + 1)) if nodes is None else nodes
    names = _node_span(admitted)
    if their_nnodes != our_nnodes:
        return (f"{LAYOUT_REFUSED}: the leader runs nnodes={our_nnodes}, this follower was "
                f"started with nnodes={their_nnodes if their_nnodes is not None else '?'}; "
                f"start it with --nnodes {our_nnodes}")
    if node_rank not in admitted:
        if nodes is not None and 0 < node_rank < our_nnodes:
            return (f"{LAYOUT_REFUSED}: this port admits node(s) {names} (one data parallel "
                    f"replica's; each replica's nodes dial master_port + its data parallel "
                    f"rank), not node_rank {node_rank}")
        return (f"{LAYOUT_REFUSED}: node_rank {node_rank} is out of range {names} "
                f"(nnodes={our_nnodes}; node 0 is the leader)")
    if taken:
        return (f"{LAYOUT_REFUSED}: duplicate node rank: another follower already joined as "
                f"node {node_rank}; give each follower its own --node-rank {names}")
    return None


def _node_span(nodes: list[int]) -> str:
    """``1..3`` (``2..2`` for one node), or ``[1, 4]`` for a set with gaps."""
    if not nodes:
        return "(none)"
    if nodes == list(range(nodes[0], nodes[-1] + 1)):
        return f"{nodes[0]}..{nodes[-1]}"
    return str(nodes)


def join_parts(nonce: int, nnodes: int) -> list[bytes]:
    """A JOIN's parts: the follower's nonce, version and idea of ``nnodes``."""
    return [NONCE.pack(nonce), this_version(), str(nnodes).encode()]


def joined_nnodes(parts: list[Any]) -> int | None:
    """The ``nnodes`` a JOIN says, or None where it says none readable."""
    if len(parts) < 3:
        return None
    text = bytes(parts[2]).decode(errors="replace")
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class NodeAssignment:
    """What the leader tells a follower: the one source of its configuration."""

    config: ExecutorConfig          # with parallel.node_rank set to the follower's
    broadcast_handle: Handle
    distributed_init_method: str


def join_auth(secret: str, direction: str) -> FrameAuth:
    return FrameAuth(derive_key(secret, "nodes/join", direction), MAX_CONTROL_BYTES)


def session_auth(secret: str, nonce: int, direction: str) -> FrameAuth:
    return FrameAuth(derive_key(secret, f"nodes/{nonce:x}", direction), MAX_CONTROL_BYTES)


class Session:
    """One direction pair of one leader-follower session: seal, open, count."""

    def __init__(self, secret: str, nonce: int, outgoing: str, incoming: str,
                 drops: DropCounter) -> None:
        self.nonce = nonce
        self._out = session_auth(secret, nonce, outgoing)
        self._in = session_auth(secret, nonce, incoming)
        self._sent = 0
        self._seen = 0
        self.drops = drops

    def seal(self, kind: int, node_rank: int, parts: list[Any]) -> list[Any]:
        self._sent += 1
        return self._out.seal(kind, node_rank, self._sent, parts)

    def open(self, frames: list[Any]) -> Opened | None:
        opened = self._in.open(frames, self.drops)
        if opened is None:
            return None
        if opened.seq <= self._seen:
            self.drops.drop("replayed")
            return None
        self._seen = opened.seq
        return opened


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Liveness:
    """How long a peer has been silent, net of the observer's own lateness.

    A heartbeat thread calls :meth:`tick` once per turn of its loop, a loop
    that waits at most ``period_s`` (its poll) plus a little work.  A turn
    late by more than ``jitter_s`` means the thread itself was not running
    (a loaded machine, a stalled GIL holder, a paused VM); that lateness is
    added up, and :meth:`silence` subtracts from a peer's silence whatever
    of it fell after the peer was last heard.  So a peer is never called
    lost for a gap the observer's own absence explains; a peer silent while
    the observer ran on time is lost after ``node_timeout_s`` as before.
    Turns late by less (waiting a few milliseconds for the GIL while the
    caller's thread is busy, timer slack) are not counted: they would only
    add up to a later verdict on a peer that is really gone.
    """

    def __init__(self, period_s: float, clock: Callable[[], float] = time.monotonic,
                 jitter_s: float = 0.1) -> None:
        self.period_s = period_s
        self.clock = clock
        self.jitter_s = jitter_s
        self.late_s = 0.0  # all the lateness seen so far
        self._last: float | None = None

    def tick(self) -> float:
        """Start a turn of the loop; returns now."""
        now = self.clock()
        if self._last is not None:
            late = now - self._last - self.period_s
            if late > self.jitter_s:
                self.late_s += late
        self._last = now
        return now

    def stamp(self) -> tuple[float, float]:
        """What to keep when a peer is heard from: now, and the lateness so far."""
        return self.clock(), self.late_s

    def silence(self, heard: tuple[float, float], now: float) -> float:
        """Seconds the peer heard at ``heard`` has been silent, net of our lateness."""
        at, late_then = heard
        return (now - at) - (self.late_s - late_then)
