"""Building an engine from :class:`~mpexec.engine.llm.LLM`'s arguments.

::

    LLM(model, ...) ── EngineArgs ──► build_engine(args) ──► BuiltEngine(engine, tokenizer,
      │                                                                  vocab_size)
      │ _plan: every check before any process starts (numbers, device, layout
      │   against the node's devices, quantization, speculative and KV-transfer
      │   settings; the model's path, context length and experts, from its
      │   config, read here once), then one ExecutorConfig per data parallel
      │   replica
      │ one executor per replica (the workers start first: the driver has no
      │   threads yet, so they can be forked); then every replica's workers
      │   join one world (join_data_parallel), so the DP group spans them:
      │   always with experts across the replicas (which then step in
      │   lockstep), for dense replicas unless replica_restart (_shares_world),
      │   where the front end forms a DP group outside the replicas' worlds
      │   instead, by generation (DpGroupSpec, mpexec.models.dp_world)
      │ checkpoint_tokenizer(path, config): the tokenizer, in the driver; the
      │   EOS ids and context length from the config _plan read
      ▼
    Engine(executor, limits, eos) per replica -> KV cache sized; one replica
    without replica_restart: that Engine, else a DataParallelEngine over them
    (with a factory that rebuilds replicas from the same configs, whose
    start-ups the front end's shutdown() cancels)

Whatever fails on the way, every executor started so far is shut down
before the error reaches the caller.

Several nodes: on the leader (node 0), with ``data_parallel_size=N`` as
well, every replica's engine runs here: one executor per replica, over the
nodes of that replica (``nnodes / N`` of them, or one node shared by ``N /
nnodes`` replicas); a replica with no rank on node 0 is driven from here by
an executor with no local worker (``ParallelConfig.remote_replica``), and
its nodes dial ``master_port + its DP rank``.  Follower nodes open the
checkpoint at the same path (or fetch a named model themselves).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mpexec.config import (
    ExecutorConfig,
    ParallelConfig,
    SchedulerConfig,
    config_object,
    distributed_backend_for,
)
from mpexec.engine.dp import DataParallelEngine, DpGroupSpec
from mpexec.engine.engine import Engine
from mpexec.engine.scheduler import SchedulerLimits
from mpexec.engine.validation import check_int
from mpexec.envs import load_envs
from mpexec.executor import Executor
from mpexec.models.ngram import SpeculativeConfig
from mpexec.system.procs import usable_cpus

if TYPE_CHECKING:
    from mpexec.models.config import ModelConfig

MODEL_WORKER = "mpexec.models.worker:ModelWorker"
CPU_WORKERS_PER_CPU = 4  # CPU workers (and intra-op threads) one usable CPU may carry
MIN_CPU_WORKER_CAP = 16  # ... but a small machine may still run a 16-worker layout
logger = logging.getLogger(__name__)

Message = dict[str, str]


class TokenizerLike(Protocol):
    """What the LLM needs of a tokenizer (``mpexec.models.tokenizer.Tokenizer`` has it)."""

    eos_token_ids: Sequence[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message],
                            add_generation_prompt: bool = True) -> list[int]: ...


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """``LLM``'s arguments, as given (their defaults and meaning: :class:`LLM`);
    ``executor_fields``: its extra keywords, fields of ``ExecutorConfig``."""

    model: str | os.PathLike[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    prefill_context_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    replica_restart: bool
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    executor_backend: str | type
    dtype: str
    quantization: str
    seed: int
    async_scheduling: bool
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    kv_transfer_config: dict[str, Any] | str | None
    speculative_config: dict[str, Any] | str | None
    kv_cache_memory_bytes: int | None
    device: str
    distributed_backend: str
    num_threads: int | None
    worker_cls: str | type
    worker_kwargs: dict[str, Any] | None
    tokenizer: TokenizerLike | str | os.PathLike[str] | None
    eos_token_ids: Sequence[int] | None
    executor_fields: dict[str, Any]

    @property
    def is_model_worker(self) -> bool:
        return self.worker_cls == MODEL_WORKER

    @property
    def namespace(self) -> str:
        """What a cached or transferred KV block's key names the model by."""
        return f"{self.model}|{self.dtype}|{self.quantization}"


