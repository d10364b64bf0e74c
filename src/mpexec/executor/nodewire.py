"""The node control channel: what a leader and its follower nodes say to each other.

::

    leader (MultiprocExecutor, node 0)             follower node R (``node``)
    ----------------------------------             --------------------------
    NodeServer: ROUTER bound at                    NodeClient: DEALER connects to
    master_addr:master_port                        master_addr:master_port
                          <------- JOIN(R, nonce, version)   (join key)
    wrong MAC: REFUSED (plain text) ------->       AuthenticationError, exit 1
    other version: REFUSED naming both ---->       NodeVersionError, exit 1
    (logged; the leader keeps waiting for a
    follower of its own version)
    CONFIG(R, assignment, version) -------->       version checked (NodeVersionError,
                                                   exit 1), then unpickled: config,
                                                   broadcast handle, init method
                                                   start the local workers
                          <------- READY(R, reply handles of its ranks)
                          <------- FAILED(R, text[, traceback, rank])
                                                   a local worker failed or died
    PING every node_heartbeat_s  <--------->       PING every node_heartbeat_s
    (from JOIN on: start-up included)              (from CONFIG on: start-up included)
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
so a mismatched follower learns why even where sealing has changed.
"""

from __future__ import annotations

import struct
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
NODE_PROTOCOL = 2
VERSION_REFUSED = "version mismatch"


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
