"""What a caller sees when teardown races start-up, a worker stops or hangs, or a
worker dies while the executor is idle.

Every case names the worker (rank, pid) well within a bound that does not
depend on the longest legitimate call, and ``leak_check`` proves every
process, descriptor and mapping was released (a stopped worker included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from tests.executor.conftest import make_config

from mpexec.errors import WorkerDiedError, WorkerStalledError, WorkerStartupError
from mpexec.executor import MultiprocExecutor
from mpexec.executor.stall import StallWatch
from mpexec.outputs import SchedulerOutput
from mpexec.system import proc_stat

pytestmark = pytest.mark.usefixtures("leak_check")

WAIT_S = 30.0


def test_queues_torn_down_before_the_handshake_fail_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A monitor tearing the queues down while start-up is at the handshake:
    the caller gets WorkerStartupError, never an error from released memory."""
    import mpexec.executor.multiproc as multiproc

    original = multiproc.handshake

    def torn_down(broadcast: Any, replies: Any, *args: Any, **kwargs: Any) -> None:
        thread = threading.Thread(target=broadcast.shutdown)
        thread.start()
        thread.join(WAIT_S)
        original(broadcast, replies, *args, **kwargs)

    monkeypatch.setattr(multiproc, "handshake", torn_down)
    with pytest.raises(WorkerStartupError, match="queue handshake was cut short"):
        MultiprocExecutor(make_config())


def test_a_reply_queue_torn_down_during_the_handshake_fails_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import mpexec.executor.multiproc as multiproc

    original = multiproc.handshake

    def torn_down(broadcast: Any, replies: Any, *args: Any, **kwargs: Any) -> None:
        threading.Timer(0.0, replies[1].shutdown).start()
        original(broadcast, replies, *args, **kwargs)

    monkeypatch.setattr(multiproc, "handshake", torn_down)
    with pytest.raises(WorkerStartupError):
        MultiprocExecutor(make_config())


# -- a worker that stops answering --------------------------------------------------------


def _stop_later(pid: int, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGSTOP))
    timer.start()
    return timer


