"""Configuration of an executor: plain dataclasses, validated on construction.

Nothing here reads the environment.  ``ExecutorConfig.from_env`` is the one,
explicit place where the ``MPEXEC_*`` variables (parsed once by
:func:`mpexec.envs.load_envs`) become configuration.

Every validation error is a ``ValueError`` that names the fields involved and
the rule they broke, e.g. ``world_size (6) must equal tensor_parallel_size (2)
x pipeline_parallel_size (2) x prefill_context_parallel_size (1)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpexec.envs import Envs

START_METHODS = ("fork", "spawn", "forkserver")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD")
RAY_CALL_PATHS = ("shm", "ray")
DEVICE_TYPES = ("cuda", "cpu")
# What device_type may be given as: "auto" becomes "cuda" when torch sees a
# CUDA device, else "cpu" (ExecutorConfig.device_type is never "auto" after
# construction).
DEVICE_CHOICES = ("auto", *DEVICE_TYPES)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A chunk must hold its header and a small call; past 1 GiB a chunk is a
# typo, not a tuning (large payloads travel in bulk segments anyway).
MIN_CHUNK_BYTES = 1024
MAX_CHUNK_BYTES = 2**30
MAX_CHUNKS = 4096
# Each shutdown step waits at most this long (an hour): beyond it, a typo.
MAX_SHUTDOWN_STEP_S = 3600.0


DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")


def distributed_backend_for(device_type: str, requested: str = "auto") -> str:
    """The torch.distributed backend for workers on ``device_type``.

    ``"auto"``: NCCL for CUDA workers (their collectives run on the GPUs),
    gloo for CPU workers.  An explicit ``"gloo"`` or ``"nccl"`` is kept, except
    NCCL for CPU workers, which cannot work: a ValueError says so.
    """
    if requested not in DISTRIBUTED_BACKENDS:
        raise ValueError(f"distributed_backend must be one of {DISTRIBUTED_BACKENDS}; "
                         f"got {requested!r}")
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise ValueError(f"distributed_backend 'nccl' needs CUDA workers; the device is "
                         f"{device_type!r} (use 'gloo', or 'auto')")
    return requested


def config_object(raw: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """An option given as a dict or as its JSON text (a command-line flag),
    as the dict; ValueError naming the option ``name`` when the text is not
    JSON or not a JSON object."""
    value: Any = raw
    if isinstance(raw, str):
        import json

        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object; got {value!r}")
    return value


def _require_positive(owner: object, *names: str) -> None:
    for name in names:
        _require_int(name, getattr(owner, name), 1)


def _require_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """``value`` is an int (not a bool) in ``[lo, hi]``, or ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {bound}; got {value!r}")


