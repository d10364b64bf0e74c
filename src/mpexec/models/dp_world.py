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

Dense replicas with ``replica_restart`` (``ParallelConfig.detached_dp_group``)
cannot share a world: torch.distributed cannot add a rank to a running
world, so a replica rebuilt after a failure could not rejoin it, and
rebuilding every replica's world would stop the survivors that take the
failed one's requests.  Each keeps a world of its own for its TP, PP and
PCP groups, and its DP group is a gloo group outside it
(``mpexec.distributed.detached``), formed by generation::

    driver (DataParallelEngine, between steps)     every replica's workers
    ─────────────────────────────────────────      ───────────────────────
    start-up: all replicas up ──► join_dp_group(host, port, g=0, timeout)
                                    retire the previous generation, then
                                    form g: one TCPStore at host:port
                                    (hosted by DP rank 0's rank 0), a
                                    ProcessGroupGloo per place under the
                                    prefix of (g, place); DP rank = group rank
    a replica fails ──► retire_dp_group(g) on the survivors: their DP
                        collectives raise StaleGroupError at once
    the rebuilt replica serves ──► join_dp_group(host, new port, g + 1, ...)
                                    on every replica, survivors included

The driver only calls these between steps (from the thread that steps), so
no step and no collective of a survivor's own world is in flight; the
survivors' TP and PP state is never touched.  Every wait is bounded by the
timeout: a replica that froze during ``join_dp_group`` is named by its
executor's stall watch (``WorkerStalledError``) and failed over like a dead
one, the others' joins end in ``DataParallelGroupError`` and they keep
serving with a retired group, and the next generation forms once the frozen
replica is rebuilt.  Until the first generation forms (and whenever the last
did not), ``get_dp_group()`` returns a group that raises ``StaleGroupError``,
never a group of one that would silently sum one replica.  Across nodes the
same holds: the store listens on ``master_addr`` (node 0, where DP rank 0's
rank 0 runs) and gloo connects the members wherever they are.
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


def install_unformed_dp_group(context: Any) -> None:
    """Before the first generation forms: a DP group whose collectives raise."""
    from mpexec import distributed
    from mpexec.distributed import DetachedGroup

    parallel = context.config.parallel
    distributed.set_dp_group(DetachedGroup.unformed(
        "dp", parallel.data_parallel_rank, parallel.data_parallel_size,
        "not formed yet: the driver forms it once every replica serves"))


def join_dp_generation(context: Any, host: str, port: int, generation: int,
                       timeout_s: float) -> Any:
    """Retire this worker's DP group and form generation ``generation`` of it
    (module docstring); the new group, also what ``get_dp_group()`` returns.
    On failure the retired group stays and the error (a
    ``DataParallelGroupError``) is raised."""
    from mpexec import distributed
    from mpexec.distributed import DetachedGroup
    from mpexec.distributed.detached import form_detached_group
    from mpexec.errors import DataParallelGroupError

    parallel = context.config.parallel
    dp_rank, dp_size = parallel.data_parallel_rank, parallel.data_parallel_size
    retire_dp_generation(generation, f"replaced by generation {generation}")
    try:
        group = form_detached_group(
            "dp", host=host, port=port, generation=generation, place=context.rank,
            rank=dp_rank, size=dp_size, host_store=dp_rank == 0 and context.rank == 0,
            timeout_s=timeout_s)
    except DataParallelGroupError as exc:
        distributed.set_dp_group(DetachedGroup.unformed(
            "dp", dp_rank, dp_size, f"generation {generation} did not form: {exc}",
            generation))
        raise
    distributed.set_dp_group(group)
    return group


def retire_dp_generation(before: int, reason: str) -> None:
    """Retire this worker's DP group if its generation is older than ``before``."""
    from mpexec import distributed
    from mpexec.distributed import DetachedGroup

    try:
        current = distributed.get_dp_group()
    except RuntimeError:  # no group at all: nothing to retire
        return
    if isinstance(current, DetachedGroup) and current.generation < before:
        current.retire(reason)


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
