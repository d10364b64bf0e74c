"""Prefill context parallelism (PCP): a long step's tokens split across P ranks.

The PCP group is P ranks with the same TP and PP coordinates (world = TP x PP
x PCP).  A step with at least ``P x MIN_ROWS_PER_RANK`` tokens is split along
its rows: rank r runs rows ``split_evenly(T, P)[r]`` through the embedding,
every linear layer and the MLP, so a long prompt's prefill costs each rank
about 1/P of the matmuls.  Attention needs every earlier token::

    q, k, v of this rank's rows (as in TP)
    k_all, v_all = gather of every rank's k, v, in row order    [T, kv heads, d]
    write k_all, v_all into this rank's cache (every rank holds the whole KV)
    attend this rank's rows as their own batch: a row range that starts
    inside a prompt is a chunked-prefill continuation over the cached context

The last stage computes the logits of the sampled rows it holds and gathers
the others' (``gather_rows``), so every PCP rank samples the same tokens and
keeps the same request state.  A smaller step (decode, mostly) is not split:
every PCP rank runs all of it, as without PCP.  The KV cache is replicated
across the PCP group (no memory saving: that is decode context parallelism's
job); what PCP buys is prefill time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mpexec.models.kv_cache import AttentionBatch, ScheduledRequest
from mpexec.models.sharding import split_evenly

# Below P x this many tokens a step runs whole on every PCP rank: splitting a
# handful of decode rows costs more in collectives than it saves.
MIN_ROWS_PER_RANK = 8


class PcpGroup(Protocol):
    world_size: int
    rank_in_group: int

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


@dataclass
class PcpBatch:
    """This rank's rows as a batch of their own, and where every row's K/V goes."""

    inner: AttentionBatch
    all_slots: torch.Tensor  # [T]: the slot of every row of the step
    counts: list[int]  # rows per PCP rank
    group: PcpGroup


def split_step(num_rows: int, size: int) -> list[tuple[int, int]] | None:
    """Each rank's rows ``[lo, hi)``, or None when the step runs whole everywhere."""
    if size == 1 or num_rows < size * MIN_ROWS_PER_RANK:
        return None
    return split_evenly(num_rows, size)


def rows_layout(layout: Sequence[ScheduledRequest], lo: int,
                hi: int) -> list[ScheduledRequest]:
    """The requests' parts that fall in rows ``[lo, hi)`` of the step."""
    out = []
    row = 0
    for request in layout:
        first, last = max(lo, row), min(hi, row + request.num_tokens)
        if first < last:
            out.append(ScheduledRequest(request.block_ids, request.start + first - row,
                                        last - first))
        row += request.num_tokens
    return out


def gather_rows(tensor: torch.Tensor, group: PcpGroup, counts: Sequence[int]) -> torch.Tensor:
    """Every rank's rows of ``tensor`` (``counts[r]`` on rank r), in rank order."""
    widest = max(counts)
    if tensor.shape[0] < widest:
        pad = tensor.new_zeros((widest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat((tensor, pad))
    every = group.all_gather(tensor.contiguous(), dim=0)
    if all(c == widest for c in counts):
        return every
    return torch.cat([every[r * widest:r * widest + c] for r, c in enumerate(counts)])


def write_all_rows(batch: PcpBatch, k: torch.Tensor, v: torch.Tensor,
                   cache: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Gather the group's K/V of this step and write all of it to this rank's cache."""
    k_all = gather_rows(k, batch.group, batch.counts)
    v_all = gather_rows(v, batch.group, batch.counts)
    cache[0].index_copy_(0, batch.all_slots, k_all)
    cache[1].index_copy_(0, batch.all_slots, v_all)
