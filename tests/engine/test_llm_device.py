"""How the LLM picks its device, its torch.distributed backend and its thread
counts, without a GPU: CUDA is faked where it matters, and no worker starts
(the executor class is replaced by one that records its config)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, distributed_backend_for
from mpexec.engine import llm as llm_module, startup
from mpexec.executor import Executor

pytestmark = pytest.mark.usefixtures("leak_check")


class _Recorded(Exception):
    def __init__(self, config: ExecutorConfig) -> None:
        super().__init__("recorded")
        self.config = config


def _record(config: ExecutorConfig) -> Any:
    def build(config: ExecutorConfig) -> Any:
        raise _Recorded(config)

    return build


@pytest.fixture
def recorded_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    """LLM(...) -> the ExecutorConfig it would have started workers with."""
    monkeypatch.setattr(Executor, "get_class", staticmethod(_record))
    monkeypatch.setattr(startup, "_resolve", lambda model: str(model))
    # no checkpoint behind the path: the context-length check reads none
    monkeypatch.setattr(startup, "_check_model",
                        lambda path, max_model_len, tp, pp: SimpleNamespace(vocab_size=101))

    def build(**kwargs: Any) -> ExecutorConfig:
        with pytest.raises(_Recorded) as info:
            llm_module.LLM("some/checkpoint", **kwargs)
        return info.value.config

    return build


def fake_cuda(monkeypatch: pytest.MonkeyPatch, visible: bool) -> None:
    from mpexec import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: visible)
    if visible:  # as many devices as any of these layouts asks for
        import torch

        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_backend_selection_table() -> None:
    assert distributed_backend_for("cuda") == "nccl"
    assert distributed_backend_for("cpu") == "gloo"
    assert distributed_backend_for("cuda", "gloo") == "gloo"
    assert distributed_backend_for("cuda", "nccl") == "nccl"
    with pytest.raises(ValueError, match="'nccl' needs CUDA workers"):
        distributed_backend_for("cpu", "nccl")
    with pytest.raises(ValueError, match="distributed_backend must be one of"):
        distributed_backend_for("cpu", "mpi")


def test_cuda_visible_gives_cuda_workers_on_nccl(monkeypatch: pytest.MonkeyPatch,
                                                 recorded_config: Any) -> None:
    fake_cuda(monkeypatch, True)
    config = recorded_config(tensor_parallel_size=2)
    assert config.device_type == "cuda" and config.parallel.backend == "nccl"
    assert config.omp_num_threads is None  # accelerator workers: one thread each
    config = recorded_config(tensor_parallel_size=2, distributed_backend="gloo")
    assert config.parallel.backend == "gloo"


def test_no_cuda_gives_cpu_workers_on_gloo(monkeypatch: pytest.MonkeyPatch,
                                           recorded_config: Any) -> None:
    fake_cuda(monkeypatch, False)
    config = recorded_config()
    assert config.device_type == "cpu" and config.parallel.backend == "gloo"
    with pytest.raises(ValueError, match="'nccl' needs CUDA workers"):
        recorded_config(distributed_backend="nccl")
    config = recorded_config(device="cpu", cpu_affinity="auto")
    assert config.cpu_affinity == "auto"


def test_more_cpu_workers_than_cpus_warn_and_get_one_thread_each(
        monkeypatch: pytest.MonkeyPatch, recorded_config: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    fake_cuda(monkeypatch, False)
    monkeypatch.setattr(startup, "usable_cpus", lambda: 2)
    with caplog.at_level("WARNING", logger="mpexec.engine.startup"):
        config = recorded_config(tensor_parallel_size=3)
    assert config.parallel.world_size == 3
    assert config.omp_num_threads == 1
    assert config.worker_kwargs["num_threads"] == 1
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "3 CPU workers" in warning and "2 usable CPU" in warning


def test_as_many_cpu_workers_as_cpus_share_them_without_a_warning(
        monkeypatch: pytest.MonkeyPatch, recorded_config: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    fake_cuda(monkeypatch, False)
    monkeypatch.setattr(startup, "usable_cpus", lambda: 8)
    with caplog.at_level("WARNING", logger="mpexec.engine.startup"):
        config = recorded_config(tensor_parallel_size=2)
    assert config.omp_num_threads == 4
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_more_cuda_workers_than_devices_is_one_clear_error(
        monkeypatch: pytest.MonkeyPatch, recorded_config: Any) -> None:
    """DP x TP x PP larger than the node's GPUs: refused before any worker starts."""
    import torch

    fake_cuda(monkeypatch, True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"data_parallel_size x tensor_parallel_size x "
                                         r"pipeline_parallel_size = 4 workers on this node, "
                                         r"but it has 2 CUDA devices"):
        recorded_config(data_parallel_size=2, tensor_parallel_size=2)
    assert recorded_config(data_parallel_size=2).device_type == "cuda"  # 2 fit
