"""Unit tests of mpexec.system: inherited descriptors, CPU affinity, and the
process helpers (groups, pidfds, the parent-death signal, forked log streams)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess

import pytest

from mpexec import system
from tests.python_child import run_code

# ---------------------------------------------------------------- descriptors


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_close_inherited_fds_closes_and_ignores_ebadf(caplog: pytest.LogCaptureFixture) -> None:
    read_fd, write_fd = os.pipe()
    with caplog.at_level(logging.WARNING, logger="mpexec.system"):
        system.close_inherited_fds([read_fd, write_fd])
        system.close_inherited_fds([read_fd])  # already closed: EBADF, silent
    assert not _is_open(read_fd)
    assert not _is_open(write_fd)
    assert caplog.records == []


def test_close_inherited_fds_warns_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[int] = []

    def fake_close(fd: int) -> None:
        if fd == 1001:
            raise OSError(errno.EIO, "I/O error")
        closed.append(fd)

    monkeypatch.setattr(os, "close", fake_close)
    with caplog.at_level(logging.WARNING, logger="mpexec.system"):
        system.close_inherited_fds([1001, 1002])
    assert closed == [1002]
    assert "1001" in caplog.text


# ---------------------------------------------------------------- CPU affinity


def test_apply_cpu_affinity_none_is_a_no_op() -> None:
    system.apply_cpu_affinity(None)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_apply_cpu_affinity_to_current_set() -> None:
    current = os.sched_getaffinity(0)
    try:
        system.apply_cpu_affinity(sorted(current))
        assert os.sched_getaffinity(0) == current
    finally:
        os.sched_setaffinity(0, current)


@pytest.mark.parametrize("cpus", [[10**6], [0, 10**6], [-1]])
def test_apply_cpu_affinity_rejects_missing_cpus(cpus: list[int]) -> None:
    with pytest.raises(ValueError, match="do not exist"):
        system.apply_cpu_affinity(cpus)


def test_apply_cpu_affinity_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one CPU"):
        system.apply_cpu_affinity([])


@pytest.mark.parametrize(
    ("text", "cpus", "ranges"),
    [
        ("0\n", {0}, "0"),
        ("0-3\n", {0, 1, 2, 3}, "0-3"),
        ("0-1,4,6-7\n", {0, 1, 4, 6, 7}, "0-1,4,6-7"),
    ],
)
def test_cpu_range_round_trip(text: str, cpus: set[int], ranges: str) -> None:
    assert system.procs.parse_cpu_list(text) == cpus
    assert system.procs.format_cpu_list(cpus) == ranges


def test_online_cpus_includes_ours() -> None:
    if hasattr(os, "sched_getaffinity"):
        assert os.sched_getaffinity(0) <= system.online_cpus()
    else:
        assert system.online_cpus()


@pytest.mark.usefixtures("leak_check")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_prefixed_stream_usable_in_child_forked_while_locked() -> None:
    result = run_code(
        """
        import os, sys
        from mpexec.system import decorate_logs
        decorate_logs("Driver")
        sys.stdout._lock.acquire()  # as if another thread were mid-write at fork time
        pid = os.fork()
        if pid == 0:
            decorate_logs("Worker")
            print("child says hi", flush=True)
            os._exit(0)
        sys.stdout._lock.release()
        _, status = os.waitpid(pid, 0)
        print("child status", os.waitstatus_to_exitcode(status))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "(Worker pid=" in result.stdout
    assert "child says hi" in result.stdout
    assert result.stdout.strip().endswith("child status 0")


def test_process_gone() -> None:
    import os
    import subprocess
    import sys

    from mpexec.system import process_gone

    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert process_gone(child.pid)


def test_process_group_helpers_in_a_child() -> None:
    result = run_code("""
        import os, signal, subprocess, time
        from mpexec import system
        assert system.become_group_leader()
        assert os.getpgrp() == os.getpid()
        child = subprocess.Popen(["sleep", "30"])
        assert system.kill_process_group(os.getpid(), signal.SIGTERM) is True
    """)
    assert result.returncode == -signal.SIGTERM, result.stderr


def test_kill_process_group_refuses_a_group_it_does_not_lead() -> None:
    if os.getpgrp() == os.getpid():
        pytest.skip("the test process leads its own group")
    assert system.kill_process_group(os.getpgrp()) is False
    assert system.kill_process_group(0) is False


def test_open_pidfd_becomes_readable_at_exit() -> None:
    import select

    proc = subprocess.Popen(["sleep", "30"])
    fd = system.open_pidfd(proc.pid)
    if fd is None:
        proc.kill()
        proc.wait(10)
        pytest.skip("no pidfd_open here")
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(0) == []
        proc.kill()
        assert poller.poll(10_000)
    finally:
        os.close(fd)
        proc.wait(10)


def test_set_parent_death_signal_in_a_child() -> None:
    result = run_code("""
        import os, signal
        from mpexec import system
        assert system.set_parent_death_signal(signal.SIGTERM, os.getppid())
        assert not system.set_parent_death_signal(signal.SIGTERM, os.getppid() + 1)
    """)
    assert result.returncode == 0, result.stderr
