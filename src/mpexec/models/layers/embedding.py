"""Vocabulary-parallel embedding and LM head.

Each TP rank holds the rows ``[vocab_start, vocab_stop)`` of the embedding
(and of the LM head, which is the same tensor when the checkpoint ties them).

- Embedding: a rank looks up the tokens that fall in its rows, writes zeros
  for the others, and the all-reduce sums the one non-zero contribution.
- LM head: a rank computes the logits of its rows; ``all_gather`` along the
  vocabulary dimension (uneven slices allowed) gives every rank the full row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.layers.parallel import ParallelGroup


class VocabParallelEmbedding:
    def __init__(self, weight: torch.Tensor, vocab_start: int, group: ParallelGroup) -> None:
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_stop = vocab_start + weight.shape[0]
        self.group = group

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(token_ids, self.weight)
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_stop)
        local = (token_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead:
    """Full float32 logits on every rank from this rank's vocabulary rows."""

    def __init__(self, weight: torch.Tensor, group: ParallelGroup) -> None:
        self.weight = weight
        self.group = group

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits
