"""One torch.distributed world across data-parallel replicas (expert parallelism).

Each replica's executor starts its own TP x PP workers; for an expert-parallel
group that spans the replicas (DP x TP ranks) they must share one world.  The
workers of such a layout join it only when the driver asks
(``ModelWorker.join_data_parallel``), once every replica's workers exist, at
one rendezvous the driver picked::

    global rank = dp_rank x (TP x PP) + rank in the replica
    world       = DP x TP x PP, groups built with data_parallel_size = DP

so the TP and PP groups stay within a replica, the DP group links the ranks
of the same (PP, TP) place in every replica, and the EP group is every
replica's TP ranks of one stage.
"""

from __future__ import annotations

from typing import Any


def join_replica_world(context: Any, init_method: str) -> tuple[Any, Any, Any, Any]:
    """Join the world of every replica; this rank's (TP, PP, EP, DP) groups."""
    from mpexec import distributed

    parallel = context.config.parallel
    dp_rank, dp_size = parallel.data_parallel_rank, parallel.data_parallel_size
    world = context.world_size
    distributed.init_distributed_environment(
        world_size=dp_size * world, rank=dp_rank * world + context.rank,
        local_rank=dp_rank * context.local_world_size + context.local_rank,
        distributed_init_method=init_method, backend=context.backend)
    distributed.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel_size,
        decode_context_model_parallel_size=parallel.decode_context_parallel_size,
        data_parallel_size=dp_size, enable_expert_parallel=True)
    distributed.setup_proc_title_and_log_prefix()
    return (distributed.get_tp_group(), distributed.get_pp_group(), distributed.get_ep_group(),
            distributed.get_dp_group())
