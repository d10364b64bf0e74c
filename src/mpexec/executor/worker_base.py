"""The worker a user implements, and the wrapper the executors drive.

:class:`WorkerBase` is the protocol: every executor calls these methods by
name (``collective_rpc("execute_model", ...)``); the defaults make a trivial
worker work out of the box.  A worker does not have to inherit from it; any
class with the methods it is called with will do.

:class:`WorkerWrapperBase` sits between an executor and the worker: it is
created first (cheaply, knowing only its ranks), builds the configured worker
class from the :class:`WorkerContext` the driver made for it
(``init_worker_from_context``), and from then on forwards every attribute it
does not have itself to the worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mpexec.executor.context import WorkerContext

if TYPE_CHECKING:
    from mpexec.outputs import DraftTokenIds, GrammarOutput, SchedulerOutput


def resolve_class(spec: type | str, what: str = "class") -> type:
    """``spec`` itself, or the class a ``"module:Class"`` name points at."""
    if isinstance(spec, type):
        return spec
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"{what} must be a class or 'module:Class'; got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: {module_name} has no {qualname}") from None
    if not isinstance(obj, type):
        raise ValueError(f"{what} {spec!r} is not a class")
    return obj


class WorkerBase:
    """One model shard in one process (or in the driver, for UniProcExecutor).

    A worker may rely on: ``context`` (see :class:`WorkerContext` for what
    each field guarantees), ``config``, ``rank``, ``local_rank``,
    ``distributed_init_method``, ``is_driver_worker``, ``shared_worker_lock``
    (None unless ``ExecutorConfig.shared_worker_lock``), and ``kwargs``
    (``config.worker_kwargs``).  Its methods are called in lockstep on every
    worker, in call order, from the process's main thread.
    """

    def __init__(self, context: WorkerContext, **kwargs: Any) -> None:
        self.context = context
        self.config = context.config
        self.local_rank = context.local_rank
        self.rank = context.rank
        self.distributed_init_method = context.distributed_init_method
        self.is_driver_worker = context.is_driver_worker
        self.shared_worker_lock = context.shared_worker_lock
        self.kwargs = kwargs

    def init_device(self) -> None:
        """Claim the device and set up process groups (nothing by default)."""

    def load_model(self) -> None:
        """Load weights (nothing by default)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement execute_model")

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Any:
        return None

    def execute_dummy_batch(self) -> None:
        """Run a throw-away step (warm-up, filling pipeline bubbles)."""

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None

    def check_health(self) -> None:
        """Raise if this worker cannot serve; returning means healthy."""

    def shutdown(self) -> None:
        """Release the device and process groups (nothing by default)."""


class WorkerWrapperBase:
    """Builds the configured worker lazily and forwards attributes to it."""

    def __init__(self, rpc_rank: int = 0, global_rank: int | None = None) -> None:
        self.rpc_rank = rpc_rank
        self.global_rank = rpc_rank if global_rank is None else global_rank
        self.worker: Any = None

    def init_worker_from_context(self, context: WorkerContext) -> None:
        """Build the worker: ``worker_cls(context, **config.worker_kwargs)``.

        The driver (or ``UniProcExecutor``) builds the context; see
        ``mpexec.executor.spec.worker_contexts``.
        """
        config = context.config
        worker_cls = resolve_class(config.worker_cls, "worker_cls")
        self.worker = worker_cls(context, **config.worker_kwargs)

    def init_worker(self, all_kwargs: list[dict[str, Any]]) -> None:
        """Build the worker from ``all_kwargs[self.rpc_rank]``, whose ``"context"``
        entry is its :class:`WorkerContext` (the seed's list-of-kwargs form)."""
        context = all_kwargs[self.rpc_rank]["context"]
        if not isinstance(context, WorkerContext):
            raise TypeError(f"init_worker needs a WorkerContext; got {type(context).__name__}")
        self.init_worker_from_context(context)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def resolve(self, name: str) -> Any:
        """``getattr(self, name)``, minus the ``__getattr__`` detour (a caught
        AttributeError, a microsecond per call) for the worker's own methods."""
        own = self.__dict__.get("_own_names")
        if own is None:
            own = self.__dict__["_own_names"] = frozenset(dir(type(self)))
        if name in own or name in self.__dict__ or self.worker is None:
            return getattr(self, name)
        return getattr(self.worker, name)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the wrapper lacks.  Going through
        # __dict__ keeps this safe while the object is half-built (unpickling).
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r} (worker not initialised)"
            )
        return getattr(worker, name)
