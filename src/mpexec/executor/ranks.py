"""Rank arithmetic: where a global rank sits in the parallel layout.

Ranks are laid out DP > PP > PCP > TP, TP varying fastest::

    tp_rank  = rank % TP
    pcp_rank = (rank // TP) % PCP
    pp_rank  = rank // (TP * PCP) % PP

Decode context parallelism splits each TP group (``dcp_rank = tp_rank %
DCP``), and expert parallelism spans DP x PCP x TP.  The driver worker of a
TP group is its TP rank 0; the rank that answers ``execute_model`` is the
first TP rank of the last pipeline stage (``world_size - TP x PCP``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpexec.config import ParallelConfig
from mpexec.layout import ParallelLayout
from mpexec.system import worker_process_name


@dataclass(frozen=True)
class ParallelRanks:
    """One worker's rank in every parallel dimension."""

    tp: int
    pcp: int
    pp: int
    dcp: int
    dp: int
    ep: int | None


def layout_of(parallel: ParallelConfig) -> ParallelLayout:
    """The sizes of every dimension (``mpexec.layout``), from the config."""
    return ParallelLayout(
        tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size,
        pcp=parallel.prefill_context_parallel_size,
        dcp=parallel.decode_context_parallel_size, dp=parallel.data_parallel_size,
        enable_ep=parallel.enable_expert_parallel)


def parallel_ranks(rank: int, parallel: ParallelConfig) -> ParallelRanks:
    """Where ``rank`` (a rank of this DP replica's executor) sits in the world."""
    world_rank = parallel.data_parallel_rank * parallel.world_size + rank
    at = layout_of(parallel).coordinates(world_rank)
    return ParallelRanks(tp=at["tp"], pcp=at["pcp"], pp=at["pp"], dcp=at["dcp"],
                         dp=at["dp"], ep=at["ep"] if parallel.enable_expert_parallel else None)


def worker_name(rank: int, parallel: ParallelConfig) -> str:
    """``Worker``, ``Worker_TP1``, ``Worker_PP1_TP0`` ... for process titles and logs."""
    r = parallel_ranks(rank, parallel)
    ep_size = layout_of(parallel).ep
    return worker_process_name(
        dp=(r.dp, parallel.data_parallel_size),
        pp=(r.pp, parallel.pipeline_parallel_size),
        pcp=(r.pcp, parallel.prefill_context_parallel_size),
        tp=(r.tp, parallel.tensor_parallel_size),
        dcp=(r.dcp, parallel.decode_context_parallel_size),
        ep=None if r.ep is None else (r.ep, ep_size),
    )


def is_driver_worker(rank: int, parallel: ParallelConfig) -> bool:
    return rank % parallel.tensor_parallel_size == 0


def output_rank(parallel: ParallelConfig) -> int:
    return parallel.world_size - (
        parallel.tensor_parallel_size * parallel.prefill_context_parallel_size
    )


def global_start_rank(parallel: ParallelConfig) -> int:
    """The global rank of this node's first worker."""
    return parallel.local_world_size * parallel.node_rank_within_dp
