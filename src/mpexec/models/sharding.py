"""Which slice of the model each rank holds: pure arithmetic, no torch.

Tensor parallelism splits four things across the ``tp`` ranks of a group:

- attention heads, by KV-head groups.  With ``kv`` KV heads and ``g = heads //
  kv`` query heads per KV head, when ``tp <= kv`` the KV heads are split as
  evenly as possible and each rank takes the query heads of its KV heads
  (9 query / 3 KV heads on TP=2: ranks hold 6+3 query and 2+1 KV heads).
  When ``tp > kv`` every rank holds exactly one KV head (replicated on the
  ranks that share it) and a contiguous part of that head's ``g`` query heads;
  the ranks are spread over the KV heads as evenly as possible.  Heads are
  split whole, so the head size does not enter: a rank's q_proj rows are
  ``[q_start · head_dim, q_stop · head_dim)`` whatever ``hidden_size`` is.
- MLP intermediate rows, split as evenly as possible (uneven when they do
  not divide);
- vocabulary rows of the embedding and the LM head, likewise.

Pipeline parallelism splits the decoder layers into contiguous stages
(:func:`pipeline_layers`).  Every share is a half-open ``[start, stop)``
range in the checkpoint's layout, so a rank reads exactly its rows (or
columns) with ``Checkpoint.read(name, dim, start, stop)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, sizes differing by
    at most one, the larger ones first (10 into 3: 4, 3, 3)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0; got {total}")
    base, extra = divmod(total, parts)
    ranges = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class AttentionShard:
    """The heads one TP rank holds: query heads ``[q_start, q_stop)`` and KV
    heads ``[kv_start, kv_stop)`` in the checkpoint's head order."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def attention_shards(num_heads: int, num_kv_heads: int, tp: int) -> list[AttentionShard]:
    """Each TP rank's heads (see the module docstring for the rule)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a positive multiple of "
            f"num_key_value_heads ({num_kv_heads})")
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {tp}")
    if tp > num_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp}) exceeds num_attention_heads ({num_heads}): "
            "a rank would hold no attention head")
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [AttentionShard(start * group, stop * group, start, stop)
                for start, stop in split_evenly(num_kv_heads, tp)]
    shards = []
    for kv_head, (first, last) in enumerate(split_evenly(tp, num_kv_heads)):
        for q_start, q_stop in split_evenly(group, last - first):
            base = kv_head * group
            shards.append(AttentionShard(base + q_start, base + q_stop, kv_head, kv_head + 1))
    return shards


@dataclass(frozen=True)
class RankShare:
    """Everything one TP rank of one pipeline stage holds."""

    tp_rank: int
    tp_size: int
    attention: AttentionShard
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    layers: tuple[int, int]

    def describe(self) -> str:
        a = self.attention
        def span(r: tuple[int, int]) -> str:
            return f"[{r[0]}, {r[1]})"

        return (f"TP rank {self.tp_rank}/{self.tp_size}: query heads "
                f"{span((a.q_start, a.q_stop))}, KV heads {span((a.kv_start, a.kv_stop))}, "
                f"MLP rows {span(self.intermediate)}, vocab rows {span(self.vocab)}, "
                f"layers {span(self.layers)}")


def rank_share(*, num_heads: int, num_kv_heads: int, intermediate_size: int,
               vocab_size: int, layers: tuple[int, int], tp_rank: int,
               tp_size: int) -> RankShare:
    """One rank's share of a model, given its stage's layers."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank ({tp_rank}) must be in [0, {tp_size})")
    if tp_size > intermediate_size or tp_size > vocab_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) exceeds intermediate_size "
            f"({intermediate_size}) or vocab_size ({vocab_size})")
    return RankShare(
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention=attention_shards(num_heads, num_kv_heads, tp_size)[tp_rank],
        intermediate=split_evenly(intermediate_size, tp_size)[tp_rank],
        vocab=split_evenly(vocab_size, tp_size)[tp_rank],
        layers=layers,
    )


def pipeline_layers(num_layers: int, pp: int,
                    partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's decoder layers ``[start, stop)``.

    ``partition`` is an explicit number of layers per stage; it must have
    ``pp`` entries, each >= 1, summing to ``num_layers``.  Without it the
    layers are split evenly (the earlier stages take the extra ones).
    """
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1; got {pp}")
    if partition is None:
        if pp > num_layers:
            raise ValueError(
                f"pipeline_parallel_size ({pp}) exceeds num_hidden_layers ({num_layers})")
        return split_evenly(num_layers, pp)
    counts = list(partition)
    if len(counts) != pp:
        raise ValueError(
            f"pp_layer_partition has {len(counts)} entries; pipeline_parallel_size is {pp}")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"pp_layer_partition entries must be integers >= 1; got {counts}")
    if sum(counts) != num_layers:
        raise ValueError(
            f"pp_layer_partition {counts} sums to {sum(counts)}; the model has "
            f"{num_layers} layers")
    ranges = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges
