"""Shared fixtures: the leak check every process-starting test uses.

``leak_check`` snapshots this process's children, its open file descriptors
(memfds included: they show as ``/memfd:mpexec-...``), its shared memory
mappings (``/proc/self/maps``: a mapped memfd outlives its descriptor) and
the ``/dev/shm`` entries this process owns, before a test; after it, it
asserts (with a bounded wait for stragglers to exit) that nothing new is
left.  Only this process's own entries count in ``/dev/shm``: other test
sessions on the same machine create and remove theirs at any time.
Leftover processes are killed so that one leaky test cannot poison the next.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

import pytest

from mpexec.system.procs import proc_stat

ROOT = Path(__file__).resolve().parent.parent
# Spawned children import test helpers (worker classes) by module path.
for path in (str(ROOT), str(ROOT / "src")):
    if path not in sys.path:
        sys.path.insert(0, path)
_pythonpath = os.environ.get("PYTHONPATH", "")
if str(ROOT) not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), _pythonpath) if p)

SETTLE_S = 10.0


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (zombies included), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        if stat is not None:
            children.setdefault(stat.ppid, []).append(stat.pid)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def open_fds() -> dict[int, str]:
    fds = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            fds[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
    return fds


def shm_entries(skip: Callable[[int], bool] | None = None) -> set[str]:
    """``/dev/shm`` entries this process or its descendants hold open or mapped,
    plus every memfd or shared-memory mapping of this process (descendants
    for which ``skip`` says True are not looked at)."""
    found: set[str] = set()
    for pid in {os.getpid(), *descendants(os.getpid())}:
        if skip is not None and pid != os.getpid() and skip(pid):
            continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and ("/memfd:" in parts[5] or parts[5].startswith("/dev/shm/")):
                found.add(f"{pid}:{parts[5]}" if pid != os.getpid() else parts[5])
    try:
        mine = os.getuid()
        for entry in os.listdir("/dev/shm"):
            path = f"/dev/shm/{entry}"
            try:
                if os.stat(path).st_uid == mine and entry.startswith("mpexec"):
                    found.add(path)
            except OSError:
                continue
    except FileNotFoundError:
        pass
    return found


def _leftovers(before_children: set[int], before_fds: dict[int, str],
               before_shm: set[str], pooled: Callable[[int], bool] | None = None,
               ) -> tuple[set[int], dict[int, str], set[str]]:
    multiprocessing.active_children()  # reaps finished multiprocessing children
    gc.collect()
    # The fork server (mpexec forks workers from it while the driver runs
    # threads) lives as long as this process, like the resource tracker;
    # so does the pipe that tells it this process is alive.
    server = forkserver._forkserver
    now = descendants(os.getpid()) - {server._forkserver_pid}
    children = now - before_children
    if pooled is not None:
        # A pooled process that took work of ours since (an idle Ray worker
        # that became an actor) counts, new or not.
        children = {pid for pid in now if not pooled(pid)
                    and (pid in children or is_ray_process(pid))}
    fds = {fd: target for fd, target in open_fds().items()
           if before_fds.get(fd) != target and fd != server._forkserver_alive_fd}
    shm = shm_entries(pooled) - before_shm
    return children, fds, shm


def stop_process(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    ``kill()`` returning does not mean the process has stopped.  The kernel
    hands SIGSTOP to one thread (the main thread, unless it is busy with
    another signal), and the group stop begins only when that thread next
    runs; until then the other threads carry on.  A worker whose calls are
    served by another thread than its main one - a Ray actor: its main
    thread idles in Ray's event loop - can answer a call after ``kill()``
    returned, for as long as the main thread waits for a CPU (1-70 ms
    measured under load).  A test that means "the worker is stopped" waits
    for state T on every thread.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue  # the thread ended
            states.append(stat[stat.rindex(")") + 2])
        if all(state in "TtZX" for state in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} did not stop: {states}"
        time.sleep(0.001)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny deterministic Llama checkpoint (HF format), written once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from mpexec.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def leak_check() -> Iterator[None]:
    yield from _leak_check(None)


def _leak_check(pooled: Callable[[int], bool] | None) -> Iterator[None]:
    # multiprocessing's resource tracker is one long-lived helper per test
    # session, not a leak: start it first so it belongs to the baseline.
    resource_tracker.ensure_running()
    before_children = descendants(os.getpid())
    before_fds = open_fds()
    before_shm = shm_entries(pooled)
    yield
    deadline = time.monotonic() + SETTLE_S
    while True:
        children, fds, shm = _leftovers(before_children, before_fds, before_shm, pooled)
        if not (children or fds or shm) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    multiprocessing.active_children()
    problems = []
    if children:
        problems.append(f"child processes left: {sorted(children)}")
    if fds:
        problems.append(f"file descriptors left: {fds}")
    if shm:
        problems.append(f"shared memory left (mappings, /dev/shm): {sorted(shm)}")
    assert not problems, "; ".join(problems)


# -- Ray ------------------------------------------------------------------------------
#
# A Ray test module starts Ray (or a ray.cluster_utils.Cluster) once, in a
# module-scoped fixture: its daemons (GCS, raylets, agents) and the workers
# it keeps pooled are descendants of this process.  ``ray_leak_check`` is
# ``leak_check`` with one allowance: a new descendant that is one of Ray's
# own processes *without* a task or actor of ours (an idle pooled worker, a
# daemon) is Ray's business, not a leak, and its memory mappings (Ray's
# object store) are not looked at.  A Ray worker still hosting an actor
# (``ray::RayWorkerActor...``) is a leak even if it existed before the test
# (Ray hands pooled workers to new actors), as is anything else the test
# started, and every fd, memfd and mapping of this process is checked as
# for any test.  The module's own teardown checks that once Ray is stopped
# no Ray process it started is left.

RAY_DAEMONS = (b"raylet", b"gcs_server", b"ray/dashboard", b"ray/_private/log_monitor",
               b"ray/_private/runtime_env", b"ray/autoscaler", b"ray/_private/monitor")


def ray_cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_ray_process(pid: int) -> bool:
    """Any process of Ray's: a daemon or a worker (by its command line)."""
    cmdline = ray_cmdline(pid)
    return (cmdline.startswith(b"ray::") or b"ray/core/src/ray" in cmdline
            or b"ray/_private/workers/" in cmdline or any(d in cmdline for d in RAY_DAEMONS))


def is_pooled_ray_process(pid: int) -> bool:
    """One of Ray's processes that runs nothing of ours: a daemon or an idle worker."""
    cmdline = ray_cmdline(pid)
    if cmdline.startswith(b"ray::"):  # a worker's title: idle, Ray's agent, or busy
        title = cmdline.split(b"\0", 1)[0]
        return title.startswith(b"ray::IDLE") or title.endswith(b"Agent")
    return is_ray_process(pid)


def ray_processes() -> set[int]:
    """Every Ray process on this machine."""
    return {int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and is_ray_process(int(entry))}


def ray_session_processes(session_dir: str) -> set[int]:
    """The Ray processes of one session: those holding a file under its
    session directory open (every daemon and worker logs there).  Another
    Ray on the machine, started by someone else meanwhile, is not ours."""
    found = set()
    for pid in ray_processes():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(session_dir):
                found.add(pid)
                break
    return found


@pytest.fixture
def ray_leak_check() -> Iterator[None]:
    yield from _leak_check(is_pooled_ray_process)
