"""What the Ray test modules share: Ray's state, starting an executor, the
conformance calls every call path must answer as mp does."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from tests.conftest import ray_session_processes
from tests.executor.conftest import make_config

from mpexec.errors import WorkerError
from mpexec.executor import Executor


def live_actors() -> list[Any]:
    from ray._private.state import actors

    return [a for a in actors().values() if a["State"] != "DEAD"]


def live_groups() -> list[Any]:
    import ray

    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def start(made: list[Any], path: str, tp: int = 2, pp: int = 1,
          cancel: threading.Event | None = None, **fields: Any) -> Any:
    from mpexec.executor.ray import RayExecutor

    fields.setdefault("device_type", "cpu")
    config = make_config(tp, pp, executor_backend="ray", ray_call_path=path, **fields)
    executor = Executor.get_class(config)(config, cancel=cancel)
    assert isinstance(executor, RayExecutor)
    made.append(executor)
    return executor


def check_calls(ex: Any) -> None:
    """Results, rank order, errors, timeouts and stats, as for mp (2 workers)."""
    assert ex.uses_ray and ex.supports_pp
    ranks = ex.collective_rpc("whoami")
    assert [r[:2] for r in ranks] == [(0, 0), (1, 1)]
    assert [r[2] for r in ranks] == [w.pid for w in ex.workers]
    assert ex.collective_rpc(lambda worker: worker.rank * 10) == [0, 10]
    assert ex.collective_rpc("add", args=(1,), kwargs={"b": 2}, unique_reply_rank=1) == 4
    assert ex.collective_rpc("echo", args=("x",), non_block=True).result(timeout=30) == ["x", "x"]
    with pytest.raises(WorkerError, match="boom") as info:
        ex.collective_rpc("raise_custom", args=("boom",))
    assert info.value.rank == 0 and type(info.value.__cause__).__name__ == "CustomError"
    with pytest.raises(WorkerError):
        ex.collective_rpc("return_unpicklable")
    with pytest.raises(TimeoutError):
        ex.collective_rpc("sleep", args=(3.0,), timeout=0.5)
    assert ex.collective_rpc("echo", args=(7,)) == [7, 7]  # the late reply is dropped
    ex.check_health()
    if os.geteuid() == 0:  # only a privileged actor may leave Ray's nice 15
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        assert ex.collective_rpc(lambda _: os.getpriority(os.PRIO_PROCESS, 0)) == [nice] * 2
    stats = ex.stats()
    # A future's call is recorded just after its result is set: it may lag here.
    assert stats["echo"].calls >= 1 and stats["whoami"].calls == 1
    assert stats["raise_custom"].failures == 1


def ray_session_dir() -> str:
    """The session directory of the Ray this driver is connected to."""
    import ray

    return str(ray._private.worker._global_node.get_session_dir_path())


def ray_processes_left(session_dir: str, timeout_s: float = 30.0) -> set[int]:
    """The session's Ray processes still there once those exiting have had ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while ray_session_processes(session_dir) and time.monotonic() < end:
        time.sleep(0.2)
    return ray_session_processes(session_dir)


def warm_up(*paths: str) -> None:
    """One executor per call path started, used and stopped: Ray's driver opens its lasting
    connections (to every raylet, the object store) on first use, and so
    does pyzmq (its one garbage-collector context, for zero-copy frames over
    a remote queue): these must not count as a test's leaked descriptors."""
    payload = bytes(1 << 20)
    for path in paths:
        made: list[Any] = []
        try:
            # A cold start (a node's first worker process imports Ray and
            # mpexec) may take a loaded machine longer than a test's 30 s.
            executor = start(made, path, startup_timeout_s=180.0)
            assert executor.collective_rpc("echo", args=(payload,))[0] == payload
        finally:
            for executor in made:
                executor.shutdown()
