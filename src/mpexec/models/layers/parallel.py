"""The slice of a process group that the layers use, and a one-rank stand-in.

Layers only call ``all_reduce`` and ``all_gather`` on their tensor-parallel
group (and the MoE layer ``all_to_all`` on its expert-parallel group) and
read ``world_size``/``rank_in_group``; any object with those
members will do (``mpexec.distributed``'s ``GroupCoordinator`` in a worker,
:class:`SingleRankGroup` when one process holds the whole model, a threaded
fake in tests).  With one rank every collective is the identity, and the
layers skip the call altogether.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ParallelGroup(Protocol):
    world_size: int
    rank_in_group: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def all_to_all(self, tensor: torch.Tensor,
                   splits: list[int]) -> tuple[torch.Tensor, list[int]]: ...


class SingleRankGroup:
    """A group of one: every collective returns its input."""

    world_size = 1
    rank_in_group = 0
    is_first_rank = True
    is_last_rank = True

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def all_to_all(self, tensor: torch.Tensor,
                   splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        return tensor, list(splits)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None
