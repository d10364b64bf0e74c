"""UniProcExecutor: the executor interface with one worker in this process.

No processes, no queues: ``collective_rpc`` calls the worker directly and
wraps the outcome the way MultiprocExecutor does (a worker exception becomes
a ``WorkerError`` with the original as ``__cause__``; ``non_block`` returns
an already completed Future).  The worker gets the same ``WorkerContext`` a
process worker would (``spec.worker_contexts``), with a ``threading.Lock``
as ``shared_worker_lock`` when the config asks for one.

``timeout=``: a call with a timeout runs on one long-lived helper thread
(always the same one, so thread-bound state such as a CUDA device stays put)
and the caller waits at most that long (``TimeoutError``, as with
processes); the call itself cannot be interrupted and keeps the worker until
it returns - later calls wait for it, in order.  Calls without a timeout run
in the caller's thread.  For tests, debugging and single-device use.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import PeerDeathSymptom, WorkerError
from mpexec.executor.abstract import Executor, check_call
from mpexec.executor.protocol import qualified_type_name
from mpexec.executor.spec import init_method, worker_contexts
from mpexec.executor.worker_base import WorkerWrapperBase
from mpexec.outputs import AsyncModelRunnerOutput, KVOutputAggregator


class UniProcExecutor(Executor):
    """Runs the single worker (world_size 1) in the calling process."""

    supports_pp = False

    def __init__(self, config: ExecutorConfig, *, cancel: threading.Event | None = None
                 ) -> None:
        super().__init__(config, cancel=cancel)  # its start waits for nothing to cancel
        self.driver_worker = WorkerWrapperBase(rpc_rank=0, global_rank=0)
        self.shared_worker_lock: Any = None
        # Held while the worker runs a call: one call at a time, in order.
        self._worker_busy = threading.Lock()
        self._timed_calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._timed_thread: threading.Thread | None = None
        self.lifecycle.at_teardown(self._end_worker)

    def _init_executor(self) -> None:
        parallel = self.parallel_config
        if parallel.world_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one worker; world_size is "
                f"{parallel.world_size} (use executor_backend='mp')")
        if self.config.shared_worker_lock:
            self.shared_worker_lock = threading.Lock()
        # Nothing rendezvouses with a single in-process worker: port 0 unless set.
        method = init_method(parallel.master_addr, parallel.master_port)
        context = worker_contexts(self.config, method, self.shared_worker_lock)[0]
        self.driver_worker.init_worker_from_context(context)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.lifecycle.mark_ready()
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
        if not self.lifecycle.usable:
            raise self.lifecycle.closed_error()
        check_call(args, kwargs, timeout, unique_reply_rank, 1)
        name = method if isinstance(method, str) else getattr(method, "__qualname__", "callable")
        started = time.perf_counter()
        future: Future[Any] = Future()

        def run() -> None:
            with self._worker_busy:
                self._run(method, name, args, kwargs or {}, unique_reply_rank,
                          kv_output_aggregator, future)

        if timeout is None:
            run()
        else:
            if self._timed_thread is None:
                self._timed_thread = threading.Thread(target=self._serve_timed, daemon=True,
                                                      name="UniProcTimedCalls")
                self._timed_thread.start()
            self._timed_calls.put(run)
            try:
                future.exception(timeout=timeout)
            except TimeoutError:
                self.call_stats.record(name, time.perf_counter() - started, False)
                error = TimeoutError(f"RPC call to {name} timed out after {timeout:g}s")
                if not non_block:
                    raise error from None
                failed: Future[Any] = Future()
                failed.set_exception(error)
                return failed
        self.call_stats.record(name, time.perf_counter() - started, future.exception() is None)
        return future if non_block else future.result()

    def _serve_timed(self) -> None:
        while True:
            run = self._timed_calls.get()
            if run is None:
                return
            run()

    def _run(self, method: str | Callable[..., Any], name: str, args: tuple[Any, ...],
             kwargs: dict[str, Any], unique_reply_rank: int | None,
             aggregator: KVOutputAggregator | None, future: Future[Any]) -> None:
        try:
            if isinstance(method, str):
                output = getattr(self.driver_worker, method)(*args, **kwargs)
            else:
                output = method(self.driver_worker, *args, **kwargs)
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()
        except (Exception, SystemExit) as exc:
            error = WorkerError(
                f"worker rank 0 raised {qualified_type_name(exc)} in {name}: {exc}",
                rank=0, pid=os.getpid(), method=name, exc_type=qualified_type_name(exc),
                remote_traceback="".join(traceback.format_exception(exc)),
                peer_death_symptom=isinstance(exc, PeerDeathSymptom))
            error.__cause__ = exc
            future.set_exception(error)
            return
        if aggregator is not None:
            output = aggregator.aggregate([output], 0)
        elif unique_reply_rank is None:
            output = [output]
        future.set_result(output)

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=self.config.check_health_timeout_s)

    def shutdown(self) -> None:
        """End the worker; idempotent, any thread (the lifecycle runs it once)."""
        self.lifecycle.close()

    def _end_worker(self) -> None:
        if self._timed_thread is not None:
            self._timed_calls.put(None)  # after whatever call it still runs
        self.driver_worker.shutdown()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
