"""The process-wide distributed state: the world and its parallel groups.

torch.distributed keeps one default process group per process, so the
groups built on it are per-process state too; this module owns it in one
object, ``_state``.  A worker's life::

    init_distributed_environment(world_size, rank, local_rank, init_method, backend)
        torch.distributed.init_process_group; the world group
    initialize_model_parallel(tp, pp, pcp, dcp, dp, enable_ep)
        every rank creates every group of every dimension, in the same order
        (torch requires it), keeping the ones it belongs to
    get_tp_group().all_reduce(x) ...
    destroy_model_parallel(); destroy_distributed_environment()

A data parallel group kept outside the world (``detached.DetachedGroup``,
rebuilt by generation while the world carries on) is installed with
:func:`set_dp_group`; ``get_dp_group()`` returns it from then on, world or
no world, and ``destroy_model_parallel`` retires it.

Both destroys are idempotent, and after them the process may initialise
again (a new world, e.g. with a fresh init method).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from mpexec.distributed.detached import DetachedGroup
from mpexec.distributed.group import DEFAULT_SHM_MAX_BYTES, GroupCoordinator
from mpexec.layout import DIMENSIONS, ParallelLayout
from mpexec.system import decorate_logs, set_process_title, worker_process_name

logger = logging.getLogger(__name__)

GROUP_TITLES = {"tp": "tensor parallel", "pp": "pipeline parallel",
                "pcp": "prefill context parallel", "dcp": "decode context parallel",
                "dp": "data parallel", "ep": "expert parallel"}


@dataclasses.dataclass(frozen=True)
class _EnvironmentArgs:
    world_size: int
    rank: int
    local_rank: int
    distributed_init_method: str
    backend: str


@dataclasses.dataclass
class _State:
    env: _EnvironmentArgs | None = None
    world: GroupCoordinator | None = None
    device: torch.device | None = None
    # The separate gloo world of an NCCL environment (for objects and CPU tensors).
    world_cpu_group: Any = None
    layout: ParallelLayout | None = None
    groups: dict[str, GroupCoordinator] = dataclasses.field(default_factory=dict)
    # Every subgroup this process created, to destroy them in order.
    process_groups: list[Any] = dataclasses.field(default_factory=list)
    # The data parallel group outside the world, when there is one (set_dp_group).
    detached_dp: DetachedGroup | None = None


_state = _State()


def _check_backend(backend: str) -> None:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "backend 'nccl' needs CUDA GPUs, and this torch "
                f"({torch.__version__}) sees none; use backend='gloo' for CPU workers "
                "(ParallelConfig(backend='gloo'))")
        if not dist.is_nccl_available():
            raise RuntimeError(
                f"backend 'nccl' is not built into this torch ({torch.__version__}); install "
                "a CUDA build of torch, or use backend='gloo'")
        return
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise RuntimeError(
            f"torch.distributed backend {backend!r} is not available in this torch "
            f"({torch.__version__}); use 'gloo' on CPU or 'nccl' on CUDA GPUs")


def init_distributed_environment(world_size: int = 1, rank: int = 0, local_rank: int = -1,
                                 distributed_init_method: str = "env://",
                                 backend: str = "gloo") -> None:
    """Join the world of ``world_size`` ranks as ``rank`` (torch.distributed).

    ``local_rank`` (default: ``rank``) picks the CUDA device with NCCL.
    Calling it again with the same arguments does nothing; with others it
    raises until :func:`destroy_distributed_environment` has run.
    """
    local_rank = rank if local_rank < 0 else local_rank
    args = _EnvironmentArgs(world_size, rank, local_rank, distributed_init_method, backend)
    if _state.env is not None:
        if _state.env == args:
            return
        raise RuntimeError(
            f"the distributed environment is already initialised with {_state.env}; call "
            f"destroy_distributed_environment() before initialising it with {args}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "torch.distributed was initialised outside mpexec.distributed; call "
            "torch.distributed.destroy_process_group() first, or use it as is")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size ({world_size}))")
    _check_backend(backend)
    if backend == "nccl":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, init_method=distributed_init_method,
                            world_size=world_size, rank=rank)
    world_group = dist.group.WORLD
    cpu_group = world_group if backend == "gloo" else dist.new_group(backend="gloo")
    _state.env = args
    _state.device = device
    _state.world_cpu_group = None if cpu_group is world_group else cpu_group
    _state.world = GroupCoordinator("world", list(range(world_size)), rank,
                                    device_group=world_group, cpu_group=cpu_group,
                                    device=device)
    logger.debug("rank %d of %d joined the world (%s, %s)", rank, world_size, backend,
                 distributed_init_method)


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              prefill_context_model_parallel_size: int = 1,
                              decode_context_model_parallel_size: int = 1,
                              data_parallel_size: int = 1,
                              enable_expert_parallel: bool = False, *,
                              use_shared_memory: bool = True,
                              shm_max_bytes: int = DEFAULT_SHM_MAX_BYTES) -> None:
    """Build the TP, PP, PCP, DCP, DP and EP groups (collective over the world).

    The world size must be DP x PP x PCP x TP (see ``layout``).
    ``use_shared_memory=False`` keeps CPU collectives on gloo.
    """
    if _state.env is None or _state.world is None:
        raise RuntimeError("initialize_model_parallel() needs the distributed environment: "
                           "call init_distributed_environment(...) first")
    layout = ParallelLayout(tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size,
                            pcp=prefill_context_model_parallel_size,
                            dcp=decode_context_model_parallel_size, dp=data_parallel_size,
                            enable_ep=enable_expert_parallel)
    if _state.layout is not None:
        if _state.layout == layout:
            return
        raise RuntimeError(f"model parallel groups already exist for {_state.layout}; call "
                           f"destroy_model_parallel() before building {layout}")
    layout.check_world_size(_state.env.world_size)
    rank, backend = _state.env.rank, _state.env.backend
    assert _state.device is not None
    # One pair of process groups per distinct set of ranks (DCP may equal TP,
    # EP may equal TP): fewer groups to create, the same on every rank.
    made: dict[tuple[int, ...], tuple[Any, Any]] = {}
    groups: dict[str, GroupCoordinator] = {}
    try:
        for dim in DIMENSIONS:
            for members in layout.groups(dim):
                key = tuple(members)
                if len(members) > 1 and key not in made:
                    made[key] = _new_group_pair(members, backend)
                if rank in members:
                    device_group, cpu_group = made.get(key, (None, None))
                    groups[dim] = GroupCoordinator(
                        dim, members, rank, device_group=device_group, cpu_group=cpu_group,
                        device=_state.device, use_shm=use_shared_memory,
                        shm_max_bytes=shm_max_bytes)
    except BaseException:
        for group in groups.values():
            group.close()
        _destroy_process_groups(made_pairs_list(made))
        raise
    _state.layout = layout
    _state.groups = groups
    _state.process_groups = made_pairs_list(made)


def made_pairs_list(made: dict[tuple[int, ...], tuple[Any, Any]]) -> list[Any]:
    out: list[Any] = []
    for device_group, cpu_group in made.values():
        for pg in (device_group, cpu_group):
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER and pg not in out:
                out.append(pg)
    return out


def _new_group_pair(members: list[int], backend: str) -> tuple[Any, Any]:
    # torch.distributed requires every rank of the world to create every
    # group, members or not; a non-member gets NON_GROUP_MEMBER back.
    device_group = dist.new_group(members, backend=backend)
    cpu_group = device_group if backend == "gloo" else dist.new_group(members, backend="gloo")
    return device_group, cpu_group


def _destroy_process_groups(groups: list[Any]) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    for pg in groups:
        try:
            dist.destroy_process_group(pg)
        except Exception as exc:  # a group whose peer died: nothing left to free
            logger.debug("destroying a process group failed: %s", exc)


def model_parallel_is_initialized() -> bool:
    return _state.layout is not None


def _group(dim: str) -> GroupCoordinator:
    group = _state.groups.get(dim)
    if group is None:
        raise RuntimeError(
            f"the {GROUP_TITLES[dim]} group is not initialised: call "
            "init_distributed_environment(...) and then initialize_model_parallel(...) first")
    return group


def get_world_group() -> GroupCoordinator:
    if _state.world is None:
        raise RuntimeError("the world group is not initialised: call "
                           "init_distributed_environment(...) first")
    return _state.world


def get_tp_group() -> GroupCoordinator:
    return _group("tp")


def get_pp_group() -> GroupCoordinator:
    return _group("pp")


def get_pcp_group() -> GroupCoordinator:
    return _group("pcp")


def get_dcp_group() -> GroupCoordinator:
    return _group("dcp")


def get_dp_group() -> GroupCoordinator | DetachedGroup:
    """The data parallel group: the one :func:`set_dp_group` installed, else the world's."""
    if _state.detached_dp is not None:
        return _state.detached_dp
    return _group("dp")


