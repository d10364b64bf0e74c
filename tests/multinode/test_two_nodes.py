"""An executor across two process trees on 127.0.0.1: the leader here, a
follower started as ``mpexec node`` or ``run_follower`` in a new session."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.errors import WorkerDiedError, WorkerStartupError
from mpexec.executor import MultiprocExecutor
from mpexec.system.procs import process_gone
from tests.multinode.nodes import (
    SECRET,
    free_port,
    kill_tree,
    reap,
    start_follower,
    tree_of,
)

WORKER = "tests.executor.workers:EchoWorker"


def two_node_config(port: int, tp: int = 4, **fields: Any) -> ExecutorConfig:
    fields.setdefault("startup_timeout_s", 60.0)
    return ExecutorConfig(
        worker_cls=WORKER, device_type="cpu", shutdown_grace_s=2.0, shutdown_term_s=2.0,
        cluster_secret=SECRET,
        parallel=ParallelConfig(tensor_parallel_size=tp, nnodes=2, master_port=port), **fields)


def assert_port_free(port: int) -> None:
    """Nobody listens on ``port`` (connections in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        probe.listen()


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if not process_gone(p)}
        time.sleep(0.05)
    return alive


@pytest.mark.timeout(120)
def test_ranks_results_and_orderly_end_with_mpexec_node(leak_check: None) -> None:
    port = free_port()
    follower = start_follower(port, cli=True)
    try:
        executor = MultiprocExecutor(two_node_config(port))
        try:
            ranks = executor.collective_rpc("whoami")
            assert [r[:2] for r in ranks] == [(0, 0), (1, 1), (2, 0), (3, 1)]
            assert len({r[2] for r in ranks}) == 4
            assert executor.collective_rpc("add", args=(1,), kwargs={"b": 2}) == [3, 4, 5, 6]
            assert executor.collective_rpc("echo", args=("one",), unique_reply_rank=3) == "one"
            futures = [executor.collective_rpc("add", args=(i,), non_block=True)
                       for i in range(50)]
            assert [f.result(30)[3] for f in futures] == [i + 3 for i in range(50)]
        finally:
            executor.shutdown()
        assert follower.wait(30) == 0
    finally:
        reap(follower)


@pytest.mark.timeout(120)
def test_lost_follower_fails_pending_and_later_calls_naming_node_and_ranks(
        leak_check: None) -> None:
    port = free_port()
    follower = start_follower(port)
    failures: list[int] = []
    try:
        executor = MultiprocExecutor(two_node_config(port))
        try:
            executor.register_failure_callback(lambda: failures.append(1))
            pending = executor.collective_rpc("sleep", args=(60,), non_block=True)
            time.sleep(0.2)
            kill_tree(follower.pid)
            with pytest.raises(WorkerDiedError, match=r"node 1 \(ranks 2-3\)"):
                pending.result(30)  # well before the call's 60 s
            with pytest.raises(WorkerDiedError, match="node 1"):
                executor.collective_rpc("echo", args=(1,), timeout=30)
            deadline = time.monotonic() + 10
            while not failures and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            assert failures == [1]
        finally:
            executor.shutdown()
        assert_port_free(port)  # nothing the leader bound stays bound
    finally:
        reap(follower)


@pytest.mark.timeout(120)
def test_a_dead_worker_on_the_follower_is_reported_at_once(leak_check: None) -> None:
    port = free_port()
    follower = start_follower(port)
    try:
        executor = MultiprocExecutor(two_node_config(port))
        try:
            with pytest.raises(WorkerDiedError, match=r"worker rank 3 .*SIGKILL"):
                executor.collective_rpc("sigkill_self", kwargs={"only_rank": 3}, timeout=60)
        finally:
            executor.shutdown()
        assert follower.wait(30) == 1
    finally:
        reap(follower)


@pytest.mark.timeout(120)
def test_wrong_secret_is_refused_clearly_on_both_sides(leak_check: None) -> None:
    port = free_port()
    follower = start_follower(port, secret="this-is-not-the-cluster-secret!!")
    try:
        with pytest.raises(WorkerStartupError, match="did not join"):
            MultiprocExecutor(two_node_config(port, startup_timeout_s=8.0))
        assert follower.wait(30) == 1
        assert follower.stdout is not None
        out = follower.stdout.read().decode()
        assert "refused to admit this node" in out and "cluster secret" in out
    finally:
        reap(follower)


_LEADER = """
import sys, time
from mpexec.executor import MultiprocExecutor
from tests.multinode.test_two_nodes import two_node_config
if __name__ == "__main__":
    ex = MultiprocExecutor(two_node_config(int(sys.argv[1])))
    ex.collective_rpc("whoami")
    print("READY", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_followers_leave_when_the_leader_is_killed(leak_check: None, tmp_path: Path) -> None:
    port = free_port()
    follower = start_follower(port)
    script = tmp_path / "leader.py"
    script.write_text(_LEADER)
    leader = subprocess.Popen([sys.executable, str(script), str(port)], start_new_session=True,
                              stdout=subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
    try:
        assert leader.stdout is not None
        line = leader.stdout.readline()
        assert line.strip() == b"READY"
        follower_tree = tree_of(follower.pid)
        leader_tree = tree_of(leader.pid)
        assert len(follower_tree) >= 3 and len(leader_tree) >= 3  # node + two workers
        kill_tree(leader.pid)
        assert _wait_gone(follower_tree | leader_tree, 30) == set()  # well within 30 s
        assert follower.wait(10) == 1
        assert_port_free(port)
    finally:
        for proc in (leader, follower):
            reap(proc)
