"""Initialising, failing, dying and tearing down: the life of the groups."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import mpexec.distributed as d  # noqa: E402
from mpexec.system.procs import proc_stat  # noqa: E402
from tests.distributed.spmd import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


# -- in this process: errors before and around initialisation ----------------


@pytest.mark.parametrize("getter", [d.get_world_group, d.get_tp_group, d.get_pp_group,
                                    d.get_pcp_group, d.get_dcp_group, d.get_dp_group,
                                    d.get_ep_group])
def test_groups_before_initialisation_name_the_fix(getter: Any) -> None:
    assert not d.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match=r"init_distributed_environment\(\.\.\.\)"):
        getter()


def test_model_parallel_needs_the_environment() -> None:
    with pytest.raises(RuntimeError, match="call init_distributed_environment"):
        d.initialize_model_parallel(tensor_model_parallel_size=1)


def test_nccl_without_cuda_names_gloo(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: NCCL may work here")
    with pytest.raises(RuntimeError, match="backend='gloo'"):
        d.init_distributed_environment(1, 0, 0, f"file://{tmp_path}/store", "nccl")
    with pytest.raises(RuntimeError, match="'no-such-backend' is not available"):
        d.init_distributed_environment(1, 0, 0, f"file://{tmp_path}/store", "no-such-backend")
    with pytest.raises(ValueError, match=r"rank 2 must be in \[0, world_size \(2\)\)"):
        d.init_distributed_environment(2, 2, 0, f"file://{tmp_path}/store", "gloo")
    assert not torch.distributed.is_initialized()


def test_single_rank_world_in_process(tmp_path: Path, leak_check: None) -> None:
    init = f"file://{tmp_path}/store"
    d.init_distributed_environment(1, 0, 0, init, "gloo")
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            d.init_distributed_environment(1, 0, 0, init + "-other", "gloo")
        with pytest.raises(ValueError, match=r"world size 1 != .* = 2"):
            d.initialize_model_parallel(tensor_model_parallel_size=2)
        with pytest.raises(ValueError, match="positive integer"):
            d.initialize_model_parallel(tensor_model_parallel_size=0)
        assert not d.model_parallel_is_initialized()
        d.initialize_model_parallel()
        d.initialize_model_parallel()  # the same layout again: nothing to do
        with pytest.raises(RuntimeError, match="destroy_model_parallel"):
            d.initialize_model_parallel(enable_expert_parallel=True)
        tp = d.get_tp_group()
        x = torch.arange(4.0)
        # a group of one: every collective hands the tensor back untouched
        assert tp.all_reduce(x) is x
        assert tp.all_gather(x) is x
        assert tp.gather(x) is x
        assert tp.broadcast(x) is x
        assert tp.broadcast_object("o") == "o"
        tp.barrier()
        with pytest.raises(ValueError, match="itself"):
            tp.send(x, 0)
        with pytest.raises(ValueError, match="not a rank"):
            tp.broadcast(x, src=1)
        assert d.parallel_worker_name() == "Worker"
    finally:
        d.destroy_distributed_environment()
    d.destroy_distributed_environment()
    assert not torch.distributed.is_initialized()
    assert not d.model_parallel_is_initialized()


# -- forked ranks -----------------------------------------------------------------


def reinitialise(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=2)
    first = d.get_tp_group().all_reduce(torch.full((8,), rank + 1.0))
    d.destroy_model_parallel()
    d.initialize_model_parallel(pipeline_model_parallel_size=2)  # new groups, same world
    pp = d.get_pp_group()
    if pp.is_first_rank:
        pp.send(torch.arange(3.0))
        relayed = None
    else:
        relayed = pp.recv((3,), torch.float32)
    d.destroy_distributed_environment()
    # a whole new world in the same process
    d.init_distributed_environment(world_size, rank, rank, init_method + "-again", "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=2)
    second = d.get_tp_group().all_reduce(torch.full((8,), rank + 10.0))
    d.destroy_distributed_environment()
    return {"first": first, "relayed": relayed, "second": second}


def test_destroy_then_reinitialise(leak_check: None) -> None:
    results = run_ranks(2, reinitialise)
    for out in results:
        assert torch.equal(out["first"], torch.full((8,), 3.0))
        assert torch.equal(out["second"], torch.full((8,), 21.0))
    assert torch.equal(results[1]["relayed"], torch.arange(3.0))


def die_mid_collective(rank: int, world_size: int, init_method: str, victim: int,
                       delay: float, use_shm: bool) -> dict[str, Any]:
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                use_shared_memory=use_shm)
    tp = d.get_tp_group()
    tp.all_reduce(torch.ones(16))  # the group works
    if rank == victim:
        time.sleep(delay)  # the others are waiting in the next all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    error: BaseException | None = None
    try:
        tp.all_reduce(torch.ones(16))
    except RuntimeError as exc:
        error = exc
    waited = time.monotonic() - started
    again = None
    if use_shm:
        try:
            tp.all_reduce(torch.ones(16))
        except RuntimeError as exc:
            again = str(exc)
    d.destroy_distributed_environment()  # must not hang on the dead peer
    return {"error": None if error is None else (type(error).__name__, str(error)),
            "dead": getattr(error, "dead", None), "waited": waited, "again": again}


@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["at-once", "while-others-sleep"])
@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "gloo"])
def test_peer_killed_mid_collective(delay: float, use_shm: bool, leak_check: None) -> None:
    results = run_ranks(3, die_mid_collective, 2, delay, use_shm, timeout=30,
                        expect_dead=frozenset({2}))
    assert results[2] is None
    for out in results[:2]:
        assert out["error"] is not None
        kind, message = out["error"]
        if use_shm:
            assert kind == "PeerDiedInCollectiveError"
            # the victim, and perhaps a survivor that already gave up and exited
            assert 2 in out["dead"]
            assert f"rank 2 of the group (pid {out['dead'][2]})" in message
            assert "unusable" in out["again"]
        # promptness: far inside the 30 s bound (the shared-memory path ticks every 100 ms)
        assert out["waited"] < 10


def die_between_stages(rank: int, world_size: int, init_method: str) -> Any:
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp = d.get_pp_group()
    if pp.is_first_rank:
        pp.send_tensor_dict({"hidden": torch.ones(16, 576)})
        time.sleep(0.3)  # the next stage is waiting for the second one by now
        os.kill(os.getpid(), signal.SIGKILL)
    first = pp.recv_tensor_dict()
    started = time.monotonic()
    try:
        pp.recv_tensor_dict()
        error = None
    except RuntimeError as exc:
        error = type(exc).__name__
    waited = time.monotonic() - started
    routes = pp.point_to_point_routes()
    d.destroy_distributed_environment()
    return {"first": first["hidden"].sum().item(), "error": error, "waited": waited,
            "routes": routes}


def test_stage_killed_while_the_next_waits(leak_check: None) -> None:
    out = run_ranks(2, die_between_stages, timeout=30, expect_dead=frozenset({0}))[1]
    assert out["routes"] == {(0, 1): "shm"}
    assert out["first"] == 16 * 576
    assert out["error"] == "PeerDiedError"
    assert out["waited"] < 10


def refuse_shared_memory(rank: int, world_size: int, init_method: str,
                         who: int, step: str) -> Any:
    from mpexec.distributed import shm_collectives

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(12, "no memory for you")

    if rank == who:  # this rank cannot create (rank 0) or map (the others) the segment
        setattr(shm_collectives.Segment, step, refuse)
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    total = tp.all_reduce(torch.full((5,), rank + 1.0))
    gathered = tp.all_gather(torch.full((1,), float(rank)), dim=0)
    active = tp.shm_active
    d.destroy_distributed_environment()
    return total, gathered, active


@pytest.mark.parametrize("who, step", [(0, "create"), (2, "attach")])
def test_a_rank_that_cannot_map_the_segment_keeps_the_group_on_gloo(
        who: int, step: str, leak_check: None) -> None:
    for total, gathered, active in run_ranks(3, refuse_shared_memory, who, step):
        assert not active
        assert torch.equal(total, torch.full((5,), 6.0))
        assert torch.equal(gathered, torch.arange(3.0))


def stopped_peer(rank: int, world_size: int, init_method: str) -> Any:
    import threading

    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    pids = tp.all_gather_object(os.getpid())
    tp.all_reduce(torch.ones(2))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 wakes us after a while
    else:
        def wake_once_stopped() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # SIGCONT before SIGSTOP would be lost
                stat = proc_stat(pids[1])
                if stat is not None and stat.stopped:
                    break
                time.sleep(0.01)
            time.sleep(0.3)  # rank 0 is asleep in the collective by now
            os.kill(pids[1], signal.SIGCONT)

        threading.Thread(target=wake_once_stopped, daemon=True).start()
    total = tp.all_reduce(torch.ones(2))
    d.destroy_distributed_environment()
    return total


def test_a_stopped_peer_is_waited_for_not_declared_dead(leak_check: None) -> None:
    for total in run_ranks(2, stopped_peer, timeout=30):
        assert torch.equal(total, torch.full((2,), 2.0))


def mismatched_shapes(rank: int, world_size: int, init_method: str) -> Any:
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    try:
        tp.all_reduce(torch.ones(4 + rank))
        error = None
    except ValueError as exc:
        error = str(exc)
    after = tp.all_reduce(torch.ones(3))  # the group stays in step
    d.destroy_distributed_environment()
    return error, after


def test_all_reduce_of_different_sizes_fails_on_every_rank(leak_check: None) -> None:
    for error, after in run_ranks(2, mismatched_shapes):
        assert error is not None and "different byte sizes [16, 20]" in error
        assert torch.equal(after, torch.full((3,), 2.0))


def two_threads(rank: int, world_size: int, init_method: str) -> Any:
    import threading

    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    tp.all_reduce(torch.ones(2))
    error = None
    flag = Path(init_method.removeprefix("file://") + ".go")  # in run_ranks' temp dir
    if rank == 0:
        background: list[Any] = []
        thread = threading.Thread(target=lambda: background.append(tp.all_reduce(torch.ones(2))))
        thread.start()
        deadline = time.monotonic() + 10
        while not tp._shm._busy.locked() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the thread waits in the collective for rank 1
        try:
            tp.all_reduce(torch.ones(2))
        except RuntimeError as exc:
            error = str(exc)
        flag.touch()  # now rank 1 may join the thread's collective
        thread.join(20)
        total = background[0]
    else:
        deadline = time.monotonic() + 20
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        total = tp.all_reduce(torch.ones(2))
    d.destroy_distributed_environment()
    return error, total


def test_a_second_thread_in_a_collective_is_refused(leak_check: None) -> None:
    (error, total), (_, peer_total) = run_ranks(2, two_threads, timeout=30)
    assert error is not None and "another thread is inside a collective" in error
    assert torch.equal(total, torch.full((2,), 2.0)) and torch.equal(peer_total, total)


def idle_wait(rank: int, world_size: int, init_method: str, idle_s: float) -> float | None:
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    tp.all_reduce(torch.ones(4))
    cpu = None
    if rank == 0:
        before = time.process_time()
        tp.all_reduce(torch.ones(4))
        cpu = time.process_time() - before
    else:
        time.sleep(idle_s)
        tp.all_reduce(torch.ones(4))
    d.destroy_distributed_environment()
    return cpu


def test_an_idle_rank_sleeps(leak_check: None) -> None:
    cpu = run_ranks(2, idle_wait, 1.5)[0]
    assert cpu is not None and cpu < 0.1, f"{cpu:.3f} CPU-s while waiting 1.5 s"


def titled(rank: int, world_size: int, init_method: str) -> tuple[str, str]:
    import sys

    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    name = d.setup_proc_title_and_log_prefix()
    prefix = getattr(sys.stdout, "prefix", "")
    d.destroy_distributed_environment()
    return name, prefix


def test_process_title_and_log_prefix_use_group_ranks(leak_check: None) -> None:
    results = run_ranks(4, titled)
    names = [name for name, _ in results]
    assert names == ["Worker_PP0_TP0", "Worker_PP0_TP1", "Worker_PP1_TP0", "Worker_PP1_TP1"]
    for name, prefix in results:
        assert prefix.startswith(f"({name} pid=")


def queue_over_group(rank: int, world_size: int, init_method: str) -> Any:
    from mpexec.ipc import MessageQueue

    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    queue = MessageQueue.create_from_process_group(d.get_tp_group(), 1 << 16, 4, writer_rank=1)
    got = [queue.broadcast_object({"step": i} if rank == 1 else None) for i in range(3)]
    queue.shutdown()
    d.destroy_distributed_environment()
    return got


def test_message_queue_over_a_group(leak_check: None) -> None:

    for got in run_ranks(3, queue_over_group):
        assert got == [{"step": 0}, {"step": 1}, {"step": 2}]
