"""mpexec.ipc: the queues between the driver and its workers.

``MessageQueue`` broadcasts each message from one writer to every reader
process, through a ring in shared memory (see ``message_queue`` for the
protocol), and to readers on other hosts over ZeroMQ (the sub-package
``remote``).  ``MessageQueue(...)`` makes the writer end, a
:class:`QueueWriter`; ``MessageQueue.create_from_handle`` a reader end, a
:class:`QueueReader` (``ends``).  Nothing here knows about executors or
models, and nothing here needs torch.
"""

from mpexec.ipc.endpoint import QueueState
from mpexec.ipc.ends import QueueReader, QueueWriter
from mpexec.ipc.handle import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, Handle
from mpexec.ipc.message_queue import MessageQueue
from mpexec.ipc.reader import MessageQueueReader
from mpexec.ipc.serialization import EncodedMessage
from mpexec.ipc.writer import MessageQueueWriter

__all__ = [
    "DEFAULT_MAX_CHUNKS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "EncodedMessage",
    "Handle",
    "MessageQueue",
    "MessageQueueReader",
    "MessageQueueWriter",
    "QueueReader",
    "QueueState",
    "QueueWriter",
]
