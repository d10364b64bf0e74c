"""mpexec.ipc: the shared-memory transport.

``MessageQueue`` broadcasts each message from one writer to every reader
process, through a ring in shared memory (see ``message_queue`` for the
protocol).  Nothing here knows about executors or models, and nothing here
needs torch.
"""

from mpexec.ipc.message_queue import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    Handle,
    MessageQueue,
)

__all__ = ["DEFAULT_MAX_CHUNKS", "DEFAULT_MAX_CHUNK_BYTES", "Handle", "MessageQueue"]
