"""Engines on the fake model worker, for the engine-loop tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig, SchedulerConfig
from mpexec.engine import Engine, SchedulerLimits

FAKE_WORKER = "tests.engine.fake_worker:FakeModelWorker"
EOS = (3,)


def fake_config(backend: str = "uni", tp: int = 1, pp: int = 1, async_scheduling: bool = False,
                **worker_kwargs: Any) -> ExecutorConfig:
    worker_kwargs.setdefault("block_size", 4)
    return ExecutorConfig(
        worker_cls=FAKE_WORKER, worker_kwargs=worker_kwargs,
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
        executor_backend=backend, device_type="cpu",
        shutdown_grace_s=2.0, shutdown_term_s=2.0, startup_timeout_s=60.0,
        execute_model_timeout_s=60.0)


def fake_limits(**fields: Any) -> SchedulerLimits:
    fields.setdefault("max_model_len", 128)
    fields.setdefault("max_num_batched_tokens", 32)
    fields.setdefault("max_num_seqs", 8)
    fields.setdefault("block_size", 4)
    return SchedulerLimits(**fields)


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """Starts engines on the fake worker; shuts every one down after the test."""
    made: list[Engine] = []

    def make(backend: str = "uni", tp: int = 1, pp: int = 1, async_scheduling: bool = False,
             limits: SchedulerLimits | None = None, **worker_kwargs: Any) -> Engine:
        config = fake_config(backend, tp, pp, async_scheduling, **worker_kwargs)
        engine = Engine.start(config, limits or fake_limits(), EOS)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
