"""Authenticated request and reply between KV peers, over ZeroMQ.

::

    client (DEALER, caller's thread)           server (ROUTER, its own thread)
    seal(kind, seq, [json, *data])   ───────>  open (MAC checked first) -> handler
                                     <───────  seal(kind | REPLY, seq, aux=0, [json, *data])
                                     <───────  seal(kind | REPLY, seq, aux=1, ...)  a stream:
                                               ... until a reply's JSON has no "more"

Frames are :class:`mpexec.ipc.auth.FrameAuth`'s (the multi-node
transport's): HMAC-SHA256 over the header and the keyed BLAKE3 hash of
every byte (SHA-256 where the ``blake3`` package is missing), keyed per
direction from the cluster secret (``derive_key(secret, "kv-peer",
"request" | "reply")``).  A frame whose MAC does not verify is dropped
(counted) before anything is parsed, and what is parsed is JSON and raw
KV bytes: nothing is ever unpickled.  The reply carries the request's
sequence number (random start, +1 per request), so the client takes only
the reply to the request it is waiting for; a late reply to a request it
gave up on (its timeout) is dropped.

A handler may answer with a stream of replies (a generator): the server
seals and sends each as soon as the handler yields it, so the hashing of
the next one overlaps the sending of this one (blake3, hashlib and the
copies release the GIL; ZeroMQ sends from its own thread), and
:meth:`PeerClient.stream` hands each over once its MAC is checked, so the
receiver's hashing and copying overlap the arrival of the next.  Each
reply of a stream carries its index in the header's ``aux`` (covered by
the MAC), so replies cannot be dropped, reordered or repeated unnoticed;
the last one says so in its (authenticated) JSON (``"more"`` absent).

A stream's large parts are best sent from a :class:`SendRing`: a few
buffers reused in turn, each refilled only once ZeroMQ has let go of the
frame made from it.  Fresh buffers would cost their page faults on every
chunk (about as much CPU as filling them), and the ring bounds how much of
a stream waits in memory for a slow reader.

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

from mpexec.ipc.auth import DropCounter, FrameAuth, Opened, derive_key

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


class SendRing:
    """``slots`` send buffers, handed out in turn (one thread), each reused once
    ZeroMQ is done with the zero-copy frame made from it.

    ``take(nbytes)`` returns a writable view of the next buffer after
    waiting, at most ``timeout_s``, until the frame last made from it has
    been sent (its tracker); ``frame()`` wraps the view just taken as a
    tracked zero-copy frame, the part to send.  A buffer that ZeroMQ still
    holds at the deadline (a stalled reader) is left to it and replaced;
    :meth:`close` ends every wait at once.
    """

    def __init__(self, slots: int, timeout_s: float) -> None:
        self._buffers: list[bytearray | None] = [None] * slots
        self._trackers: list[Any] = [None] * slots
        self._timeout_s = timeout_s
        self._next = 0
        self._view: memoryview | None = None
        self._closed = threading.Event()

    def take(self, nbytes: int) -> memoryview:
        zmq = zmq_module()
        slot = self._next
        tracker = self._trackers[slot]
        deadline = time.monotonic() + self._timeout_s
        while tracker is not None and not tracker.done:
            if self._closed.is_set() or time.monotonic() > deadline:
                self._buffers[slot] = self._trackers[slot] = None  # ZeroMQ's now
                raise TimeoutError("send ring closed" if self._closed.is_set() else
                                   f"a send buffer still queued after {self._timeout_s:g} s")
            try:
                tracker.wait(POLL_MS / 1000)
            except zmq.NotDone:
                pass
        buffer = self._buffers[slot]
        if buffer is None or len(buffer) < nbytes:
            buffer = self._buffers[slot] = bytearray(nbytes)
        self._view = memoryview(buffer)[:nbytes]
        return self._view

    def frame(self) -> Any:
        """The buffer last taken, as a tracked zero-copy frame (then the next slot's turn)."""
        assert self._view is not None, "take() first"
        frame = zmq_module().Frame(self._view, copy=False, track=True)
        self._trackers[self._next] = frame.tracker
        self._next = (self._next + 1) % len(self._buffers)
        self._view = None
        return frame

    def close(self) -> None:
        self._closed.set()


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
            if opened is not None:
                self._answer(frames[0], opened)

    def _answer(self, identity: Any, opened: Opened) -> None:
        """Every reply to one request (a method of its own: nothing it sent
        stays referenced by the serving loop, so a :class:`SendRing`'s buffer
        comes round again as soon as ZeroMQ has sent it)."""
        index = 0
        try:
            answer = self._handler(opened.kind, json.loads(bytes(opened.parts[0])))
            replies = iter([answer]) if isinstance(answer, tuple) else answer
            for reply, data in replies:
                self._send(identity, opened.kind, opened.seq, index, reply, data)
                index += 1
                # let go of the frames sent before the handler makes the next reply: it
                # may wait for ZeroMQ to let go of them too (a SendRing of one slot)
                del reply, data
        except Exception as exc:  # the client gets the reason, the server goes on
            logger.warning("%s: request kind %d failed: %r", self.what, opened.kind, exc)
            self._send(identity, opened.kind, opened.seq, index,
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
