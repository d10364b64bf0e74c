"""What a user meets first: failure callbacks that add up on every backend,
``supports_pp``, the "auto" device, CPU pinning by NUMA node, and leaving
torch.distributed at a worker's shutdown."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from tests.executor.conftest import make_config

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.executor import Executor, MultiprocExecutor
from mpexec.executor.uniproc import UniProcExecutor

pytestmark = pytest.mark.usefixtures("leak_check")


# -- failure callbacks ----------------------------------------------------------------

def _wait_for(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_uni_keeps_every_failure_callback_and_runs_each_once() -> None:
    calls: list[str] = []
    with UniProcExecutor(make_config(tp=1, executor_backend="uni")) as ex:
        ex.register_failure_callback(lambda: calls.append("engine"))
        ex.register_failure_callback(lambda: calls.append("user"))
        assert not ex.is_failed and calls == []
        ex.lifecycle.fire_callbacks()  # what a failure of any backend runs
        ex.lifecycle.fire_callbacks()
    assert calls == ["engine", "user"]


def test_mp_keeps_every_failure_callback_and_runs_each_once() -> None:
    calls: list[str] = []
    with MultiprocExecutor(make_config(tp=2)) as ex:
        ex.register_failure_callback(lambda: calls.append("engine"))
        ex.register_failure_callback(lambda: calls.append("user"))
        os.kill(ex.workers[1].pid, signal.SIGKILL)
        assert _wait_for(lambda: len(calls) == 2)
        ex.register_failure_callback(lambda: calls.append("late"))  # at once, once
    assert calls == ["engine", "user", "late"]


# -- supports_pp ----------------------------------------------------------------------

def test_supports_pp_per_backend() -> None:
    from mpexec.executor.ray import RayExecutor

    assert MultiprocExecutor.supports_pp and RayExecutor.supports_pp
    assert not UniProcExecutor.supports_pp and not Executor.supports_pp


def test_a_backend_without_pp_refuses_a_pipeline() -> None:
    config = make_config(tp=1, pp=2, executor_backend="uni")
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        Executor.get_class(config)(config)


# -- the "auto" device ----------------------------------------------------------------

def test_device_auto_is_the_default_and_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    assert ExecutorConfig(worker_cls="m:C").device_type == "cpu"
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    config = ExecutorConfig(worker_cls="m:C")
    assert config.device_type == "cuda"
    assert config.replace(device_type="cpu").device_type == "cpu"
    assert ExecutorConfig(worker_cls="m:C", device_type="auto").device_type == "cuda"


def test_cuda_available_reads_the_machine_without_importing_torch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import sys

    from mpexec import devices

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [])
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    monkeypatch.setattr(devices, "_GPUS", str(gpus))
    monkeypatch.setattr(devices.metadata, "version", lambda name: "2.13.0+cpu")
    (gpus / "0000:01:00.0").mkdir()
    assert devices.cuda_available() is False  # a CPU build of torch, whatever the machine
    monkeypatch.setattr(devices.metadata, "version", lambda name: "2.13.0")
    assert devices.cuda_available() is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.cuda_available() is False
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (gpus / "0000:01:00.0").rmdir()
    assert devices.cuda_available() is False  # no NVIDIA GPU
    assert "torch" not in sys.modules


# -- CPU pinning ----------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable CPUs")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_cpu_affinity_auto_pins_each_worker_inside_its_numa_node(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        method: str) -> None:
    from mpexec.system import topology

    first, second = sorted(os.sched_getaffinity(0))[:2]
    # A faked two-node machine made of two CPUs this process may use.
    monkeypatch.setattr(topology, "allowed_cpus", lambda: [first, second])
    monkeypatch.setattr(topology, "numa_nodes", lambda sysfs=None: {0: {first}, 1: {second}})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    config = make_config(tp=2, device_type="cpu", cpu_affinity="auto", mp_start_method=method)
    with caplog.at_level("INFO", logger="mpexec.executor.spec"), \
            MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("affinity") == [[first], [second]]
        assert ex.collective_rpc("env", args=("OMP_NUM_THREADS",)) == ["1", "1"]
    lines = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert lines == [f"Worker_TP0 is pinned to CPU {first} (NUMA node 0); OMP_NUM_THREADS=1",
                     f"Worker_TP1 is pinned to CPU {second} (NUMA node 1); OMP_NUM_THREADS=1"]


def test_cpu_affinity_accepts_auto_only_as_a_word() -> None:
    assert make_config(tp=2, cpu_affinity="auto").cpu_affinity == "auto"
    with pytest.raises(ValueError, match="cpu_affinity must be 'auto'"):
        make_config(tp=2, cpu_affinity="numa")


def test_cpu_sets_auto_partitions_this_nodes_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.executor import spec

    monkeypatch.setattr(spec, "allowed_cpus", lambda: list(range(8)))
    monkeypatch.setattr(spec, "numa_nodes",
                        lambda sysfs=None: {0: set(range(4)), 1: set(range(4, 8))})
    config = ExecutorConfig(worker_cls="m:C", cpu_affinity="auto", device_type="cpu",
                            parallel=ParallelConfig(tensor_parallel_size=4))
    assert spec.local_cpu_sets(config) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="depends on the node"):
        config.cpus_for(3)
    assert spec.local_cpu_sets(config.replace(cpu_affinity=[[3], [2], [1], [0]])) == [
        [3], [2], [1], [0]]


# -- torch.distributed left at shutdown -------------------------------------------------

@pytest.mark.torch
def test_release_distributed_leaves_a_world_the_worker_joined(tmp_path: Any) -> None:
    dist = pytest.importorskip("torch.distributed")
    from mpexec.executor.worker_proc import release_distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", world_size=1,
                            rank=0)
    assert dist.is_initialized()
    release_distributed(0)
    assert not dist.is_initialized()
    release_distributed(0)  # nothing to leave: nothing happens


# -- the output thread binds the worker's device ----------------------------------------

@pytest.mark.torch
def test_the_async_output_thread_binds_a_cuda_workers_device() -> None:
    pytest.importorskip("torch")
    from mpexec.config import SchedulerConfig

    config = make_config(tp=2, device_type="cuda", worker_cls="tests.executor.workers:"
                         "FakeCudaWorker", scheduler=SchedulerConfig(async_scheduling=True))
    with MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("echo", args=(1,)) == [1, 1]
        bound = ex.collective_rpc("bindings")
    assert bound == [[("WorkerAsyncOutputCopy", "cuda:0")], [("WorkerAsyncOutputCopy", "cuda:1")]]


def test_bind_device_leaves_cpu_workers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from mpexec.executor.worker_proc import bind_device

    calls: list[str] = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(set_device=calls.append))
    monkeypatch.setitem(sys.modules, "torch", fake)
    bind_device("cpu")
    bind_device("cuda:3")
    assert calls == ["cuda:3"]
