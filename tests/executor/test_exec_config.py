"""Configuration validation, environment parsing, rank arithmetic, backends."""

from __future__ import annotations

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig, SchedulerConfig, config_object
from mpexec.envs import Envs, load_envs
from mpexec.executor import Executor, MultiprocExecutor, UniProcExecutor
from mpexec.executor.ranks import (
    global_start_rank,
    is_driver_worker,
    output_rank,
    parallel_ranks,
    worker_name,
)

WORKER = "tests.executor.workers:EchoWorker"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"pipeline_parallel_size": -1}, "pipeline_parallel_size must be"),
        ({"nnodes": 2, "node_rank": 2}, r"node_rank \(2\) must be in \[0, nnodes \(2\)\)"),
        ({"tensor_parallel_size": 4, "decode_context_parallel_size": 3},
         "decode_context_parallel_size"),
        ({"tensor_parallel_size": 3, "nnodes": 2}, r"divisible by nnodes_within_dp \(2\)"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
        ({"nnodes": 3, "data_parallel_size": 2}, "multiple of data_parallel_size"),
        ({"nnodes": 4, "data_parallel_size": 2, "node_rank": 2, "data_parallel_rank": 0},
         r"node_rank 2 belongs to data parallel rank 1 \(2 nodes per replica\)"),
        ({"nnodes": 2, "data_parallel_size": 4, "node_rank": 1, "data_parallel_rank": 1},
         r"node_rank 1 runs data parallel ranks \[2, 4\)"),
        ({"master_port": 70000}, "master_port"),
        ({"master_port": "29500"}, "master_port must be an integer"),
        ({"master_addr": ""}, "master_addr must be a non-empty string"),
        ({"backend": None}, "backend must be a non-empty string"),
        ({"tensor_parallel_size": 2.0}, "tensor_parallel_size must be an integer"),
        ({"enable_expert_parallel": "no"}, "enable_expert_parallel must be True or False"),
    ],
)
def test_parallel_config_rejects(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_parallel_config_derived_sizes() -> None:
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                       prefill_context_parallel_size=2, nnodes=2, node_rank=1)
    assert p.world_size == 8
    assert p.nnodes_within_dp == 2
    assert p.node_rank_within_dp == 1
    assert p.local_world_size == 4
    assert global_start_rank(p) == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"worker_cls": "no_colon"}, "module:Class"),
        ({"mp_start_method": "thread"}, "mp_start_method"),
        ({"device_type": "tpu"}, "device_type"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be > 0"),
        ({"execute_model_timeout_s": -1}, "execute_model_timeout_s"),
        ({"shutdown_grace_s": -1}, "shutdown_grace_s"),
        ({"mq_max_chunks": 0}, "mq_max_chunks"),
        ({"mq_spin_s": -0.1}, "mq_spin_s must be"),
        ({"cpu_affinity": [[0]], "parallel": ParallelConfig(tensor_parallel_size=2)},
         "one per local worker"),
        ({"cpu_affinity": [[]]}, "cpu_affinity\\[0\\] is empty"),
        ({"omp_num_threads": [1, 2]}, "omp_num_threads has 2 entries"),
        ({"omp_num_threads": 0}, "omp_num_threads must be an integer >= 1"),
        # Every field up front: typed, finite, in range, named in the message.
        ({"shutdown_grace_s": float("nan")}, "shutdown_grace_s must be a finite number"),
        ({"shutdown_term_s": float("inf")}, "shutdown_term_s must be a finite number"),
        ({"shutdown_grace_s": "4"}, "shutdown_grace_s must be a finite number"),
        ({"shutdown_grace_s": 10**9}, "shutdown_grace_s must be at most"),
        ({"startup_timeout_s": float("nan")}, "startup_timeout_s must be a finite number"),
        ({"startup_timeout_s": float("inf")}, "startup_timeout_s must be a finite number"),
        ({"execute_model_timeout_s": float("nan")}, "execute_model_timeout_s"),
        ({"check_health_timeout_s": True}, "check_health_timeout_s"),
        ({"mq_max_chunk_bytes": 1}, r"mq_max_chunk_bytes must be an integer in \[1024"),
        ({"mq_max_chunk_bytes": 2**40}, "mq_max_chunk_bytes must be an integer in"),
        ({"mq_max_chunk_bytes": 4096.0}, "mq_max_chunk_bytes must be an integer"),
        ({"mq_max_chunks": 10**6}, "mq_max_chunks"),
        ({"mq_spin_s": float("nan")}, "mq_spin_s must be a finite number"),
        ({"monitor_workers": "yes"}, "monitor_workers must be True or False"),
        ({"trace": 1}, "trace must be True or False"),
        ({"shared_worker_lock": None}, "shared_worker_lock must be True or False"),
        ({"log_level": "LOUD"}, "log_level must be one of"),
        ({"worker_kwargs": [1]}, "worker_kwargs must be a dict"),
        ({"cpu_affinity": [["0"]]}, r"cpu_affinity\[0\] must be an integer"),
        ({"omp_num_threads": 2.5}, "omp_num_threads"),
        ({"worker_stall_timeout_s": 0}, "worker_stall_timeout_s must be > 0"),
        ({"worker_stall_timeout_s": float("inf")},
         "worker_stall_timeout_s must be a finite number of seconds or None"),
        ({"worker_stopped_timeout_s": -1}, "worker_stopped_timeout_s must be > 0"),
    ],
)
def test_executor_config_rejects(fields: dict, message: str) -> None:
    fields.setdefault("worker_cls", WORKER)
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(**fields)


