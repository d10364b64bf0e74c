"""Authenticated request and reply between KV peers, over ZeroMQ.

::

    client (DEALER, caller's thread)           server (ROUTER, its own thread)
    seal(kind, seq, [json, *data])   ───────>  open (MAC checked first) -> handler
                                     <───────  seal(kind | REPLY, seq, aux=0, [json, *data])
                                     <───────  seal(kind | REPLY, seq, aux=1, ...)  a stream:
                                               ... until a reply's JSON has no "more"

Frames are :class:`mpexec.ipc.auth.FrameAuth`'s (the multi-node
transport's): HMAC-SHA256 over the header and every byte, keyed per
direction from the cluster secret (``derive_key(secret, "kv-peer",
"request" | "reply")``).  A frame whose MAC does not verify is dropped
(counted) before anything is parsed, and what is parsed is JSON and raw
KV bytes: nothing is ever unpickled.  The reply carries the request's
sequence number (random start, +1 per request), so the client takes only
the reply to the request it is waiting for; a late reply to a request it
gave up on (its timeout) is dropped.

A handler may answer with a stream of replies (a generator): the server
seals and sends each as soon as the handler yields it, so the hashing of
the next one overlaps the sending of this one (hashlib and the copies
release the GIL; ZeroMQ sends from its own thread), and
:meth:`PeerClient.stream` hands each over once its MAC is checked, so the
receiver's hashing and copying overlap the arrival of the next.  Each
reply of a stream carries its index in the header's ``aux`` (covered by
the MAC), so replies cannot be dropped, reordered or repeated unnoticed;
the last one says so in its (authenticated) JSON (``"more"`` absent).

Requests are reads that change nothing on the server, so one replayed by
a third party only gets a fresh answer back, which its sender could not
forge anyway.

Every wait is bounded: :meth:`PeerClient.request` and
:meth:`PeerClient.stream` raise ``TimeoutError``
past its deadline (a dead or stalled server), and the server's thread
stops within ``POLL_MS`` of :meth:`PeerServer.close`.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mpexec.ipc.auth import DropCounter, FrameAuth, derive_key

logger = logging.getLogger(__name__)

KIND_LOOKUP = 1  # scheduler side: which of these block hashes are ready
KIND_DESCRIBE = 2  # worker side: the layout of its KV cache and its shared-memory segment
KIND_FETCH = 3  # worker side: the bytes of some blocks (a stream of chunks)
REPLY = 0x80
MAX_BYTES = 1 << 40
POLL_MS = 100
CHANNEL = "kv-peer"

def zmq_module() -> Any:
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("PeerKVConnector needs pyzmq: pip install 'mpexec[multinode]'") \
            from exc
    return zmq


Reply = tuple[dict[str, Any], list[Any]]  # JSON, then raw parts (buffers)
Handler = Callable[[int, dict[str, Any]], Reply | Iterator[Reply]]


def _auths(secret: str | bytes) -> tuple[FrameAuth, FrameAuth]:
    return (FrameAuth(derive_key(secret, CHANNEL, "request"), MAX_BYTES),
            FrameAuth(derive_key(secret, CHANNEL, "reply"), MAX_BYTES))


class PeerServer:
    """A ROUTER on ``endpoint`` answering authenticated requests with ``handler``."""

    def __init__(self, endpoint: str, secret: str | bytes, handler: Handler,
                 what: str) -> None:
        self.endpoint = endpoint
        self.what = what
        self._handler = handler
        self._requests, self._replies = _auths(secret)
        self._drops = DropCounter(what)
        self._stop = threading.Event()
        zmq = zmq_module()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # a ROUTER drops what it cannot queue: no limit, so that no chunk of a long
        # stream is lost (a reply's chunks hold no more than the one reply it replaces)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        try:
            self._socket.bind(endpoint)
        except BaseException:
            self._socket.close()
            self._context.term()
            raise
        self._thread = threading.Thread(target=self._serve, name=what, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        zmq = zmq_module()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            opened = self._requests.open(frames[1:], self._drops)
            if opened is None:
                continue
            index = 0
            try:
                answer = self._handler(opened.kind, json.loads(bytes(opened.parts[0])))
                replies = iter([answer]) if isinstance(answer, tuple) else answer
                for reply, data in replies:
                    self._send(frames[0], opened.kind, opened.seq, index, reply, data)
                    index += 1
            except Exception as exc:  # the client gets the reason, the server goes on
                logger.warning("%s: request kind %d failed: %r", self.what, opened.kind, exc)
                self._send(frames[0], opened.kind, opened.seq, index,
                           {"error": f"{type(exc).__name__}: {exc}"}, [])

    def _send(self, identity: Any, kind: int, seq: int, index: int, reply: dict[str, Any],
              data: list[Any]) -> None:
        sealed = self._replies.seal(kind | REPLY, 0, seq, [json.dumps(reply).encode(), *data],
                                    aux=index)
        self._socket.send_multipart([identity, *sealed], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * POLL_MS / 1000 + 5)
        self._socket.close()
        self._context.term()


class PeerClient:
    """A DEALER to one server; one request at a time, from one thread."""

    def __init__(self, endpoint: str, secret: str | bytes, what: str) -> None:
        zmq = zmq_module()
        self.endpoint = endpoint
        self.what = what
        self._requests, self._replies = _auths(secret)
        self._drops = DropCounter(what)
        self._seq = secrets.randbits(62)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    def request(self, kind: int, payload: dict[str, Any], timeout_s: float) -> Reply:
        """The reply's JSON and data parts; ``TimeoutError`` past ``timeout_s``."""
        for reply in self.stream(kind, payload, timeout_s):
            return reply
        raise AssertionError("unreachable: a stream has at least one reply")  # pragma: no cover

    def stream(self, kind: int, payload: dict[str, Any], timeout_s: float) -> Iterator[Reply]:
        """Each reply (JSON, data parts) of the request as it arrives, authenticated,
        until the one without ``"more"``; ``TimeoutError`` once ``timeout_s`` is
        past (for the whole stream).  A caller that stops early drops the rest
        (they carry this request's sequence number, which no later one takes)."""
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        self._socket.send_multipart(self._requests.seal(kind, 0, seq,
                                                        [json.dumps(payload).encode()]))
        index = 0
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._poller.poll(left_ms):
                raise TimeoutError(f"{self.what}: no reply from {self.endpoint} within "
                                   f"{timeout_s:g} s")
            frames = self._socket.recv_multipart(copy=False)
            opened = self._replies.open(frames, self._drops)
            if opened is None or opened.seq != seq or opened.kind != kind | REPLY:
                continue  # forged, or the late reply to a request given up on
            if opened.aux != index:
                raise ValueError(f"{self.what}: reply {opened.aux} from {self.endpoint} "
                                 f"where {index} was due")
            reply = json.loads(bytes(opened.parts[0]))
            if not isinstance(reply, dict):
                raise ValueError(f"{self.what}: malformed reply from {self.endpoint}")
            more = bool(reply.pop("more", False))
            yield reply, opened.parts[1:]
            if not more:
                return
            index += 1

    def close(self) -> None:
        self._socket.close()
        self._context.term()
