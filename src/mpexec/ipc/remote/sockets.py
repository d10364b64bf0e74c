"""ZeroMQ sockets between hosts: the import, addresses, and shared settings.

Used by both ends of a remote queue (``writer``, ``reader``), so that both set
their sockets up one way, and share one ZeroMQ context per process.
"""

from __future__ import annotations

import os
import threading
from typing import Any

DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
CONTROL_MAX_BYTES = 4096  # what a reader may send the writer (HELLO/ACK/RESUME/CLOSE)
CLOSE_GRACE_S = 2.0
LINGER_MS = 200


def zmq_module() -> Any:
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("remote readers need pyzmq: pip install 'mpexec[multinode]'") from exc
    return zmq


def plain_send(zmq: Any) -> Any:
    """``Socket.send`` without pyzmq's Python wrapper (routing ids, groups:
    never used here), called as ``send(sock, data, flags)``: a message in
    the hot path is one or two sends, and the wrapper costs as much as the
    send itself.  Only for ``bytes`` (copied into ZeroMQ's own message)."""
    backend = getattr(getattr(zmq, "backend", None), "Socket", None)
    send = getattr(backend, "send", None)
    return send if callable(send) else zmq.Socket.send


def endpoint(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def channel_name(handle_token: int, name: str) -> str:
    return f"mq/{name}/{handle_token:x}"


# One ZeroMQ context (one I/O thread) for all the remote queue ends of a
# process, counted: the last end to close terminates it, so no I/O thread or
# descriptor outlives the queues.  One I/O thread instead of one per queue
# means fewer thread wake-ups per round trip (a call out, its reply back).
_context: Any = None
_context_pid = 0
_context_users = 0
_context_lock = threading.Lock()


def acquire_context() -> Any:
    global _context, _context_pid, _context_users
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            _context, _context_pid, _context_users = zmq_module().Context(1), os.getpid(), 0
        _context_users += 1
        return _context


def release_context(context: Any) -> None:
    """Give back what :func:`acquire_context` gave (its sockets closed first)."""
    global _context, _context_users
    with _context_lock:
        if context is not _context:
            return  # a forked copy's: not ours to end
        _context_users -= 1
        if _context_users:
            return
        _context = None
    context.term()