@dataclass
class BuiltEngine:
    """What ``LLM`` keeps: the engine (or the replicas' front end) and the
    tokenizer prompts are encoded and outputs decoded with."""

    engine: Engine | DataParallelEngine
    tokenizer: TokenizerLike
    vocab_size: int | None


@dataclass
class _Plan:
    """What the checks settled, before any process starts."""

    replica_configs: list[ExecutorConfig]  # one per data parallel replica
    join: bool  # the replicas' workers join one world (the DP group spans them)
    lockstep: bool  # experts across replicas: the replicas step together
    detached_dp: bool  # dense replicas with replica_restart: a DP group outside each world
    path: Any  # the checkpoint (the model worker only)
    model_config: ModelConfig | None  # read once, by _check_model (the model worker only)
    connector: dict[str, Any] | None  # the completed kv_transfer_config
    speculative: SpeculativeConfig | None
    vocab_size: int | None


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Check ``args``, start the workers of every replica and build the engine
    over them (see the module docstring); nothing is left running on failure."""
    plan = _plan(args)
    executors: list[Executor] = []
    try:
        for config in plan.replica_configs:
            executors.append(Executor.get_class(config)(config))
        if plan.join:
            _join_replicas(executors, args.master_addr)
        tokenizer, eos, limits = _front(args, plan)
        engines = [Engine(executor, limits, eos, tokenizer=tokenizer,
                          vocab_size=plan.vocab_size) for executor in executors]
        engine: Engine | DataParallelEngine
        if args.data_parallel_size == 1 and not args.replica_restart:
            engine = engines[0]
        else:
            def rebuild(ranks: list[int], cancel: threading.Event) -> list[Engine]:
                # with experts across replicas: every replica, joined again (with
                # replica_restart, dense replicas keep a world each: _shares_world)
                started: list[Executor] = []
                try:
                    for rank in ranks:
                        config = plan.replica_configs[rank]
                        # shutdown() does not wait for a start that waits for a node
                        executor = Executor.get_class(config)(config, cancel=cancel)
                        started.append(executor)
                    if plan.lockstep:
                        _join_replicas(started, args.master_addr)
                    return [Engine(executor, limits, eos, tokenizer=tokenizer,
                                   vocab_size=plan.vocab_size) for executor in started]
                except BaseException:
                    for executor in started:
                        executor.shutdown()
                    raise

            timeout_s = plan.replica_configs[0].check_health_timeout_s
            engine = DataParallelEngine(
                engines, restart=args.replica_restart, factory=rebuild, lockstep=plan.lockstep,
                dp_group=DpGroupSpec(args.master_addr, timeout_s) if plan.detached_dp else None)
    except BaseException:
        for executor in executors:
            executor.shutdown()
        raise
    return BuiltEngine(engine, tokenizer, plan.vocab_size)


def _plan(args: EngineArgs) -> _Plan:
    """Every check, then the replicas' executor configs; no process starts."""
    _check_arguments(seed=args.seed, max_model_len=args.max_model_len,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     block_size=args.block_size,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     num_threads=args.num_threads)
    is_model_worker = args.is_model_worker
    device_type = _device_type(args.device) if is_model_worker else "cpu"
    dp = args.data_parallel_size
    if args.nnodes > 1 and not args.master_port:
        raise ValueError("nnodes > 1 needs master_port: the port follower nodes dial "
                         "(each data parallel replica's nodes: master_port + its rank)")
    if dp > 1 and args.kv_transfer_config is not None:
        raise ValueError("kv_transfer_config with data_parallel_size > 1 is not supported")
    ep_across = args.enable_expert_parallel and dp > 1
    if ep_across and (args.pipeline_parallel_size > 1 or args.async_scheduling):
        raise ValueError("enable_expert_parallel with data_parallel_size > 1 steps the "
                         "replicas in lockstep: it needs pipeline_parallel_size=1 and "
                         "async_scheduling=False")
    shared = _shares_world(args)
    detached = dp > 1 and args.replica_restart and args.is_model_worker and not shared
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        data_parallel_size=dp, enable_expert_parallel=args.enable_expert_parallel,
        nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        backend=distributed_backend_for(device_type, args.distributed_backend),
        shared_dp_world=shared, detached_dp_group=detached)
    # One parallel config per data parallel replica: a replica none of whose
    # nodes is this one (node 0) is driven from here with no local worker.
    replica_parallel = [_replica_parallel(parallel, rank) for rank in range(dp)]
    if any(p.remote_replica for p in replica_parallel) and args.executor_backend != "mp":
        raise ValueError("data parallel replicas on other nodes need executor_backend "
                         f"'mp' (its follower nodes); got {args.executor_backend!r}")
    world = sum(p.local_world_size for p in replica_parallel)  # the workers of this node
    cpus = usable_cpus()
    if device_type == "cpu" and is_model_worker and world > cpus:
        # Any layout runs (slowly) on any machine: share the CPUs, one
        # intra-op thread per worker, rather than refuse.
        on_node = f" on this node (of {parallel.world_size})" if args.nnodes > 1 else ""
        logger.warning(
            "%d CPU workers%s (data x tensor x pipeline x prefill context parallel sizes) "
            "on %d usable CPU(s): the workers share the CPUs, one intra-op thread each, and "
            "run slower than on %d CPUs", world, on_node, cpus, world)
    _check_devices(world, device_type, is_model_worker)
    if is_model_worker:  # a typo fails here, not in every worker
        from mpexec.models.quantization import check_quantization
        from mpexec.models.worker import DTYPES

        check_quantization(args.quantization)
        if args.dtype != "auto" and args.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}; "
                             f"got {args.dtype!r}")
    speculative = _speculative(args.speculative_config, parallel, is_model_worker)
    connector = _kv_transfer(args.kv_transfer_config, args.namespace, args.block_size,
                             parallel.world_size)
    executor_fields = dict(args.executor_fields)
    if connector is not None:
        if not is_model_worker:
            raise ValueError("kv_transfer_config needs the model worker (worker_cls)")
        if args.decode_context_parallel_size > 1 or args.prefill_context_parallel_size > 1:
            raise ValueError("kv_transfer_config does not support context parallelism "
                             "(decode/prefill_context_parallel_size > 1)")
        # every worker's finished transfers, merged: not only the output rank's reply
        executor_fields["aggregate_kv_outputs"] = True
    path = None
    model_config: ModelConfig | None = None
    vocab_size: int | None = getattr(args.tokenizer, "vocab_size", None)
    num_threads = args.num_threads
    if is_model_worker:
        path = _resolve(args.model)
        # Before any worker starts: a path that is no model, or a context
        # longer than the model's, fails here in one line.
        model_config = _check_model(path, args.max_model_len, args.tensor_parallel_size,
                                    args.pipeline_parallel_size)
        vocab_size = int(model_config.vocab_size)
        if args.enable_expert_parallel:
            _check_experts(model_config, path, args.tensor_parallel_size * dp)
        if num_threads is None and device_type == "cpu":
            num_threads = max(1, cpus // world)
        # Follower nodes open the checkpoint at the same path; a named model
        # ("default", …) travels as it is, so each node fetches (or finds) its own copy.
        model = str(args.model)
        spec = model if args.nnodes > 1 and _is_named_model(model) else str(path)
        kwargs: dict[str, Any] = {
            "model": spec, "dtype": args.dtype, "quantization": args.quantization,
            "block_size": args.block_size,
            "max_model_len": args.max_model_len,  # None: the checkpoint's
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "seed": args.seed,
            "num_threads": num_threads, "kv_transfer_config": connector,
            "speculative_config": speculative.to_dict() if speculative else None,
        }
        kwargs.update(args.worker_kwargs or {})
        executor_fields.setdefault("omp_num_threads", num_threads)
    else:
        if args.tokenizer is None:
            raise ValueError("worker_cls other than the model worker needs a tokenizer")
        if args.max_model_len is None:
            raise ValueError("worker_cls other than the model worker needs max_model_len")
        kwargs = dict(args.worker_kwargs or {})
    # after the model's own checks, which say more (a TP above its heads, say)
    _check_cpu_load(world, args.num_threads, cpus, device_type)
    config = ExecutorConfig.from_env(
        worker_cls=args.worker_cls, worker_kwargs=kwargs, parallel=parallel,
        scheduler=SchedulerConfig(async_scheduling=args.async_scheduling),
        executor_backend=args.executor_backend, device_type=device_type, **executor_fields)
    return _Plan(replica_configs=[_replica_config(config, p) for p in replica_parallel],
                 join=parallel.joins_replica_world, lockstep=ep_across,
                 detached_dp=detached, path=path, model_config=model_config,
                 connector=connector, speculative=speculative, vocab_size=vocab_size)


def _front(args: EngineArgs, plan: _Plan) -> tuple[TokenizerLike, tuple[int, ...],
                                                    SchedulerLimits]:
    """The tokenizer, the EOS ids and the scheduler's limits.  Called after the
    workers started: loading the tokenizer starts the tokenizer library's threads.
    The model's config is the one :func:`_plan` read; only the tokenizer is read here."""
    tokenizer = args.tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _load_tokenizer(tokenizer)
    assert not isinstance(tokenizer, (str, os.PathLike))
    eos_token_ids = args.eos_token_ids
    model_max_len = args.max_model_len
    if args.is_model_worker:
        config = plan.model_config
        assert config is not None
        if tokenizer is None:  # a tokenizer= given wins: the checkpoint may have none
            tokenizer = importlib.import_module("mpexec.models.loader").checkpoint_tokenizer(
                plan.path, config)
        if eos_token_ids is None:
            eos_token_ids = list(dict.fromkeys([*config.eos_token_ids,
                                                *tokenizer.eos_token_ids]))
        model_max_len = args.max_model_len or config.max_position_embeddings
    assert tokenizer is not None and model_max_len is not None
    eos = tuple(eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids)
    speculative = plan.speculative
    limits = SchedulerLimits(max_model_len=model_max_len,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_num_seqs=args.max_num_seqs,
                             # a block holds block_size tokens on each DCP rank
                             block_size=args.block_size * args.decode_context_parallel_size,
                             enable_prefix_caching=args.enable_prefix_caching,
                             prefix_cache_namespace=args.namespace,
                             kv_transfer_config=plan.connector,
                             num_speculative_tokens=speculative.num_speculative_tokens
                             if speculative else 0)
    return tokenizer, eos, limits


def _shares_world(args: EngineArgs) -> bool:
    """Whether the replicas' workers join one world, so that ``get_dp_group()``
    in a worker spans the replicas.

    Experts split across the replicas need it.  Dense replicas of the model
    worker get it too, except with ``replica_restart``: torch.distributed
    cannot add a rank to a running world, so a replica rebuilt alone could
    not rejoin its peers' world, and rebuilding every replica instead would
    stop the survivors that are meant to take the failed one's requests.
    There each dense replica keeps a world of its own and the DP group is a
    gloo group outside them, formed again by generation after each rebuild
    (``ParallelConfig.detached_dp_group``, ``mpexec.models.dp_world``).
    Other worker classes build no groups across the replicas.
    """
    dp = args.data_parallel_size
    if dp == 1:
        return False
    if args.enable_expert_parallel:
        return True
    if not args.is_model_worker:
        return False
    if args.replica_restart:
        logger.info("replica_restart: the %d dense data parallel replicas keep a "
                    "torch.distributed world each, so that a failed replica can be rebuilt "
                    "alone while the others serve; their DP group (get_dp_group() in a "
                    "worker) is formed outside those worlds, again after each rebuild", dp)
        return False
    return True


def _check_arguments(**values: Any) -> None:
    optional = ("max_model_len", "kv_cache_memory_bytes", "num_threads")
    for name, value in values.items():
        check_int(name, value, minimum=2 if name == "max_model_len" else
                  (0 if name == "seed" else 1), optional=name in optional)


def _check_cpu_load(workers: int, num_threads: int | None, cpus: int, device_type: str) -> None:
    """CPU workers may outnumber the CPUs (they share them), but not without
    bound: each is a process with its own torch and its share of the model, and
    a data_parallel_size of 1000 would fork until the machine gives out
    (``MPEXEC_MAX_CPU_WORKERS`` moves the bound).  The same for intra-op
    threads: OpenMP starts every one it is told to."""
    chosen = load_envs().max_cpu_workers
    cap = chosen or max(MIN_CPU_WORKER_CAP, CPU_WORKERS_PER_CPU * cpus)
    if device_type == "cpu" and workers > cap:
        why = "MPEXEC_MAX_CPU_WORKERS" if chosen else (
            f"{CPU_WORKERS_PER_CPU} per usable CPU, {cpus} usable, {MIN_CPU_WORKER_CAP} at "
            "least; MPEXEC_MAX_CPU_WORKERS=N allows N")
        raise ValueError(f"data x tensor x pipeline x prefill context parallel sizes = "
                         f"{workers} CPU workers on this node; at most {cap} start here "
                         f"({why})")
    thread_cap = CPU_WORKERS_PER_CPU * cpus
    if num_threads is not None and num_threads > thread_cap:
        raise ValueError(f"num_threads {num_threads} is more than {CPU_WORKERS_PER_CPU} "
                         f"intra-op threads per usable CPU ({cpus} usable): at most "
                         f"{thread_cap}")


def _check_model(path: Any, max_model_len: int | None, tp: int, pp: int) -> ModelConfig:
    """The model's config, read from ``path`` once for the whole start-up,
    after the checks each worker would make on its share, made once here
    before any worker starts: a ``max_model_len`` above the model's context, a
    TP size above its attention heads (or MLP rows, or vocabulary) or a PP
    size above its layers is one ValueError, not a fleet of workers that each
    fail (at a TP of 1000, a machine swamped by processes)."""
    config, _ = _open_model(path, with_tokenizer=False)
    limit = int(config.max_position_embeddings)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                         f"{limit} (max_position_embeddings of {path})")
    sharding = importlib.import_module("mpexec.models.sharding")
    sharding.pipeline_layers(int(config.num_hidden_layers), pp, None)
    sharding.rank_share(num_heads=int(config.num_attention_heads),
                        num_kv_heads=int(config.num_key_value_heads),
                        intermediate_size=int(config.intermediate_size),
                        vocab_size=int(config.vocab_size), layers=(0, 1),
                        tp_rank=0, tp_size=tp)
    return config


