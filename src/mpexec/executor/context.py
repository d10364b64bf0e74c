"""What one worker is told about itself: :class:`WorkerContext`.

The driver builds one context per worker and the worker's constructor
receives it (``worker_cls(context, **config.worker_kwargs)``).  It is frozen
and picklable, so the same object reaches a forked child, a spawned child or
an in-process worker (``UniProcExecutor``) unchanged.

A worker may rely on every field being set and consistent with
``config.parallel``:

- ``rank`` is the global rank (``0 <= rank < world_size``), ``local_rank``
  the index among the workers of this node (it picks the device), and
  ``rpc_rank`` the index of the worker's reply queue at the driver;
- ``world_size`` and ``local_world_size`` come from ``config.parallel``;
- ``distributed_init_method`` (``tcp://host:port``) and ``backend``
  (``gloo`` or ``nccl``) are what ``torch.distributed`` should be initialised
  with; every worker of one executor gets the same pair, and two executors on
  one machine never share a port;
- ``device`` is ``"cpu"`` or ``"cuda:<local_rank>"``;
- ``is_driver_worker`` is true for TP rank 0 of each TP group;
- ``shared_worker_lock`` is a lock shared by the workers of one node, or
  None when the executor was not asked for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpexec.executor.ranks import ParallelRanks, parallel_ranks

if TYPE_CHECKING:
    from mpexec.config import ExecutorConfig


@dataclass(frozen=True)
class WorkerContext:
    """One worker's place in the executor: ranks, sizes, rendezvous, device."""

    config: ExecutorConfig
    rank: int
    local_rank: int
    rpc_rank: int
    world_size: int
    local_world_size: int
    distributed_init_method: str
    backend: str
    device: str
    is_driver_worker: bool
    shared_worker_lock: Any = None

    @property
    def ranks(self) -> ParallelRanks:
        """This worker's rank in every parallel dimension."""
        return parallel_ranks(self.rank, self.config.parallel)
