"""What a benchmark run must not leave behind: children, memfds, /dev/shm entries.
"""

from __future__ import annotations

import os

from mpexec.system.procs import proc_stat


def children_left() -> list[str]:
    """Live children of this process, except multiprocessing's resource tracker.

    The tracker is started by the first spawn and ends when this process does.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    me = os.getpid()
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        if stat is not None and stat.ppid == me and stat.pid != tracker:
            left.append(f"{entry} {stat.name} ({stat.state})")
    return left


def dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def own_memfds() -> set[str]:
    """This process's mpexec memfds, open or mapped: none should outlive a run."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:mpexec-"):
            found.add(target)
    with open("/proc/self/maps") as maps:
        found |= {line.split(None, 5)[5].strip() for line in maps if "/memfd:mpexec-" in line}
    return found
