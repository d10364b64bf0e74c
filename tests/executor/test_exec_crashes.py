"""What a caller sees when a worker misbehaves: one row per crash case.

Each row starts a real executor (two workers), under fork and under spawn,
does the bad thing, and checks the error type and fields the caller gets
and the state the executor is left in.  ``leak_check`` proves every
process, descriptor and mapping was released.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tests.executor.conftest import make_config
from tests.executor.workers import CustomError, OnlyHere

from mpexec.errors import WorkerDiedError, WorkerError, WorkerStalledError
from mpexec.executor import MultiprocExecutor

pytestmark = pytest.mark.usefixtures("leak_check")

START_METHODS = [pytest.param("fork"), pytest.param("spawn", marks=pytest.mark.slow)]
WAIT_S = 30.0


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
    assert err.rank == 0 and err.pid == ex.workers[0].pid
    assert "raise CustomError(message)" in err.remote_traceback


def _no_cause(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError) and err.__cause__ is None
    assert "UnpicklableError" in err.exc_type


def _attribute_error(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError) and err.exc_type == "AttributeError"


def _nothing_broadcast(err: BaseException, ex: MultiprocExecutor) -> None:
    assert "echo" not in ex.stats(), "the failed call must not have been broadcast"


def _undecodable_argument(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError)
    assert err.method == "echo" and err.rank == 0 and err.pid == ex.workers[0].pid
    assert err.exc_type == "ValueError"
    assert "cannot be unpickled outside process" in err.remote_traceback


def _undecodable_reply(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError)
    assert err.rank == 0 and err.method == "return_undecodable"
    assert isinstance(err.__cause__, ValueError)


def _system_exit(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerError) and err.exc_type == "SystemExit"


def _killed(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerDiedError)
    assert err.rank == 1 and err.signal_name == "SIGKILL"
    assert err.pid == ex.workers[1].pid
    assert ex.is_failed
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        ex.collective_rpc("echo", args=(1,))


def _late_reply_dropped(err: BaseException, ex: MultiprocExecutor) -> None:
    # The sleep's reply arrives later; it must not answer these calls.
    assert ex.collective_rpc("echo", args=("a",)) == ["a", "a"]
    assert ex.collective_rpc("add", args=(10,), unique_reply_rank=1) == 11


def _stop_then_kill(ex: MultiprocExecutor) -> Any:
    """SIGSTOP rank 1 while it is busy, then SIGKILL it: the stopped worker is dead."""
    pid = ex.workers[1].pid
    future = ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)
    return future.result(timeout=WAIT_S)


def _stop_mid_call(ex: MultiprocExecutor) -> Any:
    """SIGSTOP rank 1 inside a call that has no deadline: the stopped worker is named."""
    pid = ex.workers[1].pid
    timer = threading.Timer(0.2, os.kill, (pid, signal.SIGSTOP))
    timer.start()
    try:
        return ex.collective_rpc("sleep", args=(120.0,))
    finally:
        timer.join(WAIT_S)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _stalled(err: BaseException, ex: MultiprocExecutor) -> None:
    assert isinstance(err, WorkerStalledError) and isinstance(err, WorkerDiedError)
    assert err.rank == 1 and err.pid == ex.workers[1].pid and err.seen == "stopped"
    assert ex.is_failed
    with pytest.raises(WorkerStalledError, match="rank 1"):
        ex.collective_rpc("echo", args=(1,))


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
    CrashCase("argument that fails to unpickle in the worker",
              lambda ex: ex.collective_rpc("echo", args=(OnlyHere(),)),
              WorkerError, "the arguments of call 1 could not be unpickled",
              usable_after=True, check=_undecodable_argument),
    CrashCase("unpicklable result", lambda ex: ex.collective_rpc("return_unpicklable"),
              WorkerError, "lock", usable_after=True),
    CrashCase("reply that fails to unpickle in the driver",
              lambda ex: ex.collective_rpc("return_undecodable"),
              WorkerError, "reply of worker rank 0 to return_undecodable could not be unpickled",
              usable_after=True, check=_undecodable_reply),
    CrashCase("SystemExit in a method", lambda ex: ex.collective_rpc("raise_system_exit"),
              WorkerError, "SystemExit", usable_after=True, check=_system_exit),
    CrashCase("hang past the timeout",
              lambda ex: ex.collective_rpc("sleep", args=(1.0,), timeout=0.2),
              TimeoutError, "sleep timed out after 0.2s", usable_after=True,
              check=_late_reply_dropped),
    CrashCase("unique_reply_rank out of range",
              lambda ex: ex.collective_rpc("echo", args=(1,), unique_reply_rank=5),
              ValueError, r"unique_reply_rank must be a rank in \[0, 1\]", usable_after=True,
              check=_nothing_broadcast),
    CrashCase("negative unique_reply_rank",
              lambda ex: ex.collective_rpc("echo", args=(1,), unique_reply_rank=-1),
              ValueError, r"\[0, 1\]", usable_after=True, check=_nothing_broadcast),
    CrashCase("args not a tuple", lambda ex: ex.collective_rpc("echo", args=[1]),  # type: ignore[arg-type]
              TypeError, "args must be a tuple", usable_after=True, check=_nothing_broadcast),
    CrashCase("SIGKILL mid-call",
              lambda ex: ex.collective_rpc("sigkill_self", kwargs={"only_rank": 1,
                                                                  "delay_s": 0.1}),
              WorkerDiedError, "rank 1 .* killed by SIGKILL", usable_after=False,
              check=_killed),
    CrashCase("SIGSTOP'd worker, then SIGKILL", _stop_then_kill,
              WorkerDiedError, "rank 1 .* killed by SIGKILL", usable_after=False,
              check=_killed),
    CrashCase("SIGSTOP mid-call", _stop_mid_call,
              WorkerStalledError, r"rank 1 \(pid \d+\) has been stopped", usable_after=False,
              check=_stalled, config={"worker_stopped_timeout_s": 1.0}),
]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crash_case(case: CrashCase, method: str) -> None:
    failed = threading.Event()
    with MultiprocExecutor(make_config(mp_start_method=method, **case.config)) as ex:
        ex.register_failure_callback(failed.set)
        with pytest.raises(case.error, match=case.match) as info:
            case.action(ex)
        case.check(info.value, ex)
        if case.usable_after:
            assert ex.collective_rpc("echo", args=(7,)) == [7, 7]
            assert not failed.is_set()
        else:
            assert failed.wait(WAIT_S)
            late: list[str] = []
            ex.register_failure_callback(lambda: late.append("at once"))
            assert late == ["at once"]
    assert failed.is_set() == (not case.usable_after)


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
        assert future.result(timeout=WAIT_S) == [0]
        assert ex.collective_rpc("echo", args=(2,), timeout=WAIT_S) == [2]