def _check_devices(workers: int, device_type: str, is_model_worker: bool) -> None:
    """One clear error for more CUDA workers than this node's devices (CPU workers
    may outnumber the CPUs: they share them, with a warning)."""
    if is_model_worker and device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if workers > gpus:
            raise ValueError(f"data_parallel_size x tensor_parallel_size x "
                             f"pipeline_parallel_size = {workers} workers on this node, but it "
                             f"has {gpus} CUDA devices: one worker needs one device")


def _replica_parallel(parallel: ParallelConfig, rank: int) -> ParallelConfig:
    """Data parallel rank ``rank``'s parallel config, as this node (0) drives it."""
    dp, nodes = parallel.data_parallel_size, parallel.nnodes
    first_node = rank * parallel.nnodes_within_dp if nodes >= dp else rank // (dp // nodes)
    return dataclasses.replace(parallel, data_parallel_rank=rank,
                               remote_replica=first_node != 0)


def _replica_config(config: ExecutorConfig, parallel: ParallelConfig) -> ExecutorConfig:
    """``config`` for one replica; a remote one keeps no per-local-worker lists
    (its workers are on the followers, which get this config)."""
    changes: dict[str, Any] = {"parallel": parallel}
    if parallel.remote_replica:
        if not isinstance(config.cpu_affinity, (str, type(None))):
            changes["cpu_affinity"] = None
        if not isinstance(config.omp_num_threads, (int, type(None))):
            changes["omp_num_threads"] = None
    return dataclasses.replace(config, **changes)


