"""Remote readers: a queue whose readers include ranks on other hosts.

``MessageQueue(n_reader, n_local_reader < n_reader, connect_ip=..., secret=...)``
builds a :class:`RemoteWriter`: the ``n_local_reader`` local ranks keep the
shared-memory ring (a plain ``MessageQueueWriter`` inside), and the other
ranks are served over one ZeroMQ ROUTER socket bound at ``connect_ip``
(loopback when not told otherwise) on a port the OS picks.  The address
travels in the :class:`~mpexec.ipc.message_queue.Handle`
(``remote_subscribe_addr``); a remote rank attaches with
``MessageQueue.create_from_handle(handle, rank, secret=...)``, which returns a
:class:`~mpexec.ipc.remote_reader.RemoteReader` (a DEALER socket).  Every frame is sealed with
``auth`` (HMAC-SHA256, per-queue keys, sequence numbers)::

    remote reader r                            writer
    ---------------                            ------
    attach: HELLO(r, nonce)  ----------------> verify; remember r's identity
                                               (wrong secret: REFUSED, plain text)
    wait_until_ready  <--------- WELCOME(r, nonce)   once every reader said HELLO
    dequeue  <------------------ DATA(r, seq k, pickle pieces, buffers)
    every window/2 messages: ACK(r, k+1) ----> credit: the writer sends message k
                                               only when every reader acked > k-window
    shutdown: CLOSE ------------------------> reader r consumes no more
             <-------------------------------- CLOSE: the writer shut the queue

Back-pressure is the ring's: the writer is at most ``max_chunks`` messages
ahead of its slowest remote reader (``window``) and waits for ACKs rather
than let ZeroMQ drop at its high-water mark (ROUTER_MANDATORY, no HWM).
``enqueue`` waits for credit *before* it publishes anything, so a
``TimeoutError`` still means nothing was sent.  Buffers of 64 KiB and more
leave as their own ZeroMQ frames without a copy; ``enqueue`` returns only
once ZeroMQ is done with them, so the caller may reuse its arrays.

The reader checks every frame (structure, size limit, MAC, then the
sequence number it expects next) before it unpickles anything; a frame that
fails is dropped and counted in ``drops`` (by reason), logged at most once
per interval, and the reader keeps serving the real writer.

Liveness across hosts is not this module's job: the executor's node
channel (heartbeats) shuts a queue down when its peer host is lost, which
wakes every wait here within one ``tick_s``.  One thread may use an end at
a time; ``shutdown`` may come from any thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from mpexec.errors import PeerDiedError, QueueClosedError
from mpexec.ipc.auth import (
    ACK,
    CLOSE,
    DATA,
    HELLO,
    WELCOME,
    DropCounter,
    FrameAuth,
    Opened,
    derive_key,
    kind_of,
    refusal,
)
from mpexec.ipc.message_queue import (
    DEFAULT_LOG_INTERVAL_S,
    DEFAULT_TICK_S,
    Handle,
    MessageQueue,
)
from mpexec.ipc.serialization import EncodedMessage, Encoder, Frame

logger = logging.getLogger(__name__)

ZERO_COPY_BYTES = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
CONTROL_MAX_BYTES = 4096  # what a reader may send the writer (HELLO/ACK/CLOSE)
CLOSE_GRACE_S = 2.0
LINGER_MS = 200


def zmq_module() -> Any:
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("remote readers need pyzmq: pip install 'mpexec[multinode]'") from exc
    return zmq


def _endpoint(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def channel_name(handle_token: int, name: str) -> str:
    return f"mq/{name}/{handle_token:x}"


class RemoteWriter(MessageQueue):
    """The writer end of a queue with remote readers (see the module docstring)."""

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int = 512 * 1024, max_chunks: int = 8, *,
                 name: str = "mq", connect_ip: str | None = None,
                 secret: str | bytes | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tick_s: float = DEFAULT_TICK_S, **local_options: Any) -> None:
        zmq = zmq_module()
        if secret is None:
            raise ValueError(f"queue {name!r} has remote readers: it needs the cluster secret")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        self.name = name
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = list(local_reader_ranks)
        self.remote_reader_ranks = [r for r in range(n_reader) if r not in local_reader_ranks]
        if len(self.remote_reader_ranks) != n_reader - n_local_reader:
            raise ValueError(f"local_reader_ranks must be {n_local_reader} distinct ranks in "
                             f"[0, {n_reader}), got {local_reader_ranks}")
        self._closed = False
        self._busy = False
        self._pid = os.getpid()
        self._tick_s = tick_s
        self._window = max_chunks
        self._seq = 0
        self._ready = False
        self._encoder = Encoder()
        self._local: MessageQueue | None = None
        if n_local_reader:
            from mpexec.ipc.writer import MessageQueueWriter
            self._local = MessageQueueWriter(n_local_reader, n_local_reader,
                                             list(local_reader_ranks), max_chunk_bytes,
                                             max_chunks, name=name, tick_s=tick_s,
                                             **local_options)
        self._token = secrets.randbits(63)
        channel = channel_name(self._token, name)
        self._out = FrameAuth(derive_key(secret, channel, "w2r"), max_message_bytes)
        self._in = FrameAuth(derive_key(secret, channel, "r2w"), CONTROL_MAX_BYTES)
        self.drops = DropCounter(f"queue {name!r} (writer)", DEFAULT_LOG_INTERVAL_S / 12)
        self._identity: dict[int, bytes] = {}
        self._nonce: dict[int, int] = {}
        self._acked = dict.fromkeys(self.remote_reader_ranks, 0)
        self._reader_closed: set[int] = set()
        self.connect_ip = connect_ip or "127.0.0.1"
        # A context of its own, ended with the queue: no I/O thread or
        # descriptor outlives it.
        self._context = zmq.Context(1)
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A reader that reconnects (same routing id) takes its pipe back.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            if ":" in self.connect_ip:
                sock.setsockopt(zmq.IPV6, 1)
            port = sock.bind_to_random_port(_endpoint(self.connect_ip, "").rstrip(":"))
        except BaseException:
            sock.close(0)
            self._context.term()
            if self._local is not None:
                self._local.shutdown()
            raise
        self._sock = sock
        # One poller for the queue's life: Socket.poll() builds one per call.
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self.remote_subscribe_addr = _endpoint(self.connect_ip, port)

    @property
    def closed(self) -> bool:
        return self._closed

    def export_handle(self) -> Handle:
        local = self._local.export_handle() if self._local is not None else None
        return Handle(
            local_reader_ranks=list(self.local_reader_ranks),
            buffer=None if local is None else local.buffer,
            n_reader=self.n_reader,
            max_chunks=self._window,
            max_chunk_bytes=0 if local is None else local.max_chunk_bytes,
            token=self._token if local is None else local.token,
            name=self.name,
            connect_ip=self.connect_ip,
            remote_subscribe_addr=self.remote_subscribe_addr,
            remote_token=self._token,
        )

    def encode(self, obj: Any) -> EncodedMessage:
        self._check_open()
        return EncodedMessage(self._encoder.dump(obj))

    def broadcast_object(self, obj: Any = None) -> Any:
        self.enqueue(obj)
        return obj

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")

    # -- incoming control frames -------------------------------------------------

    def _pump(self, wait_s: float) -> None:
        """Handle every control frame that arrives within ``wait_s`` (0: what is there)."""
        # Reading first and polling only when there was nothing: a poll
        # costs more than a failed non-blocking read.
        if self._drain() or wait_s <= 0:
            return
        if self._poller.poll(max(0, int(wait_s * 1000))):
            self._drain()

    def _drain(self) -> bool:
        zmq = zmq_module()
        sock = self._sock
        got = False
        # ZMQ_EVENTS costs less than a failed non-blocking read (an exception).
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            got = True
            self._handle(frames[0], frames[1:])
        return got

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        opened = self._in.open(frames, self.drops)
        if opened is None:
            if kind_of(frames) == HELLO:
                self._refuse(identity)
            return
        rank = opened.rank
        if rank not in self._acked:
            self.drops.drop("unknown rank")
        elif opened.kind == HELLO:
            self._hello(identity, rank, opened)
        elif self._identity.get(rank) != identity:
            self.drops.drop("not from the reader")
        elif opened.kind == ACK:
            if self._acked[rank] < opened.seq <= self._seq:
                self._acked[rank] = opened.seq
            else:
                self.drops.drop("replayed")
        elif opened.kind == CLOSE:
            self._reader_closed.add(rank)
        else:
            self.drops.drop("unexpected kind")

    def _hello(self, identity: bytes, rank: int, opened: Opened) -> None:
        known = self._identity.get(rank)
        if known is not None:
            if known != identity:
                self.drops.drop("second reader for a rank")
            elif self._ready and opened.seq == self._nonce[rank]:
                self._welcome(rank)  # its HELLO is repeated: our WELCOME was lost
            return
        self._identity[rank] = identity
        self._nonce[rank] = opened.seq
        if self._ready:
            self._welcome(rank)

    def _welcome(self, rank: int) -> None:
        self._send(rank, self._out.seal(WELCOME, rank, self._nonce[rank], [], aux=self._seq))

    def _refuse(self, identity: bytes) -> None:
        zmq = zmq_module()  # the failed MAC was counted (and logged) as a drop already
        try:
            self._sock.send_multipart([identity, *refusal("bad secret")], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _send(self, rank: int, frames: list[Any], copy: bool = True, track: bool = False,
              ) -> Any:
        zmq = zmq_module()
        try:
            return self._sock.send_multipart([self._identity[rank], *frames], copy=copy,
                                             track=track)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerDiedError(f"queue {self.name!r}: remote reader rank {rank} "
                                    "disconnected", pid=-1, role=f"reader {rank}") from exc
            raise

    # -- handshake -----------------------------------------------------------------

    def _handshake(self, deadline: float | None) -> None:
        if self._local is not None:
            self._local.wait_until_ready(None if deadline is None
                                         else max(0.0, deadline - time.monotonic()))
        self._busy = True
        try:
            self._wait_remote(lambda: len(self._identity) == len(self._acked), deadline,
                       "wait_until_ready (remote readers saying HELLO)")
            if not self._ready:
                self._ready = True
                for rank in self.remote_reader_ranks:
                    self._welcome(rank)
        finally:
            self._busy = False

    def _wait_remote(self, done: Any, deadline: float | None, what: str) -> None:
        self._pump(0)
        while not done():
            self._check_open()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"queue {self.name!r}: {what} timed out; "
                                   f"{self._describe_progress()}")
            wait = self._tick_s if deadline is None else min(self._tick_s, deadline - now)
            self._pump(wait)

    def _describe_progress(self) -> str:
        parts = []
        for rank, acked in self._acked.items():
            state = "no HELLO" if rank not in self._identity else f"acked {acked}"
            parts.append(f"remote rank {rank} {state}")
        return f"writer published {self._seq}; " + ", ".join(parts)

    # -- publishing -------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to local and remote readers; blocks while any is a window behind."""
        self._check_open()
        data = obj.data if obj.__class__ is EncodedMessage else self._encoder.dump(obj)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._busy = True
        try:
            seq = self._seq
            must_exceed = seq - self._window

            def has_credit() -> bool:
                for rank, acked in self._acked.items():
                    if rank in self._reader_closed:
                        raise QueueClosedError(f"queue {self.name!r}: reader rank {rank} shut "
                                               "down and will not consume more messages")
                    if acked <= must_exceed:
                        return False
                return len(self._identity) == len(self._acked)

            # Credit in hand (the common case) needs no look at the socket;
            # ACKs are read when it runs short.
            if not (self._ready and min(self._acked.values()) > must_exceed
                    and not self._reader_closed):
                self._wait_remote(has_credit, deadline,
                                  "enqueue (a remote reader is a window behind)")
            if self._local is not None:
                self._local.enqueue(EncodedMessage(data), None if deadline is None
                                    else max(0.0, deadline - time.monotonic()))
            self._publish(seq, data)
            self._seq = seq + 1
        finally:
            self._busy = False

    def _publish(self, seq: int, data: bytes | Frame) -> None:
        if isinstance(data, bytes):
            parts: list[Any] = [data]
            n_pickle = 1
        else:
            parts = [*data.pieces, *data.buffers]
            n_pickle = len(data.pieces)
        large = any(len(memoryview(p).cast("B")) >= ZERO_COPY_BYTES for p in parts)
        firsts, rest = self._out.seal_many(DATA, self.remote_reader_ranks, seq, parts,
                                           aux=n_pickle)
        trackers = []
        for rank, first in zip(self.remote_reader_ranks, firsts, strict=True):
            trackers.append(self._send(rank, [first, *rest], copy=not large, track=large))
        for tracker in trackers:
            # ZeroMQ reads the caller's buffers until the bytes are sent; wait
            # for that, or the caller could change them in flight.  Published
            # already, so no deadline: only shutdown ends this wait.
            while tracker is not None and not tracker.done:
                if self._closed:
                    return
                try:
                    tracker.wait(self._tick_s)
                except Exception:  # zmq.NotDone: keep waiting
                    pass

    # -- closing ---------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            return  # a forked copy: the sockets belong to the parent
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self._busy:
            for rank in list(self._identity):
                try:
                    self._send(rank, self._out.seal(CLOSE, rank, self._seq, []))
                except Exception:
                    pass
            self._sock.close(LINGER_MS)
            self._context.term()
        if self._local is not None:
            self._local.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<MessageQueue {self.name!r} writer {state} readers={self.n_reader} "
                f"remote={self.remote_reader_ranks} at {self.remote_subscribe_addr}>")
