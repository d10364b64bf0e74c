"""Which global ranks form each parallel group: pure arithmetic, no torch.

The world holds ``DP x PP x PCP x TP`` ranks laid out with TP varying
fastest, then PCP, then PP, then DP::

    rank = ((dp_rank * PP + pp_rank) * PCP + pcp_rank) * TP + tp_rank

A group of one dimension is the set of ranks that differ only in that
dimension's coordinate, listed in increasing coordinate order (which is also
increasing rank order).  Two dimensions are not plain coordinates:

* DCP splits each TP group into consecutive blocks of DCP ranks, so a rank's
  ``dcp_rank`` is ``tp_rank % DCP``;
* EP (when enabled) spans DP x PCP x TP within one pipeline stage, with
  ``ep_rank = (dp_rank * PCP + pcp_rank) * TP + tp_rank``; without expert
  parallelism every rank is its own EP group of one.
"""

from __future__ import annotations

from dataclasses import dataclass

# The order of the process-title dimensions, and of group construction.
DIMENSIONS = ("dp", "pp", "pcp", "tp", "dcp", "ep")


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of every parallel dimension of one world."""

    tp: int = 1
    pp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    enable_ep: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} size must be a positive integer; got {value!r}")
        if self.tp % self.dcp:
            raise ValueError(
                f"decode_context_model_parallel_size ({self.dcp}) must divide "
                f"tensor_model_parallel_size ({self.tp}): DCP splits each TP group"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.pcp * self.tp

    @property
    def ep(self) -> int:
        return self.dp * self.pcp * self.tp if self.enable_ep else 1

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != data_parallel_size ({self.dp}) x "
                f"pipeline_model_parallel_size ({self.pp}) x "
                f"prefill_context_model_parallel_size ({self.pcp}) x "
                f"tensor_model_parallel_size ({self.tp}) = {self.world_size}; "
                "start that many ranks or change the sizes"
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index in every dimension (its rank within each group)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        tp_rank = rank % self.tp
        pcp_rank = rank // self.tp % self.pcp
        pp_rank = rank // (self.tp * self.pcp) % self.pp
        dp_rank = rank // (self.tp * self.pcp * self.pp)
        ep_rank = (dp_rank * self.pcp + pcp_rank) * self.tp + tp_rank if self.enable_ep else 0
        return {"dp": dp_rank, "pp": pp_rank, "pcp": pcp_rank, "tp": tp_rank,
                "dcp": tp_rank % self.dcp, "ep": ep_rank}

    def rank_of(self, *, dp: int = 0, pp: int = 0, pcp: int = 0, tp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.pcp + pcp) * self.tp + tp

    def size(self, dim: str) -> int:
        return {"dp": self.dp, "pp": self.pp, "pcp": self.pcp, "tp": self.tp,
                "dcp": self.dcp, "ep": self.ep}[dim]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of dimension ``dim``: a partition of the world's ranks."""
        if dim not in DIMENSIONS:
            raise ValueError(f"unknown parallel dimension {dim!r}; one of {DIMENSIONS}")
        if dim == "dcp":
            return [tp_group[i:i + self.dcp]
                    for tp_group in self.groups("tp")
                    for i in range(0, self.tp, self.dcp)]
        if dim == "ep":
            if not self.enable_ep:
                return [[r] for r in range(self.world_size)]
            return [[self.rank_of(dp=d, pp=p, pcp=c, tp=t)
                     for d in range(self.dp) for c in range(self.pcp) for t in range(self.tp)]
                    for p in range(self.pp)]
        out = []
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            if coords[dim] != 0:
                continue  # each group is listed once, from its first member
            members = []
            for i in range(self.size(dim)):
                coords[dim] = i
                members.append(self.rank_of(dp=coords["dp"], pp=coords["pp"],
                                            pcp=coords["pcp"], tp=coords["tp"]))
            out.append(members)
        return out

    def group_of(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group in dimension ``dim``."""
        for members in self.groups(dim):
            if rank in members:
                return members
        raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
