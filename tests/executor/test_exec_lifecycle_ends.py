"""The executor's deaths and ends: a worker dying, shutdown escalating, the
driver dying or exiting, an executor dropped without shutdown.

Start-up and calls are in ``test_exec_lifecycle.py``.  Promptness is shown by
an event beating a much longer deadline (a 60 s call, a 30 s grace period),
never by a wall-clock assertion.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tests.executor.conftest import make_config
from tests.executor.lifecycle_support import (
    DRIVER_START_METHODS,
    ROOT,
    WAIT_S,
    driver_env,
    wait_gone,
)

from mpexec.errors import QueueClosedError, WorkerDiedError
from mpexec.executor import MultiprocExecutor
from mpexec.system import process_gone

pytestmark = pytest.mark.usefixtures("leak_check")


# -- deaths --------------------------------------------------------------------------

def test_frozen_peer_does_not_delay_the_error_or_the_callback() -> None:
    """Rank 1 is stopped, rank 0 is killed: the blocked caller and the failure
    callback hear of it while the frozen survivor is still there (its
    escalation would take 30 s of grace)."""
    config = make_config(tp=2, shutdown_grace_s=30.0, shutdown_term_s=30.0)
    ex = MultiprocExecutor(config)
    frozen = ex.workers[1].pid
    called = threading.Event()
    ex.register_failure_callback(called.set)
    try:
        future = ex.collective_rpc("sleep", args=(60.0,), non_block=True)
        os.kill(frozen, signal.SIGSTOP)
        os.kill(ex.workers[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="rank 0") as info:
            ex.collective_rpc("echo", args=(1,))
        assert info.value.exitcode == -signal.SIGKILL
        with pytest.raises(WorkerDiedError):
            future.result(timeout=WAIT_S)
        assert called.wait(WAIT_S)
        assert not process_gone(frozen)  # still in its grace period
    finally:
        os.kill(frozen, signal.SIGKILL)
        os.kill(frozen, signal.SIGCONT)
        ex.shutdown()


def test_a_raising_failure_callback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR), MultiprocExecutor(make_config(tp=2)) as ex:
        done = threading.Event()
        ex.register_failure_callback(broken)
        ex.register_failure_callback(done.set)
        os.kill(ex.workers[1].pid, signal.SIGKILL)
        assert done.wait(WAIT_S)
    assert "failure callback" in caplog.text and "callback bug" in caplog.text


def test_grandchild_holding_inherited_descriptors_does_not_hide_a_death(
        tmp_path: Path) -> None:
    pid_file = str(tmp_path / "pids")
    with MultiprocExecutor(make_config(tp=1)) as ex:
        died = threading.Event()
        ex.register_failure_callback(died.set)
        ex.collective_rpc("start_grandchild_and_sleep", args=(60.0, pid_file),
                          non_block=True)
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(f"{pid_file}.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        worker, grandchild = map(int, Path(f"{pid_file}.0").read_text().split())
        os.kill(worker, signal.SIGKILL)
        assert died.wait(WAIT_S)  # long before the grandchild's 60 s
    assert wait_gone([grandchild])  # shutdown ended the worker's process group


def test_many_descriptors_in_the_driver() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"descriptor limit {hard} is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    extra = []
    try:
        while len(extra) < 1030:
            extra.append(os.open(os.devnull, os.O_RDONLY))
        with MultiprocExecutor(make_config(tp=2)) as ex:
            assert ex.collective_rpc("echo", args=(1,)) == [1, 1]
            os.kill(ex.workers[1].pid, signal.SIGKILL)
            with pytest.raises(WorkerDiedError, match="rank 1"):
                ex.collective_rpc("sleep", args=(60.0,))
    finally:
        for fd in extra:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_shutdown_escalates_to_sigkill_for_a_worker_ignoring_sigterm(
        caplog: pytest.LogCaptureFixture) -> None:
    ex = MultiprocExecutor(make_config(tp=1, shutdown_grace_s=0.3, shutdown_term_s=0.3))
    ex.collective_rpc("ignore_death_and_sigterm")
    pid = ex.workers[0].pid
    with caplog.at_level(logging.INFO, logger="mpexec.executor.termination"):
        ex.shutdown()
    assert "sending SIGTERM" in caplog.text and "sending SIGKILL" in caplog.text
    assert process_gone(pid)
    with pytest.raises(QueueClosedError, match="shut down"):
        ex.collective_rpc("echo", args=(1,))


# -- the driver going away -------------------------------------------------------------

BUSY_DRIVER = textwrap.dedent("""
    import sys, time
    from mpexec.config import ExecutorConfig, ParallelConfig
    from mpexec.executor import MultiprocExecutor
    ex = MultiprocExecutor(ExecutorConfig(
        worker_cls="tests.executor.workers:EchoWorker", mp_start_method=sys.argv[1],
        parallel=ParallelConfig(tensor_parallel_size=2)))
    ex.collective_rpc("start_grandchild_and_sleep", args=(60.0, sys.argv[2]), non_block=True)
    print("busy", flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("method", DRIVER_START_METHODS)
def test_driver_sigkill_ends_busy_workers_and_their_children(method: str,
                                                             tmp_path: Path) -> None:
    pid_file = str(tmp_path / "pids")
    driver = subprocess.Popen([sys.executable, "-c", BUSY_DRIVER, method, pid_file],
                              stdout=subprocess.PIPE, env=driver_env(), cwd=ROOT, text=True)
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "busy\n"
        deadline = time.monotonic() + WAIT_S
        files = [Path(f"{pid_file}.{r}") for r in (0, 1)]
        while not all(f.exists() and f.read_text().endswith("\n") for f in files):
            assert time.monotonic() < deadline, "workers never got busy"
            time.sleep(0.01)
        pids = [int(p) for f in files for p in f.read_text().split()]
        driver.kill()
        driver.wait(WAIT_S)
        # Each worker is 60 s into a call and holds a 60 s grandchild.
        assert wait_gone(pids, 20.0), f"{pids} outlived their driver"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(WAIT_S)
        if driver.stdout is not None:
            driver.stdout.close()


EXITING_DRIVER = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO)
    from mpexec.config import ExecutorConfig, ParallelConfig
    from mpexec.executor import MultiprocExecutor
    ex = MultiprocExecutor(ExecutorConfig(
        worker_cls="tests.executor.workers:EchoWorker", mp_start_method=sys.argv[1],
        parallel=ParallelConfig(tensor_parallel_size=2)))
    ex.register_failure_callback(lambda: print("CALLBACK", flush=True))
    print(" ".join(str(w.pid) for w in ex.workers), flush=True)
    if sys.argv[2] == "wait":
        import time
        time.sleep(120)