def test_executor_config_per_worker_settings() -> None:
    config = ExecutorConfig(worker_cls=WORKER, parallel=ParallelConfig(tensor_parallel_size=2),
                            cpu_affinity=[[1, 0], {3}], omp_num_threads=[1, 2])
    assert config.cpus_for(0) == [0, 1]
    assert config.cpus_for(1) == [3]
    assert config.omp_threads_for(1) == 2
    assert ExecutorConfig(worker_cls=WORKER, omp_num_threads=4).omp_threads_for(0) == 4


def test_load_envs_defaults_and_values() -> None:
    assert load_envs({}) == Envs()
    envs = load_envs({
        "MPEXEC_EXECUTE_MODEL_TIMEOUT_SECONDS": "none",
        "MPEXEC_WORKER_MULTIPROC_METHOD": "spawn",
        "MPEXEC_MQ_MAX_CHUNK_BYTES": "1048576",
        "MPEXEC_MQ_MAX_CHUNKS": "4",
        "MPEXEC_MQ_SPIN_SECONDS": "0",
        "MPEXEC_LOGGING_LEVEL": "debug",
        "MPEXEC_TRACE": "1",
    })
    assert envs.execute_model_timeout_s is None
    assert envs.worker_multiproc_method == "spawn"
    assert envs.mq_max_chunk_bytes == 1 << 20
    assert envs.mq_max_chunks == 4
    assert envs.mq_spin_s == 0.0
    assert envs.logging_level == "DEBUG"
    assert envs.trace is True


@pytest.mark.parametrize(
    "environ",
    [
        {"MPEXEC_MQ_MAX_CHUNKS": "0"},
        {"MPEXEC_TRACE": "maybe"},
        {"MPEXEC_WORKER_MULTIPROC_METHOD": "threads"},
        {"MPEXEC_EXECUTE_MODEL_TIMEOUT_SECONDS": "soon"},
        {"MPEXEC_SHUTDOWN_GRACE_SECONDS": "nan"},
        {"MPEXEC_STARTUP_TIMEOUT_SECONDS": "inf"},
        {"MPEXEC_MQ_SPIN_SECONDS": "nan"},
    ],
)
def test_load_envs_names_the_bad_variable(environ: dict) -> None:
    (name,) = environ
    with pytest.raises(ValueError, match=name):
        load_envs(environ)


def test_from_env_applies_envs_and_explicit_fields_win() -> None:
    envs = Envs(execute_model_timeout_s=7.0, mq_max_chunks=3, worker_multiproc_method="spawn")
    config = ExecutorConfig.from_env(envs, worker_cls=WORKER, mq_max_chunks=5)
    assert config.execute_model_timeout_s == 7.0
    assert config.mp_start_method == "spawn"
    assert config.mq_max_chunks == 5


