"""The reader end of a queue on another host: :class:`RemoteReader`.

The protocol is drawn in ``remote.writer`` and ``resend``: attach sends HELLO,
``wait_until_ready`` waits for the writer's WELCOME, ``dequeue`` takes the
DATA frame with the next sequence number and ACKs every half window (at once
after a large message, so the writer's resend log lets it go).  A DATA frame
further on means frames were lost with a connection: the reader asks with
RESUME for the one it expects, as it does after ``SILENCE_S`` with nothing
heard (the last frames, or an ACK, may have been lost), or when a CLOSE
counts more messages than arrived; the writer resends.  Old frames in the
range it asked for are duplicates (``recovery``), older ones replays
(``drops``); anything failing authentication is dropped unopened and
counted in ``drops``.  A refusal during the handshake is an
:class:`~mpexec.ipc.auth.AuthenticationError`; a message that verifies but
does not unpickle is an :class:`~mpexec.errors.UndecodableMessageError`
(consumed: the reader stays usable).
"""

from __future__ import annotations

import os
import pickle
import secrets
import threading
import time
from collections import Counter
from typing import Any

from mpexec.errors import QueueClosedError, UndecodableMessageError
from mpexec.ipc.auth import (
    ACK,
    CLOSE,
    DATA,
    HELLO,
    RESUME,
    WELCOME,
    AuthenticationError,
    DropCounter,
    FrameAuth,
    Opened,
    derive_key,
    is_refusal,
)
from mpexec.ipc.curve import HandshakeWatch, secure
from mpexec.ipc.handle import DEFAULT_TICK_S, Handle
from mpexec.ipc.remote.sockets import (
    CLOSE_GRACE_S,
    CONTROL_MAX_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    LINGER_MS,
    acquire_context,
    channel_name,
    plain_send,
    release_context,
    zmq_module,
)

_HELLO_REPEAT_S = 1.0
SILENCE_S = 0.5     # nothing heard for this long: RESUME (the writer may be waiting)
GAP_REPEAT_S = 0.2  # a gap asks again for the same message no sooner than this
# CLOSE came before messages it counts: how long to wait for them to be resent
# (the writer stays up to control.CLOSE_LINGER_S for it) before giving up.
CLOSE_GAP_WAIT_S = 2.0
_CURVE_CHECK_S = 0.1


