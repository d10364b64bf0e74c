"""One conformance suite over three executors: uni (in process), mp on one
node, and mp across two nodes (two process trees on 127.0.0.1).  The same
calls give the same results, errors, ordering, timeouts and failures."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.errors import WorkerDiedError, WorkerError
from mpexec.executor import Executor
from tests.multinode.nodes import SECRET, free_port, kill_tree, start_follower

WORKER = "tests.executor.workers:EchoWorker"
BACKENDS = ["uni", "mp", "mp-2-nodes"]


@pytest.fixture(params=BACKENDS)
def executor(request: Any, leak_check: None) -> Iterator[Executor]:
    kind = request.param
    follower: subprocess.Popen[bytes] | None = None
    common: dict[str, Any] = {"worker_cls": WORKER, "device_type": "cpu",
                              "shutdown_grace_s": 2.0, "shutdown_term_s": 2.0,
                              "startup_timeout_s": 60.0}
    if kind == "uni":
        config = ExecutorConfig(executor_backend="uni", **common)
    elif kind == "mp":
        config = ExecutorConfig(parallel=ParallelConfig(tensor_parallel_size=2), **common)
    else:
        pytest.importorskip("zmq")
        port = free_port()
        follower = start_follower(port)
        config = ExecutorConfig(cluster_secret=SECRET, parallel=ParallelConfig(
            tensor_parallel_size=2, nnodes=2, master_port=port), **common)
    try:
        made = Executor.get_class(config)(config)
        try:
            yield made
        finally:
            made.shutdown()
    finally:
        if follower is not None:
            follower.wait(30)
            kill_tree(follower.pid)
            assert follower.stdout is not None
            said = follower.stdout.read().decode(errors="replace").strip()
            if said:  # shown with a failed test's captured output
                print(f"the follower said:\n{said[-4000:]}")
            follower.stdout.close()


def _world(executor: Executor) -> int:
    return executor.parallel_config.world_size


@pytest.mark.timeout(120)
def test_ranks_and_results(executor: Executor) -> None:
    world = _world(executor)
    assert [r[0] for r in executor.collective_rpc("whoami")] == list(range(world))
    assert executor.collective_rpc("add", args=(10,), kwargs={"b": 1}) == [
        11 + r for r in range(world)]
    last = world - 1
    assert executor.collective_rpc("add", args=(1,), unique_reply_rank=last) == 1 + last
    assert executor.collective_rpc(lambda worker: worker.rank * 2) == [
        2 * r for r in range(world)]


@pytest.mark.timeout(120)
def test_large_payload_round_trip(executor: Executor) -> None:
    np = pytest.importorskip("numpy")
    array = np.arange(2 * 2**20, dtype=np.float32)  # 8 MiB
    out = executor.collective_rpc("echo", args=(array,), unique_reply_rank=_world(executor) - 1)
    assert np.array_equal(out, array)


@pytest.mark.timeout(120)
def test_worker_error_keeps_type_and_executor_usable(executor: Executor) -> None:
    with pytest.raises(WorkerError, match="bad input") as info:
        executor.collective_rpc("raise_custom", args=("bad input",))
    assert info.value.exc_type.endswith("CustomError") and info.value.rank == 0
    assert executor.collective_rpc("echo", args=("after",)) == ["after"] * _world(executor)


@pytest.mark.timeout(120)
def test_non_blocking_calls_complete_in_call_order(executor: Executor) -> None:
    futures = [executor.collective_rpc("add", args=(i,), non_block=True) for i in range(100)]
    assert [f.result(60)[0] for f in futures] == list(range(100))


@pytest.mark.timeout(120)
def test_timeout_then_later_calls_get_their_own_replies(executor: Executor) -> None:
    with pytest.raises(TimeoutError):
        executor.collective_rpc("sleep", args=(2.0,), timeout=0.3)
    assert executor.collective_rpc("echo", args=("next",), timeout=30) == (
        ["next"] * _world(executor))


@pytest.mark.timeout(120)
def test_a_killed_worker_fails_the_call_and_every_later_one(executor: Executor) -> None:
    if _world(executor) == 1 and executor.config.executor_backend == "uni":
        pytest.skip("uni runs its worker in this process: nothing to kill")
    last = _world(executor) - 1
    with pytest.raises(WorkerDiedError, match=f"rank {last}"):
        executor.collective_rpc("sigkill_self", kwargs={"only_rank": last}, timeout=60)
    with pytest.raises(WorkerDiedError):
        executor.collective_rpc("echo", args=(1,), timeout=30)
    assert executor.is_failed
