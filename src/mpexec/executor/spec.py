"""Everything one worker process is given: :class:`WorkerSpec`.

The driver builds one frozen spec per worker and the child receives only
that (as the single argument of ``worker_main``), so the constructor
arguments of a worker are written down in exactly one place::

    driver                                     child
    ------                                     -----
    worker_contexts(config, init_method)  ->   WorkerSpec.context
    + broadcast handle, pipes, settings   ->   worker_main(spec)
                                                 worker_cls(spec.context, **worker_kwargs)

``worker_contexts`` is also what ``UniProcExecutor`` uses for its one
in-process worker, so every backend builds a :class:`WorkerContext` the same
way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.executor.context import WorkerContext
from mpexec.executor.ranks import global_start_rank, is_driver_worker, worker_name
from mpexec.executor.tracing import current_carrier
from mpexec.ipc import Handle
from mpexec.ipc.shm import SegmentRef
from mpexec.system import thread_vars
from mpexec.system.topology import allowed_cpus, numa_nodes, partition_cpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's start: who it is, what it attaches to, how it behaves."""

    context: WorkerContext
    broadcast_handle: Handle
    ready_pipe: Connection
    death_pipe: Connection
    driver_pid: int
    # Arm PR_SET_PDEATHSIG: only when the starting thread lives as long as
    # the driver (the signal follows the thread that created the child).
    parent_death_signal: bool
    trace: bool = False
    # The driver's start-up span (W3C traceparent) when tracing: the parent
    # of this worker's worker.start span.
    trace_parent: Mapping[str, str] | None = None
    # Descriptors a forked child inherited from its siblings' pipes.
    inherited_fds: tuple[int, ...] = ()
    cpu_affinity: tuple[int, ...] | None = None
    thread_env: Mapping[str, str] = field(default_factory=dict)
    # A worker on a follower node: its reply queue is served over the network
    # from this address, and cross-host frames use this secret.
    reply_connect_ip: str | None = None
    cluster_secret: str | None = field(default=None, repr=False)
    # A worker forked from the fork server inherits the server's environment,
    # not the driver's: the driver's (thread_env included) travels here.
    environ: Mapping[str, str] | None = field(default=None, repr=False)
    # The driver's heartbeat segment (``stall``): this worker stamps cell
    # ``heartbeat_index`` every ``heartbeat_s``; None: no heartbeat.
    heartbeat: SegmentRef | None = None
    heartbeat_index: int = 0
    heartbeat_s: float = 1.0

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def config(self) -> ExecutorConfig:
        return self.context.config


def init_method(host: str, port: int) -> str:
    """``tcp://host:port``, with an IPv6 host in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def worker_contexts(config: ExecutorConfig, distributed_init_method: str,
                    shared_worker_lock: Any = None) -> list[WorkerContext]:
    """The context of every worker this node runs, in local-rank order."""
    parallel = config.parallel
    start = global_start_rank(parallel)
    contexts = []
    for local_rank in range(parallel.local_world_size):
        rank = start + local_rank
        contexts.append(WorkerContext(
            config=config,
            rank=rank,
            local_rank=local_rank,
            rpc_rank=local_rank,
            world_size=parallel.world_size,
            local_world_size=parallel.local_world_size,
            distributed_init_method=distributed_init_method,
            backend=parallel.backend,
            device=f"cuda:{local_rank}" if config.device_type == "cuda" else "cpu",
            is_driver_worker=is_driver_worker(rank, parallel),
            shared_worker_lock=shared_worker_lock,
        ))
    return contexts


def local_cpu_sets(config: ExecutorConfig) -> list[list[int]] | None:
    """Every local worker's CPU set, in local-rank order (None: no pinning).

    ``cpu_affinity="auto"`` partitions this machine's usable CPUs among the
    node's workers, each inside one NUMA node (``mpexec.system.topology``).
    """
    if config.cpu_affinity is None:
        return None
    if isinstance(config.cpu_affinity, str):
        return partition_cpus(config.parallel.local_world_size, allowed_cpus(), numa_nodes())
    return [sorted(cpus) for cpus in config.cpu_affinity]


def spec_factories(config: ExecutorConfig, contexts: list[WorkerContext],
                   broadcast_handle: Handle, heartbeat: SegmentRef | None = None,
                   heartbeat_s: float = 1.0, **extra: Any) -> list[partial[WorkerSpec]]:
    """One ``WorkerSpec`` factory per context, for ``WorkerLauncher.start``
    (the launcher adds the pipes); ``heartbeat`` is the driver's heartbeat
    segment (cell = local rank); ``extra`` are further ``WorkerSpec`` fields."""
    # PR_SET_PDEATHSIG follows the thread that starts the child: arm it only
    # when that thread lives as long as the process.
    main_thread = threading.current_thread() is threading.main_thread()
    trace_parent = current_carrier() if config.trace else None
    cpu_sets = local_cpu_sets(config)  # "auto" is worked out once, on this node
    factories = []
    for ctx in contexts:
        threads = config.omp_threads_for(ctx.local_rank)
        cpus = None if cpu_sets is None else cpu_sets[ctx.local_rank]
        if threads is None and config.device_type == "cpu" and cpus is not None:
            threads = len(cpus)  # a pinned CPU worker: one thread per CPU of its own
        if threads is None and config.device_type == "cpu":
            env: dict[str, str] = {}  # CPU workers left to the user's environment
        else:
            env = thread_vars(threads, os.environ)
        if cpus is not None:
            _log_binding(ctx, cpus, env)
        factories.append(partial(
            WorkerSpec, context=ctx, broadcast_handle=broadcast_handle,
            driver_pid=os.getpid(), parent_death_signal=main_thread, trace=config.trace,
            trace_parent=trace_parent,
            cpu_affinity=None if cpus is None else tuple(cpus), thread_env=env,
            heartbeat=heartbeat, heartbeat_index=ctx.local_rank, heartbeat_s=heartbeat_s,
            **extra))
    return factories


def _log_binding(ctx: WorkerContext, cpus: list[int], env: Mapping[str, str]) -> None:
    from mpexec.system.topology import describe_cpus, numa_nodes

    threads = env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "unset"
    logger.info("%s is pinned to %s; OMP_NUM_THREADS=%s",
                worker_name(ctx.rank, ctx.config.parallel), describe_cpus(cpus, numa_nodes()),
                threads)


class PortReservation:
    """The rendezvous port of ``ParallelConfig`` (``master_port`` 0: pick one).

    Picking a free port by binding and closing a probe socket races with
    every other program that asks the kernel for a port.  Instead the probe
    stays bound, with ``SO_REUSEADDR``, until the workers are ready: while
    it is bound the kernel hands the port to no one else, and Linux still
    lets the rank-0 store bind and listen on it (``SO_REUSEADDR`` permits a
    second bind as long as the first socket is not listening).  ``close()``
    once the workers have joined.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self._probe: socket.socket | None = None
        if port == 0:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            probe = socket.socket(family, socket.SOCK_STREAM)
            try:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, 0))
            except OSError as exc:
                probe.close()
                raise OSError(exc.errno, f"cannot reserve a port on master_addr "
                                         f"{host!r}: {exc.strerror}") from exc
            port = probe.getsockname()[1]
            self._probe = probe
        self.port = port

    @property
    def init_method(self) -> str:
        return init_method(self.host, self.port)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
