"""The executor's start-up and calls: start-up failures, the context the driver
builds, thread counts, futures that complete on their own, step deadlines.

Deaths and ends are in ``test_exec_lifecycle_ends.py``.  Promptness is shown
by an event beating a much longer deadline, never by a wall-clock assertion.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
from tests.executor.conftest import make_config
from tests.executor.lifecycle_support import ROOT, START_METHODS, WAIT_S
from tests.python_child import run_python

from mpexec.errors import WorkerStartupError
from mpexec.executor import MultiprocExecutor

pytestmark = pytest.mark.usefixtures("leak_check")


# -- start-up ----------------------------------------------------------------------

STARTUP_CASES = [
    ("load_model:raise", "rank 1 .*failed during start-up with RuntimeError: boom",
     "boom in load_model"),
    ("init:raise", "failed during start-up", "boom in init"),
    ("init_device:exit", r"rank 1 .*exited during start-up \(exit code 3\)", None),
]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize(("fail_at", "match", "traceback"), STARTUP_CASES,
                         ids=[c[0] for c in STARTUP_CASES])
def test_startup_failure(fail_at: str, match: str, traceback: str | None, method: str) -> None:
    config = make_config(worker_kwargs={"fail_at": fail_at, "fail_rank": 1},
                         mp_start_method=method)
    with pytest.raises(WorkerStartupError, match=match) as info:
        MultiprocExecutor(config)
    assert info.value.rank == 1
    if traceback is not None:
        assert traceback in info.value.remote_traceback
        assert traceback in str(info.value)


_ONE_RANK_FAILS = """
import sys
sys.path.insert(0, {root!r})
from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.errors import WorkerStartupError
from mpexec.executor.multiproc import MultiprocExecutor
config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                        parallel=ParallelConfig(tensor_parallel_size=4),
                        worker_kwargs={{"fail_at": {fail_at!r}, "fail_rank": 2}})
try:
    MultiprocExecutor(config)
except WorkerStartupError as exc:
    print("raised", exc.rank)
"""


@pytest.mark.parametrize("fail_at", ["init:raise", "load_model:raise"])
def test_only_the_failing_rank_logs_an_error_at_start_up(fail_at: str) -> None:
    # The other ranks see the driver give up (a closed queue, a released
    # mapping, a broken ready pipe): that is logged at INFO, not as a second
    # ERROR with a traceback that hides the real one.
    child = run_python("-c", _ONE_RANK_FAILS.format(root=str(ROOT), fail_at=fail_at))
    assert "raised 2" in child.stdout, child.stderr
    errors = [line for line in child.stderr.splitlines() if " ERROR " in f" {line}"]
    assert len(errors) == 1 and "failed to start" in errors[0], child.stderr


@pytest.mark.parametrize("method", START_METHODS)
def test_startup_timeout_names_the_configured_timeout(method: str) -> None:
    config = make_config(worker_kwargs={"fail_at": "load_model:hang", "fail_rank": 0},
                         startup_timeout_s=3.0, mp_start_method=method)
    # Rank 1 may be late too under spawn on a loaded machine; rank 0 never comes.
    with pytest.raises(WorkerStartupError,
                       match=r"rank\(s\) 0(, 1)? did not report READY within 3s "
                             r"\(startup_timeout_s\)"):
        MultiprocExecutor(config)


def test_context_is_built_by_the_driver_with_the_configured_rendezvous() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = make_config(tp=2)
    config.parallel.master_port = port
    with MultiprocExecutor(config) as ex:
        contexts = ex.collective_rpc(lambda w: (w.context.rank, w.context.local_rank,
                                                w.context.distributed_init_method,
                                                w.context.shared_worker_lock))
    assert contexts == [(0, 0, f"tcp://127.0.0.1:{port}", None),
                        (1, 1, f"tcp://127.0.0.1:{port}", None)]


def test_port_zero_picks_one_port_for_all_and_the_lock_only_when_asked() -> None:
    with MultiprocExecutor(make_config(tp=2, shared_worker_lock=True)) as ex:
        methods = ex.collective_rpc(lambda w: w.distributed_init_method)
        locks = ex.collective_rpc(lambda w: w.shared_worker_lock is not None)
    assert methods[0] == methods[1] and not methods[0].endswith(":0")
    assert locks == [True, True]


def test_thread_counts_reach_the_workers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with MultiprocExecutor(make_config(tp=2, device_type="cuda")) as ex:
        assert ex.collective_rpc("env", args=("OMP_NUM_THREADS",)) == ["1", "1"]
        assert "OMP_NUM_THREADS" not in os.environ


# -- futures on their own ------------------------------------------------------------------

def test_non_blocking_futures_complete_without_result() -> None:
    with MultiprocExecutor(make_config(tp=2)) as ex:
        seen = threading.Event()
        future = ex.collective_rpc("echo", args=(1,), non_block=True)
        future.add_done_callback(lambda f: seen.set())
        assert seen.wait(WAIT_S)
        batch = [ex.collective_rpc("echo", args=(i,), non_block=True) for i in range(20)]
        _, not_done = concurrent.futures.wait(batch, timeout=WAIT_S)
        assert not not_done
        order = [f.result() for f in concurrent.futures.as_completed(batch, timeout=WAIT_S)]
        assert sorted(r[0] for r in order) == list(range(20))

        async def main() -> list[int]:
            return await asyncio.wrap_future(
                ex.collective_rpc("echo", args=(5,), non_block=True))

        assert asyncio.run(main()) == [5, 5]
        # Blocking calls after the futures still work, in order.
        assert ex.collective_rpc("echo", args=(9,)) == [9, 9]


def test_non_blocking_future_times_out_on_its_own() -> None:
    with MultiprocExecutor(make_config(tp=1)) as ex:
        future = ex.collective_rpc("sleep", args=(5.0,), timeout=0.2, non_block=True)
        done, _ = concurrent.futures.wait([future], timeout=WAIT_S)
        assert done and isinstance(future.exception(), TimeoutError)


def test_step_methods_have_a_deadline() -> None:
    config = make_config(tp=1, execute_model_timeout_s=0.3,
                         worker_kwargs={"dummy_sleep_s": 5.0})
    with MultiprocExecutor(config) as ex:
        with pytest.raises(TimeoutError, match="execute_dummy_batch"):
            ex.execute_dummy_batch()
        with pytest.raises(TimeoutError, match="take_draft_token_ids"):
            ex.take_draft_token_ids()  # the worker is still in the dummy batch
