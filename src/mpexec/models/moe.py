"""Which experts (and which of their rows) a rank holds, and loading its share.

With ``R`` ranks in the group that runs the MoE blocks (the TP group of a
pipeline stage; with expert parallelism it is also the EP group):

- tensor parallel (default): every rank holds all ``E`` experts, rows
  ``split_evenly(moe_intermediate_size, R)[rank]`` of each expert's gate/up
  and the same columns of its down projection;
- expert parallel: rank ``r`` holds the whole experts
  ``split_evenly(E, R)[r]`` (uneven when ``R`` does not divide ``E``: the
  first ranks take one more), and no rank holds another's.

The router and the shared expert's gate are replicated; the shared expert
is split the tensor-parallel way in both cases.

Across data parallel replicas (``ep_group`` = every replica's TP ranks, in
DP x TP order) rank ``e`` of the EP group holds ``split_evenly(E, DP x TP)[e]``.
Only this rank's slices are read from the checkpoint.

With ``linear`` (``quantization.WeightBuilder.linear``: ``quantization="auto"``
on a CPU device) an expert whose slices the file stores in groups of 32
(GGUF Q8_0, Q4_0, Q4_K …; other quantised types re-quantised to groups) is
kept packed, like a dense MLP's linears: its gate and up rows as one packed
weight, its down columns as another (``PaddedColumns`` when a TP column slice
does not fall on group edges).  A projection that does not pack (a float
tensor, rows that are not whole blocks) is one stacked float tensor, as
without ``linear``; every held expert of a projection comes from the same
stacked file tensor, so they pack alike.  The shared expert packs the same
way; the routers stay float.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpexec.models.layers.moe import Experts, MoEBlock, SharedExpert
from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import PackedWeight, Weight
from mpexec.models.moe_config import MoEConfig
from mpexec.models.sharding import split_evenly

# read(name, dim, start, stop) -> this rank's slice, on the device, in the model dtype
Reader = Callable[..., torch.Tensor]
# linear([(name, dim, start, stop), ...]) -> the slices' rows as one weight, packed or float
Linear = Callable[[list[tuple[str, int | None, int, int | None]]], Weight]


@dataclass(frozen=True)
class ExpertShare:
    experts: tuple[int, int]  # [start, stop) of the experts held
    rows: tuple[int, int]     # [start, stop) of each held expert's intermediate rows
    shared_rows: tuple[int, int]

    def describe(self) -> str:
        return (f"experts [{self.experts[0]}, {self.experts[1]}), expert rows "
                f"[{self.rows[0]}, {self.rows[1]})")


def expert_share(moe: MoEConfig, rank: int, size: int, expert_parallel: bool) -> ExpertShare:
    if expert_parallel:
        if moe.num_experts < size:
            raise ValueError(f"the model has {moe.num_experts} experts, fewer than the "
                             f"expert parallel size {size}: a rank would hold none")
        experts = split_evenly(moe.num_experts, size)[rank]
        rows = (0, moe.moe_intermediate_size)
    else:
        experts = (0, moe.num_experts)
        rows = split_evenly(moe.moe_intermediate_size, size)[rank]
    shared_rows = split_evenly(moe.shared_expert_intermediate_size, size)[rank]
    return ExpertShare(experts, rows, shared_rows)


def load_moe_block(read: Reader, moe: MoEConfig, layer: int, share: ExpertShare,
                   group: ParallelGroup, *, ep_group: ParallelGroup | None = None,
                   dp_group: ParallelGroup | None = None,
                   linear: Linear | None = None) -> MoEBlock:
    """Layer ``layer``'s MoE block for this rank (``read`` slices as ``load_stage`` does).

    ``group`` is the TP group; ``ep_group`` and ``dp_group`` are given when the
    experts are split across data parallel replicas (see ``MoEBlock``);
    ``linear`` packs what the checkpoint stores quantised (module docstring)."""
    prefix = moe.prefix(layer)
    rows = share.rows

    def weight(parts: list[tuple[str, int | None, int, int | None]]) -> Weight:
        if linear is not None:
            return linear(parts)
        return torch.cat([read(*part) for part in parts])

    gate_ups, downs = [], []
    for expert in range(*share.experts):
        gate, up, down = moe.expert_names(layer, expert)
        gate_ups.append(weight([(gate, 0, *rows), (up, 0, *rows)]))
        downs.append(weight([(down, 1, *rows)]))
    shared = None
    if moe.shared_expert_intermediate_size:
        s = prefix + "shared_expert."
        srows = share.shared_rows
        shared = SharedExpert(
            gate_up=weight([(s + "gate_proj.weight", 0, *srows),
                            (s + "up_proj.weight", 0, *srows)]),
            down=weight([(s + "down_proj.weight", 1, *srows)]),
            gate=read(prefix + "shared_expert_gate.weight"))
    bounds = None
    if ep_group is not None:
        bounds = [start for start, _ in split_evenly(moe.num_experts, ep_group.world_size)]
        bounds.append(moe.num_experts)
    return MoEBlock(router=read(prefix + "gate.weight"), gate_up=_experts(gate_ups),
                    down=_experts(downs), expert_start=share.experts[0], top_k=moe.top_k,
                    renormalize=moe.norm_topk_prob,
                    group=ep_group if ep_group is not None else group, shared=shared,
                    dp_group=dp_group, tp_group=group if ep_group is not None else None,
                    expert_bounds=bounds)


def _experts(weights: list[Weight]) -> Experts:
    """One projection of the held experts: packed per expert, or one stacked
    float tensor.  (Every expert of a projection comes from one stacked file
    tensor, same type and same slice: all pack or none does.)"""
    packed: list[PackedWeight] = [w for w in weights if not isinstance(w, torch.Tensor)]
    if not packed:
        return torch.stack([w for w in weights if isinstance(w, torch.Tensor)])
    if len(packed) != len(weights):
        raise ValueError("the experts of one projection are partly packed, partly float")
    return packed
