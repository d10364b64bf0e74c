"""Fork while the driver runs threads: workers come from the fork server,
with the driver's environment, and end with the driver."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from multiprocessing import forkserver

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.executor import MultiprocExecutor


@pytest.fixture
def driver_thread() -> Iterator[None]:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, args=(60,), name="driver-thread")
    helper.start()
    try:
        yield
    finally:
        stop.set()
        helper.join(30)


def test_fork_with_threads_running_forks_from_the_server_with_the_drivers_environment(
        leak_check: None, driver_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPEXEC_TEST_MARKER", "set-after-the-server-may-have-started")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker", device_type="cpu",
                            mp_start_method="fork", omp_num_threads=[1, 2],
                            parallel=ParallelConfig(tensor_parallel_size=2))
    with MultiprocExecutor(config) as ex:
        server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        parents = ex.collective_rpc(lambda worker: os.getppid())
        assert server is not None and parents == [server, server]
        assert ex.collective_rpc("env", args=("MPEXEC_TEST_MARKER",)) == [
            "set-after-the-server-may-have-started"] * 2
        # Each worker's own thread count, never the driver's.
        assert ex.collective_rpc("env", args=("OMP_NUM_THREADS",)) == ["1", "2"]
        assert "OMP_NUM_THREADS" not in os.environ
        assert ex.collective_rpc("add", args=(1,)) == [1, 2]


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_carry_their_title_whatever_the_start_method(
        leak_check: None, method: str) -> None:
    """A child of the fork server replaces its environment; the title is set
    before that, or ``ps`` shows the fork server's command line."""
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker", device_type="cpu",
                            mp_start_method=method,
                            parallel=ParallelConfig(tensor_parallel_size=2))
    with MultiprocExecutor(config) as ex:
        assert [_title(w.pid) for w in ex.workers] == ["mpexec::Worker_TP0",
                                                       "mpexec::Worker_TP1"]


def test_workers_forked_from_the_server_because_of_a_thread_carry_their_title(
        leak_check: None, driver_thread: None) -> None:
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker", device_type="cpu",
                            mp_start_method="fork",
                            parallel=ParallelConfig(tensor_parallel_size=2))
    with MultiprocExecutor(config) as ex:
        server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        assert ex.collective_rpc(lambda worker: os.getppid()) == [server, server]
        assert [_title(w.pid) for w in ex.workers] == ["mpexec::Worker_TP0",
                                                       "mpexec::Worker_TP1"]
