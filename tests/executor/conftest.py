"""Helpers for the executor tests that start real worker processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.executor import MultiprocExecutor

WORKER = "tests.executor.workers:EchoWorker"


def make_config(tp: int = 2, pp: int = 1, **fields: Any) -> ExecutorConfig:
    fields.setdefault("worker_cls", WORKER)
    fields.setdefault("shutdown_grace_s", 2.0)
    fields.setdefault("shutdown_term_s", 2.0)
    fields.setdefault("startup_timeout_s", 30.0)
    return ExecutorConfig(
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp), **fields)


@pytest.fixture
def executor_factory() -> Iterator[Callable[..., MultiprocExecutor]]:
    """Builds executors and shuts every one of them down after the test."""
    made: list[MultiprocExecutor] = []

    def make(tp: int = 2, pp: int = 1, **fields: Any) -> MultiprocExecutor:
        executor = MultiprocExecutor(make_config(tp, pp, **fields))
        made.append(executor)
        return executor

    yield make
    for executor in made:
        executor.shutdown()
