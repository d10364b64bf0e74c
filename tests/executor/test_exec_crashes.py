"""What a caller sees when a worker misbehaves: one row per crash case.

Each row starts a real executor (two workers unless said otherwise), does
the bad thing, and checks the error the caller gets and what state the
executor is left in.  ``leak_check`` proves every process was reaped.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tests.executor.conftest import make_config
from tests.executor.workers import CustomError

from mpexec.errors import WorkerDiedError, WorkerError, WorkerStartupError
from mpexec.executor import MultiprocExecutor

pytestmark = pytest.mark.usefixtures("leak_check")


@dataclass
class CrashCase:
    name: str
    action: Callable[[MultiprocExecutor], Any]
    error: type[BaseException]
    match: str
    usable_after: bool
    check: Callable[[BaseException, MultiprocExecutor], None] = lambda e, ex: None
    config: dict[str, Any] = field(default_factory=dict)


def _custom_cause(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError)
    assert isinstance(err.__cause__, CustomError)
    assert err.exc_type == "tests.executor.workers.CustomError"
    assert err.method == "raise_custom"
    assert err.rank == 0 and err.pid == ex.workers[0].proc.pid
    assert "raise CustomError(message)" in err.remote_traceback


def _no_cause(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError) and err.__cause__ is None
    assert "UnpicklableError" in err.exc_type


def _attribute_error(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError) and err.exc_type == "AttributeError"


def _nothing_broadcast(err: BaseException, ex: MultiprocExecutor) -> None:
    assert ex._next_call_id == 0, "the failed call must not have been broadcast"


def _killed(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerDiedError)
    assert err.rank == 1 and err.signal_name == "SIGKILL"
    assert ex.is_failed
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        ex.collective_rpc("echo", args=(1,))


def _late_reply_dropped(err: BaseException, ex: MultiprocExecutor) -> None:
    # The sleep's reply arrives later; it must not answer these calls.
    assert ex.collective_rpc("echo", args=("a",)) == ["a", "a"]
    assert ex.collective_rpc("add", args=(10,), unique_reply_rank=1) == 11


CASES = [
    CrashCase("raise in a method", lambda ex: ex.collective_rpc("raise_custom", args=("bad",)),
              WorkerError, "worker rank 0 raised .*CustomError in raise_custom: bad",
              usable_after=True, check=_custom_cause),
    CrashCase("raise an unpicklable exception",
              lambda ex: ex.collective_rpc("raise_unpicklable", args=("no pickle",)),
              WorkerError, "no pickle", usable_after=True, check=_no_cause),
    CrashCase("unknown method name", lambda ex: ex.collective_rpc("no_such_method"),
              WorkerError, "AttributeError", usable_after=True, check=_attribute_error),
    CrashCase("unpicklable argument",
              lambda ex: ex.collective_rpc("echo", args=(threading.Lock(),)),
              TypeError, "lock", usable_after=True, check=_nothing_broadcast),
    CrashCase("unpicklable result", lambda ex: ex.collective_rpc("return_unpicklable"),
              WorkerError, "lock", usable_after=True),
    CrashCase("hang past the timeout",
              lambda ex: ex.collective_rpc("sleep", args=(1.0,), timeout=0.2),
              TimeoutError, "sleep timed out after 0.2s", usable_after=True,
              check=_late_reply_dropped),
    CrashCase("SIGKILL mid-call",
              lambda ex: ex.collective_rpc("sigkill_self", kwargs={"only_rank": 1,
                                                                  "delay_s": 0.1}),
              WorkerDiedError, "rank 1 .* killed by SIGKILL", usable_after=False,
              check=_killed),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crash_case(case: CrashCase) -> None:
    callbacks: list[str] = []
    with MultiprocExecutor(make_config(**case.config)) as ex:
        ex.register_failure_callback(lambda: callbacks.append("failed"))
        with pytest.raises(case.error, match=case.match) as info:
            case.action(ex)
        case.check(info.value, ex)
        if case.usable_after:
            assert ex.collective_rpc("echo", args=(7,)) == [7, 7]
            assert callbacks == []
        else:
            # The callback runs on the monitor thread once shutdown is done.
            deadline = time.monotonic() + 30
            while not callbacks and time.monotonic() < deadline:
                time.sleep(0.01)
            assert callbacks == ["failed"]
            late: list[str] = []
            ex.register_failure_callback(lambda: late.append("at once"))
            assert late == ["at once"]
    assert callbacks == ([] if case.usable_after else ["failed"])


@dataclass
class StartupCase:
    name: str
    fail_at: str
    match: str
    traceback: str | None


STARTUP_CASES = [
    StartupCase("raise in load_model", "load_model:raise",
                "rank 1 .*failed during start-up with RuntimeError", "boom in load_model"),
    StartupCase("raise in constructor", "init:raise", "failed during start-up", "boom in init"),
    StartupCase("exit in init_device", "init_device:exit", "rank 1 .*exited during start-up "
                r"\(exit code 3\)", None),
]


@pytest.mark.parametrize("case", STARTUP_CASES, ids=[c.name for c in STARTUP_CASES])
def test_startup_failure(case: StartupCase) -> None:
    config = make_config(worker_kwargs={"fail_at": case.fail_at, "fail_rank": 1})
    with pytest.raises(WorkerStartupError, match=case.match) as info:
        MultiprocExecutor(config)
    if case.traceback is not None:
        assert case.traceback in info.value.remote_traceback
        assert case.traceback in str(info.value)


def test_startup_timeout_reaps_the_slow_worker() -> None:
    config = make_config(worker_kwargs={"fail_at": "load_model:hang", "fail_rank": 0},
                         startup_timeout_s=0.5)
    with pytest.raises(WorkerStartupError, match=r"rank\(s\) 0 did not report READY"):
        MultiprocExecutor(config)


def test_pending_non_block_calls_fail_when_a_worker_dies() -> None:
    with MultiprocExecutor(make_config()) as ex:
        done = [ex.collective_rpc("sleep", args=(0.01,), non_block=True) for _ in range(3)]
        assert [f.result(timeout=30) for f in done] == [[0, 1]] * 3
        doomed = ex.collective_rpc("sigkill_self", kwargs={"only_rank": 0, "delay_s": 0.2},
                                   non_block=True)
        after = [ex.collective_rpc("sleep", args=(0.05,), non_block=True) for _ in range(5)]
        # Every call not yet resolved when the worker died fails, even one
        # whose replies were already on their way.
        for future in [doomed, *after]:
            with pytest.raises(WorkerDiedError, match="rank 0"):
                future.result(timeout=30)


def test_shutdown_escalates_to_sigkill_for_a_worker_ignoring_sigterm(
        caplog: pytest.LogCaptureFixture) -> None:
    ex = MultiprocExecutor(make_config(tp=1, shutdown_grace_s=0.3, shutdown_term_s=0.3))
    ex.collective_rpc("ignore_death_and_sigterm")
    proc = ex.workers[0].proc
    with caplog.at_level(logging.INFO, logger="mpexec.executor.termination"):
        ex.shutdown()
    assert "sending SIGTERM" in caplog.text
    assert "sending SIGKILL" in caplog.text
    assert proc._popen is None or proc.exitcode == -9  # closed once reaped


def test_headless_monitor_inline() -> None:
    with MultiprocExecutor(make_config(monitor_workers=False)) as ex:
        calls: list[int] = []
        ex.register_failure_callback(lambda: calls.append(1))
        watcher = threading.Thread(target=ex.start_worker_monitor, kwargs={"inline": True})
        watcher.start()
        ex.collective_rpc("sigkill_self", kwargs={"only_rank": 1}, non_block=True)
        watcher.join(30)
        assert not watcher.is_alive()
        assert ex.is_failed and calls == [1]


def test_unpicklable_callable_is_refused_at_the_call_site() -> None:
    lock = threading.Lock()
    with MultiprocExecutor(make_config(tp=1)) as ex:
        with pytest.raises((TypeError, pickle.PicklingError)):
            ex.collective_rpc(lambda w: lock)
        assert ex.collective_rpc("echo", args=(1,)) == [1]


def test_result_timeout_does_not_lose_the_reply() -> None:
    with MultiprocExecutor(make_config(tp=1)) as ex:
        future = ex.collective_rpc("sleep", args=(0.5,), non_block=True)
        with pytest.raises(TimeoutError):
            future.result(timeout=0.01)
        assert future.result(timeout=30) == [0]
        assert ex.collective_rpc("echo", args=(2,), timeout=30) == [2]
