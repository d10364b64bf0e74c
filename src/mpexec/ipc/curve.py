"""Optional encryption of cross-host sockets with ZeroMQ's own CURVE.

The HMAC layer (``auth``) makes every frame authentic; CURVE adds
confidentiality.  No key is distributed: both key pairs are derived from the
cluster secret, so a follower that holds the secret needs nothing more::

    server secret key = HMAC-SHA256(secret, "mpexec/1/curve/server")   (32 bytes)
    client secret key = HMAC-SHA256(secret, "mpexec/1/curve/client")
    public keys       = Curve25519 of each (zmq.curve_public)

The bound end (a queue writer's ROUTER, the leader's node channel) is the
CURVE server; the connecting end (a remote reader, a follower) is the client
and must know the server's public key before the handshake.  That key never
crosses the wire and is derived from the secret, so only holders of the
secret complete the handshake; a plaintext peer, or one with another secret,
fails it inside ZeroMQ and never delivers a frame (the connecting end learns
it from the socket monitor: :class:`HandshakeWatch`).  The HMAC checks stay
on underneath, unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from mpexec.errors import MpexecError
from mpexec.ipc.auth import secret_bytes

# Handshakes failed "with no detail" in a row that mean CURVE keys from another
# secret; one alone is a writer that died during it.
NO_DETAIL_RUN = 3


class CurveUnavailableError(MpexecError, RuntimeError):
    """libzmq was built without CURVE (libsodium / tweetnacl)."""


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("CURVE needs pyzmq: pip install 'mpexec[multinode]'") from exc
    return zmq


def require_curve() -> None:
    zmq = _zmq()
    if not zmq.has("curve"):
        raise CurveUnavailableError(
            f"cluster_curve is on but this libzmq ({zmq.zmq_version()}) has no CURVE "
            "support: install a pyzmq wheel (it bundles libzmq with CURVE) or turn "
            "cluster_curve off")


def _keypair(secret: str | bytes, role: str) -> tuple[bytes, bytes]:
    from zmq.utils import z85

    raw = hmac.new(secret_bytes(secret), f"mpexec/1/curve/{role}".encode(),
                   hashlib.sha256).digest()
    private = z85.encode(raw)
    return _zmq().curve_public(private), private


def secure(sock: Any, secret: str | bytes, *, server: bool) -> None:
    """Turn CURVE on for ``sock`` (before it binds or connects)."""
    require_curve()
    zmq = _zmq()
    server_public, server_private = _keypair(secret, "server")
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_private)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
    else:
        client_public, client_private = _keypair(secret, "client")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, client_private)


class HandshakeWatch:
    """A connecting socket's ZeroMQ handshakes, watched until :meth:`end`.

    A CURVE mismatch fails inside ZeroMQ, before any frame: only the socket
    monitor tells.  A mechanism mismatch (CURVE at one end only) is a
    protocol failure, at once.  CURVE keys from another secret fail "with no
    detail" on every reconnect (~0.1 s apart); a writer that dies during the
    handshake fails so once, then refuses connections: only a run of
    ``NO_DETAIL_RUN`` of them means the keys.
    """

    def __init__(self, sock: Any) -> None:
        zmq = _zmq()
        self._refused = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        self._no_detail = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self._ok = zmq.EVENT_HANDSHAKE_SUCCEEDED
        self._run = 0
        self._sock = sock
        self._monitor: Any = sock.get_monitor_socket(self._refused | self._no_detail | self._ok)

    def failed(self) -> bool:
        """Whether the handshakes so far say the two ends' CURVE settings differ."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event & self._ok:
                self._run = 0
            elif event & self._no_detail:
                self._run += 1
            if event & self._refused or self._run >= NO_DETAIL_RUN:
                return True
        return False

    def end(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
