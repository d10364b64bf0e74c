"""The executor interface every backend implements.

An ``Executor`` owns the workers of one model replica.  Callers build one from
an :class:`~mpexec.config.ExecutorConfig` (``Executor.get_class(config)``
picks the backend), drive it with ``collective_rpc`` and the step methods
built on it, and end it with ``shutdown()`` (or a ``with`` block).  A backend
implements ``_init_executor``, ``collective_rpc``, ``check_health`` and
``shutdown``; everything else is common.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from functools import cached_property
from types import TracebackType
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import WorkerStartupError
from mpexec.executor.lifecycle import FailureCallback, Lifecycle
from mpexec.executor.ranks import output_rank
from mpexec.executor.stats import CallStats, MethodStats
from mpexec.executor.termination import TerminationPolicy
from mpexec.outputs import (
    DraftTokenIds,
    GrammarOutput,
    KVOutputAggregator,
    ModelRunnerOutput,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

_BACKENDS = {
    "mp": "mpexec.executor.multiproc:MultiprocExecutor",
    "uni": "mpexec.executor.uniproc:UniProcExecutor",
    "ray": "mpexec.executor.ray:RayExecutor",
}


class _StartedOnConstruction(ABCMeta):
    """``SomeExecutor(config)`` constructs the executor, then calls its
    ``start()``: each ``__init__`` in the class chain stores its config and
    sets its attributes in the usual order, and no worker exists before all
    of them have run."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        executor = super().__call__(*args, **kwargs)
        executor.start()
        return executor