def _join_replicas(executors: list[Executor], host: str) -> None:
    """Every replica's workers join one world (``mpexec.models.dp_world``) and
    load the model, within the replicas' ``startup_timeout_s``.  The first
    replica that fails (a worker that died, or froze and was named by its
    executor's stall watch) is the error at once: its peers would wait for it
    in the rendezvous, and the caller shuts them down; so is a replica that
    has not joined in time (alive, but never arriving)."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    from mpexec.errors import WorkerStartupError, root_failure
    from mpexec.executor.spec import PortReservation

    timeout_s = executors[0].config.startup_timeout_s
    port = PortReservation(host, 0)
    try:
        futures = [e.collective_rpc("join_data_parallel", args=(port.init_method,),
                                    non_block=True) for e in executors]
        done, late = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        errors = [e for e in (f.exception() for f in done) if e is not None]
        if errors:
            raise root_failure(errors)
        if late:
            ranks = ", ".join(str(rank) for rank, f in enumerate(futures) if f in late)
            raise WorkerStartupError(
                f"DP replica(s) {ranks} did not join the replicas' world and load the "
                f"model within {timeout_s:g}s (startup_timeout_s)")
    finally:
        port.close()


def _check_experts(config: ModelConfig, path: Any, ep_size: int) -> None:
    """enable_expert_parallel: the checkpoint has experts, at least one per EP rank."""
    moe = getattr(config, "moe", None)
    if moe is None:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {path} "
                         "is dense")
    if moe.num_experts < ep_size:
        raise ValueError(f"the model has {moe.num_experts} experts, fewer than the expert "
                         f"parallel size {ep_size} (DP x TP ranks): a rank would hold none")


def _device_type(device: str) -> str:
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    return "cuda" if cuda_available() else "cpu"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch imported only when it may; see
    :mod:`mpexec.devices`)."""
    from mpexec.devices import cuda_available as visible

    return visible()


