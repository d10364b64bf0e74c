"""A TCP proxy a test can cut: every connection through it reset at once
(in-flight bytes lost), new ones refused for a while, or the writer's bytes
silently swallowed before a cut (a message certainly lost)."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time


def _reset(sock: socket.socket) -> None:
    # SO_LINGER 0: close sends RST, whatever is buffered is thrown away.
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.addr = f"tcp://127.0.0.1:{self.port}"
        self._peer: dict[socket.socket, socket.socket] = {}
        self._from_client: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut_requested = 0
        self.cuts = 0
        self.accepted = 0
        self.refuse_until = 0.0
        self.swallow = False
        self.swallowed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="TcpProxy")
        self._thread.start()

    def cut(self, refuse_s: float = 0.0) -> None:
        """Reset every connection now; refuse new ones for ``refuse_s``."""
        with self._lock:
            self.refuse_until = time.monotonic() + refuse_s
            self._cut_requested += 1
        deadline = time.monotonic() + 5
        while self.cuts < self._cut_requested and time.monotonic() < deadline:
            time.sleep(0.005)

    def _close_all(self) -> None:
        for sock in list(self._peer):
            _reset(sock)
        self._peer.clear()
        self._from_client.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self.cuts < self._cut_requested:
                    self._close_all()
                    self.swallow = False
                    self.cuts = self._cut_requested
            readable, _, _ = select.select([self.listener, *self._peer], [], [], 0.01)
            for sock in readable:
                if sock is self.listener:
                    self._accept()
                elif sock in self._peer:
                    self._forward(sock)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        if time.monotonic() < self.refuse_until:
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=2)
        except OSError:
            _reset(client)
            return
        self.accepted += 1
        self._peer[client], self._peer[upstream] = upstream, client
        self._from_client.add(client)

    def _forward(self, sock: socket.socket) -> None:
        other = self._peer[sock]
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            for s in (sock, other):
                self._peer.pop(s, None)
                self._from_client.discard(s)
                _reset(s)
            return
        if self.swallow and sock not in self._from_client:
            self.swallowed += len(data)  # the writer's bytes, never delivered
            return
        try:
            other.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._close_all()
        self.listener.close()
