"""UniProcExecutor: the executor interface with one worker in this process.

No processes, no queues: ``collective_rpc`` calls the worker directly and
wraps the outcome the way MultiprocExecutor does (a worker exception becomes
a ``WorkerError`` with the original as ``__cause__``; ``non_block`` returns
an already completed Future).  Timeouts are not enforced - there is no one to
interrupt the call.  For tests, debugging and single-device use.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import QueueClosedError, WorkerError
from mpexec.executor.abstract import Executor
from mpexec.executor.protocol import qualified_type_name
from mpexec.executor.worker_base import WorkerWrapperBase
from mpexec.outputs import AsyncModelRunnerOutput, KVOutputAggregator


class UniProcExecutor(Executor):
    """Runs the single worker (world_size 1) in the calling process."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.driver_worker = WorkerWrapperBase(rpc_rank=0, global_rank=0)
        self.shutting_down = False
        super().__init__(config)

    def _init_executor(self) -> None:
        if self.parallel_config.world_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one worker; world_size is "
                f"{self.parallel_config.world_size} (use executor_backend='mp')")
        self.driver_worker.init_worker([{
            "config": self.config,
            "local_rank": 0,
            "rank": 0,
            "distributed_init_method": "tcp://127.0.0.1:0",
            "is_driver_worker": True,
            "shared_worker_lock": None,
        }])
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self._post_init_executor()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        kv_output_aggregator: KVOutputAggregator | None = None,
    ) -> Any:
        if self.shutting_down:
            raise QueueClosedError("collective_rpc on an executor that is shut down")
        name = method if isinstance(method, str) else getattr(method, "__qualname__", "callable")
        started = time.perf_counter()
        future: Future[Any] = Future()
        try:
            if isinstance(method, str):
                output = getattr(self.driver_worker, method)(*args, **(kwargs or {}))
            else:
                output = method(self.driver_worker, *args, **(kwargs or {}))
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()
        except Exception as exc:
            error = WorkerError(
                f"worker rank 0 raised {qualified_type_name(exc)} in {name}: {exc}",
                rank=0, pid=os.getpid(), method=name, exc_type=qualified_type_name(exc),
                remote_traceback="".join(traceback.format_exception(exc)))
            error.__cause__ = exc
            future.set_exception(error)
        else:
            if kv_output_aggregator is not None:
                output = kv_output_aggregator.aggregate([output], 0)
            elif unique_reply_rank is None:
                output = [output]
            future.set_result(output)
        self.call_stats.record(name, time.perf_counter() - started, future.exception() is None)
        return future if non_block else future.result()

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        self.driver_worker.shutdown()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
