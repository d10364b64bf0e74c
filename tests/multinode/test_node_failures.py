"""Failures across nodes: a follower killed or stopped at each phase, a
follower whose worker fails start-up, a stopped leader.  Two process trees
on 127.0.0.1: the leader here, a follower in a session of its own.

Promptness is shown by the error beating a much longer deadline: the call
sleeps 60 s, start-up may take 60 s, and the node timeout is 2 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.errors import WorkerDiedError, WorkerStalledError, WorkerStartupError
from mpexec.executor import MultiprocExecutor
from tests.multinode.nodes import free_port, kill_tree, reap, signal_tree, start_follower, tree_of
from tests.multinode.test_two_nodes import _wait_gone, assert_port_free, two_node_config

HANG_RANK_2 = {"fail_at": "init:hang", "fail_rank": 2}  # the follower never gets READY


@pytest.fixture
def follower_port() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    follower = start_follower(port)
    try:
        yield follower, port
    finally:
        signal_tree(follower.pid, signal.SIGCONT)
        reap(follower)


def _when_workers_started(follower: subprocess.Popen[bytes], then: int) -> threading.Thread:
    """A thread that sends ``then`` to the follower's tree once it started its
    workers (so it has joined), twice: the second catches late children."""
    def watch() -> None:
        deadline = time.monotonic() + 60
        while len(tree_of(follower.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        signal_tree(follower.pid, then)
        time.sleep(0.1)
        signal_tree(follower.pid, then)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_follower_lost_after_join_fails_the_start_within_the_node_timeout(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int],
        how: signal.Signals) -> None:
    follower, port = follower_port
    watcher = _when_workers_started(follower, how)
    with pytest.raises(WorkerStartupError, match=r"node 1 \(ranks 2-3\) lost: no heartbeat"):
        MultiprocExecutor(two_node_config(port, startup_timeout_s=60.0,
                                          worker_kwargs=HANG_RANK_2))
    watcher.join(10)
    assert_port_free(port)  # the node channel is closed
    if how == signal.SIGSTOP:
        tree = signal_tree(follower.pid, signal.SIGCONT)
        # Woken, it finds the leader gone and ends, its workers with it.
        assert follower.wait(30) == 1
        assert _wait_gone(tree, 30) == set()


@pytest.mark.timeout(120)
def test_a_follower_worker_failing_start_up_sends_its_traceback(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int]) -> None:
    follower, port = follower_port
    with pytest.raises(WorkerStartupError, match=r"node 1 \(ranks 2-3\) reported: worker "
                       r"rank 3 .*failed during start-up with RuntimeError") as info:
        MultiprocExecutor(two_node_config(port, worker_kwargs={"fail_at": "init:raise",
                                                               "fail_rank": 3}))
    assert info.value.rank == 3
    assert "boom in init on rank 3" in info.value.remote_traceback
    assert "_maybe_fail" in info.value.remote_traceback  # the worker's own frames
    assert "Worker traceback (rank 3)" in str(info.value)
    assert follower.wait(30) == 1
    assert_port_free(port)


@pytest.mark.timeout(120)
def test_a_follower_worker_stopped_mid_call_is_named_within_its_bound(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int]) -> None:
    """SIGSTOP one of the follower's workers inside a 120 s call: the
    follower's own stall watch sees state T past worker_stopped_timeout_s,
    kills the worker and reports it; the caller's WorkerStalledError names
    the rank, its pid on the follower and the node, long before the call ends."""
    follower, port = follower_port
    executor = MultiprocExecutor(two_node_config(port, worker_stopped_timeout_s=1.0))
    try:
        pid = next(who[2] for who in executor.collective_rpc("whoami") if who[0] == 3)
        pending = executor.collective_rpc("sleep", args=(120.0,), non_block=True)
        time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(WorkerStalledError, match=rf"rank 3 \(pid {pid}\) on node 1 has been "
                           r"stopped .*worker_stopped_timeout_s=1\)") as info:
            pending.result(60)
        assert info.value.rank == 3 and info.value.pid == pid and info.value.seen == "stopped"
        assert executor.is_failed
        assert follower.wait(30) == 1  # it reported the failure and ended
        assert not os.path.exists(f"/proc/{pid}")  # the stopped worker was killed
    finally:
        executor.shutdown()
    assert_port_free(port)


@pytest.mark.timeout(120)
def test_a_stopped_follower_fails_the_calls_in_flight_and_is_cleaned_up(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int]) -> None:
    follower, port = follower_port
    failures: list[int] = []
    executor = MultiprocExecutor(two_node_config(port))
    try:
        executor.register_failure_callback(lambda: failures.append(1))
        errors: list[BaseException] = []

        def stream() -> None:  # calls back to back until one fails
            try:
                while True:
                    executor.collective_rpc("add", args=(1,), timeout=60)
            except BaseException as exc:
                errors.append(exc)

        caller = threading.Thread(target=stream)
        caller.start()
        pending = executor.collective_rpc("sleep", args=(60,), non_block=True)
        time.sleep(0.3)
        tree = signal_tree(follower.pid, signal.SIGSTOP)
        with pytest.raises(WorkerDiedError, match=r"node 1 \(ranks 2-3\) lost"):
            pending.result(30)  # well before the call's 60 s
        caller.join(30)
        assert not caller.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
        assert "node 1" in str(errors[0])
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert failures == [1]
    finally:
        executor.shutdown()
    assert_port_free(port)
    # The stopped tree, continued, finds the leader gone and ends on its own.
    signal_tree(follower.pid, signal.SIGCONT)
    assert follower.wait(30) == 1
    assert _wait_gone(tree, 30) == set()


_LEADER = """
import sys, time
from mpexec.executor import MultiprocExecutor
from tests.multinode.test_two_nodes import two_node_config
if __name__ == "__main__":
    # argv[2] "hang": the leader's rank 0 never finishes start-up.
    hang = {"fail_at": "init:hang", "fail_rank": 0} if sys.argv[2:] == ["hang"] else {}
    ex = MultiprocExecutor(two_node_config(int(sys.argv[1]), worker_kwargs=hang))
    ex.collective_rpc("whoami")
    print("READY", flush=True)
    time.sleep(600)