def _resume(pid: int) -> None:
    """Whatever happened, never leave a stopped process behind."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_a_worker_stopped_mid_call_is_named_within_its_bound() -> None:
    """SIGSTOP during a call with no deadline: the monitor sees state T and
    fails the call (and the executor) with WorkerStalledError naming the rank."""
    failed = threading.Event()
    with MultiprocExecutor(make_config(worker_stopped_timeout_s=1.0)) as ex:
        ex.register_failure_callback(failed.set)
        pid = ex.workers[1].pid
        timer = _stop_later(pid, 0.3)
        try:
            with pytest.raises(WorkerStalledError, match=rf"rank 1 \(pid {pid}\) has been "
                               r"stopped .*worker_stopped_timeout_s=1") as info:
                ex.collective_rpc("sleep", args=(120.0,))
        finally:
            timer.join(WAIT_S)
            _resume(pid)
        assert info.value.rank == 1 and info.value.pid == pid and info.value.seen == "stopped"
        assert isinstance(info.value, WorkerDiedError) and ex.is_failed
        assert failed.wait(WAIT_S)
        with pytest.raises(WorkerStalledError, match=r"rank 1 .* stopped") as later:
            ex.collective_rpc("echo", args=(1,))
        assert later.value.__cause__ is ex.failure


def test_a_worker_holding_the_gil_is_named_by_its_silent_heartbeat() -> None:
    """Not stopped, yet unable to run Python (one C call holds the GIL): the
    heartbeat beside the main thread goes silent past worker_stall_timeout_s."""
    config = make_config(worker_stall_timeout_s=3.0, worker_stopped_timeout_s=None)
    with MultiprocExecutor(config) as ex:
        pids = [w.pid for w in ex.workers]
        # Every rank holds the GIL, so whichever the monitor names first is
        # right (on a loaded machine an idle one could be starved as long).
        with pytest.raises(WorkerStalledError, match=r"rank \d \(pid \d+\) has not answered "
                           r"its heartbeat .*worker_stall_timeout_s=3") as info:
            ex.collective_rpc("hold_gil", args=(120.0,))
        error = info.value
        assert error.seen == "silent" and error.rank in (0, 1)
        assert error.pid == pids[error.rank]


def test_a_busy_main_thread_keeps_its_heartbeat() -> None:
    """A long pure-Python call (or a sleep) is not a stall: the heartbeat runs beside it."""
    config = make_config(worker_stall_timeout_s=2.0, worker_stopped_timeout_s=2.0)
    with MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("spin", args=(4.0,)) == [0, 1]
        assert ex.collective_rpc("sleep", args=(3.0,)) == [0, 1]
        assert not ex.is_failed


@pytest.mark.parametrize(("how", "seen"), [("stop", "stopped"), ("hold_gil", "heartbeat")])
def test_a_worker_stalled_in_start_up_fails_it_within_its_bound(how: str, seen: str) -> None:
    config = make_config(worker_kwargs={"fail_at": f"init_device:{how}", "fail_rank": 1},
                         worker_stall_timeout_s=3.0, worker_stopped_timeout_s=1.0,
                         startup_timeout_s=120.0)
    with pytest.raises(WorkerStartupError, match=rf"worker rank 1 \(pid \d+\) .*{seen}.* "
                       "during start-up") as info:
        MultiprocExecutor(config)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, WorkerStalledError)


def test_a_call_deadline_names_the_ranks_that_did_not_answer() -> None:
    with MultiprocExecutor(make_config()) as ex:
        with pytest.raises(TimeoutError, match=r"sleep timed out after 0.3s; no reply from "
                           r"rank\(s\) \[1\]"):
            ex.collective_rpc("sleep", args=(2.0,), kwargs={"only_rank": 1}, timeout=0.3)
        future = ex.collective_rpc("sleep", args=(2.0,), kwargs={"only_rank": 0},
                                   non_block=True)
        with pytest.raises(TimeoutError, match=r"no reply from rank\(s\) \[0, 1\]"):
            future.result(timeout=0.2)
        assert future.result(timeout=WAIT_S) == [0, 1]


# -- a worker that dies while the executor is idle -------------------------------------------


def test_a_death_while_idle_is_named_at_the_next_call() -> None:
    failed = threading.Event()
    with MultiprocExecutor(make_config()) as ex:
        ex.register_failure_callback(failed.set)
        pid = ex.workers[1].pid
        os.kill(pid, signal.SIGKILL)
        assert failed.wait(WAIT_S)
        first = ex.failure
        assert isinstance(first, WorkerDiedError) and first.rank == 1 and first.pid == pid
        for _ in range(2):
            with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died: killed by "
                               "SIGKILL") as info:
                ex.execute_model(SchedulerOutput())
            assert info.value.__cause__ is first and info.value is not first
            assert info.value.signal_name == "SIGKILL"


class _Handle:
    def __init__(self, rank: int, pid: int | None) -> None:
        self.rank = rank
        self.pid = pid


def test_the_stall_watch_judges_state_and_heartbeat_against_its_bounds() -> None:
    """A fake clock: a stopped process is named once stopped for its bound; a
    heartbeat cell not stamped for its bound is named; a beat clears it; a
    handle without a local pid is never judged."""
    now = [100.0]
    watch = StallWatch(3, stall_timeout_s=10.0, stopped_timeout_s=2.0, clock=lambda: now[0])
    child = subprocess.Popen(["sleep", "60"])
    handles = [_Handle(0, os.getpid()), _Handle(1, child.pid), _Handle(2, None)]
    try:
        assert watch.check(handles) is None
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + WAIT_S
        while (stat := proc_stat(child.pid)) is not None and stat.state != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.check(handles) is None  # stopped from now on (fake time)
        now[0] += 2.5
        stall = watch.check(handles)
        assert stall is not None and (stall.rank, stall.pid, stall.seen) == (
            1, child.pid, "stopped")
        assert "for 2.5s (worker_stopped_timeout_s=2)" in stall.how
        os.kill(child.pid, signal.SIGCONT)
        now[0] += 20.0
        stall = watch.check(handles)
        assert stall is not None and (stall.rank, stall.seen) == (0, "silent")
        assert "heartbeat for 22.5s" in stall.how
        assert watch.segment is not None
        watch.segment.store(0, int(now[0] * 1e9))  # rank 0 beats
        stall = watch.check(handles)
        assert stall is not None and stall.rank == 1
    finally:
        watch.close()
        _resume(child.pid)
        child.kill()
        child.wait(WAIT_S)
