"""Unit tests of mpexec.system: start method, names, process titles, log
prefixes, thread env (descriptors, CPUs and processes: test_system_processes.py)."""

from __future__ import annotations

import errno
import io
import logging
import os
import signal
import sys
import threading
import time
import types
from typing import Any

import pytest

from mpexec import system
from tests.python_child import run_code

# ---------------------------------------------------------------- start method


def test_get_mp_context_defaults_to_spawn() -> None:
    assert system.get_mp_context().get_start_method() == "spawn"
    assert system.get_mp_context(None).get_start_method() == "spawn"


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_get_mp_context_accepts_known_methods(method: str) -> None:
    assert system.get_mp_context(method).get_start_method() == method


@pytest.mark.parametrize("method", ["threads", "Spawn", "fork "])
def test_get_mp_context_rejects_unknown_methods(method: str) -> None:
    with pytest.raises(ValueError, match="start method"):
        system.get_mp_context(method)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_maybe_force_spawn_leaves_non_fork_alone(method: str) -> None:
    assert system.maybe_force_spawn(method) == method


def test_maybe_force_spawn_keeps_fork_when_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system.start, "running_thread_count", lambda: 1)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert system.maybe_force_spawn("fork") == "fork"


def test_maybe_force_spawn_with_threads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, args=(30,), name="helper-thread")
    helper.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="mpexec.system"):
            assert system.maybe_force_spawn("fork") == "forkserver"
            assert system.maybe_force_spawn("fork") == "forkserver"
    finally:
        stop.set()
        helper.join(timeout=30)
    assert "instead of 'fork'" in caplog.text and "threads are running" in caplog.text
    assert "helper-thread" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_maybe_force_spawn_with_cuda_initialised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(system.start, "running_thread_count", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="mpexec.system"):
        assert system.maybe_force_spawn("fork") == "spawn"
    assert "CUDA is already initialised" in caplog.text


def test_running_thread_count_sees_this_thread() -> None:
    assert system.running_thread_count() >= 1


# ---------------------------------------------------------------- names

ONE = (0, 1)

NAME_CASES = [
    # dp,     pp,     pcp,    tp,     dcp,    ep,     expected
    (ONE, ONE, ONE, ONE, ONE, None, "Worker"),
    (ONE, ONE, ONE, (1, 2), ONE, None, "Worker_TP1"),
    (ONE, (1, 2), ONE, (0, 2), ONE, None, "Worker_PP1_TP0"),
    ((0, 2), (2, 4), ONE, (3, 4), ONE, None, "Worker_DP0_PP2_TP3"),
    ((1, 2), (1, 2), (1, 2), (1, 2), (1, 2), (5, 8), "Worker_DP1_PP1_PCP1_TP1_DCP1_EP5"),
    (ONE, ONE, (1, 2), ONE, ONE, None, "Worker_PCP1"),
    (ONE, ONE, ONE, (0, 2), (1, 2), None, "Worker_TP0_DCP1"),
    (ONE, ONE, ONE, ONE, ONE, (0, 1), "Worker_EP0"),
    (ONE, ONE, ONE, (3, 4), ONE, (3, 4), "Worker_TP3_EP3"),
]


@pytest.mark.parametrize(("dp", "pp", "pcp", "tp", "dcp", "ep", "expected"), NAME_CASES)
def test_worker_process_name(
    dp: tuple[int, int],
    pp: tuple[int, int],
    pcp: tuple[int, int],
    tp: tuple[int, int],
    dcp: tuple[int, int],
    ep: tuple[int, int] | None,
    expected: str,
) -> None:
    assert system.worker_process_name(dp=dp, pp=pp, pcp=pcp, tp=tp, dcp=dcp, ep=ep) == expected


# ---------------------------------------------------------------- process title


