"""ZeroMQ sockets between hosts: the import, addresses, and shared settings.

Used by both ends of a remote queue (``remote``, ``remote_reader``) and by the
executor's node channel, so that every socket that crosses the network is set
up one way.
"""

from __future__ import annotations

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


def endpoint(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def channel_name(handle_token: int, name: str) -> str:
    return f"mq/{name}/{handle_token:x}"