def _require_seconds(name: str, value: Any, *, positive: bool, optional: bool = False,
                     most: float | None = None) -> None:
    """A finite number of seconds (> 0 or >= 0), or ValueError naming ``name``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite number of seconds{none}; got {value!r}")
    if (positive and value <= 0) or value < 0:
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}; got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most:g} s; got {value!r}")


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def _require_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string; got {value!r}")


@dataclass
class ParallelConfig:
    """How the workers of one executor divide the model.

    Ranks are laid out DP > PP > PCP > TP (TP varies fastest): global rank
    ``r`` has ``tp_rank = r % TP``, ``pcp_rank = (r // TP) % PCP`` and
    ``pp_rank = r // (TP * PCP) % PP``.  Decode context parallelism splits
    each TP group, so ``decode_context_parallel_size`` must divide
    ``tensor_parallel_size``.

    Several nodes: ``node_rank`` is the node this process runs on and
    ``data_parallel_rank`` the replica its executor drives; they must name
    the same place (``replica_nodes``).  The one exception is
    ``remote_replica``: the data parallel front end on node 0 drives a
    replica that lives wholly on follower nodes (node_rank 0, no local
    worker).  Each replica's follower nodes dial its node channel at
    ``node_port`` (``master_port + data_parallel_rank``).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # The torch.distributed backend the workers build their groups with.
    backend: str = "gloo"
    # Set by the data parallel front end on node 0 for a replica none of whose
    # ranks are on node 0: its executor starts no worker here and admits every
    # node of the replica as a follower.
    remote_replica: bool = False
    # Set by the data parallel front end: the workers of every replica join one
    # torch.distributed world of DP x (TP x PP x PCP) ranks when the driver
    # calls ``join_data_parallel`` (the model worker's), so the DP group spans
    # the replicas.  Experts split across replicas always join (whatever this
    # says); dense replicas join unless a failed one is to be rebuilt alone.
    shared_dp_world: bool = False
    # Set by the data parallel front end for dense replicas with
    # replica_restart: each replica keeps a world of its own (so a failed one
    # is rebuilt alone) and the DP group is a gloo group outside it, formed by
    # generation when the driver calls ``join_dp_group`` (mpexec.models.dp_world).
    detached_dp_group: bool = False

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "nnodes",
        )
        _require_int("data_parallel_rank", self.data_parallel_rank, 0)
        _require_int("node_rank", self.node_rank, 0)
        _require_bool("enable_expert_parallel", self.enable_expert_parallel)
        _require_bool("remote_replica", self.remote_replica)
        _require_bool("shared_dp_world", self.shared_dp_world)
        _require_bool("detached_dp_group", self.detached_dp_group)
        _require_str("master_addr", self.master_addr)
        _require_int("master_port", self.master_port, 0, 65535)
        _require_str("backend", self.backend)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({self.data_parallel_rank}) must be in "
                f"[0, data_parallel_size ({self.data_parallel_size}))"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank ({self.node_rank}) must be in [0, nnodes ({self.nnodes}))"
            )
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ValueError(
                f"decode_context_parallel_size ({self.decode_context_parallel_size}) must "
                f"divide tensor_parallel_size ({self.tensor_parallel_size})"
            )
        dp, nodes = self.data_parallel_size, self.nnodes
        if nodes >= dp and nodes % dp:
            raise ValueError(
                f"nnodes ({nodes}) must be a multiple of data_parallel_size ({dp}) "
                "when data parallel ranks span several nodes"
            )
        if nodes < dp and dp % nodes:
            raise ValueError(
                f"data_parallel_size ({dp}) must be a multiple of nnodes ({nodes}) "
                "when several data parallel ranks share a node"
            )
        if self.nnodes > 1 and self.master_port and \
                self.master_port + dp - 1 > 65535:
            raise ValueError(f"master_port ({self.master_port}) + data_parallel_size ({dp}) "
                             "- 1 must be a port: each replica's nodes dial master_port + "
                             "its data parallel rank")
        if self.remote_replica:
            if nodes == 1 or self.node_rank != 0 or 0 in self.replica_nodes:
                raise ValueError(
                    f"remote_replica drives, from node 0, a data parallel replica wholly on "
                    f"follower nodes; data_parallel_rank {self.data_parallel_rank} lives on "
                    f"node(s) {list(self.replica_nodes)} of nnodes={nodes} and this is "
                    f"node_rank {self.node_rank}")
        # The node and the data parallel rank name the same place: a replica
        # spanning nodes lives on the nodes of its block; several replicas on
        # one node are that node's block of DP ranks.
        elif nodes >= dp:
            replica = self.node_rank // (nodes // dp)
            where = (f"node_rank {self.node_rank} belongs to data parallel rank {replica} "
                     f"({nodes // dp} nodes per replica)")
            if replica != self.data_parallel_rank:
                raise ValueError(f"data_parallel_rank ({self.data_parallel_rank}) does not "
                                 f"match the node: with nnodes={nodes} and "
                                 f"data_parallel_size={dp}, {where}")
        elif self.data_parallel_rank // (dp // nodes) != self.node_rank:
            raise ValueError(
                f"data_parallel_rank ({self.data_parallel_rank}) does not match the node: "
                f"with nnodes={nodes} and data_parallel_size={dp}, node_rank "
                f"{self.node_rank} runs data parallel ranks "
                f"[{self.node_rank * (dp // nodes)}, {(self.node_rank + 1) * (dp // nodes)})")
        if self.world_size % self.nnodes_within_dp:
            raise ValueError(
                f"world_size ({self.world_size}) = tensor_parallel_size x "
                "pipeline_parallel_size x prefill_context_parallel_size must be divisible "
                f"by nnodes_within_dp ({self.nnodes_within_dp})"
            )

    @property
    def joins_replica_world(self) -> bool:
        """Whether the workers wait for ``join_data_parallel`` to build their
        groups, in one world with every other replica's (see ``shared_dp_world``)."""
        return self.data_parallel_size > 1 and (self.enable_expert_parallel
                                                or self.shared_dp_world)

    @property
    def world_size(self) -> int:
        """Workers in one data parallel rank: TP x PP x PCP."""
        return (
            self.tensor_parallel_size
            * self.pipeline_parallel_size
            * self.prefill_context_parallel_size
        )

    @property
    def nnodes_within_dp(self) -> int:
        """Nodes that one data parallel rank spans."""
        return max(1, self.nnodes // self.data_parallel_size)

    @property
    def node_rank_within_dp(self) -> int:
        """This node's index among the nodes of its data parallel rank."""
        return self.node_rank % self.nnodes_within_dp

    @property
    def local_world_size(self) -> int:
        """Workers this node runs for its data parallel rank (none for a
        ``remote_replica``)."""
        return 0 if self.remote_replica else self.world_size // self.nnodes_within_dp

    @property
    def replica_nodes(self) -> range:
        """The nodes data parallel rank ``data_parallel_rank`` runs on: its block
        of ``nnodes_within_dp`` nodes, or the one node it shares with others."""
        dp, nodes = self.data_parallel_size, self.nnodes
        if nodes >= dp:
            first = self.data_parallel_rank * self.nnodes_within_dp
            return range(first, first + self.nnodes_within_dp)
        node = self.data_parallel_rank // (dp // nodes)
        return range(node, node + 1)

    @property
    def follower_nodes(self) -> range:
        """The nodes whose workers this executor admits as followers (on node 0
        of its replica, or on node 0 for a ``remote_replica``): the replica's
        nodes other than this one."""
        nodes = self.replica_nodes
        if self.remote_replica:
            return nodes
        if self.node_rank != nodes.start:
            return range(0)  # a follower node: its executor lives elsewhere
        return range(nodes.start + 1, nodes.stop)

    @property
    def node_port(self) -> int:
        """Where this replica's follower nodes dial its node channel."""
        return self.master_port + self.data_parallel_rank if self.master_port else 0


@dataclass
class SchedulerConfig:
    """What the executor needs to know about the scheduler driving it."""

    # Overlap scheduling of step N+1 with execution of step N: workers send
    # replies from a separate thread and two batches may be in flight.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _require_bool("async_scheduling", self.async_scheduling)


@dataclass
class ExecutorConfig:
    """Everything an executor is built from.

    ``worker_cls`` is a class or a ``"module:Class"`` name; each worker is
    constructed as ``worker_cls(context, **worker_kwargs)`` with its
    :class:`mpexec.executor.WorkerContext` (ranks, sizes, rendezvous, device).
    """

    worker_cls: type | str
    worker_kwargs: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "uni", "mp", "ray", "module:Class", or an Executor subclass.
    executor_backend: str | type = "mp"
    # "auto" (CUDA when torch sees a device, else CPU; resolved on
    # construction), "cuda" or "cpu".  "cuda" workers get one OpenMP thread
    # each unless the user set OMP_NUM_THREADS; "cpu" workers may get their
    # own share (omp_num_threads).
    device_type: str = "auto"

    execute_model_timeout_s: float | None = 300.0
    check_health_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    # Termination: wait shutdown_grace_s after closing the death pipes, then
    # SIGTERM and wait shutdown_term_s, then SIGKILL.
    shutdown_grace_s: float = 4.0
    shutdown_term_s: float = 4.0

    mp_start_method: str = "fork"
    # One CPU set per local worker, applied in the child as it starts; or
    # "auto": the usable CPUs partitioned among the local workers, each
    # inside one NUMA node (mpexec.system.topology, applied by the executor).  A pinned CPU worker
    # without omp_num_threads gets one OpenMP thread per CPU of its set.
    cpu_affinity: Sequence[Sequence[int]] | str | None = None
    # CPU workers: OpenMP threads for every worker (int) or per local worker.
    omp_num_threads: int | Sequence[int] | None = None
    monitor_workers: bool = True
    # The monitor (and the start-up wait) name a local worker that stops
    # answering, whatever call it is in: stopped by a signal (state T in
    # /proc) for worker_stopped_timeout_s, or silent on its heartbeat (a
    # thread beside its busy main thread) for worker_stall_timeout_s: hung, or
    # holding the GIL in one C call that long.  None turns a check off.
    worker_stall_timeout_s: float | None = 60.0
    worker_stopped_timeout_s: float | None = 5.0

    mq_max_chunk_bytes: int = 512 * 1024
    mq_max_chunks: int = 8
    # How long a queue waiter polls (yielding the CPU) before it sleeps on a
    # futex: longer buys latency for back-to-back calls with CPU, 0 sleeps at once.
    mq_spin_s: float = 0.001
    # Build a KVOutputAggregator so that KV transfer completion is merged over
    # all workers (every worker replies to execute_model / sample_tokens).
    aggregate_kv_outputs: bool = False

    # Give the workers of one node a multiprocessing lock
    # (WorkerContext.shared_worker_lock); it lives in /dev/shm, so only on request.
    shared_worker_lock: bool = False

    # executor_backend "ray": the cluster to join (None: RAY_ADDRESS if set,
    # else a local Ray, stopped by the last executor that used it), how the
    # workers' placement group spreads over nodes, how long it may take to be
    # placed, and how calls travel ("shm": mpexec's shared-memory queues,
    # actors on the driver's node; "ray": actor calls).
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout_s: float = 60.0
    ray_call_path: str = "shm"

    # OpenTelemetry spans in this executor and its workers (not process-wide),
    # one trace across them; trace_exporter: "module:factory" of a SpanExporter
    # that the driver and every worker each build a TracerProvider around
    # (None: each process's own OpenTelemetry setup).  See executor.tracing.
    trace: bool = False
    trace_exporter: str | None = None
    log_level: str = "INFO"
    # Several nodes (parallel.nnodes > 1): the per-cluster secret every
    # cross-host frame is authenticated with (None: MPEXEC_CLUSTER_SECRET
    # through from_env, else the leader generates one); never in repr.
    cluster_secret: str | None = field(default=None, repr=False)
    # Several nodes: where this node binds the sockets its peers connect to.
    node_bind_addr: str = "127.0.0.1"
    # Several nodes: heartbeat period and the silence after which a peer is lost.
    node_heartbeat_s: float = 0.5
    node_timeout_s: float = 2.0
    # Several nodes: encrypt every cross-host socket with ZeroMQ's CURVE, keys
    # derived from cluster_secret (MPEXEC_CLUSTER_CURVE; followers need it too).
    cluster_curve: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.worker_cls, str) and ":" not in self.worker_cls:
            raise ValueError(
                f"worker_cls must be a class or 'module:Class'; got {self.worker_cls!r}"
            )
        if not isinstance(self.worker_cls, (str, type)):
            raise ValueError(
                f"worker_cls must be a class or 'module:Class'; got {self.worker_cls!r}")
        if self.mp_start_method not in START_METHODS:
            raise ValueError(
                f"mp_start_method must be one of {START_METHODS}; got {self.mp_start_method!r}"
            )
        if self.device_type not in DEVICE_CHOICES:
            raise ValueError(
                f"device_type must be one of {DEVICE_CHOICES}; got {self.device_type!r}")
        if self.device_type == "auto":
            from mpexec.devices import resolve_device_type

            self.device_type = resolve_device_type(self.device_type)
        if not isinstance(self.worker_kwargs, dict):
            raise ValueError(f"worker_kwargs must be a dict; got {self.worker_kwargs!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"parallel must be a ParallelConfig; got {self.parallel!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler must be a SchedulerConfig; got {self.scheduler!r}")
        if not isinstance(self.executor_backend, (str, type)):
            raise ValueError("executor_backend must be a name or an Executor subclass; got "
                             f"{self.executor_backend!r}")
        _require_seconds("execute_model_timeout_s", self.execute_model_timeout_s,
                         positive=True, optional=True)
        _require_seconds("check_health_timeout_s", self.check_health_timeout_s, positive=True)
        _require_seconds("startup_timeout_s", self.startup_timeout_s, positive=True)
        _require_seconds("worker_stall_timeout_s", self.worker_stall_timeout_s, positive=True,
                         optional=True)
        _require_seconds("worker_stopped_timeout_s", self.worker_stopped_timeout_s,
                         positive=True, optional=True)
        _require_seconds("shutdown_grace_s", self.shutdown_grace_s, positive=False,
                         most=MAX_SHUTDOWN_STEP_S)
        _require_seconds("shutdown_term_s", self.shutdown_term_s, positive=False,
                         most=MAX_SHUTDOWN_STEP_S)
        _require_int("mq_max_chunk_bytes", self.mq_max_chunk_bytes, MIN_CHUNK_BYTES,
                     MAX_CHUNK_BYTES)
        _require_int("mq_max_chunks", self.mq_max_chunks, 1, MAX_CHUNKS)
        _require_seconds("mq_spin_s", self.mq_spin_s, positive=False, most=1.0)
        if self.ray_address is not None:
            _require_str("ray_address", self.ray_address)
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}; "
                             f"got {self.ray_placement_strategy!r}")
        _require_seconds("ray_placement_timeout_s", self.ray_placement_timeout_s, positive=True)
        if self.ray_call_path not in RAY_CALL_PATHS:
            raise ValueError(f"ray_call_path must be one of {RAY_CALL_PATHS}; "
                             f"got {self.ray_call_path!r}")
        for name in ("monitor_workers", "aggregate_kv_outputs", "shared_worker_lock", "trace"):
            _require_bool(name, getattr(self, name))
        if self.trace_exporter is not None and (
                not isinstance(self.trace_exporter, str) or ":" not in self.trace_exporter):
            raise ValueError("trace_exporter must be 'module:factory' (a callable returning "
                             f"an OpenTelemetry SpanExporter) or None; got {self.trace_exporter!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}; got {self.log_level!r}")
        _require_str("node_bind_addr", self.node_bind_addr)
        _require_seconds("node_heartbeat_s", self.node_heartbeat_s, positive=True)
        _require_seconds("node_timeout_s", self.node_timeout_s, positive=True)
        if self.node_timeout_s <= self.node_heartbeat_s:
            raise ValueError(f"node_timeout_s ({self.node_timeout_s}) must exceed "
                             f"node_heartbeat_s ({self.node_heartbeat_s})")
        _require_bool("cluster_curve", self.cluster_curve)
        if self.cluster_secret is not None:
            _require_str("cluster_secret", self.cluster_secret)
            if len(self.cluster_secret.encode()) < 16:
                raise ValueError("cluster_secret must be at least 16 bytes")
        local = self.parallel.local_world_size
        if isinstance(self.cpu_affinity, str):
            if self.cpu_affinity != "auto":
                raise ValueError("cpu_affinity must be 'auto', one CPU set per local worker, "
                                 f"or None; got {self.cpu_affinity!r}")
        elif self.cpu_affinity is not None:
            if not isinstance(self.cpu_affinity, Sequence) or isinstance(self.cpu_affinity,
                                                                          str):
                raise ValueError(f"cpu_affinity must be one CPU set per local worker; got "
                                 f"{self.cpu_affinity!r}")
            if len(self.cpu_affinity) != local:
                raise ValueError(
                    f"cpu_affinity has {len(self.cpu_affinity)} CPU sets; it needs one per "
                    f"local worker (local_world_size = {local})"
                )
            for rank, cpus in enumerate(self.cpu_affinity):
                if not cpus:
                    raise ValueError(f"cpu_affinity[{rank}] is empty; give at least one CPU")
                for cpu in cpus:
                    _require_int(f"cpu_affinity[{rank}]", cpu, 0)
        threads = self.omp_num_threads
        if threads is not None:
            if not isinstance(threads, (int, Sequence)) or isinstance(threads, (bool, str)):
                raise ValueError("omp_num_threads must be an integer, one per local worker, "
                                 f"or None; got {threads!r}")
            counts = [threads] if isinstance(threads, int) else list(threads)
            if not isinstance(threads, int) and len(counts) != local:
                raise ValueError(
                    f"omp_num_threads has {len(counts)} entries; it needs one per local "
                    f"worker (local_world_size = {local}) or a single integer"
                )
            for count in counts:
                _require_int("omp_num_threads", count, 1)

    def omp_threads_for(self, local_rank: int) -> int | None:
        """OpenMP threads for one local worker (None: the accelerator default)."""
        threads = self.omp_num_threads
        if threads is None or isinstance(threads, int):
            return threads
        return threads[local_rank]

    def cpus_for(self, local_rank: int) -> list[int] | None:
        """The CPU set one local worker is pinned to, if any (an explicit list).

        ``"auto"`` is worked out from the machine that starts the workers, by
        the executor (``mpexec.executor.spec.cpu_sets``); here it is a
        ``ValueError``.
        """
        if self.cpu_affinity is None:
            return None
        if isinstance(self.cpu_affinity, str):
            raise ValueError("cpu_affinity 'auto' depends on the node that starts the "
                             "workers: see mpexec.executor.spec.cpu_sets(config)")
        return sorted(self.cpu_affinity[local_rank])

    @classmethod
    def from_env(cls, envs: Envs | None = None, **fields: Any) -> ExecutorConfig:
        """A config whose defaults come from ``MPEXEC_*`` (explicit fields win)."""
        from mpexec.envs import load_envs

        envs = envs if envs is not None else load_envs()
        defaults: dict[str, Any] = {
            "execute_model_timeout_s": envs.execute_model_timeout_s,
            "startup_timeout_s": envs.startup_timeout_s,
            "shutdown_grace_s": envs.shutdown_grace_s,
            "shutdown_term_s": envs.shutdown_grace_s,
            "mp_start_method": envs.worker_multiproc_method,
            "mq_max_chunk_bytes": envs.mq_max_chunk_bytes,
            "mq_max_chunks": envs.mq_max_chunks,
            "mq_spin_s": envs.mq_spin_s,
            "trace": envs.trace,
            "log_level": envs.logging_level,
            "cluster_secret": envs.cluster_secret,
            "ray_address": envs.ray_address,
            "cluster_curve": envs.cluster_curve,
        }
        return cls(**{**defaults, **fields})

    def replace(self, **changes: Any) -> ExecutorConfig:
        """A copy with ``changes`` applied (and validated again)."""
        return dataclasses.replace(self, **changes)
