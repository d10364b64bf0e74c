"""One torch.distributed world across data-parallel replicas.

Each replica's executor starts its own TP x PP x PCP workers.  When the DP
group must be real (experts split across the replicas, or dense replicas
whose front end asked for it: ``ParallelConfig.shared_dp_world``), they
must share one world.  The workers of such a layout join it only when the
driver asks (``ModelWorker.join_data_parallel``), once every replica's
workers exist, at one rendezvous the driver picked::

    global rank = dp_rank x (TP x PP x PCP) + rank in the replica
    world       = DP x TP x PP x PCP, groups built with data_parallel_size = DP

so the TP, PCP and PP groups stay within a replica, the DP group links the
ranks of the same (PP, PCP, TP) place in every replica, and with experts the
EP group is every replica's TP ranks of one stage.  Only expert parallelism
puts collectives across the replicas into a step (and so needs them in
lockstep); dense replicas keep stepping on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ReplicaGroups:
    """This rank's groups in the world of every replica (None: not in the layout)."""

    tp: Any
    pp: Any
    dp: Any
    ep: Any = None
    dcp: Any = None
    pcp: Any = None


def join_replica_world(context: Any, init_method: str) -> ReplicaGroups:
    """Join the world of every replica; this rank's groups."""
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
        prefill_context_model_parallel_size=parallel.prefill_context_parallel_size,
        decode_context_model_parallel_size=parallel.decode_context_parallel_size,
        data_parallel_size=dp_size, enable_expert_parallel=parallel.enable_expert_parallel)
    distributed.setup_proc_title_and_log_prefix()
    return ReplicaGroups(
        tp=distributed.get_tp_group(), pp=distributed.get_pp_group(),
        dp=distributed.get_dp_group(),
        ep=distributed.get_ep_group() if parallel.enable_expert_parallel else None,
        dcp=distributed.get_dcp_group() if parallel.decode_context_parallel_size > 1 else None,
        pcp=distributed.get_pcp_group() if parallel.prefill_context_parallel_size > 1 else None)