def _kv_transfer(raw: dict[str, Any] | str | None, namespace: str, block_size: int,
                 world_size: int) -> dict[str, Any] | None:
    """``kv_transfer_config`` (a dict or its JSON) completed with what the engine knows."""
    if raw is None:
        return None
    from mpexec.models.kv_connector import KVTransferConfig

    return KVTransferConfig.from_dict(config_object(raw, "kv_transfer_config"),
                                      namespace=namespace, block_size=block_size,
                                      world_size=world_size).to_dict()


def _speculative(raw: dict[str, Any] | str | None, parallel: ParallelConfig,
                 is_model_worker: bool) -> SpeculativeConfig | None:
    """``speculative_config`` (a dict or its JSON) checked, or None."""
    if raw is None:
        return None
    config = SpeculativeConfig.from_dict(raw)
    if not is_model_worker:
        raise ValueError("speculative_config needs the model worker (worker_cls)")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise ValueError("speculative_config does not support context parallelism "
                         "(decode/prefill_context_parallel_size > 1) yet")
    return config


def _is_named_model(model: str) -> bool:
    return model in importlib.import_module("mpexec.models.fetch").NAMED_MODELS


def _resolve(model: str | os.PathLike[str]) -> Any:
    fetch = importlib.import_module("mpexec.models.fetch")
    return fetch.resolve_model(str(model))


def _load_tokenizer(spec: str | os.PathLike[str]) -> Any:
    """A tokenizer from a checkpoint directory (tokenizer.json) or a .gguf file."""
    from pathlib import Path

    path = Path(spec)
    if not path.exists():
        raise ValueError(f"tokenizer={str(spec)!r}: no such file or directory")
    if path.is_file():
        return _open_model(path)[1]
    tokenizer_module = importlib.import_module("mpexec.models.tokenizer")
    return tokenizer_module.Tokenizer.from_hf_dir(path)


def _open_model(path: Any, with_tokenizer: bool = True) -> tuple[Any, Any]:
    """The checkpoint's config and tokenizer (None without ``with_tokenizer``)."""
    loader = importlib.import_module("mpexec.models.loader")
    with loader.open_checkpoint(path) as checkpoint:
        return checkpoint.config, checkpoint.tokenizer() if with_tokenizer else None
