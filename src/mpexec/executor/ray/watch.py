"""The stall watch of the actors on a Ray node the driver is not on.

A stopped or hung actor is seen only where it runs: its state in
``/proc/<pid>/stat`` and its heartbeat cell are that machine's (see
``stall``).  The driver watches the actors on its own Ray node itself; each
other Ray node that hosts ranks gets one small :class:`RayNodeWatch` actor
(no CPU, pinned to the node) that runs the same ``StallWatch`` there::

    driver                                        watch actor on node N
    ------                                        ---------------------
    RayNodeWatch(world, bounds) pinned to N  -->  StallWatch: a heartbeat segment
    heartbeat.remote()  (an ObjectRef, handed
      to the actors of N as a constructor
      argument; Ray resolves it first)       -->  the segment's ref
    actors of N: Heartbeat thread, cell = local rank
    watch_workers.remote({cell: (rank, pid)})
      after start-up                         -->  check every tick; returns the
                                                  first Stall (rank, pid, what
                                                  was seen) and ends
    the death watch waits on that ref beside
    the actors' liveness refs: a Stall marks
    the actor's handle stalled and gone; the
    lifecycle kills it (``ray.kill``) and fails
    with WorkerStalledError naming the rank
    shutdown: ray.kill the watch actors

The watch never kills: the driver does, once it has recorded the verdict,
so that the actor's death cannot be seen before its cause.  A watch actor
that dies (its node lost) says nothing; the actors' own liveness refs tell.
"""

from __future__ import annotations

import time

from mpexec.executor.stall import Stall, StallWatch
from mpexec.ipc.shm import SegmentRef


class _Process:
    def __init__(self, rank: int, pid: int | None) -> None:
        self.rank = rank
        self.pid = pid


class RayNodeWatch:
    """One Ray node's stall watch; see the module docstring."""

    def __init__(self, cells: int, stall_timeout_s: float | None,
                 stopped_timeout_s: float | None) -> None:
        self.cells = cells
        self.stall = StallWatch(cells, stall_timeout_s, stopped_timeout_s)

    def heartbeat(self) -> SegmentRef | None:
        """Where this node's actors stamp their heartbeats (None: no heartbeat)."""
        return self.stall.ref()

    def watch_workers(self, workers: dict[int, tuple[int, int]]) -> Stall | None:
        """Watch ``{cell: (rank, pid)}`` until one stalls; that verdict."""
        stall = self.stall
        if stall.tick_s is None:
            return None
        processes = [_Process(-1, None) for _ in range(self.cells)]
        for cell, (rank, pid) in workers.items():
            processes[cell] = _Process(rank, pid)
        while True:
            found = stall.check(processes)
            if found is not None:
                return found
            time.sleep(stall.tick_s)


__all__ = ["RayNodeWatch"]
