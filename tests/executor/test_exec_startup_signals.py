"""A worker killed (SIGKILL) or frozen (SIGSTOP) at each phase of start-up, under
fork and spawn: the constructor raises one bounded, typed ``WorkerStartupError``
naming the rank, and no process or shared-memory segment is left.

Phases: the worker class's constructor, ``init_device`` and ``load_model``
(all before ``Ready``, from inside the worker), and the queue handshake after
every ``Ready`` (from the driver, which signals a worker just before it).
The first call after start-up is covered by test_exec_crashes.py (SIGKILL)
and test_exec_reliability.py (SIGSTOP).  Every wait is bounded by
``startup_timeout_s`` (60 s), far above the stall bounds (1 s stopped, 3 s
silent) that must end a frozen worker first.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from tests.conftest import descendants
from tests.executor.conftest import make_config
from tests.executor.lifecycle_support import START_METHODS

import mpexec.executor.multiproc as multiproc
from mpexec.errors import WorkerStartupError
from mpexec.executor import MultiprocExecutor

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(180)]

BOUNDS: dict[str, Any] = {"worker_stall_timeout_s": 3.0, "worker_stopped_timeout_s": 1.0,
                          "startup_timeout_s": 60.0}
SEEN = {"kill": r"(exited|died).* during start-up.*SIGKILL|SIGKILL.*during start-up",
        "stop": r"stopped.* during start-up"}


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("stage", ["init", "init_device", "load_model"])
@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_worker_signalled_before_ready_fails_start_up(method: str, stage: str,
                                                         action: str) -> None:
    config = make_config(worker_kwargs={"fail_at": f"{stage}:{action}", "fail_rank": 1},
                         mp_start_method=method, **BOUNDS)
    with pytest.raises(WorkerStartupError, match=SEEN[action]) as info:
        MultiprocExecutor(config)
    assert info.value.rank == 1


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_worker_signalled_in_the_handshake_fails_start_up(
        method: str, action: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker has sent ``Ready``; the driver signals one just before the queue
    handshake, which then waits on a worker that will never answer."""
    before = descendants(os.getpid())
    real = multiproc.handshake
    signalled: list[int] = []

    def handshake_after_signal(*args: Any, **kwargs: Any) -> Any:
        workers = sorted(descendants(os.getpid()) - before)
        victim = workers[-1]  # one worker: whichever rank, the error must name it
        os.kill(victim, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        signalled.append(victim)
        return real(*args, **kwargs)

    monkeypatch.setattr(multiproc, "handshake", handshake_after_signal)
    config = make_config(mp_start_method=method, **BOUNDS)
    try:
        with pytest.raises(WorkerStartupError) as info:
            MultiprocExecutor(config)
    finally:
        for pid in signalled:  # a stopped worker the executor did not reap
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    # the rank, pid and signal are named (a death here reads "worker rank R (pid
    # PID) died: killed by SIGKILL (during the queue handshake: ...)"; a frozen
    # worker, the stall watch's "rank R (pid PID) ... stopped")
    assert signalled and str(signalled[0]) in str(info.value), str(info.value)
    assert info.value.rank is not None and f"rank {info.value.rank}" in str(info.value)
    if action == "kill":
        assert "SIGKILL" in str(info.value) and "queue handshake" in str(info.value)
