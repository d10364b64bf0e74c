"""Where everything lives in a queue's shared-memory segment.

The segment is one memfd, mapped by the writer and by every local reader::

    offset 0      control line     magic, geometry, writer pid, token, ready, closed
    offset 64     write line       write_seq: messages published so far (futex word)
    offset 128    writer line      writer_waiting: the writer sleeps for space
    offset 192    reader lines     one 64-byte line per local reader r:
                                     read_seq  messages reader r has consumed (futex word)
                                     sleeping  reader r sleeps for a message
                                     pid       reader r's process id
                                     state     0 detached-never, 1 attached, 2 closed
    ...           release table    per reader, BULK_SLOTS u64: the generation of
                                   each bulk segment that reader has let go of
    page-aligned  ring             max_chunks chunks of CHUNK_HEADER + chunk_bytes

Each counter sits alone on a 64-byte line so that a reader advancing its own
``read_seq`` does not bounce the line other processes poll.  Message ``k``
lives in chunk ``k % max_chunks``.  All numbers are u64 "cells"; ``*_cell``
values are indexes into a ``memoryview`` cast to ``"Q"``.
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = int.from_bytes(b"MPEXECQ1", "little")
LINE = 64
PAGE = 4096
CELLS_PER_LINE = LINE // 8
BULK_SLOTS = 16          # bulk segments a writer keeps for reuse
CHUNK_HEADER = 64        # kind, frame length, bulk descriptor

# control line cells
MAGIC_CELL = 0
N_READERS_CELL = 1
MAX_CHUNKS_CELL = 2
CHUNK_BYTES_CELL = 3
WRITER_PID_CELL = 4
TOKEN_CELL = 5
READY_CELL = 6
CLOSED_CELL = 7
WRITE_SEQ_CELL = 8
WRITER_WAITING_CELL = 16

# reader line cells, relative to the line start
READ_SEQ = 0
SLEEPING = 1
PID = 2
STATE = 3
STATE_ATTACHED = 1
STATE_CLOSED = 2

# chunk header cells, relative to the chunk start
KIND = 0
FRAME_LEN = 1
BULK_FD = 2
BULK_INODE = 3
BULK_SLOT = 4
BULK_GENERATION = 5
KIND_INLINE = 1      # a frame (see serialization) in the chunk
KIND_BULK = 2        # a frame in a bulk segment; the chunk holds its descriptor
KIND_PICKLE = 3      # a bare pickle in the chunk: no frame header, no buffers
NO_SLOT = (1 << 64) - 1


def align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class RingLayout:
    """Offsets of one queue's segment, derived from its geometry alone."""

    n_readers: int
    max_chunks: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.n_readers < 1:
            raise ValueError(f"n_readers must be >= 1, got {self.n_readers}")
        if self.max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {self.max_chunks}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"max_chunk_bytes must be >= 1024, got {self.chunk_bytes}")

    def reader_cell(self, reader: int, field: int) -> int:
        return (3 + reader) * CELLS_PER_LINE + field

    def release_cell(self, reader: int, slot: int) -> int:
        return self._release_base_cell + reader * BULK_SLOTS + slot

    @property
    def _release_base_cell(self) -> int:
        return (3 + self.n_readers) * CELLS_PER_LINE

    @property
    def ring_offset(self) -> int:
        return align((self._release_base_cell + self.n_readers * BULK_SLOTS) * 8, PAGE)

    @property
    def chunk_stride(self) -> int:
        return align(CHUNK_HEADER + self.chunk_bytes, LINE)

    def chunk_offset(self, seq: int) -> int:
        return self.ring_offset + (seq % self.max_chunks) * self.chunk_stride

    @property
    def total_bytes(self) -> int:
        return align(self.ring_offset + self.max_chunks * self.chunk_stride, PAGE)
