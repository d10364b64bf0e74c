"""How much memory this process may still put into shared memory.

A memfd's pages are charged to the memory cgroup of the process that touches
them and count against ``RLIMIT_FSIZE`` (the file grows) and, once mapped,
``RLIMIT_AS``.  Asking the kernel for more than that does not fail cleanly:
``posix_fallocate`` of a terabyte runs until the OOM killer picks a process
(machine-wide, without a cgroup), and a file size limit raises ``SIGXFSZ``.
So every reservation is checked here first, against each limit that applies:

    MemAvailable              /proc/meminfo
    cgroup v2                 memory.max - memory.current, of our cgroup and each ancestor
    cgroup v1                 memory.limit_in_bytes - memory.usage_in_bytes, likewise
    RLIMIT_FSIZE              the soft limit on one file's size
    RLIMIT_AS                 the soft limit on address space, minus what is mapped now

The tightest one that is too small becomes an ``OSError(ENOMEM)`` naming what
was being reserved, the MiB needed and that limit.  Reading these files costs
tens of microseconds, so callers check only when they are about to allocate
new memory, never on a reuse.
"""

from __future__ import annotations

import errno
import os
import resource
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Limit:
    """One bound on new memory: how many bytes it still allows, and its name."""

    headroom: int
    source: str

    def describe(self) -> str:
        return f"{self.source} leaves {self.headroom / MiB:.1f} MiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo_available() -> Limit | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return Limit(int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs() -> list[tuple[str, Path]]:
    """(version, directory) of this process's memory cgroup and its ancestors."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[str, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            version, base = "v2", _CGROUP_ROOT
            if not (base / "memory.max").exists() and (base / "unified").is_dir():
                base = base / "unified"
        elif "memory" in controllers.split(","):
            version, base = "v1", _CGROUP_ROOT / "memory"
        else:
            continue
        # Inside a container the mount often shows our own cgroup at its root,
        # and the path in /proc/self/cgroup does not exist under it (what
        # does exist there may be other cgroups): then the root is ours.
        path = base / rel.lstrip("/")
        if not path.is_dir():
            path = base
        chain = [path, *(p for p in path.parents if p == base or base in p.parents)]
        found += [(version, p) for p in chain]
    return found


def _cgroup_limits() -> list[Limit]:
    limits = []
    for version, directory in _cgroup_dirs():
        if version == "v2":
            limit = _read_int(directory / "memory.max")
            used = _read_int(directory / "memory.current")
            name = "memory.max"
        else:
            limit = _read_int(directory / "memory.limit_in_bytes")
            used = _read_int(directory / "memory.usage_in_bytes")
            name = "memory.limit_in_bytes"
        # v1 reports "no limit" as a huge page-rounded number.
        if limit is None or limit >= 1 << 62:
            continue
        limits.append(Limit(max(limit - (used or 0), 0),
                            f"cgroup {version} {directory / name} ({limit / MiB:.1f} MiB, "
                            f"{(used or 0) / MiB:.1f} MiB used)"))
    return limits


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _rlimits(mapped: bool) -> list[Limit]:
    limits = []
    fsize, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if fsize != resource.RLIM_INFINITY:
        limits.append(Limit(fsize, f"RLIMIT_FSIZE ({fsize / MiB:.1f} MiB per file)"))
    if mapped:
        space, _ = resource.getrlimit(resource.RLIMIT_AS)
        if space != resource.RLIM_INFINITY:
            used = _vm_size()
            limits.append(Limit(max(space - used, 0),
                                f"RLIMIT_AS ({space / MiB:.1f} MiB, {used / MiB:.1f} MiB "
                                "mapped)"))
    return limits


def memory_limits(mapped: bool = True) -> list[Limit]:
    """Every limit that applies to new shared memory (``mapped``: it will be mapped)."""
    limits = _rlimits(mapped) + _cgroup_limits()
    available = _meminfo_available()
    if available is not None:
        limits.append(available)
    return limits


def tightest(limits: list[Limit]) -> Limit | None:
    return min(limits, key=lambda limit: limit.headroom, default=None)


def check_reservation(size: int, what: str, mapped: bool = True) -> None:
    """Raise ``OSError(ENOMEM)`` when ``size`` new bytes exceed any limit."""
    if size <= 0:
        return
    limits = memory_limits(mapped)
    over = [limit for limit in limits if limit.headroom < size]
    if over:
        raise no_memory_error(size, what, tightest(over))


def no_memory_error(size: int, what: str, limit: Limit | None,
                    code: int = errno.ENOMEM, reason: str | None = None) -> OSError:
    """The documented error: what, the MiB needed, and the limit that applies."""
    applies = "no limit could be read" if limit is None else limit.describe()
    why = f"{reason}; " if reason else ""
    return OSError(
        code,
        f"cannot reserve {size / MiB:.1f} MiB of shared memory for {what}: {why}"
        f"the limit that applies: {applies}. "
        "Lower max_chunk_bytes / max_chunks (or the payload), or raise the limit.",
    )


def reservation_failed(err: OSError, size: int, what: str) -> OSError:
    """The same error, for a reservation the kernel itself refused."""
    code = err.errno or errno.ENOMEM
    return no_memory_error(size, what, tightest(memory_limits()), code, os.strerror(code))
