"""Naming a worker that stopped answering, whatever call it is in (driver side).

A call may legitimately run for minutes, so its deadline cannot tell a slow
worker from one that will never answer.  Two signs can, within bounds of
their own (``ExecutorConfig.worker_stopped_timeout_s`` and
``worker_stall_timeout_s``)::

    driver (StallWatch.check, every tick_s)        worker r
    ---------------------------------------        --------
    /proc/<pid>/stat state T for stopped_s   <---  SIGSTOP'd (job control, a signal)
    heartbeat cell r older than stall_s      <---  Heartbeat thread (``watcher``):
                                                   cell r = CLOCK_MONOTONIC, every beat_s

The heartbeat is a small thread beside the worker's main thread, so a main
thread busy in a long call (torch kernels, sleeps, I/O, even a pure-Python
loop: the interpreter hands the GIL over every few milliseconds) keeps it
beating; it goes silent when the whole process cannot run (stopped, starved)
or when one C call holds the GIL throughout, hence the generous default.
A process stopped by a debugger (state ``t``) is never judged.  The cells
live in one small memfd segment of the driver (``ipc.shm``), one per local
worker, stamped with the launch time, so start-up is covered from the first
moment; CLOCK_MONOTONIC is one clock for every process of the machine.

Checked by the lifecycle's monitor while the executor runs and by the
start-up waits before that; a verdict is a :class:`Stall` naming the
worker, its pid and what was seen, which becomes a ``WorkerStalledError``.

The watch runs where the processes are, because /proc and CLOCK_MONOTONIC
are one machine's: the driver watches its own local workers (and the Ray
actors on its Ray node: ``only`` names the handles that are here); a
follower node watches its workers and reports a verdict over the node
channel (``nodes``); a Ray node without the driver gets a small watch actor
(``ray.watch``) that returns its verdict to the driver.  A verdict that
comes from elsewhere reaches the lifecycle through the worker's handle
(``WorkerExit.stalled``), and fails the executor the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpexec.errors import WorkerStalledError, WorkerStartupError
from mpexec.ipc.shm import Segment, SegmentRef, segment_name
from mpexec.system import proc_stat

if TYPE_CHECKING:
    from mpexec.executor.launcher import WatchedWorker


class Watched(Protocol):
    """What the watch reads of a worker: its rank and its process here (if any)."""

    @property
    def rank(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

_MIN_TICK_S = 0.05
_MAX_TICK_S = 1.0


def beat_period(stall_timeout_s: float) -> float:
    """How often a worker's heartbeat stamps its cell: ten beats per bound."""
    return min(_MAX_TICK_S, max(_MIN_TICK_S, stall_timeout_s / 10))


@dataclass(frozen=True)
class Stall:
    """One worker that stopped answering, and what was seen."""

    index: int    # its place in the handles checked
    rank: int
    pid: int
    seen: str     # "stopped" or "silent"
    how: str      # for the error: what, for how long, against which bound

    def error(self, when: str = "") -> WorkerStalledError:
        return WorkerStalledError(
            f"worker rank {self.rank} (pid {self.pid}) {self.how}{when}; it was killed and "
            "the executor has failed", rank=self.rank, pid=self.pid, seen=self.seen)


class StallWatch:
    """The driver's view of its local workers' heartbeats and run states."""

    def __init__(self, n_workers: int, stall_timeout_s: float | None,
                 stopped_timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.stopped_timeout_s = stopped_timeout_s
        self._clock = clock
        self._stopped_since: dict[int, float] = {}
        # The handles (by index) whose processes are on this machine; None:
        # every handle with a pid.
        self.only: frozenset[int] | None = None
        self.segment: Segment | None = None
        if stall_timeout_s is not None and n_workers:
            self.segment = Segment.create(segment_name("heartbeat"), 8 * n_workers,
                                          f"the heartbeats of {n_workers} workers")
            now = int(clock() * 1e9)
            for index in range(n_workers):
                self.segment.cells[index] = now
        self.beat_s = beat_period(stall_timeout_s) if stall_timeout_s is not None else 0.0
        bounds = [b for b in (stall_timeout_s, stopped_timeout_s) if b is not None]
        # A verdict comes at most a quarter of its bound late.
        self.tick_s = min(_MAX_TICK_S, max(_MIN_TICK_S, min(bounds) / 4)) if bounds else None

    @property
    def enabled(self) -> bool:
        return self.tick_s is not None

    def ref(self) -> SegmentRef | None:
        """Where the workers stamp their heartbeats (None: no heartbeat)."""
        return None if self.segment is None else self.segment.ref()

    def check(self, handles: Sequence[Watched]) -> Stall | None:
        """The first local worker past a bound, or None (dead ones are the
        monitor's: their pidfd says so)."""
        now = self._clock()
        only = self.only
        for index, handle in enumerate(handles):
            if only is not None and index not in only:
                continue
            pid = handle.pid
            if pid is None or not isinstance(pid, int):
                continue  # not a local process (a follower node, an actor)
            stat = proc_stat(pid)
            state = None if stat is None else stat.state
            if state is None or state in ("Z", "X", "t"):
                self._stopped_since.pop(index, None)
                continue  # gone (the pidfd tells), or held by a debugger
            stall = self._judge(index, handle.rank, pid, state, now)
            if stall is not None:
                return stall
        return None

    def _judge(self, index: int, rank: int, pid: int, state: str, now: float) -> Stall | None:
        stopped_for = 0.0
        if state == "T":
            stopped_for = now - self._stopped_since.setdefault(index, now)
        else:
            self._stopped_since.pop(index, None)
        bound = self.stopped_timeout_s
        if bound is not None and stopped_for >= bound:
            return Stall(index, rank, pid, "stopped",
                         f"has been stopped (state T in /proc/{pid}/stat: SIGSTOP or job "
                         f"control) for {stopped_for:.1f}s (worker_stopped_timeout_s="
                         f"{bound:g})")
        segment, bound = self.segment, self.stall_timeout_s
        if segment is None or bound is None or segment.closed or index * 8 >= segment.size:
            return None
        silent = now - segment.cells[index] / 1e9
        if silent < bound:
            return None
        stopped = " (stopped)" if state == "T" else ""
        return Stall(index, rank, pid, "silent",
                     f"has not answered its heartbeat for {silent:.1f}s{stopped} "
                     f"(worker_stall_timeout_s={bound:g}): it is hung, cannot be scheduled, "
                     "or holds the GIL in one long C call")

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()


def startup_guard(watch: StallWatch, handles: Sequence[WatchedWorker]) -> Callable[[], None]:
    """A start-up wait's tick: for the first worker past a bound, kill it and
    raise ``WorkerStartupError`` (its ``WorkerStalledError`` as the cause)."""

    def check() -> None:
        stall = watch.check(handles)
        if stall is None:
            return
        handles[stall.index].kill()
        cause = stall.error()
        raise WorkerStartupError(
            f"worker rank {stall.rank} (pid {stall.pid}) {stall.how} during start-up; it was "
            "killed", rank=stall.rank) from cause

    return check