""")


@pytest.mark.parametrize("method", DRIVER_START_METHODS)
def test_interpreter_exit_without_shutdown_is_orderly(method: str) -> None:
    done = subprocess.run([sys.executable, "-c", EXITING_DRIVER, method, "exit"],
                          capture_output=True, text=True, env=driver_env(), cwd=ROOT, timeout=90)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()[:2]]
    assert "CALLBACK" not in done.stdout
    assert "ERROR" not in done.stderr and "died unexpectedly" not in done.stderr
    assert wait_gone(pids)


def test_ctrl_c_to_the_process_group_is_orderly() -> None:
    driver = subprocess.Popen([sys.executable, "-c", EXITING_DRIVER, "fork", "wait"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=driver_env(),
                              cwd=ROOT, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        os.killpg(driver.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = driver.communicate(timeout=60)
        assert "KeyboardInterrupt" in err
        assert "died unexpectedly" not in err and "CALLBACK" not in out
        assert wait_gone(pids)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(WAIT_S)


def test_an_executor_dropped_without_shutdown_is_collected_and_ends_its_workers() -> None:
    import gc
    import weakref

    ex = MultiprocExecutor(make_config(tp=2))
    ex.collective_rpc("echo", args=(1,), non_block=True).result(timeout=WAIT_S)
    assert ex.collective_rpc("echo", args=(2,)) == [2, 2]
    pids = [w.pid for w in ex.workers]
    ref = weakref.ref(ex)
    del ex
    gc.collect()
    assert ref() is None  # nothing (monitor, pump, router) keeps it alive
    assert wait_gone(pids)


def test_a_death_under_back_pressure_is_a_worker_died_error() -> None:
    """The broadcast ring is full (both workers busy, two chunks) when rank 1
    dies: the caller blocked in enqueue gets WorkerDiedError, not a queue error."""
    with MultiprocExecutor(make_config(tp=2, mq_max_chunks=2)) as ex:
        victim = ex.workers[1].pid
        busy = [ex.collective_rpc("sleep", args=(60.0,), non_block=True) for _ in range(3)]
        threading.Timer(0.3, os.kill, args=(victim, signal.SIGKILL)).start()
        with pytest.raises(WorkerDiedError, match="rank 1") as info:
            for _ in range(10):  # blocks once the ring is full
                ex.collective_rpc("echo", args=(1,), non_block=True)
        assert info.value.pid == victim
        for future in busy:
            with pytest.raises(WorkerDiedError):
                future.result(timeout=WAIT_S)


def test_shutdown_from_the_failure_callback() -> None:
    ex = MultiprocExecutor(make_config(tp=2))
    done = threading.Event()

    def on_failure() -> None:
        ex.shutdown()  # on the monitor thread, before its own teardown
        done.set()

    ex.register_failure_callback(on_failure)
    pids = [w.pid for w in ex.workers]
    os.kill(pids[0], signal.SIGKILL)
    assert done.wait(WAIT_S)
    assert wait_gone(pids)
    with pytest.raises(WorkerDiedError):
        ex.collective_rpc("echo", args=(1,))
    ex.shutdown()
