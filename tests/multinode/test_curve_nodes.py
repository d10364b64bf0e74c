"""Two nodes on 127.0.0.1 with CURVE on (``cluster_curve``): calls work, and a
follower that speaks plaintext to a CURVE leader is never admitted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

zmq = pytest.importorskip("zmq")

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.errors import WorkerStartupError  # noqa: E402
from mpexec.executor import MultiprocExecutor  # noqa: E402
from tests.multinode.nodes import ROOT, SECRET, free_port, reap  # noqa: E402

pytestmark = [pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE"),
              pytest.mark.timeout(120)]


def _follower(port: int, curve: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "MPEXEC_CLUSTER_CURVE": "1" if curve else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    code = ("import sys; from mpexec.executor.nodes.follower import run_follower; "
            f"sys.exit(run_follower(2, 1, '127.0.0.1', {port}, join_timeout_s=60))")
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _config(port: int, **fields: object) -> ExecutorConfig:
    return ExecutorConfig(
        worker_cls="tests.executor.workers:EchoWorker", device_type="cpu",
        shutdown_grace_s=2.0, shutdown_term_s=2.0, cluster_secret=SECRET,
        cluster_curve=True, parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2,
                                                    master_port=port), **fields)


def test_calls_across_nodes_with_curve(leak_check: None) -> None:
    port = free_port()
    follower = _follower(port, curve=True)
    try:
        executor = MultiprocExecutor(_config(port, startup_timeout_s=60.0))
        try:
            assert executor.rpc_broadcast_mq.export_handle().remote_curve
            assert executor.collective_rpc("add", args=(1,), kwargs={"b": 1}) == [2, 3]
            assert executor.collective_rpc("echo", args=(b"z" * (1 << 20),)) == [
                b"z" * (1 << 20)] * 2
        finally:
            executor.shutdown()
        assert follower.wait(30) == 0
    finally:
        reap(follower)


def test_a_plaintext_follower_is_not_admitted_by_a_curve_leader(leak_check: None) -> None:
    port = free_port()
    follower = _follower(port, curve=False)
    try:
        with pytest.raises(WorkerStartupError, match="did not join"):
            MultiprocExecutor(_config(port, startup_timeout_s=5.0))
    finally:
        reap(follower)