"""


def _start_leader(tmp_path: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """The leader script in its own session, its stdout a pipe (READY, ...)."""
    script = tmp_path / "leader.py"
    script.write_text(_LEADER)
    return subprocess.Popen([sys.executable, str(script), str(port), *args],
                            start_new_session=True, stdout=subprocess.PIPE,
                            cwd=str(Path(__file__).parents[2]))


@pytest.mark.timeout(120)
def test_followers_leave_when_the_leader_is_stopped(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int],
        tmp_path: Path) -> None:
    follower, port = follower_port
    leader = _start_leader(tmp_path, port)
    try:
        assert leader.stdout is not None
        assert leader.stdout.readline().strip() == b"READY"
        follower_tree = tree_of(follower.pid)
        leader_tree = signal_tree(leader.pid, signal.SIGSTOP)
        assert _wait_gone(follower_tree, 30) == set()  # well within 30 s
        assert follower.wait(10) == 1
        kill_tree(leader.pid)  # SIGKILL ends stopped processes too
        assert _wait_gone(leader_tree, 30) == set()
        assert_port_free(port)  # a killed leader leaves no port bound
    finally:
        reap(leader)


@pytest.mark.timeout(120)
def test_followers_leave_when_the_leader_is_killed_during_start_up(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int],
        tmp_path: Path) -> None:
    # The follower joined and started its workers; the leader is still
    # starting (its rank 0 hangs) when it dies: heartbeats run from JOIN on,
    # so the follower does not wait for startup_timeout_s (60 s here).
    follower, port = follower_port
    leader = _start_leader(tmp_path, port, "hang")
    try:
        deadline = time.monotonic() + 60
        while len(tree_of(follower.pid)) < 3:  # the follower and its two workers
            assert time.monotonic() < deadline and follower.poll() is None
            time.sleep(0.05)
        follower_tree = tree_of(follower.pid)
        kill_tree(leader.pid)
        assert follower.wait(30) == 1  # well before startup_timeout_s
        assert _wait_gone(follower_tree, 30) == set()
    finally:
        reap(leader)


@pytest.mark.timeout(120)
def test_a_leader_worker_failing_start_up_is_not_kept_waiting_for_followers(
        leak_check: None) -> None:
    port = free_port()  # no follower ever comes
    with pytest.raises(WorkerStartupError, match=r"worker rank 0 .*failed during start-up"):
        MultiprocExecutor(two_node_config(port, startup_timeout_s=60.0, worker_kwargs={
            "fail_at": "init:raise", "fail_rank": 0}))
    assert_port_free(port)


@pytest.mark.timeout(120)
def test_a_follower_stopped_during_the_queue_handshake_fails_the_start(
        leak_check: None, follower_port: tuple[subprocess.Popen[bytes], int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.executor.nodes.leader import NodeServer

    follower, port = follower_port
    collect = NodeServer.collect

    def collect_then_stop(self: NodeServer, deadline: float, timeout_s: float,
                          **options: Any) -> Any:
        handles = collect(self, deadline, timeout_s, **options)
        signal_tree(follower.pid, signal.SIGSTOP)  # READY came; the handshake has not
        return handles

    monkeypatch.setattr(NodeServer, "collect", collect_then_stop)
    with pytest.raises(WorkerStartupError, match=r"node 1 \(ranks 2-3\) lost: no heartbeat"):
        MultiprocExecutor(two_node_config(port, startup_timeout_s=60.0))
    assert_port_free(port)
    tree = signal_tree(follower.pid, signal.SIGCONT)
    assert follower.wait(30) == 1
    assert _wait_gone(tree, 30) == set()


@pytest.mark.timeout(120)
def test_a_leader_worker_stuck_in_native_code_ends_without_sigkill_after_a_failed_start(
        leak_check: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 blocks in native code no signal interrupts (as a rendezvous
    waiting for a follower that never comes does): the failed start's
    teardown ends it with the death pipe and SIGTERM, never SIGKILL."""
    from mpexec.executor.termination import TerminationPolicy, TerminationReport

    reports: list[TerminationReport] = []
    terminate = TerminationPolicy.terminate

    def recorded(self: TerminationPolicy, procs: Any, *rest: Any) -> TerminationReport:
        reports.append(terminate(self, procs, *rest))
        return reports[-1]

    monkeypatch.setattr(TerminationPolicy, "terminate", recorded)
    port = free_port()  # no follower ever comes: the start times out
    with pytest.raises(WorkerStartupError, match=r"did not join"):
        MultiprocExecutor(two_node_config(port, startup_timeout_s=3.0, worker_kwargs={
            "fail_at": "init_device:native", "fail_rank": 0}))
    assert len(reports) == 1
    assert reports[0].stage in ("exited", "sigterm") and not reports[0].killed, reports[0]
    assert_port_free(port)
