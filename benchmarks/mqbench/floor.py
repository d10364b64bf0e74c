"""The floor: the least a shared-memory ring can do in pure Python (one slot,
one write counter, one read counter per reader, spin with ``sched_yield``).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from harness import BenchError

from mqbench.messages import CALL_TIMEOUT_S, CHILD_WAIT_S, FLOOR_SLOT_BYTES


class FloorRing:
    """One writer, ``n`` readers, one slot; waits spin with ``sched_yield``.

    Layout (u64 cells, each counter alone on a 64-byte line)::

        line 0        write_seq
        line 1 + r    read_seq of reader r
        line 1 + n    slot: u64 length, then the pickled message

    Publication is "data, then write_seq": on x86-64 (total store order)
    stores stay in order and loads stay in order, so no fence is needed.
    This is a measuring stick for the design's cost in Python, not a
    transport: it has no sleeping, no liveness checks, no large messages.
    The memory is a memfd, like mpexec's, shared through /proc/<pid>/fd.
    """

    def __init__(self, fd: int, size: int, n_readers: int, reader: int | None,
                 alive: Callable[[], bool] | None, owner: bool, timeout: float) -> None:
        self.size = size
        self.n = n_readers
        self.fd = fd if owner else -1
        self.map = mmap.mmap(fd, size)
        self.mv = memoryview(self.map)
        self.cells = self.mv.cast("Q")
        self.read_cells = [8 * (1 + r) for r in range(n_readers)]
        self.len_cell = 8 * (1 + n_readers)
        self.data_off = self.len_cell * 8 + 8
        self.capacity = size - self.data_off
        self.reader = reader
        self.my_cell = self.read_cells[reader] if reader is not None else -1
        self.seq = int(self.cells[self.my_cell] if reader is not None else self.cells[0])
        self.alive = alive
        self.timeout = timeout

    @classmethod
    def create(cls, n_readers: int, reader: int | None = None) -> FloorRing:
        size = 64 * (2 + n_readers) + FLOOR_SLOT_BYTES
        fd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, n_readers, reader, None, owner=True, timeout=CALL_TIMEOUT_S)
        except BaseException:
            os.close(fd)
            raise

    def ref(self) -> tuple[int, int, int, int]:
        return (os.getpid(), self.fd, self.size, self.n)

    @classmethod
    def attach(cls, ref: tuple[int, int, int, int], reader: int | None,
               alive: Callable[[], bool]) -> FloorRing:
        pid, fd, size, n_readers = ref
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            return cls(own, size, n_readers, reader, alive, owner=False, timeout=CHILD_WAIT_S)
        finally:
            os.close(own)

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, 5)
        cells = self.cells
        seq = self.seq
        for cell in self.read_cells:
            if cells[cell] < seq:
                self._spin(cell, seq)
        size = len(data)
        if size > self.capacity:
            raise ValueError(f"floor ring: {size} B message, slot holds {self.capacity} B")
        cells[self.len_cell] = size
        self.mv[self.data_off:self.data_off + size] = data
        cells[0] = seq + 1
        self.seq = seq + 1

    def recv(self) -> Any:
        cells = self.cells
        seq = self.seq
        if cells[0] <= seq:
            self._spin(0, seq + 1)
        size = cells[self.len_cell]
        data = bytes(self.mv[self.data_off:self.data_off + size])  # copy out, then free the slot
        cells[self.my_cell] = seq + 1
        self.seq = seq + 1
        return pickle.loads(data)

    def _spin(self, cell: int, target: int) -> None:
        cells = self.cells
        deadline = time.monotonic() + self.timeout
        polls = 0
        while cells[cell] < target:
            os.sched_yield()
            polls += 1
            if not polls & 1023:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"floor ring: waited {self.timeout:.0f} s")
                if self.alive is not None and not self.alive():
                    raise BenchError("floor ring: the driver is gone")

    def close(self) -> None:
        self.cells.release()
        self.mv.release()
        self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
