"""Absurd ``LLM(...)`` arguments: each one ValueError naming the field, before any
worker process starts.

``multiprocessing``'s ``Process.start`` is made to fail the test for the whole
of each construction, so a refusal that came only after start-up (a dtype
typo failing in every worker, a data_parallel_size of 1000 forking until the
machine gave out) fails here instead of starting anything.
"""

from __future__ import annotations

import multiprocessing.process
from pathlib import Path
from typing import Any

import pytest

from mpexec.engine.llm import LLM
from mpexec.engine.startup import CPU_WORKERS_PER_CPU, MIN_CPU_WORKER_CAP
from mpexec.system.procs import usable_cpus

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

CAP = max(MIN_CPU_WORKER_CAP, CPU_WORKERS_PER_CPU * usable_cpus())


@pytest.mark.parametrize(("fields", "match"), [
    ({"block_size": -16}, "block_size must be >= 1"),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"max_model_len": 0}, "max_model_len must be >= 2"),
    ({"max_model_len": 10**12}, "max_model_len 1000000000000 exceeds the model's context"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be >= 1"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes must be >= 1"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be >= 1"),
    ({"num_threads": 0}, "num_threads must be >= 1"),
    ({"num_threads": 100_000}, "num_threads 100000 is more than"),
    ({"dtype": "int3"}, "dtype must be 'auto' or one of"),
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
    ({"data_parallel_size": -1}, "data_parallel_size must be an integer >= 1"),
    ({"data_parallel_size": 1000}, "1000 CPU workers on this node; at most"),
    ({"data_parallel_size": CAP + 1}, f"{CAP + 1} CPU workers on this node"),
    ({"data_parallel_size": CAP // 2 + 1, "tensor_parallel_size": 2}, "CPU workers on this"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1"),
    ({"pipeline_parallel_size": 4 + 1}, r"pipeline_parallel_size \(5\) exceeds"),
    ({"pipeline_parallel_size": 100_000}, r"pipeline_parallel_size \(100000\) exceeds"),
    ({"tensor_parallel_size": -2}, "tensor_parallel_size must be an integer >= 1"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"quantization": "nope"}, "quantization must be one of"),
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda'"),
    ({"speculative_config": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
])
def test_an_absurd_argument_is_one_value_error_before_any_worker(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any],
        match: str) -> None:
    def refuse(self: Any) -> None:
        raise AssertionError(f"a worker process ({self.name}) started for {fields}")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_checkpoint), **fields)


def test_unknown_vllm_options_are_refused_by_name(tiny_checkpoint: Path) -> None:
    """vLLM's gpu_memory_utilization / kv_cache_dtype are not options here: a TypeError
    naming them, before anything starts."""
    for name, value in (("gpu_memory_utilization", 5), ("kv_cache_dtype", "nonsense")):
        with pytest.raises(TypeError, match=name):
            LLM(str(tiny_checkpoint), **{name: value})


def test_the_cpu_worker_bound_is_the_users_to_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPEXEC_MAX_CPU_WORKERS replaces the default bound, either way."""
    from mpexec.engine.startup import _check_cpu_load

    monkeypatch.setenv("MPEXEC_MAX_CPU_WORKERS", str(CAP + 8))
    _check_cpu_load(CAP + 8, None, usable_cpus(), "cpu")  # allowed now
    monkeypatch.setenv("MPEXEC_MAX_CPU_WORKERS", "2")
    with pytest.raises(ValueError, match=r"3 CPU workers .* at most 2 start here "
                                         r"\(MPEXEC_MAX_CPU_WORKERS\)"):
        _check_cpu_load(3, None, usable_cpus(), "cpu")
    monkeypatch.delenv("MPEXEC_MAX_CPU_WORKERS")
    with pytest.raises(ValueError, match="MPEXEC_MAX_CPU_WORKERS=N allows N"):
        _check_cpu_load(CAP + 1, None, usable_cpus(), "cpu")
