"""What the machine is, and what a process has used: for the header of every run.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from mpexec.system.procs import proc_stat


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (clock-tick resolution)."""
    stat = proc_stat(pid)
    if stat is None:
        raise ProcessLookupError(pid)
    return stat.cpu_s


def descendant_pids(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                parents.setdefault(stat.ppid, []).append(stat.pid)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_s_of(pids: set[int]) -> dict[int, float]:
    """utime + stime of each of ``pids`` still there."""
    out = {}
    for pid in pids:
        stat = proc_stat(pid)
        if stat is not None:
            out[pid] = stat.cpu_s
    return out


def machine_info() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "cpu": model,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        from mpexec.ipc import sync

        info["mpexec_fence"] = sync.FENCE_KIND
    except Exception as err:  # reported, not fatal here
        info["mpexec_fence"] = f"unavailable ({err!r})"
    try:
        import numpy
        import zmq

        info["numpy"] = numpy.__version__
        info["pyzmq"] = f"{zmq.__version__} (libzmq {zmq.zmq_version()})"
    except Exception as err:
        info["deps"] = repr(err)
    return info


def free_ports(count: int = 1, attempts: int = 50) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` are free on loopback right now
    (another process may take them before they are bound: fine for a benchmark)."""
    import socket

    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no run of {count} free loopback ports in {attempts} attempts")
