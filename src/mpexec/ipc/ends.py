"""The two ends of a queue as types: :class:`QueueWriter` and :class:`QueueReader`.

::

    writer end (one)                          reader end (one per rank)
    ----------------                          -------------------------
    export_handle() ── Handle ──────────────▶ MessageQueue.create_from_handle(handle, rank)
    wait_until_ready() ◀── every reader ────▶ wait_until_ready()
    encode(obj) / enqueue(obj) ── message ──▶ dequeue()
    shutdown() ── closes both sides ────────▶ QueueClosedError at the next call

Four classes implement them, each holding only what its transport needs:
:class:`~mpexec.ipc.writer.MessageQueueWriter` and
:class:`~mpexec.ipc.reader.MessageQueueReader` share a ring in shared memory
(both hold an :class:`~mpexec.ipc.endpoint.RingEnd`);
:class:`~mpexec.ipc.remote.RemoteWriter` adds ranks on other hosts over
ZeroMQ, and :class:`~mpexec.ipc.remote.RemoteReader` is such a rank.
:class:`~mpexec.ipc.message_queue.MessageQueue` is the writer callers build;
it picks one of the two writers from its arguments.  A reader end has no
``enqueue`` and a writer end no ``dequeue``: asking for one is an
``AttributeError``, and a type checker says so before that.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from mpexec.ipc.handle import Handle
from mpexec.ipc.serialization import EncodedMessage


@runtime_checkable
class QueueWriter(Protocol):
    """The one writer of a queue: broadcasts each message to every reader, in order."""

    name: str

    @property
    def closed(self) -> bool: ...

    def export_handle(self) -> Handle:
        """What readers attach with (small, picklable)."""
        ...

    def encode(self, obj: Any) -> EncodedMessage:
        """Pickle ``obj`` once, for one or more ``enqueue`` tries."""
        ...

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` (or an :class:`EncodedMessage`); ``TimeoutError``
        means nothing was published."""
        ...

    def broadcast_object(self, obj: Any = None) -> Any:
        """``enqueue(obj)``, then ``obj``."""
        ...

    def lagging_ranks(self) -> list[int]:
        """The reader ranks a full ring waits for."""
        ...

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until every reader has attached, then let them start."""
        ...

    def shutdown(self) -> None:
        """Close the queue: every reader's next call raises ``QueueClosedError``."""
        ...


@runtime_checkable
class QueueReader(Protocol):
    """One reader of a queue: every message, in the order the writer published it."""

    name: str

    @property
    def closed(self) -> bool: ...

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message; ``TimeoutError`` when none came by ``timeout``."""
        ...

    def broadcast_object(self, obj: Any = None) -> Any:
        """The next message (``obj`` is ignored: the writer's side gives it)."""
        ...

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until the writer has seen every reader attach."""
        ...

    def shutdown(self) -> None:
        """Leave: this reader consumes no more; the writer's waits for it end."""
        ...