class RemoteReader:
    """A reader end on another host (see the module docstring); a
    :class:`~mpexec.ipc.ends.QueueReader`.  Constructing one connects to the
    writer and says HELLO."""

    @classmethod
    def attach(cls, handle: Handle, rank: int, secret: str | bytes | None, *,
               max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
               tick_s: float = DEFAULT_TICK_S) -> RemoteReader:
        """Attach as remote reader ``rank`` (``MessageQueue.create_from_handle``)."""
        return cls(handle, rank, secret, max_message_bytes=max_message_bytes, tick_s=tick_s)

    def __init__(self, handle: Handle, rank: int, secret: str | bytes | None, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tick_s: float = DEFAULT_TICK_S) -> None:
        if secret is None:
            raise ValueError(f"queue {handle.name!r}: a remote reader needs the cluster secret")
        if handle.remote_subscribe_addr is None or rank in handle.local_reader_ranks or not (
                0 <= rank < handle.n_reader):
            raise ValueError(f"rank {rank} is not a remote reader of queue {handle.name!r}")
        zmq = zmq_module()
        self.name = handle.name
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.rank = rank
        self._closed = False
        # The user's call and shutdown meet as on a shared-memory end
        # (endpoint.EndGuard): the socket is closed once, by whoever is last.
        self._busy = False
        self._end_lock = threading.Lock()
        self._sock_closed = False
        self._pid = os.getpid()
        self._tick_s = tick_s
        self._seq = 0
        # Credit: ACK every half window (never more than a window, or the
        # writer could wait for an ACK that a caught-up reader never sends).
        self._ack_every = max(1, handle.max_chunks // 2)
        self._window = handle.max_chunks
        self._acked = 0
        self._control = 0              # grows with every ACK/RESUME (replay guard)
        self._heard_at = time.monotonic()
        self._heard_seq = 0
        self._resume_at = -float("inf")
        self._resume_seq = -1
        self._dup_floor = 1 << 64      # duplicates tolerated from here (asked resends)
        self.recovery: Counter[str] = Counter()  # gaps, resume requests, duplicates
        self._welcomed = False
        assert handle.remote_token is not None
        channel = channel_name(handle.remote_token, handle.name)
        self._in = FrameAuth(derive_key(secret, channel, "w2r"), max_message_bytes)
        self._out = FrameAuth(derive_key(secret, channel, "r2w"), CONTROL_MAX_BYTES)
        self.drops = DropCounter(f"queue {handle.name!r} (remote reader rank {rank})")
        self._nonce = secrets.randbits(63)
        self._writer_closed = False
        self._close_seq: int | None = None  # CLOSE came with a gap: the count it gave
        self._close_seen_at = 0.0
        self._context = acquire_context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.RCVHWM, 0)
        # A fixed routing id: should the connection drop and come back, the
        # writer still knows this reader (ZeroMQ would otherwise pick a new one).
        sock.setsockopt(zmq.ROUTING_ID, b"r%d-%x" % (rank, self._nonce))
        if max_message_bytes < 2**63:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if ":" in (handle.connect_ip or ""):
            sock.setsockopt(zmq.IPV6, 1)
        if handle.remote_curve:
            secure(sock, secret, server=False)
        # Until WELCOME: a ZeroMQ handshake that fails (CURVE on one end only,
        # or CURVE keys from another secret) is reported, not waited out.
        self._watch: HandshakeWatch | None = HandshakeWatch(sock)
        sock.connect(handle.remote_subscribe_addr)
        self._sock = sock
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(tick_s * 1000)))
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._rcvmore, self._noblock, self._again = zmq.RCVMORE, zmq.NOBLOCK, zmq.Again
        self._send = plain_send(zmq)
        self._hello()

    def _hello(self) -> None:
        # Never blocks: with no connection up (a CURVE handshake failing) a
        # DEALER would wait for one; the next repeat makes a lost HELLO good.
        try:
            self._sock.send_multipart(self._out.seal(HELLO, self.rank, self._nonce, []),
                                      self._noblock)
        except self._again:
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def broadcast_object(self, obj: Any = None) -> Any:
        """The next message (the writer's ``broadcast_object`` sent it)."""
        return self.dequeue()

    def _enter_call(self) -> None:
        self._busy = True  # announced before closed is looked at
        if self._closed:
            self._leave_call()
            raise QueueClosedError(f"queue {self.name!r} was shut down")

    def _leave_call(self) -> None:
        self._busy = False
        if self._closed:
            self._close_socket_if_idle()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait for the writer's WELCOME (it comes once every reader said HELLO)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._enter_call()
        try:
            hello_at = time.monotonic() + _HELLO_REPEAT_S
            while not self._welcomed:
                self._check_curve_handshake()
                # HELLO again every second until the WELCOME comes: either may
                # have been lost with a connection that dropped.
                step = min(hello_at, time.monotonic() + _CURVE_CHECK_S)
                part = step if deadline is None else min(step, deadline)
                try:
                    self._receive(part, "wait_until_ready (writer's WELCOME)")
                except TimeoutError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    if time.monotonic() >= hello_at:
                        hello_at = time.monotonic() + _HELLO_REPEAT_S
                        self._hello()
        finally:
            self._end_monitor()
            self._leave_call()

    def _check_curve_handshake(self) -> None:
        """A CURVE mismatch fails inside ZeroMQ, before any frame: the socket
        monitor tells (``curve.HandshakeWatch``), as clear an error as a refusal."""
        if self._watch is not None and self._watch.failed():
            raise AuthenticationError(
                f"queue {self.name!r}: the ZeroMQ handshake of remote reader rank "
                f"{self.rank} with the writer failed: CURVE (cluster_curve) is on at "
                "one end only, or this host's cluster secret differs from the writer's")

    def _end_monitor(self) -> None:
        if self._watch is not None:
            self._watch.end()
            self._watch = None

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message, in order; frames that fail authentication are dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._enter_call()
        try:
            if self._seq - self._acked >= self._ack_every:
                # Due since the last message: sent now, just before this read
                # waits, so that it leaves with whatever the caller sent in
                # between (one I/O thread wake-up for both, not one each).
                self._tell(ACK)
            while True:
                message = self._receive(deadline, "dequeue")
                if message is not None:
                    break
            if message.__class__ is not bytes and len(message.parts) > 1:  # type: ignore[union-attr]
                self._tell(ACK)  # large parts: let the writer free them at once
        finally:
            self._leave_call()
        try:
            if isinstance(message, bytes):
                return pickle.loads(message)
            return _decode(message)
        except Exception as exc:
            raise UndecodableMessageError(
                f"queue {self.name!r}: message {self._seq - 1} from the writer (remote "
                f"reader rank {self.rank}) could not be unpickled: "
                f"{type(exc).__name__}: {exc}") from exc

    def _tell(self, kind: int) -> None:
        """ACK or RESUME: the next sequence this reader expects (never blocks:
        one lost is made good by the next)."""
        self._control = control = (self._control + 1) & 0xFFFFFFFF
        self._acked = seq = self._seq
        try:
            self._send(self._sock, self._out.seal_control(kind, self.rank, seq, control),
                       self._noblock)
        except self._again:
            pass

    def _resume(self, why: str) -> None:
        now = time.monotonic()
        if why == "gap" and self._resume_seq == self._seq and now - self._resume_at < (
                GAP_REPEAT_S):
            return
        self.recovery["resume after " + why] += 1
        # Duplicates are expected from here on; the writer keeps at most a
        # window of messages, so nothing older than that can be a resend.
        seq = self._seq
        self._dup_floor = seq if self._dup_floor + self._window < seq else min(
            self._dup_floor, seq)
        self._resume_at, self._resume_seq = now, seq
        self._tell(RESUME)

    def _receive(self, deadline: float | None, what: str) -> Opened | bytes | None:
        """Wait for one frame and handle it; a DATA message in order is returned:
        its one small part as bytes (the hot path), else as :class:`Opened`."""
        # A blocking read that gives up after a tick (RCVTIMEO): one call when
        # a frame is there or comes, no poller; the tick lets shutdown and the
        # deadline be seen.  A wait shorter than a tick (timeout=0: a look)
        # polls first, so that it never blocks for a whole tick.
        again = self._again
        sock = self._sock
        while True:
            left = self._tick_s if deadline is None else deadline - time.monotonic()
            if left >= self._tick_s or self._poller.poll(
                    0 if left <= 0 else int(left * 1000) + 1):
                try:
                    first = sock.recv()  # small: bytes beat a zmq.Frame
                except again:
                    first = None
            else:
                first = None
            if first is not None:
                if self._welcomed:
                    # The frame expected next, checked whole (header, MAC) in one
                    # step; anything else takes the general path, which counts it.
                    part = self._in.open_expected(first, DATA, self.rank, self._seq, 1)
                    if part is not None:
                        self._seq += 1  # heard: noted at the next idle tick
                        return part
                return self._accept(self._rest(first))
            if self._closed:
                raise QueueClosedError(f"queue {self.name!r} was shut down")
            now = time.monotonic()
            if self._close_seq is not None and (self._seq >= self._close_seq or (
                    now - self._close_seen_at >= CLOSE_GAP_WAIT_S)):
                self._writer_closed = True  # all of it came, or the writer is gone
            if self._writer_closed:
                raise QueueClosedError(self._closed_by_writer())
            if self._seq != self._heard_seq:  # messages came since the last tick
                self._heard_seq, self._heard_at = self._seq, now
            if self._welcomed and now - max(self._heard_at, self._resume_at) >= SILENCE_S:
                self._resume("silence")
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"queue {self.name!r}: {what} timed out (remote "
                                   f"reader rank {self.rank}, {self._seq} messages read)")

    def _closed_by_writer(self) -> str:
        missing = (self._close_seq or 0) - self._seq
        lost = f"; {missing} message(s) before its CLOSE never came" if missing > 0 else ""
        return f"queue {self.name!r}: the writer shut the queue down{lost}"

    def _rest(self, first: bytes) -> list[Any]:
        """``first`` and the frames of the same message after it."""
        sock = self._sock
        if not sock.getsockopt(self._rcvmore):
            return [first]
        frames: list[Any] = [first]
        while True:  # the large parts, uncopied
            frame = sock.recv(copy=False)
            frames.append(frame)
            if not frame.more:
                return frames

    def _accept(self, frames: list[Any]) -> Opened | None:
        reason = None if self._welcomed else is_refusal(frames)
        if reason is not None:
            raise AuthenticationError(
                f"queue {self.name!r}: the writer refused remote reader rank {self.rank} "
                f"({reason}): this host's cluster secret differs from the writer's")
        opened = self._in.open(frames, self.drops)
        if opened is None:
            return None
        self._heard_at = time.monotonic()
        if opened.rank != self.rank:
            self.drops.drop("for another rank")
        elif opened.kind == DATA and self._welcomed:
            seq = opened.seq
            if seq == self._seq:
                self._seq += 1
                return opened
            if seq > self._seq:
                self.recovery["gap"] += 1  # lost with a connection: ask for it
                self._resume("gap")
            elif seq >= self._dup_floor:
                self.recovery["duplicate"] += 1
            else:
                self.drops.drop("replayed")
        elif opened.kind == WELCOME and opened.seq == self._nonce and not self._welcomed:
            self._welcomed = True
        elif opened.kind == CLOSE and opened.seq >= self._seq:
            # CLOSE says how many messages the writer published: with all of
            # them here, done (an ACK lets a lingering writer go at once);
            # with fewer, the rest was lost with a connection: ask for it.
            if opened.seq == self._seq:
                self._writer_closed = True
                self._tell(ACK)
            else:
                if self._close_seq is None:
                    self._close_seq, self._close_seen_at = opened.seq, time.monotonic()
                    self.recovery["gap before close"] += 1
                self._resume("gap")
        else:
            self.drops.drop("replayed")
        return None

    def shutdown(self) -> None:
        """Leave: tell the writer (CLOSE) and close the socket once no call is inside."""
        with self._end_lock:
            if self._closed:
                return
            self._closed = True
        if self._pid != os.getpid():
            return
        # A call in another thread sees ``closed`` within a tick and leaves;
        # should it still be inside after the grace, it closes the socket itself.
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.001)
        self._close_socket_if_idle()

    def _close_socket_if_idle(self) -> None:
        with self._end_lock:
            if self._sock_closed or self._busy or self._pid != os.getpid():
                return
            self._sock_closed = True
            try:
                self._sock.send_multipart(self._out.seal(CLOSE, self.rank, self._seq, []),
                                          zmq_module().NOBLOCK)
            except Exception:
                pass
            self._end_monitor()
            self._sock.close(LINGER_MS)
            release_context(self._context)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<RemoteReader {self.name!r} rank {self.rank} {state}>"


def _decode(message: Opened) -> Any:
    n_pickle = message.aux
    parts = message.parts
    data = parts[0] if n_pickle == 1 else b"".join(parts[:n_pickle])
    return pickle.loads(data, buffers=parts[n_pickle:])
