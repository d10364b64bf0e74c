"""Where benchmark processes run: CPU pinning by placement name.
"""

from __future__ import annotations

import os

PLACEMENTS = {
    "free": "no pinning: the scheduler places every process (and reacts to other load)",
    "apart": "driver pinned to the first CPU, reader i to CPU (i + 1) mod nproc",
    "together": "driver and every reader pinned to the first CPU",
}


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (ZeroMQ has I/O threads) to ``cpus``."""
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass


def place(placement: str, pids: list[int], allowed: list[int]) -> None:
    if placement == "free":
        return
    first = {allowed[0]}
    pin(os.getpid(), first)
    for rank, pid in enumerate(pids):
        cpu = allowed[(rank + 1) % len(allowed)] if placement == "apart" else allowed[0]
        pin(pid, {cpu})
