"""Processes and descriptors: liveness, process groups, parent death, CPUs."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import signal
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that mpexec reads (see proc(5))."""

    pid: int
    name: str       # the command name, as the kernel keeps it (15 bytes)
    state: str      # R running, S/D sleeping, T/t stopped, Z zombie, X dead, ...
    ppid: int
    pgrp: int
    cpu_ticks: int  # utime + stime, in clock ticks

    @property
    def exited(self) -> bool:
        """Gone but for its zombie: exited and not yet reaped."""
        return self.state in {"Z", "X"}

    @property
    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
        return self.state in {"T", "t"}

    @property
    def cpu_s(self) -> float:
        return self.cpu_ticks / os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The name may hold spaces and parentheses: it ends at the last ")".
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    if len(fields) < 13:
        return None
    return ProcStat(pid=pid, name=head.partition("(")[2], state=fields[0],
                    ppid=int(fields[1]), pgrp=int(fields[2]),
                    cpu_ticks=int(fields[11]) + int(fields[12]))


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or only its zombie left."""
    stat = proc_stat(pid)
    return stat is None or stat.exited


def close_inherited_fds(fds: Sequence[int]) -> None:
    """Close descriptors a forked worker inherited but must not hold.

    A forked child holds copies of its siblings' pipe ends; while it does,
    the driver's end never sees EOF.  An already closed descriptor (EBADF) is
    fine; any other error is logged at WARNING and the rest are still closed.
    """
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                logger.warning("Could not close inherited descriptor %d: %s", fd, exc)


def apply_cpu_affinity(cpus: Sequence[int] | None) -> None:
    """Pin this process to ``cpus`` (no change when None).

    Raises ``ValueError`` naming the CPUs that do not exist on this machine,
    or when the set is empty or not allowed to this process (cgroup cpuset).
    """
    if cpus is None:
        return
    wanted = set(cpus)
    if not wanted:
        raise ValueError("cpu affinity needs at least one CPU; got an empty list")
    known = online_cpus()
    missing = sorted(c for c in wanted if c not in known)
    if missing:
        raise ValueError(
            f"CPU(s) {missing} do not exist on this machine; online CPUs: "
            f"{format_cpu_list(known)}"
        )
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU affinity is not supported on %s; ignoring %s", sys.platform, cpus)
        return
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        raise ValueError(f"cannot pin to CPUs {sorted(wanted)}: {exc.strerror}") from exc


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def online_cpus() -> set[int]:
    """CPU numbers the kernel has online (all of ``os.cpu_count()`` elsewhere)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (the kernel's cpulist format) as a set of CPUs."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: Collection[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and spans[-1][1] == cpu - 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


# --------------------------------------------------------------------------
# process groups and parent death
#
# Each worker leads its own process group, so that whatever it starts
# (compiler helpers, data loaders) can be ended with it by one killpg, and so
# that a Ctrl-C meant for the driver's terminal group reaches only the driver
# (which then shuts the workers down in order).

_PR_SET_PDEATHSIG = 1


def become_group_leader() -> bool:
    """Make this process the leader of a new process group; False if refused."""
    try:
        os.setpgid(0, 0)
    except OSError as exc:  # a session leader, or a platform without it
        logger.debug("Could not start a process group: %s", exc)
        return False
    return True


def kill_process_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to every process of group ``pgid``; False if none is left.

    Refuses the caller's own group unless the caller leads it: a worker that
    could not start its own group must never signal the driver's.
    """
    if pgid <= 1:
        return False
    if pgid == os.getpgrp() and pgid != os.getpid():
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def set_parent_death_signal(sig: int, parent_pid: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits.

    The kernel ties the signal to the *thread* that created this process, not
    to the process: the caller decides whether that thread lives as long as
    the driver (see the executor's launcher).  Returns False where the call
    is not available, and also when ``parent_pid`` is already gone (the
    parent died before the signal was armed, so it would never come).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return False
    except OSError:
        return False
    return os.getppid() == parent_pid


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (None if unsupported).

    Unlike ``multiprocessing``'s sentinel pipe, a pidfd cannot be held open
    by a grandchild that inherited it, so a death is seen at once.
    """
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd
