"""RayExecutor's "shm" path across Ray nodes, on one machine.

``ray.cluster_utils.Cluster`` runs a head raylet (the driver's node, one
CPU) and a second raylet (two CPUs) here.  A 2-worker placement group with
SPREAD has one bundle on each node: the rank on the driver's node reads
shared memory, the other rank reads the same queues over the network
(remote readers), because "same node" is the Ray node id, never the IP.
With PACK both bundles go to the second node and every rank is remote.
One cluster serves the whole module (a raylet takes seconds to start); the
node-lost case removes the second node, so it runs last.  With
``cluster_curve`` the remote queues speak CURVE.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.conftest import stop_process
from tests.executor.ray_support import (
    check_calls,
    live_actors,
    live_groups,
    ray_processes_left,
    start,
    warm_up,
)

from mpexec.errors import WorkerDiedError, WorkerStalledError, WorkerStartupError

ray = pytest.importorskip("ray")
pytest.importorskip("zmq")

from ray.cluster_utils import Cluster  # noqa: E402

from mpexec.ipc.remote import RemoteReader, RemoteWriter  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any]]:
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    session = str(cluster.head_node.get_session_dir_path())
    other = cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        warm_up("shm")
        yield cluster, other
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert ray_processes_left(session) == set()


@pytest.fixture
def made(cluster: tuple[Any, Any], ray_leak_check: None) -> Iterator[list[Any]]:
    executors: list[Any] = []
    yield executors
    for executor in executors:
        executor.shutdown()
    assert live_actors() == [] and live_groups() == []


def spread(made: list[Any], **fields: Any) -> Any:
    return start(made, "shm", ray_placement_strategy="SPREAD", **fields)


def remote_rank(ex: Any) -> int:
    """The rank whose actor is on the other Ray node (asserting there is one)."""
    here = ray.get_runtime_context().get_node_id()
    remote = [w.rank for w in ex.workers if w.node_id != here]
    assert len(remote) == 1, [w.node_id for w in ex.workers]
    return remote[0]


def test_actors_on_two_nodes_answer_as_on_one(made: list[Any]) -> None:
    ex = spread(made, mq_max_chunks=4)
    rank = remote_rank(ex)
    # A collective's failure may wait for a death as across mp's nodes.
    assert ex.death_verdict_s == ex.config.node_timeout_s + 2 * ex.config.node_heartbeat_s
    assert isinstance(ex.rpc_broadcast_mq.transport, RemoteWriter)
    assert [isinstance(mq, RemoteReader) for mq in ex.response_mqs] == [
        r == rank for r in range(2)]
    check_calls(ex)
    big = os.urandom(1 << 20)  # out-of-band buffers over the network
    assert ex.collective_rpc("echo", args=(big,)) == [big, big]
    futures = [ex.collective_rpc("echo", args=(i,), non_block=True) for i in range(2000)]
    assert futures[-1].result(timeout=120) == [1999, 1999]
    assert [f.result(timeout=0)[0] for f in futures] == list(range(2000))


def test_a_stopped_actor_is_caught_by_the_health_check(made: list[Any]) -> None:
    """SIGSTOP: Ray still sees the actor alive, and before the stall watch's
    bound (worker_stopped_timeout_s, 5 s) only a deadline can tell -
    check_health() within check_health_timeout_s (and execute_model within
    execute_model_timeout_s); shutdown() is bounded by shutdown_grace_s.

    The actor is stopped once all of its threads are (``stop_process``): an
    actor serves calls on another thread than its main one, which keeps
    answering until the main thread has run to begin the group stop."""
    ex = spread(made, check_health_timeout_s=1.0, shutdown_grace_s=1.0)
    victim = ex.workers[remote_rank(ex)]
    stop_process(victim.pid)
    try:
        with pytest.raises(TimeoutError):
            ex.check_health()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert ex.collective_rpc("echo", args=(3,), timeout=30) == [3, 3]  # usable again
    stop_process(victim.pid)
    ended = time.monotonic()
    ex.shutdown()  # the stopped actor is killed, not waited for
    assert time.monotonic() - ended < 60
    assert live_actors() == []


def test_a_remote_actor_stopped_mid_call_is_named_by_its_nodes_watch(made: list[Any]) -> None:
    """The driver cannot see an actor on another Ray node stop: that node's
    watch actor (``ray.watch``) sees state T past worker_stopped_timeout_s
    and tells the driver, which kills the actor and fails the call with
    WorkerStalledError naming the rank and the node, long before its 120 s."""
    ex = spread(made, worker_stopped_timeout_s=1.0)
    rank = remote_rank(ex)
    victim = ex.workers[rank]
    pending = ex.collective_rpc("sleep", args=(120.0,), non_block=True)
    stop_process(victim.pid)
    with pytest.raises(WorkerStalledError, match=rf"rank {rank} \(pid {victim.pid}\) on Ray node "
                       rf"{victim.node_id} has been stopped .*worker_stopped_timeout_s=1\)"
                       ) as info:
        pending.result(timeout=60)
    assert info.value.rank == rank and info.value.seen == "stopped"
    assert ex.is_failed


def test_remote_actors_holding_the_gil_are_named_by_their_silent_heartbeat(
        made: list[Any]) -> None:
    """Every actor on the other Ray node (PACK), each holding the GIL in one
    long C call: their heartbeats, stamped in that node's watch actor's
    segment, go silent past worker_stall_timeout_s."""
    ex = start(made, "shm", ray_placement_strategy="PACK", worker_stall_timeout_s=3.0,
               worker_stopped_timeout_s=None)
    with pytest.raises(WorkerStalledError, match=r"rank \d \(pid \d+\) on Ray node \w+ has not "
                       r"answered its heartbeat .*worker_stall_timeout_s=3\)") as info:
        ex.collective_rpc("hold_gil", args=(120.0,))
    assert info.value.seen == "silent" and info.value.rank in (0, 1)
    assert info.value.pid == ex.workers[info.value.rank].pid


def test_remote_actor_dying_in_the_queue_handshake_fails_start_up(
        made: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote reader cannot see its peer die; the watcher does, so start-up
    fails at once rather than at startup_timeout_s (120 s here)."""
    import mpexec.executor.ray.executor as ray_executor

    started = ray_executor._wait_started
    here = ray.get_runtime_context().get_node_id()

    def then_kill_the_remote_one(ray_module: Any, handles: list[Any], *args: Any) -> Any:
        replies = started(ray_module, handles, *args)
        os.kill(next(h.pid for h in handles if h.node_id != here), signal.SIGKILL)
        return replies

    monkeypatch.setattr(ray_executor, "_wait_started", then_kill_the_remote_one)
    with pytest.raises(WorkerStartupError, match=r"died during the queue handshake.*node"):
        spread(made, startup_timeout_s=120.0)


