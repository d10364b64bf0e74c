"""What a reader needs to attach to a queue, and the queue's default sizes.

The writer end exports a :class:`Handle` (small, picklable); a reader end
attaches with it.  Both ends, shared-memory and remote, read these, so they
live here, below every end.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpexec.ipc.shm import SegmentRef

DEFAULT_MAX_CHUNK_BYTES = 512 * 1024
DEFAULT_MAX_CHUNKS = 8
DEFAULT_SPIN_S = 0.001
DEFAULT_TICK_S = 0.05
DEFAULT_LOG_INTERVAL_S = 60.0


@dataclass
class Handle:
    """What a reader needs to attach to a queue; small and picklable."""

    local_reader_ranks: list[int]
    buffer: SegmentRef | None   # None when every reader is remote
    n_reader: int
    max_chunks: int
    max_chunk_bytes: int
    token: int
    name: str = "mq"
    # Remote readers (see ``remote``): where they connect, and the token that
    # names the queue's authentication keys.  None: every reader is local.
    connect_ip: str | None = None
    remote_subscribe_addr: str | None = None
    remote_token: int | None = None
    # Remote readers: the writer's socket speaks CURVE (``curve``), keys from the secret.
    remote_curve: bool = False