class Executor(metaclass=_StartedOnConstruction):
    """Runs the same calls on every worker and collects their replies."""

    # Whether this backend can run pipeline_parallel_size > 1 (its workers
    # run concurrent micro-batches); a backend says so itself.
    supports_pp: bool = False

    @staticmethod
    def get_class(config: ExecutorConfig) -> type[Executor]:
        """The Executor subclass ``config.executor_backend`` names.

        ``"mp"``, ``"uni"``, ``"ray"`` (needs the ``ray`` extra), a ``"module:Class"``
        name, or an Executor subclass itself.
        """
        backend = config.executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(
                    f"executor_backend must be an Executor subclass; got {backend.__qualname__}")
            return backend
        if not isinstance(backend, str):
            raise TypeError(
                f"executor_backend must be a name or an Executor subclass; got {backend!r}")
        spec = _BACKENDS.get(backend, backend)
        module_name, sep, qualname = spec.partition(":")
        if not sep:
            raise ValueError(
                f"unknown executor_backend {backend!r}: expected 'mp', 'uni', 'ray', "
                "'module:Class' or an Executor subclass")
        try:
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"executor_backend {backend!r} cannot be loaded: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"executor_backend {backend!r} is not an Executor subclass")
        return cls

    def __init__(self, config: ExecutorConfig, *, cancel: threading.Event | None = None
                 ) -> None:
        """``cancel``: an event another thread may set to end the start while it
        still waits (see :meth:`start`); a subclass passes it on."""
        if config.parallel.pipeline_parallel_size > 1 and not self.supports_pp:
            raise ValueError(
                f"{type(self).__qualname__} does not support pipeline parallelism "
                f"(pipeline_parallel_size = {config.parallel.pipeline_parallel_size}); "
                "use executor_backend 'mp' or 'ray'")
        self.config = config
        self.parallel_config = config.parallel
        self.scheduler_config = config.scheduler
        # One state machine for every backend: READY, CLOSED, FAILED, the first
        # failure and the failure callbacks (``lifecycle``).
        self.termination = TerminationPolicy(config.shutdown_grace_s, config.shutdown_term_s)
        self.lifecycle = Lifecycle(self.termination)
        self.kv_output_aggregator: KVOutputAggregator | None = (
            KVOutputAggregator(config.parallel.world_size)
            if config.aggregate_kv_outputs else None
        )
        self.call_stats = CallStats()
        self._started = False
        # Set from another thread: the start gives up (see start()).
        self.start_cancel = cancel

    def start(self) -> None:
        """Start the workers and wait until they are ready; raise (having cleaned
        up) if they cannot start.  ``SomeExecutor(config)`` calls it once every
        ``__init__`` of the class has run; calling it again does nothing.

        ``SomeExecutor(config, cancel=event)``: once another thread sets
        ``event``, a start that is still waiting (for follower nodes to join,
        for the Ray placement group, for workers to report READY, for the
        queue handshake) cleans up and raises ``WorkerStartupError``.  The
        ``mp`` and ``ray`` backends check it before they start anything and
        then at least every 50 ms while they wait for nodes, the placement
        group and workers (every 1.5 s in the handshake); the ``uni``
        backend's start (one worker, in this thread) waits for nothing and
        does not look at it.
        """
        if self._started:
            return
        self._started = True
        self._init_executor()

    def raise_if_start_cancelled(self) -> None:
        """``WorkerStartupError`` once ``start``'s ``cancel`` event is set."""
        if self.start_cancel is not None and self.start_cancel.is_set():
            raise WorkerStartupError("the executor's start-up was cancelled (its cancel "
                                     "event was set) before the workers were ready")

    def start_cancelled(self) -> bool:
        return self.start_cancel is not None and self.start_cancel.is_set()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers; raise (having cleaned up) if they cannot start."""

    def _post_init_executor(self) -> None:
        """Hook for subclasses: runs once the workers are ready."""

    # -- calls -----------------------------------------------------------------

    @abstractmethod
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
        """Run ``method`` on every worker.

        ``method`` is a worker method name, or a callable taking the worker as
        its first argument.  Returns one result per worker (a list in rank
        order), or the single result of ``unique_reply_rank`` / of the
        aggregator; with ``non_block`` a Future of that.
        """

    @property
    def output_rank(self) -> int:
        """The rank whose reply is the step's output (first TP rank, last stage)."""
        return output_rank(self.parallel_config)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        return self.collective_rpc(
            "execute_model",
            args=(scheduler_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=self.config.execute_model_timeout_s,
            kv_output_aggregator=self.kv_output_aggregator,
        )

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        return self.collective_rpc(
            "sample_tokens",
            args=(grammar_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=self.config.execute_model_timeout_s,
            kv_output_aggregator=self.kv_output_aggregator,
        )

    def execute_dummy_batch(self) -> None:
        self.collective_rpc("execute_dummy_batch", unique_reply_rank=self.output_rank,
                            timeout=self.config.execute_model_timeout_s)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        result: DraftTokenIds | None = self.collective_rpc(
            "take_draft_token_ids", unique_reply_rank=self.output_rank,
            timeout=self.config.execute_model_timeout_s)
        return result

    def check_health(self) -> None:
        """Raise unless every worker answers ``check_health`` in time."""
        self.collective_rpc("check_health", timeout=self.config.check_health_timeout_s)

    # -- failure and lifetime ------------------------------------------------------

    @property
    def is_failed(self) -> bool:
        """True once a worker died; every later call raises ``WorkerDiedError``."""
        return self.lifecycle.failed

    @property
    def failure(self) -> BaseException | None:
        """Why the executor failed: the first failure's error (a
        ``WorkerDiedError`` naming the rank, pid and signal), kept however
        long ago it happened; None while it has not failed."""
        return self.lifecycle.first_error

    @property
    def death_verdict_s(self) -> float:
        """The longest a collective's failure may precede this executor's
        verdict on the death behind it (see ``executor.verdict``)."""
        from mpexec.executor.verdict import death_verdict_s

        return death_verdict_s(self.config)

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback`` once when the executor fails (at once if it has).

        Callbacks add up: each one registered runs once, in the order they
        were registered.  A callback that raises is logged at ERROR; it never
        reaches the thread that noticed the failure, nor stops the others.
        """
        self.lifecycle.register_callback(callback)

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release everything; idempotent."""

    @cached_property
    def max_concurrent_batches(self) -> int:
        """Batches the scheduler may have in flight."""
        pp_size = self.parallel_config.pipeline_parallel_size
        if pp_size <= 1 and self.scheduler_config.async_scheduling:
            return 2
        return pp_size

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False

    def stats(self) -> dict[str, MethodStats]:
        """Per method: calls, failures and latency percentiles (p50/p90/p99)."""
        return self.call_stats.snapshot()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def check_call(args: Any, kwargs: Any, timeout: Any, unique_reply_rank: Any,
               world_size: int) -> None:
    """Refuse a malformed call before anything is broadcast (``TypeError``/``ValueError``)."""
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple; got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None; got {type(kwargs).__name__}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0 or None; "
                         f"got {timeout!r}")
    if unique_reply_rank is not None and (
            isinstance(unique_reply_rank, bool) or not isinstance(unique_reply_rank, int)
            or not 0 <= unique_reply_rank < world_size):
        raise ValueError(f"unique_reply_rank must be a rank in [0, {world_size - 1}] "
                         f"(world_size {world_size}) or None; got {unique_reply_rank!r}")
