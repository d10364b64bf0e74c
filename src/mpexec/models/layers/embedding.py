"""Vocabulary-parallel embedding and LM head.

Each TP rank holds the rows ``[vocab_start, vocab_stop)`` of the embedding
(and of the LM head, which is the same tensor when the checkpoint ties them).

- Embedding: a rank looks up the tokens that fall in its rows, writes zeros
  for the others, and the all-reduce sums the one non-zero contribution.
- LM head: a rank computes the logits of its rows; ``all_gather`` along the
  vocabulary dimension (uneven slices allowed) gives every rank the full row.

The embedding's rows may be packed (``quantized.GroupRows`` or
``Int8Weight``: a lookup gathers and scales the rows it needs), and so may
the head's weight (any ``quantized.Weight``).  A packed head's results
carry bfloat16 rounding (up to 1/16 on a logit of 20); given ``exact_rows``
(the same rows, readable one by one), each row's ``RESCORED`` highest
logits are computed again in float32 from them, so the greedy choice and
the top logits are those of the stored weights (the head's own call then
rounds its input once, ``split=False``: it only has to find them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import PackedRows, Rows, Weight, matmul


class VocabParallelEmbedding:
    def __init__(self, weight: Rows, vocab_start: int, group: ParallelGroup,
                 dtype: torch.dtype | None = None) -> None:
        self.weight = weight
        self.vocab_start = vocab_start
        rows = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.out_features
        self.vocab_stop = vocab_start + rows
        self.group = group
        self.dtype = dtype or torch.float32  # of a packed weight's rows

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self._lookup(token_ids)
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_stop)
        local = (token_ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.rows(ids, self.dtype)


RESCORED = 16


class ParallelLMHead:
    """Full float32 logits on every rank from this rank's vocabulary rows."""

    def __init__(self, weight: Weight, group: ParallelGroup,
                 exact_rows: PackedRows | None = None) -> None:
        self.weight = weight
        self.group = group
        self.exact_rows = exact_rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exact_rows is None or isinstance(self.weight, torch.Tensor):
            logits = matmul(hidden, self.weight).float()
        else:
            # the top logits are computed again below: x rounded once to
            # bfloat16 is enough to find them (and half the kernel's rows)
            logits = self.weight(hidden, split=False).float()
        if self.exact_rows is not None and logits.shape[-1]:
            # per row, elementwise then summed: a row's numbers do not depend
            # on the other rows of the step
            top = logits.topk(min(RESCORED, logits.shape[-1]), dim=-1).indices
            rows = self.exact_rows.rows(top, torch.float32)  # [tokens, RESCORED, hidden]
            exact = (rows * hidden.float().unsqueeze(-2)).sum(-1)
            logits.scatter_(-1, top, exact)
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits
