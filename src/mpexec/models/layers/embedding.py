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

When the sampler needs only each row's argmax (``argmax_only``: greedy rows
without logprobs, biases, penalties or a grammar) and the head is 8-bit in
groups of 32 (``Int8GroupWeight``, e.g. Q8_0: ``q = 16·h + l``), the head
reads half its bytes: the high nibbles alone (``Int8GroupWeight.high``,
whose zeros carry the low nibbles' mean 7.5) estimate every logit, off by
``Σ_i s_i·(l_i − 7.5)·x_i``.  Taking the low nibbles as uniform on 0..15
(variance 21.25), that error has a spread per logit of

    σ_v = √(21.25 · Σ_g s_vg² · Σ_{i∈g} x_i²)

and logit ``v`` can beat ``B``, the highest estimate's logit computed
exactly, only if it is a *candidate*:
``estimate_v + 8·σ_v + |estimate_v|/128 ≥ B`` (the last term covers the
kernel's bfloat16 rounding).  Computing σ_v for every row would cost a pass
over ``[vocab, groups]`` scales, so the rows are first narrowed with the
largest σ any row can have (from each group's largest scale), then σ_v is
computed for those only.  The candidates are
re-scored exactly; every other logit keeps its estimate, which is below
``B``, so the row's argmax is the stored weights' argmax.  (More than
``MAX_CANDIDATES`` per row on average, and the head reads the low nibbles
too.)  Measured on Gemma 3 270M (262 144 rows, 168 greedy steps): the
estimate's error stayed within 5.2 σ_v over 44 million logits (the bound
allows 8); a median of 4 candidates a step, at most ~430.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import (
    GROUP,
    GroupRows,
    Int8GroupWeight,
    PackedRows,
    Rows,
    Weight,
    matmul,
)


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
SIGMAS = 8.0  # how many σ_v a high-nibble estimate may be below its logit
MAX_CANDIDATES = 1024  # per row, on average; beyond, the head reads the low nibbles too
_LOW_VARIANCE = (16 ** 2 - 1) / 12  # of a nibble uniform on 0..15
_KERNEL_ROUNDING = 2.0 ** -7  # bfloat16 input and output, relative, with room


class ParallelLMHead:
    """Full float32 logits on every rank from this rank's vocabulary rows."""

    def __init__(self, weight: Weight, group: ParallelGroup,
                 exact_rows: PackedRows | None = None) -> None:
        self.weight = weight
        self.group = group
        self.exact_rows = exact_rows
        # 21.25 · (each group's largest s²) [groups]: the widest σ of any row
        # (None: this head has no high-nibble pass)
        self.widest_variance: torch.Tensor | None = None
        if isinstance(weight, Int8GroupWeight) and weight.centred \
                and isinstance(exact_rows, GroupRows) and len(exact_rows.scale):
            self.widest_variance = _LOW_VARIANCE * exact_rows.scale.square().amax(0)

    def __call__(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        if argmax_only and self.widest_variance is not None and len(hidden):
            logits = self._argmax_logits(hidden)
        else:
            logits = self._logits(hidden)
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exact_rows is None or isinstance(self.weight, torch.Tensor):
            return matmul(hidden, self.weight).float()
        # the top logits are computed again below: x rounded once to
        # bfloat16 is enough to find them (and half the kernel's rows)
        logits = self.weight(hidden, split=False).float()
        return self._rescore_top(logits, hidden.float())[0]

    def _rescore_top(self, logits: torch.Tensor,
                     x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` with each row's ``RESCORED`` highest computed exactly; and
        the highest exact one of each row."""
        if not logits.shape[-1]:
            return logits, logits.new_full((len(logits),), float("-inf"))
        top = logits.topk(min(RESCORED, logits.shape[-1]), dim=-1).indices
        exact = self._exact(top, x.unsqueeze(-2))
        return logits.scatter_(-1, top, exact), exact.amax(-1)

    def _exact(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the stored rows ``ids`` against ``x`` (broadcast
        to ``[*ids.shape, hidden]``): elementwise then summed, so a row's
        numbers do not depend on the other rows of the step."""
        assert self.exact_rows is not None
        return (self.exact_rows.rows(ids, torch.float32) * x).sum(-1)

    def _argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Estimates from the high nibbles, exact where they could be the
        argmax (the module docstring)."""
        assert isinstance(self.weight, Int8GroupWeight) and self.widest_variance is not None
        assert isinstance(self.exact_rows, GroupRows)
        x = hidden.float()
        logits = self.weight.high(x, split=False).float()
        top = logits.argmax(-1, keepdim=True)
        best = self._exact(top, x.unsqueeze(-2)).squeeze(-1)  # B: an exact logit
        squares = x.unflatten(-1, (-1, GROUP)).square().sum(-1)  # [tokens, groups]
        # e + |e|/128 grows with e: the rows whose bound could reach B with the
        # widest σ are those above ``floor``
        reach = best - SIGMAS * (squares @ self.widest_variance).sqrt()
        floor = reach / (1 + torch.where(reach > 0, _KERNEL_ROUNDING, -_KERNEL_ROUNDING))
        rows, ids = (logits >= floor.unsqueeze(-1)).nonzero(as_tuple=True)
        # of those, the candidates by their own σ_v
        variance = (self.exact_rows.scale[ids].square() * squares[rows]).sum(-1)
        estimate = logits[rows, ids]
        candidate = estimate + SIGMAS * (_LOW_VARIANCE * variance).sqrt() \
            + _KERNEL_ROUNDING * estimate.abs() >= best[rows]
        rows, ids = rows[candidate], ids[candidate]
        if len(ids) > MAX_CANDIDATES * len(x):  # too flat to narrow down: all of it
            return self._logits(hidden)
        logits.scatter_(-1, top, best.unsqueeze(-1))
        logits[rows, ids] = self._exact(ids, x[rows])
        return logits
