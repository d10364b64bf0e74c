"""The writer's side of what its remote readers send it: HELLO, ACK, RESUME, CLOSE.

It also waits for credit (reading ACKs) and closes the readers at shutdown
(CLOSE with the count published; see ``resend``).

:class:`WriterControl` is the half of :class:`~mpexec.ipc.remote.RemoteWriter`
that reads the ROUTER socket: it admits readers (HELLO -> WELCOME, or a
plain-text refusal for a wrong secret), takes credit from ACKs, resends from
the log on RESUME (``resend``), and notes readers that CLOSEd.  Every frame is
opened (``auth``) before it is looked at; anything that fails is counted in
``drops``.  It runs on the writer's thread while that waits for credit or
readers, and on the service thread (:meth:`_serve`) while the writer's thread
is elsewhere; ``_io`` gives the socket to one of them at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from mpexec.ipc.auth import (
    ACK,
    CLOSE,
    HELLO,
    RESUME,
    WELCOME,
    DropCounter,
    FrameAuth,
    Opened,
    kind_of,
    refusal,
)
from mpexec.ipc.remote.resend import ResendLog
from mpexec.ipc.remote.sockets import zmq_module

logger = logging.getLogger(__name__)

SERVICE_S = 0.05  # how often an idle writer reads its readers' control frames
# After a dropped connection, how long a closing writer stays for readers that
# still lack messages (they ask with RESUME when CLOSE tells them how many).
CLOSE_LINGER_S = 1.0
# ... if the drop was this recent (a longer-ago loss the reader's RESUME after
# reader.SILENCE_S has recovered already).
RECENT_DROP_S = 1.0


class WriterControl:
    """Control frames from remote readers (see the module docstring)."""

    name: str
    drops: DropCounter
    resent: int
    _sock: Any
    _poller: Any
    _events: int
    _pollin: int
    _in: FrameAuth
    _out: FrameAuth
    _log: ResendLog
    _identity: dict[int, bytes]
    _nonce: dict[int, int]
    _reader_closed: set[int]
    _ready: bool
    _closing: bool
    _tick_s: float
    _again: type[Exception]
    _monitor: Any
    _dropped_at: float
    _solo: tuple[int, bytes] | None
    _seq: int
    _io: threading.Lock
    _stop: threading.Event

    if TYPE_CHECKING:  # RemoteWriter's
        def _has_credit(self, seq: int) -> bool: ...
        def _check_open(self) -> None: ...
        def _describe_progress(self) -> str: ...

    # -- incoming control frames -------------------------------------------------

    def _pump(self, wait_s: float) -> None:
        """Handle every control frame that arrives within ``wait_s`` (0: what is there)."""
        # Reading first and polling only when there was nothing: a poll
        # costs more than a failed non-blocking read.
        if self._drain() or wait_s <= 0:
            return
        if self._poller.poll(max(0, int(wait_s * 1000))):
            self._drain()

    def _await_credit(self, seq: int, deadline: float | None) -> None:
        """Read control frames until message ``seq`` may go (or the deadline)."""
        # Short of credit, an ACK is usually waiting already: without a
        # deadline a blocking read (it gives up after a tick, RCVTIMEO) takes
        # it in one call, with no look at ZMQ_EVENTS first.  With one (the
        # executor's first try is timeout=0), what is there is read first.
        again, sock, events, pollin = self._again, self._sock, self._events, self._pollin
        while not self._has_credit(seq):
            self._check_open()
            if deadline is None:
                try:
                    self._read_control()
                except again:  # a tick with nothing: note dropped connections
                    self._watch_connections()
                continue
            if sock.getsockopt(events) & pollin:
                self._read_control()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"queue {self.name!r}: enqueue (a remote reader is a "
                                   f"window behind) timed out; {self._describe_progress()}")
            if not self._poller.poll(int(min(left, self._tick_s) * 1000) + 1):
                self._watch_connections()

    def _drain(self) -> bool:
        sock = self._sock
        got = False
        # ZMQ_EVENTS costs less than a failed non-blocking read (an exception).
        while sock.getsockopt(self._events) & self._pollin:
            self._read_control()
            got = True
        return got

    def _read_control(self) -> None:
        """Read and handle one message (ROUTER: identity, frames); blocks at most
        a tick (RCVTIMEO: ``zmq.Again``) when none is there."""
        sock = self._sock
        identity = sock.recv()
        # A ROUTER message always has a frame after the identity; as a
        # zmq.Frame it tells whether more follow (cheaper than ZMQ_RCVMORE).
        first = sock.recv(copy=False)
        if first.more:  # more than a control frame: never a reader's
            frames = [first.bytes]
            while True:
                frame = sock.recv(copy=False)
                frames.append(frame.bytes)
                if not frame.more:
                    break
            self._handle(identity, frames)
        else:
            self._handle(identity, [first.bytes])

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        opened = self._in.open_control(frames[0]) if len(frames) == 1 else None
        if opened is None:
            opened = self._in.open(frames, self.drops)
            if opened is None:
                if kind_of(frames) == HELLO:
                    self._refuse(identity)
                return
        self._opened(identity, opened)

    def _opened(self, identity: bytes, opened: Opened) -> None:
        rank = opened.rank
        log = self._log
        if rank not in log.acked:
            self.drops.drop("unknown rank")
        elif opened.kind == HELLO:
            self._hello(identity, rank, opened)
        elif self._identity.get(rank) != identity:
            self.drops.drop("not from the reader")
        elif opened.kind == ACK or opened.kind == RESUME:
            # A reader never goes back, and its counter grows with every
            # control frame: anything else is an old frame replayed.
            if not (log.acked[rank] <= opened.seq <= self._seq
                    and log.fresh_control(rank, opened.aux)):
                self.drops.drop("replayed")
                return
            log.ack(rank, opened.seq)
            if opened.kind == RESUME:
                self._resend(rank, opened.seq)
        elif opened.kind == CLOSE:
            self._reader_closed.add(rank)
            self._solo = None  # enqueue's general path says so
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

    def _resend(self, rank: int, seq: int) -> None:
        for frames in self._log.frames_from(rank, seq):
            # Counted first: the reader may hold the message before _send returns.
            self.resent += 1
            if not self._send(rank, frames):
                self.resent -= 1
                return  # gone again: it will ask once more
        if self._closing:
            self._close_reader(rank)  # CLOSE again, after what it lacked

    # -- closing -------------------------------------------------------------------

    def _close_reader(self, rank: int) -> None:
        """CLOSE carries how many messages were published: a reader that has
        fewer asks for the rest (RESUME) before it stops."""
        try:
            self._send(rank, [self._out.seal_control(CLOSE, rank, self._seq)])
        except Exception:
            pass  # closing: a reader we cannot reach is the node channel's concern

    def _close_readers(self) -> None:
        """CLOSE every reader; if a connection dropped in the last
        ``RECENT_DROP_S``, stay up to ``CLOSE_LINGER_S`` while a reader lacks
        messages, serving its RESUME (a message lost with the connection just
        before CLOSE).  An older drop has been made good by the reader's RESUME
        after silence already, and a peer that died long ago (what the node
        channel shuts a queue down for) is not waited for."""
        self._closing = True
        for rank in list(self._identity):
            self._close_reader(rank)
        self._watch_connections()
        self._end_monitor()
        if time.monotonic() - self._dropped_at > RECENT_DROP_S:
            return
        deadline = time.monotonic() + CLOSE_LINGER_S
        while True:
            behind = [rank for rank in self._identity if rank not in self._reader_closed
                      and self._log.acked[rank] < self._seq]
            left = deadline - time.monotonic()
            if not behind or left <= 0:
                return
            if self._poller.poll(max(1, int(min(left, SERVICE_S) * 1000))):
                self._drain()
            else:  # its CLOSE may have found no connection: again, every tick
                for rank in behind:
                    self._close_reader(rank)

    def _watch_connections(self) -> None:
        """Note when a reader's connection last dropped (the socket monitor,
        read every service tick and at shutdown)."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0):
            monitor.recv_multipart()  # only EVENT_DISCONNECTED is asked for
            self._dropped_at = time.monotonic()

    def _end_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None

    def _refuse(self, identity: bytes) -> None:
        zmq = zmq_module()  # the failed MAC was counted (and logged) as a drop already
        try:
            self._sock.send_multipart([identity, *refusal("bad secret")], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _send(self, rank: int, frames: list[Any]) -> bool:
        """Send to one reader; False when it is not connected right now."""
        zmq = zmq_module()
        sock = self._sock
        try:
            if len(frames) == 1:  # a small message: two plain sends beat send_multipart
                sock.send(self._identity[rank], zmq.SNDMORE)
                sock.send(frames[0])
            else:  # copy=False: pyzmq still copies frames under its copy threshold
                sock.send_multipart([self._identity[rank], *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False  # kept in the log; resent when it asks (RESUME)
            raise
        return True

    def _serve(self) -> None:
        """The service thread: control frames while the writer's thread is away."""
        while not self._stop.wait(SERVICE_S):
            if self._io.acquire(blocking=False):
                try:
                    if not self._stop.is_set():
                        self._drain()
                        self._watch_connections()
                except Exception:
                    if self._stop.is_set():
                        return  # the socket closed under us: we are stopping
                    # Not fatal to the queue: the writer's own thread reads
                    # the socket too; keep serving and say why once per tick.
                    logger.warning("queue %r: reading control frames failed", self.name,
                                   exc_info=True)
                finally:
                    self._io.release()