@pytest.mark.parametrize(
    ("tp", "pcp", "pp", "rank", "expected"),
    [
        (2, 1, 1, 1, (1, 0, 0)),
        (2, 1, 2, 2, (0, 0, 1)),
        (2, 2, 2, 5, (1, 0, 1)),
        (2, 2, 2, 6, (0, 1, 1)),
        (4, 1, 3, 11, (3, 0, 2)),
    ],
)
def test_parallel_ranks(tp: int, pcp: int, pp: int, rank: int,
                        expected: tuple[int, int, int]) -> None:
    p = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                       pipeline_parallel_size=pp)
    r = parallel_ranks(rank, p)
    assert (r.tp, r.pcp, r.pp) == expected


def test_worker_names_and_roles() -> None:
    assert worker_name(0, ParallelConfig()) == "Worker"
    assert worker_name(1, ParallelConfig(tensor_parallel_size=2)) == "Worker_TP1"
    pp_tp = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert worker_name(2, pp_tp) == "Worker_PP1_TP0"
    assert output_rank(pp_tp) == 2
    assert [is_driver_worker(r, pp_tp) for r in range(4)] == [True, False, True, False]
    assert output_rank(ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=4)) == 24
    ep = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    assert worker_name(1, ep) == "Worker_TP1_EP1"


def test_get_class() -> None:
    def config(backend: object) -> ExecutorConfig:
        return ExecutorConfig(worker_cls=WORKER, executor_backend=backend)  # type: ignore[arg-type]

    assert Executor.get_class(config("mp")) is MultiprocExecutor
    assert Executor.get_class(config("uni")) is UniProcExecutor
    assert Executor.get_class(config(UniProcExecutor)) is UniProcExecutor
    assert Executor.get_class(
        config("mpexec.executor.multiproc:MultiprocExecutor")) is MultiprocExecutor
    # Importing the Ray backend needs no Ray (it is imported when an executor starts).
    assert Executor.get_class(config("ray")).__name__ == "RayExecutor"
    with pytest.raises(ValueError, match="unknown executor_backend"):
        Executor.get_class(config("threads"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        Executor.get_class(config("no.such.module:Thing"))
    with pytest.raises(TypeError, match="not an Executor subclass"):
        Executor.get_class(config("mpexec.config:ParallelConfig"))
    with pytest.raises(TypeError, match="Executor subclass"):
        Executor.get_class(config(int))


def test_multinode_misconfigurations_are_refused_clearly() -> None:
    pytest.importorskip("zmq")
    config = ExecutorConfig(worker_cls=WORKER, parallel=ParallelConfig(
        tensor_parallel_size=2, nnodes=2))
    with pytest.raises(ValueError, match="master_port"):
        MultiprocExecutor(config)
    follower = ExecutorConfig(worker_cls=WORKER, parallel=ParallelConfig(
        tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=1))
    with pytest.raises(ValueError, match="follower node"):
        MultiprocExecutor(follower)


def test_max_concurrent_batches() -> None:
    def batches(pp: int, async_scheduling: bool) -> int:
        config = ExecutorConfig(worker_cls=WORKER, executor_backend="uni",
                                parallel=ParallelConfig(pipeline_parallel_size=pp),
                                scheduler=SchedulerConfig(async_scheduling=async_scheduling))
        # Only the arithmetic matters here: skip construction.
        executor = UniProcExecutor.__new__(UniProcExecutor)
        executor.parallel_config = config.parallel
        executor.scheduler_config = config.scheduler
        return executor.max_concurrent_batches

    assert batches(1, False) == 1
    assert batches(1, True) == 2
    assert batches(3, True) == 3


def test_config_object_takes_a_dict_or_its_json() -> None:
    assert config_object({"a": 1}, "opt") == {"a": 1}
    assert config_object('{"a": [1, 2]}', "opt") == {"a": [1, 2]}
    with pytest.raises(ValueError, match="opt is not valid JSON"):
        config_object("{a", "opt")
    for bad in ("[1]", "3", [1]):
        with pytest.raises(ValueError, match="opt must be a JSON object; got"):
            config_object(bad, "opt")  # type: ignore[arg-type]
