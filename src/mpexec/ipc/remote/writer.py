"""Remote readers: a queue whose readers include ranks on other hosts.

``MessageQueue(n_reader, n_local_reader < n_reader, connect_ip=..., secret=...)``
builds a :class:`RemoteWriter`: the ``n_local_reader`` local ranks keep the
shared-memory ring (a plain ``MessageQueueWriter`` inside), and the other
ranks are served over one ZeroMQ ROUTER socket bound at ``connect_ip``
(loopback when not told otherwise) on a port the OS picks.  The address
travels in the :class:`~mpexec.ipc.message_queue.Handle`
(``remote_subscribe_addr``); a remote rank attaches with
``MessageQueue.create_from_handle(handle, rank, secret=...)``, which returns a
:class:`~mpexec.ipc.remote.reader.RemoteReader` (a DEALER socket).  Every frame is sealed with
``auth`` (HMAC-SHA256, per-queue keys, sequence numbers)::

    remote reader r                            writer
    ---------------                            ------
    attach: HELLO(r, nonce)  ----------------> verify; remember r's identity
                                               (wrong secret: REFUSED, plain text)
    wait_until_ready  <--------- WELCOME(r, nonce)   once every reader said HELLO
    dequeue  <------------------ DATA(r, seq k, pickle pieces, buffers)
    every window/2 messages: ACK(r, k+1) ----> credit: the writer sends message k
      (at the next dequeue, before it waits)   only when every reader acked > k-window
    gap or silence: RESUME(r, k) ------------> resend the kept messages k, k+1, ...
    shutdown: CLOSE(r) ----------------------> reader r consumes no more
    fewer than n: RESUME  <--------- CLOSE(r, n published): the writer's shutdown
    all n: ACK(r, n) ------------------------> (after a dropped connection it stays
                                               up to CLOSE_LINGER_S to resend)

Back-pressure is the ring's: the writer is at most ``max_chunks`` messages
ahead of its slowest remote reader (``window``) and waits for ACKs rather
than let ZeroMQ drop at its high-water mark (ROUTER_MANDATORY, no HWM).
``enqueue`` waits for credit *before* it publishes anything, so a
``TimeoutError`` still means nothing was sent.

Delivery survives a dropped connection (``resend``): the writer keeps every
message until each remote reader acknowledged it (at most a window of them),
a reader that sees a gap - or hears nothing for a while - asks with RESUME
for the next sequence it expects, and the writer resends from there.  A
reader that is disconnected is not an error here: sends to it are skipped and
made good on its RESUME.  While the writer's thread is elsewhere (the usual
case for a driver between calls), a small service thread reads control
frames every ``control.SERVICE_S``, so a RESUME never waits for the next ``enqueue``;
a lock gives the socket to one thread at a time.  Large parts are copied into
the resend log, so ``enqueue`` returns with the caller free to reuse its
arrays; ZeroMQ sends them without a further copy.

The reader checks every frame (structure, size limit, MAC, then the
sequence number it expects next) before it unpickles anything; a frame that
fails is dropped and counted in ``drops`` (by reason), logged at most once
per interval, and the reader keeps serving the real writer.

The hot path (one remote reader, credit in hand, a pickle of at most
``auth.INLINE_BYTES``) is one frame each way: ``enqueue`` seals it
(``FrameAuth.seal_small``) and makes two plain sends (the reader's identity,
the frame), with no look at the socket; ``dequeue`` makes one blocking read
and accepts the frame only if its header is byte for byte the one it
expects next and its MAC verifies (``FrameAuth.open_expected``), else the
general path checks and counts it.  The reader's ACK waits for its next
``dequeue`` so that it leaves with whatever its process sent meanwhile (one
I/O-thread wake-up, not two); a writer short of credit reads it with one
blocking read.

Liveness across hosts is not this module's job: the executor's node
channel (heartbeats) shuts a queue down when its peer host is lost, which
wakes every wait here within one ``tick_s``.  One thread may use an end at
a time; ``shutdown`` may come from any thread.  The control frames readers
send are handled in ``control``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any

from mpexec.errors import QueueClosedError
from mpexec.ipc.auth import (
    DATA,
    INLINE_BYTES,
    DropCounter,
    FrameAuth,
    derive_key,
)
from mpexec.ipc.curve import secure
from mpexec.ipc.endpoint import QueueState
from mpexec.ipc.handle import DEFAULT_LOG_INTERVAL_S, DEFAULT_TICK_S, Handle
from mpexec.ipc.remote.control import WriterControl
from mpexec.ipc.remote.resend import ResendLog, owned
from mpexec.ipc.remote.sockets import (
    CLOSE_GRACE_S,
    CONTROL_MAX_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    LINGER_MS,
    acquire_context,
    channel_name,
    endpoint,
    plain_send,
    release_context,
    zmq_module,
)
from mpexec.ipc.serialization import EncodedMessage, Encoder, Frame
from mpexec.ipc.writer import MessageQueueWriter

logger = logging.getLogger(__name__)


class RemoteWriter(WriterControl):
    """The writer end of a queue with remote readers (see the module docstring);
    a :class:`~mpexec.ipc.ends.QueueWriter`.  Its local ranks are served by a
    :class:`~mpexec.ipc.writer.MessageQueueWriter` it holds."""

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int = 512 * 1024, max_chunks: int = 8, *,
                 name: str = "mq", connect_ip: str | None = None,
                 secret: str | bytes | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tick_s: float = DEFAULT_TICK_S, curve: bool = False,
                 **local_options: Any) -> None:
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
        self._io = threading.Lock()  # the socket, the log and the handshake state
        self._stop = threading.Event()
        self._service: threading.Thread | None = None
        self._pid = os.getpid()
        self._tick_s = tick_s
        self._window = max_chunks
        self._seq = 0
        self._ready = False
        self._encoder = Encoder()
        self._log = ResendLog(self.remote_reader_ranks, max_chunks)
        self._local: MessageQueueWriter | None = None
        if n_local_reader:
            self._local = MessageQueueWriter(n_local_reader, n_local_reader,
                                             list(local_reader_ranks), max_chunk_bytes,
                                             max_chunks, name=name, tick_s=tick_s,
                                             **local_options)
        self._token = secrets.randbits(63)
        channel = channel_name(self._token, name)
        self._out = FrameAuth(derive_key(secret, channel, "w2r"), max_message_bytes)
        self._in = FrameAuth(derive_key(secret, channel, "r2w"), CONTROL_MAX_BYTES)
        self.drops = DropCounter(f"queue {name!r} (writer)", DEFAULT_LOG_INTERVAL_S / 12)
        self.resent = 0  # messages sent again on a reader's RESUME
        self._identity: dict[int, bytes] = {}
        self._nonce: dict[int, int] = {}
        self._reader_closed: set[int] = set()
        # (rank, identity) of the one remote reader of a queue that has no
        # other reader, once ready, while open and that reader has not CLOSEd:
        # enqueue's hot path.  None: the general path.
        self._solo: tuple[int, bytes] | None = None
        self.connect_ip = connect_ip or "127.0.0.1"
        # The process's shared context, ended with its last queue (``sockets``).
        self._context = acquire_context()
        sock = self._context.socket(zmq.ROUTER)
        self.curve = curve
        try:
            if curve:
                secure(sock, secret, server=True)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A reader that reconnects (same routing id) takes its pipe back.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            # Reads block at most a tick: shutdown and deadlines are seen.
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(tick_s * 1000)))
            if ":" in self.connect_ip:
                sock.setsockopt(zmq.IPV6, 1)
            port = sock.bind_to_random_port(endpoint(self.connect_ip, "").rstrip(":"))
        except BaseException:
            sock.close(0)
            release_context(self._context)
            if self._local is not None:
                self._local.shutdown()
            raise
        self._sock = sock
        # Connections that drop (seen at shutdown: ``_close_readers``).
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._dropped_at = -float("inf")
        self._closing = False
        # One poller for the queue's life: Socket.poll() builds one per call.
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._events, self._pollin, self._again = zmq.EVENTS, zmq.POLLIN, zmq.Again
        self._plain_send, self._sndmore = plain_send(zmq), zmq.SNDMORE
        self._zmq_error, self._unreachable = zmq.ZMQError, zmq.EHOSTUNREACH
        self.remote_subscribe_addr = endpoint(self.connect_ip, port)

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
            remote_curve=self.curve,
        )

    def encode(self, obj: Any) -> EncodedMessage:
        self._check_open()
        return EncodedMessage(self._encoder.dump(obj))

    def broadcast_object(self, obj: Any = None) -> Any:
        """``enqueue(obj)``, then ``obj``."""
        self.enqueue(obj)
        return obj

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")

    # -- handshake -----------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until every reader, local and remote, has attached (remote ones:
        said HELLO), then let them start (WELCOME)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._local is not None:
            self._local.wait_until_ready(None if deadline is None
                                         else max(0.0, deadline - time.monotonic()))
        with self._io:
            self._wait_remote(lambda: len(self._identity) == len(self._log.acked), deadline,
                              "wait_until_ready (remote readers saying HELLO)")
            if not self._ready:
                self._ready = True
                for rank in self.remote_reader_ranks:
                    self._welcome(rank)
                if self._local is None and len(self.remote_reader_ranks) == 1:
                    rank = self.remote_reader_ranks[0]
                    self._solo = (rank, self._identity[rank])
                self._service = threading.Thread(target=self._serve, daemon=True,
                                                 name=f"MpexecQueue-{self.name}")
                self._service.start()

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
        for rank, acked in self._log.acked.items():
            state = "no HELLO" if rank not in self._identity else f"acked {acked}"
            parts.append(f"remote rank {rank} {state}")
        return f"writer published {self._seq}; " + ", ".join(parts)

    def unattached_ranks(self) -> list[int]:
        """The reader ranks that have not attached yet: local ones not in the
        ring, remote ones that have not said HELLO."""
        ranks = [] if self._local is None else self._local.unattached_ranks()
        ranks += [rank for rank in self.remote_reader_ranks if rank not in self._identity]
        return sorted(ranks)

    def state(self) -> QueueState:
        """The header of the shared-memory ring of the local readers."""
        if self._local is None:
            raise ValueError(f"queue {self.name!r} has no shared-memory ring: "
                             "every reader is remote")
        return self._local.state()

    def lagging_ranks(self) -> list[int]:
        """The reader ranks a full ring waits for (local: a whole ring behind;
        remote: no credit, a window of messages unacknowledged)."""
        ranks = [] if self._local is None else list(self._local.lagging_ranks())
        floor = self._seq - self._window
        ranks += [rank for rank, acked in self._log.acked.items() if acked <= floor]
        return sorted(ranks)

    # -- publishing -------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to local and remote readers; blocks while any is a window behind."""
        if self._closed:
            self._check_open()
        data = obj.data if obj.__class__ is EncodedMessage else self._encoder.dump(obj)
        with self._io:
            seq = self._seq
            solo = self._solo
            if (solo is not None and self._log.floor > seq - self._window
                    and data.__class__ is bytes and len(data) <= INLINE_BYTES):
                # The hot path: one remote reader, credit in hand (no look at
                # the socket: ACKs are read when it runs short), a small pickle.
                rank, identity = solo
                first = self._out.seal_small(DATA, rank, seq, data, 1)
                self._log.keep(seq, [first], [])
                sock, send = self._sock, self._plain_send
                try:
                    send(sock, identity, self._sndmore)
                    send(sock, first, 0)
                except self._zmq_error as exc:
                    if exc.errno != self._unreachable:
                        raise  # unreachable: kept in the log; resent when it asks (RESUME)
                self._seq = seq + 1
                return
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._ready or self._reader_closed or self._log.floor <= seq - self._window:
                self._await_credit(seq, deadline)
            if self._local is not None:
                self._local.enqueue(EncodedMessage(data), None if deadline is None
                                    else max(0.0, deadline - time.monotonic()))
            if data.__class__ is bytes and len(data) <= INLINE_BYTES:
                self._publish_small(seq, data)
            else:
                self._publish(seq, data)
            self._seq = seq + 1

    def _has_credit(self, seq: int) -> bool:
        if self._reader_closed:
            rank = min(self._reader_closed)
            closed = QueueClosedError(f"queue {self.name!r}: reader rank {rank} shut down and "
                                      "will not consume more messages")
            closed.reader_rank = rank
            raise closed
        return (len(self._identity) == len(self._log.acked) and self._ready
                and self._log.has_credit_for(seq))

    def _publish_small(self, seq: int, data: bytes) -> None:
        """One small pickle: one frame per reader, sealed (its MAC) per reader."""
        seal, ranks = self._out.seal_small, self.remote_reader_ranks
        firsts = [seal(DATA, ranks[0], seq, data, 1)] if len(ranks) == 1 else [
            seal(DATA, rank, seq, data, 1) for rank in ranks]
        self._log.keep(seq, firsts, [])
        send, sock, more, identity = self._plain_send, self._sock, self._sndmore, self._identity
        for rank, first in zip(ranks, firsts, strict=True):
            try:
                send(sock, identity[rank], more)
                send(sock, first, 0)
            except self._zmq_error as exc:
                if exc.errno != self._unreachable:
                    raise  # unreachable: kept in the log; resent when it asks (RESUME)

    def _publish(self, seq: int, data: bytes | Frame) -> None:
        if data.__class__ is bytes:
            parts: list[Any] = [data]
            n_pickle = 1
        else:
            assert isinstance(data, Frame)
            parts = [owned(p) for p in (*data.pieces, *data.buffers)]
            n_pickle = len(data.pieces)
        firsts, rest = self._out.seal_many(DATA, self.remote_reader_ranks, seq, parts,
                                           aux=n_pickle)
        self._log.keep(seq, firsts, rest)
        for rank, first in zip(self.remote_reader_ranks, firsts, strict=True):
            self._send(rank, [first, *rest])

    # -- closing ---------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._solo = None
        self._stop.set()
        if self._pid != os.getpid():
            return  # a forked copy: the sockets belong to the parent
        # A blocked enqueue sees ``closed`` within a tick and lets go.
        if self._io.acquire(timeout=CLOSE_GRACE_S):
            try:
                try:
                    self._close_readers()
                except Exception:  # pragma: no cover - closing goes on regardless
                    logger.warning("queue %r: closing the remote readers failed", self.name,
                                   exc_info=True)
                self._end_monitor()  # before the context ends: it is a socket too
                self._sock.close(LINGER_MS)
                release_context(self._context)
            finally:
                self._io.release()
        if self._service is not None:
            self._service.join(CLOSE_GRACE_S)
        if self._local is not None:
            self._local.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<RemoteWriter {self.name!r} {state} readers={self.n_reader} "
                f"remote={self.remote_reader_ranks} at {self.remote_subscribe_addr}>")
