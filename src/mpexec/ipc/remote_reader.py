"""The reader end of a queue on another host: :class:`RemoteReader`.

The protocol is drawn in ``remote``: attach sends HELLO, ``wait_until_ready``
waits for the writer's WELCOME, ``dequeue`` takes the DATA frame with the
next sequence number (anything else is dropped unopened and counted in
``drops``) and ACKs every half window.  A refusal during the handshake is an
:class:`~mpexec.ipc.auth.AuthenticationError`.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
from typing import Any

from mpexec.errors import QueueClosedError
from mpexec.ipc.auth import (
    ACK,
    CLOSE,
    DATA,
    HELLO,
    WELCOME,
    AuthenticationError,
    DropCounter,
    FrameAuth,
    Opened,
    derive_key,
    is_refusal,
)
from mpexec.ipc.message_queue import DEFAULT_TICK_S, Handle, MessageQueue
from mpexec.ipc.remote import (
    CLOSE_GRACE_S,
    CONTROL_MAX_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    LINGER_MS,
    channel_name,
    zmq_module,
)

_HELLO_REPEAT_S = 1.0


class RemoteReader(MessageQueue):
    """A reader end on another host (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # made by attach()

    @classmethod
    def attach(cls, handle: Handle, rank: int, secret: str | bytes | None, *,
               max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
               tick_s: float = DEFAULT_TICK_S) -> RemoteReader:
        if secret is None:
            raise ValueError(f"queue {handle.name!r}: a remote reader needs the cluster secret")
        if handle.remote_subscribe_addr is None or rank in handle.local_reader_ranks or not (
                0 <= rank < handle.n_reader):
            raise ValueError(f"rank {rank} is not a remote reader of queue {handle.name!r}")
        reader = object.__new__(cls)
        reader._attach(handle, rank, secret, max_message_bytes, tick_s)
        return reader

    def _attach(self, handle: Handle, rank: int, secret: str | bytes,
                max_message_bytes: int, tick_s: float) -> None:
        zmq = zmq_module()
        self.name = handle.name
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.rank = rank
        self._closed = False
        self._busy = False
        self._pid = os.getpid()
        self._tick_s = tick_s
        self._seq = 0
        # Credit: ACK every half window (never more than a window, or the
        # writer could wait for an ACK that a caught-up reader never sends).
        self._ack_every = max(1, handle.max_chunks // 2)
        self._acked = 0
        self._welcomed = False
        assert handle.remote_token is not None
        channel = channel_name(handle.remote_token, handle.name)
        self._in = FrameAuth(derive_key(secret, channel, "w2r"), max_message_bytes)
        self._out = FrameAuth(derive_key(secret, channel, "r2w"), CONTROL_MAX_BYTES)
        self.drops = DropCounter(f"queue {handle.name!r} (remote reader rank {rank})")
        self._nonce = secrets.randbits(63)
        self._writer_closed = False
        self._context = zmq.Context(1)
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
        sock.connect(handle.remote_subscribe_addr)
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        sock.send_multipart(self._out.seal(HELLO, rank, self._nonce, []))

    @property
    def closed(self) -> bool:
        return self._closed

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.dequeue()

    def _handshake(self, deadline: float | None) -> None:
        self._busy = True
        try:
            while not self._welcomed:
                # HELLO again every second until the WELCOME comes: either may
                # have been lost with a connection that dropped.
                step = time.monotonic() + _HELLO_REPEAT_S
                part = step if deadline is None else min(step, deadline)
                try:
                    self._receive(part, "wait_until_ready (writer's WELCOME)")
                except TimeoutError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    self._sock.send_multipart(self._out.seal(HELLO, self.rank, self._nonce,
                                                             []))
        finally:
            self._busy = False

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message, in order; frames that fail authentication are dropped."""
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} was shut down")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._busy = True
        try:
            while True:
                message = self._receive(deadline, "dequeue")
                if message is not None:
                    break
        finally:
            self._busy = False
        if self._seq - self._acked >= self._ack_every:
            self._acked = self._seq
            self._sock.send_multipart(self._out.seal(ACK, self.rank, self._seq, []))
        return _decode(message)

    def _receive(self, deadline: float | None, what: str) -> Opened | None:
        """Wait for one frame and handle it; a DATA frame in order is returned."""
        zmq = zmq_module()
        sock = self._sock
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        else:
            frames = self._poll_receive(deadline, what)
        return self._accept(frames)

    def _poll_receive(self, deadline: float | None, what: str) -> list[Any]:
        sock = self._sock
        while True:
            if self._closed:
                raise QueueClosedError(f"queue {self.name!r} was shut down")
            if self._writer_closed:
                raise QueueClosedError(f"queue {self.name!r}: the writer shut the queue down")
            now = time.monotonic()
            wait = self._tick_s if deadline is None else max(0.0, min(self._tick_s,
                                                                      deadline - now))
            if self._poller.poll(int(wait * 1000)):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"queue {self.name!r}: {what} timed out (remote reader "
                                   f"rank {self.rank}, {self._seq} messages read)")
        frames: list[Any] = sock.recv_multipart(copy=False)
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
        if opened.rank != self.rank:
            self.drops.drop("for another rank")
        elif opened.kind == DATA:
            if opened.seq == self._seq and self._welcomed:
                self._seq += 1
                return opened
            self.drops.drop("replayed" if opened.seq < self._seq else "out of order")
        elif opened.kind == WELCOME and opened.seq == self._nonce and not self._welcomed:
            self._welcomed = True
        elif opened.kind == CLOSE and opened.seq == self._seq:
            self._writer_closed = True
        else:
            self.drops.drop("replayed")
        return None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            return
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self._busy:
            try:
                self._sock.send_multipart(self._out.seal(CLOSE, self.rank, self._seq, []),
                                          zmq_module().NOBLOCK)
            except Exception:
                pass
            self._sock.close(LINGER_MS)
            self._context.term()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MessageQueue {self.name!r} remote reader {self.rank} {state}>"


def _decode(message: Opened) -> Any:
    n_pickle = message.aux
    parts = message.parts
    data = parts[0] if n_pickle == 1 else b"".join(parts[:n_pickle])
    return pickle.loads(data, buffers=parts[n_pickle:])