def test_every_actor_remote(made: list[Any]) -> None:
    ex = start(made, "shm", ray_placement_strategy="PACK")
    here = ray.get_runtime_context().get_node_id()
    assert len({w.node_id for w in ex.workers} - {here}) == 1
    assert ex.rpc_broadcast_mq.export_handle().local_reader_ranks == []
    assert all(isinstance(mq, RemoteReader) for mq in ex.response_mqs)
    assert ex.collective_rpc(lambda worker: worker.rank) == [0, 1]
    assert ex.collective_rpc("add", args=(1,), kwargs={"b": 2}, unique_reply_rank=0) == 3


def test_cluster_curve_encrypts_the_queues_between_ray_nodes(made: list[Any]) -> None:
    """cluster_curve: the remote ends of the broadcast queue and of the remote
    actor's reply queue speak CURVE (keys from the executor's secret); the
    calls answer as without it."""
    import zmq

    ex = spread(made, cluster_curve=True)
    rank = remote_rank(ex)
    broadcast = ex.rpc_broadcast_mq.transport
    assert isinstance(broadcast, RemoteWriter) and broadcast.export_handle().remote_curve
    assert broadcast._sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    reply = ex.response_mqs[rank]
    assert isinstance(reply, RemoteReader)
    assert reply._sock.getsockopt(zmq.MECHANISM) == zmq.CURVE  # as is the actor's writer
    check_calls(ex)
    big = os.urandom(1 << 20)
    assert ex.collective_rpc("echo", args=(big,)) == [big, big]
    assert all(not mq.drops.by_reason for mq in ex.response_mqs if isinstance(mq, RemoteReader))


def test_node_lost_mid_call(made: list[Any], cluster: tuple[Any, Any]) -> None:
    ex = spread(made)
    rank = remote_rank(ex)
    node_id = ex.workers[rank].node_id
    fired: list[int] = []
    done = threading.Event()
    ex.register_failure_callback(lambda: (fired.append(1), done.set()))
    pending = ex.collective_rpc("sleep", args=(60.0,), non_block=True)
    cluster[0].remove_node(cluster[1])
    with pytest.raises(WorkerDiedError, match=f"rank {rank}") as info:
        pending.result(timeout=90)
    assert node_id in str(info.value) and info.value.rank == rank
    assert done.wait(30) and ex.is_failed
    with pytest.raises(WorkerDiedError, match=f"rank {rank}.*{node_id}"):
        ex.collective_rpc("echo", args=(1,))
    ex.shutdown()
    assert fired == [1]