def set_dp_group(group: DetachedGroup | None) -> DetachedGroup | None:
    """Make ``group`` (outside the world) what :func:`get_dp_group` returns; None
    goes back to the world's.  Returns the one installed before (not retired:
    the caller decides)."""
    previous, _state.detached_dp = _state.detached_dp, group
    return previous


def get_ep_group() -> GroupCoordinator:
    """Expert parallel group; without expert parallelism each rank is alone in its own."""
    return _group("ep")


def destroy_model_parallel() -> None:
    """Release every parallel group (not the world); idempotent."""
    detached = set_dp_group(None)
    if detached is not None:
        detached.close()
    for group in _state.groups.values():
        group.close()
    _destroy_process_groups(_state.process_groups)
    _state.groups = {}
    _state.process_groups = []
    _state.layout = None


def destroy_distributed_environment() -> None:
    """Release the groups and leave torch.distributed; idempotent."""
    destroy_model_parallel()
    if _state.world is not None:
        _state.world.close()
    if _state.world_cpu_group is not None:
        _destroy_process_groups([_state.world_cpu_group])
    if dist.is_available() and dist.is_initialized() and _state.env is not None:
        dist.destroy_process_group()
    _state.env = None
    _state.world = None
    _state.world_cpu_group = None
    _state.device = None


def parallel_worker_name(dp: tuple[int, int] | None = None) -> str:
    """``Worker_PP1_TP0``-style name from this rank's groups (dimensions above one).

    ``dp`` (rank, size) names the data parallel replica when this world is one
    replica of several (each its own world, so its DP group is of one)."""
    def coords(dim: str) -> tuple[int, int]:
        group = _group(dim)
        return group.rank_in_group, group.world_size

    ep = coords("ep")
    return worker_process_name(dp=dp or coords("dp"), pp=coords("pp"), pcp=coords("pcp"),
                               tp=coords("tp"), dcp=coords("dcp"),
                               ep=ep if ep[1] > 1 else None)


def setup_proc_title_and_log_prefix(dp: tuple[int, int] | None = None) -> str:
    """Title this process and prefix its output with its group ranks; returns the name.

    The model worker calls it after :func:`initialize_model_parallel`.
    """
    name = parallel_worker_name(dp)
    set_process_title(name)
    decorate_logs(name)
    return name
