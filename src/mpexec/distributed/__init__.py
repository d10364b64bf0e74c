"""Parallel groups on torch.distributed, with shared-memory collectives on one node.

Needs torch (the ``torch`` extra).  See ``parallel_state`` for a worker's
life cycle, ``layout`` for which ranks form each group, ``group`` for the
collectives, ``shm_collectives`` for the shared-memory path and
``detached`` for a group outside the world, rebuilt by generation.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - the torch extra is missing
    raise ImportError("mpexec.distributed needs torch: pip install 'mpexec[torch]' "
                      "(or -e '.[torch]' in a checkout)") from exc

from mpexec.distributed.detached import DetachedGroup
from mpexec.distributed.group import GroupCoordinator
from mpexec.distributed.liveness import PeerDiedInCollectiveError
from mpexec.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_dcp_group,
    get_dp_group,
    get_ep_group,
    get_pcp_group,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    parallel_worker_name,
    set_dp_group,
    setup_proc_title_and_log_prefix,
)
from mpexec.layout import ParallelLayout

__all__ = [
    "DetachedGroup",
    "GroupCoordinator",
    "ParallelLayout",
    "PeerDiedInCollectiveError",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_dcp_group",
    "get_dp_group",
    "get_ep_group",
    "get_pcp_group",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "parallel_worker_name",
    "set_dp_group",
    "setup_proc_title_and_log_prefix",
]