@pytest.mark.usefixtures("leak_check")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/comm")
def test_set_process_title_in_child() -> None:
    result = run_code(
        """
        import sys
        sys.modules["setproctitle"] = None  # force the prctl path
        from mpexec.system import set_process_title
        set_process_title("Worker_TP1")
        print(open("/proc/self/comm").read().strip())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "mpexec::Worker_TP1"[:15]


def test_set_process_title_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(title: str) -> None:
        raise OSError(errno.EPERM, "not allowed")

    monkeypatch.setitem(sys.modules, "setproctitle", None)
    monkeypatch.setattr(system.names, "_prctl_set_name", broken)
    system.set_process_title("Worker")


# ---------------------------------------------------------------- log prefixes


def test_prefixed_stream_handles_partial_writes() -> None:
    out = io.StringIO()
    stream = system.PrefixedStream(out, "(W pid=1) ")
    stream.write("hel")
    stream.write("lo\nwor")
    stream.write("ld\n")
    stream.write("")
    stream.write("a\nb\n\nc")
    assert (
        out.getvalue()
        == "(W pid=1) hello\n(W pid=1) world\n(W pid=1) a\n(W pid=1) b\n(W pid=1) \n(W pid=1) c"
    )


def test_prefixed_stream_returns_length_and_delegates() -> None:
    out = io.StringIO()
    stream = system.PrefixedStream(out, "> ")
    assert stream.write("abc\n") == 4
    assert stream.getvalue() == "> abc\n"  # delegated to StringIO
    stream.writelines(["x\n", "y"])
    assert out.getvalue() == "> abc\n> x\n> y"


def test_prefixed_stream_carriage_return_starts_a_line() -> None:
    out = io.StringIO()
    stream = system.PrefixedStream(out, "> ")
    stream.write("10%\r20%\r")
    assert out.getvalue() == "> 10%\r> 20%\r"


@pytest.mark.usefixtures("leak_check")
def test_decorate_logs_prefixes_prints_and_logs() -> None:
    result = run_code(
        """
        import logging, os, sys
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from mpexec.system import decorate_logs
        decorate_logs("Worker_TP1")
        print("part one, ", end="")
        print("part two")
        logging.getLogger("demo").info("first\\nsecond")
        sys.stderr.write("raw err\\n")
        decorate_logs("Worker_TP0")
        print("after rename")
        print("PID", os.getpid(), file=sys.__stdout__)
        """
    )
    assert result.returncode == 0, result.stderr
    pid_line = result.stdout.strip().splitlines()[-1]
    pid = pid_line.split()[1]
    p1, p0 = f"(Worker_TP1 pid={pid}) ", f"(Worker_TP0 pid={pid}) "
    assert result.stdout.splitlines()[:2] == [p1 + "part one, part two", p0 + "after rename"]
    assert result.stderr.splitlines() == [p1 + "INFO first", p1 + "second", p1 + "raw err"]


# ---------------------------------------------------------------- thread env


@pytest.fixture
def clean_thread_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in system.THREAD_ENV_VARS:
        monkeypatch.setenv(var, "0")  # recorded, so the original is restored after
        monkeypatch.delenv(var)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    return monkeypatch


THREAD_VAR_CASES = [
    # num_threads, environ,                       expected
    (None, {}, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
    (4, {}, {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}),
    (None, {"OMP_NUM_THREADS": "8"}, {}),
    (4, {"OMP_NUM_THREADS": "8"}, {}),
    (2, {"MKL_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "2"}),
]


@pytest.mark.parametrize(("num_threads", "environ", "expected"), THREAD_VAR_CASES)
def test_thread_vars(
    num_threads: int | None, environ: dict[str, str], expected: dict[str, str]
) -> None:
    assert system.thread_vars(num_threads, environ) == expected


@pytest.mark.parametrize("bad", [0, -1])
def test_thread_vars_rejects_non_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="num_threads"):
        system.thread_vars(bad, {})


def test_apply_thread_env_in_child_sets_an_imported_torch(
    clean_thread_env: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    clean_thread_env.setitem(sys.modules, "torch", types.SimpleNamespace(
        set_num_threads=calls.append))
    system.apply_thread_env_in_child({"OMP_NUM_THREADS": "3"})
    system.apply_thread_env_in_child({})
    assert calls == [3]


def test_worker_thread_env_is_temporary(clean_thread_env: pytest.MonkeyPatch) -> None:
    with system.worker_thread_env(2) as applied:
        assert applied == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
        assert os.environ["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in os.environ
    assert "MKL_NUM_THREADS" not in os.environ


def test_worker_thread_env_restores_after_error(clean_thread_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError), system.worker_thread_env(None):
        raise RuntimeError("start failed")
    assert "OMP_NUM_THREADS" not in os.environ


def test_worker_thread_env_keeps_user_setting(clean_thread_env: pytest.MonkeyPatch) -> None:
    clean_thread_env.setenv("OMP_NUM_THREADS", "5")
    with system.worker_thread_env(2) as applied:
        assert applied == {}
        assert os.environ["OMP_NUM_THREADS"] == "5"
    assert os.environ["OMP_NUM_THREADS"] == "5"


def _sleep_long() -> None:
    time.sleep(60)


def _statuses_seen_by_racing_threads(proc: Any) -> list[int | None]:
    """Two threads polling ``proc.exitcode`` and one joining it, all let go at once."""
    seen: list[int | None] = []
    barrier = threading.Barrier(4)

    def poll() -> None:
        barrier.wait()
        deadline = time.monotonic() + 10
        while proc.exitcode is None and time.monotonic() < deadline:
            pass
        seen.append(proc.exitcode)

    def join() -> None:
        barrier.wait()
        proc.join(10)
        seen.append(proc.exitcode)

    threads = [threading.Thread(target=poll), threading.Thread(target=poll),
               threading.Thread(target=join)]
    for thread in threads:
        thread.start()
    barrier.wait()
    for thread in threads:
        thread.join(15)
    return seen


@pytest.mark.parametrize("method", ["forkserver", "fork", "spawn"])
def test_exit_status_read_by_racing_threads_is_the_real_one(method: str) -> None:
    """Several threads polling a SIGKILLed worker at once all see SIGKILL; under the fork
    server, unlocked polls race for the status pipe and one of them records 255."""
    from mpexec.system.start import serialize_exit_status

    context: Any = system.get_mp_context(method)
    for _ in range(10):
        proc = context.Process(target=_sleep_long, daemon=True)
        proc.start()
        serialize_exit_status(proc)
        time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        seen = _statuses_seen_by_racing_threads(proc)
        assert seen == [-signal.SIGKILL] * 3, seen
        assert proc.exitcode == -signal.SIGKILL
        proc.close()
