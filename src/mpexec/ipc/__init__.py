"""mpexec.ipc: the shared-memory transport.

``MessageQueue`` broadcasts each message from one writer to every reader
process, through a ring in shared memory (see ``message_queue`` for the
protocol).  ``MessageQueue(...)`` makes the writer end
(:class:`MessageQueueWriter`), ``MessageQueue.create_from_handle`` a reader end
(:class:`MessageQueueReader`).  Nothing here knows about executors or models,
and nothing here needs torch.
"""

from mpexec.ipc.endpoint import QueueState
from mpexec.ipc.message_queue import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    Handle,
    MessageQueue,
)
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
    "QueueState",
]
