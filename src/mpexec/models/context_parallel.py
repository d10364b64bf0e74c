"""Decode context parallelism (DCP): every request's KV cache spread over D ranks.

A DCP group is D consecutive ranks of a TP group that hold the same KV head
(so ``tensor_parallel_size >= D x num_key_value_heads``, and each KV head's
ranks split evenly into DCP groups).  Without DCP those D ranks would each
store the same K/V; with it, each stores one D-th of every request's tokens:

    token at position p   lives on DCP rank  p % D,  at its local position  p // D

The scheduler's blocks hold ``block_size x D`` tokens: block ``b`` of a
request is, on every DCP rank, that rank's local block ``b`` of
``block_size`` slots.  The same per-rank memory thus holds contexts D times
as long.

Per layer (:func:`dcp_attention`), after q, k, v of this rank's heads::

    write k, v of the new tokens this rank owns into its cache
    q_all = all_gather(q, DCP group)                 [T, D x h, d]  every query head of the group
    o_r, lse_r = attention of q_all over this rank's share of each context (causal: a
                 query at position i sees the local positions j with j x D + r <= i)
    o, lse of every rank = all_gather(o_r, lse_r)   (exact merge below)
    o = sum_r exp(lse_r - max lse) o_r / sum_r exp(lse_r - max lse), this rank's heads only

The merge is exact: softmax over the union of the shares is the
lse-weighted mean of the per-share softmaxes.  A rank that sees no key for
a query (its share is empty so far) contributes lse = -inf, weight 0.  The
output then goes through ``o_proj`` exactly as in TP.  The merge gathers
every head's partial output (D x what each rank keeps): on a node the
shared-memory all-gather makes that cheap; an all-to-all would send only
what each rank keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mpexec.models.kv_cache import ScheduledRequest
from mpexec.models.profiling import span
from mpexec.models.sharding import attention_shards


class DcpGroup(Protocol):
    world_size: int
    rank_in_group: int

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


@dataclass
class DcpSpan:
    """One request's rows of a step, and this rank's share of its context."""

    start: int  # rows [start, stop) of the step's tokens
    stop: int
    slots: torch.Tensor  # [L] this rank's cached slots of the positions < the last new one
    mask: torch.Tensor  # [q, L] bool, True = may attend


@dataclass
class DcpBatch:
    """What every layer of one step needs under DCP (see the module docstring)."""

    write_rows: torch.Tensor  # rows of the step whose token this rank stores
    write_slots: torch.Tensor  # and where
    spans: list[DcpSpan]
    num_tokens: int


def dcp_head_counts(num_heads: int, num_kv_heads: int, tp: int, dcp: int,
                    tp_rank: int) -> list[int]:
    """The query heads each rank of ``tp_rank``'s DCP group holds; ValueError
    unless the group's ranks share one KV head."""
    check_dcp_heads(num_heads, num_kv_heads, tp, dcp)
    first = tp_rank - tp_rank % dcp
    return [s.num_heads for s in attention_shards(num_heads, num_kv_heads, tp)[first:first + dcp]]


def check_dcp_heads(num_heads: int, num_kv_heads: int, tp: int, dcp: int) -> None:
    """ValueError unless every DCP group of the TP group shares one KV head."""
    if dcp == 1:
        return
    if tp % dcp:
        raise ValueError(f"decode_context_parallel_size ({dcp}) must divide "
                         f"tensor_parallel_size ({tp})")
    shards = attention_shards(num_heads, num_kv_heads, tp)
    for first in range(0, tp, dcp):
        group = shards[first:first + dcp]
        kv = {(s.kv_start, s.kv_stop) for s in group}
        if len(kv) != 1 or group[0].num_kv_heads != 1:
            raise ValueError(
                f"decode_context_parallel_size ({dcp}) needs each group of {dcp} consecutive "
                f"TP ranks to hold the same single KV head; with num_key_value_heads "
                f"({num_kv_heads}) and tensor_parallel_size ({tp}) TP ranks {first}.."
                f"{first + dcp - 1} hold KV heads {sorted(kv)}: use a tensor_parallel_size "
                f"that is a multiple of {dcp} x {num_kv_heads}")


def build_dcp_batch(requests: Sequence[ScheduledRequest], block_size: int, dcp_size: int,
                    dcp_rank: int, device: torch.device) -> DcpBatch:
    """This rank's writes and context shares for one step.

    ``block_size`` is the per-rank block size: a scheduler block holds
    ``block_size x dcp_size`` tokens.
    """
    write_rows: list[torch.Tensor] = []
    write_slots: list[torch.Tensor] = []
    spans = []
    row = 0
    tokens_per_block = block_size * dcp_size
    for request in requests:
        end = request.start + request.num_tokens
        if end > len(request.block_ids) * tokens_per_block:
            raise ValueError(
                f"a request reaches position {end - 1} but its block table holds "
                f"{len(request.block_ids)} blocks of {tokens_per_block} tokens "
                f"({block_size} on each of {dcp_size} DCP ranks)")
        blocks = torch.tensor(request.block_ids, dtype=torch.int64)
        # this rank's positions r, r + D, ... below `end`, as local positions 0, 1, ...
        local = torch.arange((end - dcp_rank + dcp_size - 1) // dcp_size
                             if end > dcp_rank else 0)
        slots = blocks[local // block_size] * block_size + local % block_size
        positions = local * dcp_size + dcp_rank
        new = positions >= request.start
        write_rows.append(positions[new] - request.start + row)
        write_slots.append(slots[new])
        queries = torch.arange(request.start, end).unsqueeze(1)
        mask = positions.unsqueeze(0) <= queries
        spans.append(DcpSpan(row, row + request.num_tokens, slots.to(device), mask.to(device)))
        row += request.num_tokens
    empty = torch.empty(0, dtype=torch.int64)
    return DcpBatch(torch.cat(write_rows).to(device) if write_rows else empty.to(device),
                    torch.cat(write_slots).to(device) if write_slots else empty.to(device),
                    spans, row)


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [n, H, d] over a share of the context ([L, Hk, d] each),
    and its log-sum-exp [n, H]; -inf (and a zero output) where no key is visible."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if keys.shape[0] == 0:
        return (torch.zeros_like(q),
                torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
    group = heads // kv_heads
    k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    v = values.repeat_interleave(group, dim=1) if group > 1 else values
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("hnl,lhd->nhd", weights, v.float())
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention over the union of D shares: ``outs`` [D, n, H, d]
    and ``lses`` [D, n, H] → [n, H, d]."""
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(lses - top.unsqueeze(0))  # [D, n, H]
    total = weights.sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    merged = (weights.unsqueeze(-1) * outs.float()).sum(dim=0) / total.unsqueeze(-1)
    return merged.to(outs.dtype)


def dcp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DcpBatch,
                  cache: tuple[torch.Tensor, torch.Tensor], group: DcpGroup,
                  head_counts: Sequence[int], scale: float) -> torch.Tensor:
    """This rank's heads' attention output [T, h x d] (see the module docstring);
    ``head_counts``: the query heads each rank of the group holds."""
    k_cache, v_cache = cache
    if batch.write_rows.numel():
        k_cache.index_copy_(0, batch.write_slots, k.index_select(0, batch.write_rows))
        v_cache.index_copy_(0, batch.write_slots, v.index_select(0, batch.write_rows))
    tokens, heads, head_dim = q.shape
    size, rank = group.world_size, group.rank_in_group
    # Ranks of a group may hold different numbers of query heads: pad to the
    # largest so that the gather is regular.
    widest = max(head_counts)
    padded = q if heads == widest else torch.cat(
        (q, q.new_zeros(tokens, widest - heads, head_dim)), dim=1)
    with span("dcp.gather_q"):
        q_all = group.all_gather(padded.contiguous(), dim=1)  # [T, D x widest, d]
    outs = torch.empty((tokens, size * widest, head_dim), dtype=q.dtype, device=q.device)
    lses = torch.empty((tokens, size * widest), dtype=torch.float32, device=q.device)
    with span("dcp.attention"):
        for share in batch.spans:
            keys = torch.index_select(k_cache, 0, share.slots)
            values = torch.index_select(v_cache, 0, share.slots)
            out, lse = partial_attention(q_all[share.start:share.stop], keys, values,
                                         share.mask, scale)
            outs[share.start:share.stop] = out
            lses[share.start:share.stop] = lse
    with span("dcp.gather_out"):
        every_out = group.all_gather(outs.unsqueeze(0), dim=0)  # [D, T, D x widest, d]
        every_lse = group.all_gather(lses.unsqueeze(0), dim=0)
    mine = slice(rank * widest, rank * widest + heads)
    with span("dcp.merge"):
        merged = merge_partials(every_out[:, :, mine], every_lse[:, :, mine])
    return merged.reshape(tokens, heads * head_dim)
