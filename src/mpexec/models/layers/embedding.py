"""Vocabulary-parallel embedding and LM head.

Each TP rank holds the rows ``[vocab_start, vocab_stop)`` of the embedding
(and of the LM head, which is the same tensor when the checkpoint ties them).

- Embedding: a rank looks up the tokens that fall in its rows, writes zeros
  for the others, and the all-reduce sums the one non-zero contribution.
- LM head: a rank computes the logits of its rows; ``all_gather`` along the
  vocabulary dimension (uneven slices allowed) gives every rank the full row.

The embedding's rows may be packed (``quantized.GroupRows``: a lookup
gathers and scales the rows it needs), and so may
the head's weight (any ``quantized.Weight``).  A packed head's results
carry bfloat16 rounding (up to 1/16 on a logit of 20); given ``exact_rows``
(the same rows, readable one by one), each row's ``RESCORED`` highest
logits are computed again in float32 from them, so the greedy choice and
the top logits are those of the stored weights (the head's own call then
rounds its input once, ``split=False``: it only has to find them).

When the sampler needs only each row's argmax (``argmax_only``: greedy rows
without logprobs, biases, penalties or a grammar) and the head is 8-bit in
groups of 32 (``Int8GroupWeight``, e.g. Q8_0), the head reads half its
bytes: the top 4 bits of each value alone (``Int8GroupWeight.high``, whose
zeros carry the mean ``c`` of the ``k`` low bits below them) estimate every
logit, off by ``Σ_i s_i·(l_i − c)·x_i``.  Taking the low bits as uniform on
``0..2ᵏ−1`` (variance ``(4ᵏ − 1) / 12``: 21.25 for Q8_0's k = 4), that
error has a spread per logit of

    σ_v = √(Σ_g (4^k_vg − 1)/12 · s_vg² · Σ_{i∈g} x_i²)

and logit ``v`` can beat ``B``, the highest estimate's logit computed
exactly, only if it is a *candidate*:
``estimate_v + 6·σ_v + |estimate_v|/128 ≥ B`` (the last term covers the
kernel's bfloat16 rounding).  Computing σ_v for every row would cost a pass
over ``[vocab, groups]`` scales, so the rows are first narrowed with the
largest σ any row can have (from each group's largest scale), then σ_v is
computed for those only.  The candidates are re-scored exactly (~2.7 µs
each, mostly fetching the row); every other logit keeps its estimate, which
is below ``B``, so the row's argmax is the stored weights' argmax unless the
argmax's own estimate fell more than 6 σ short (a Gaussian's tail: 1e-9 a
step).  Beyond ``MAX_CANDIDATES`` per row on average (a flat distribution)
the head adds the low bits' pass and re-scores its top ``RESCORED``, i.e.
computes what the full head computes.  Measured on Gemma 3 270M (262 144
rows, 168 greedy steps of 7 prompts): the estimates' error reached 5.4 σ_v
over 44 million logits; 3 candidates a step (median), at most 161.  Steps
after the benchmark's synthetic prompt (token ids 100, 103, 106, …) are
much flatter at first: 283 to 40 781 candidates for 6 steps, then 2-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import (
    GROUP,
    GroupRows,
    Int8GroupWeight,
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
SIGMAS = 6.0  # how many σ_v an estimate may be below its logit
MAX_CANDIDATES = 4096  # per row, on average; beyond, the head reads the low bits too
_KERNEL_ROUNDING = 2.0 ** -7  # bfloat16 input and output, relative, with room


class ParallelLMHead:
    """Full float32 logits on every rank from this rank's vocabulary rows."""

    def __init__(self, weight: Weight, group: ParallelGroup,
                 exact_rows: GroupRows | None = None) -> None:
        self.weight = weight
        self.group = group
        self.exact_rows = exact_rows
        # each group's largest (4ᵏ − 1)/12 · s² [groups]: the widest σ of any
        # row (None: this head has no estimating pass)
        self.widest_variance: torch.Tensor | None = None
        if isinstance(weight, Int8GroupWeight) and exact_rows is not None \
                and len(exact_rows.scale):
            self.widest_variance = self._low_variance(slice(None)).amax(0)

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
        return self._rescore_top(logits, hidden.float())

    def _rescore_top(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``logits`` with each row's ``RESCORED`` highest computed exactly."""
        if not logits.shape[-1]:
            return logits
        top = logits.topk(min(RESCORED, logits.shape[-1]), dim=-1).indices
        rows = torch.arange(len(top)).repeat_interleave(top.shape[-1])
        logits[rows, top.flatten()] = self._exact(rows, top.flatten(), x)
        return logits

    def _exact(self, rows: torch.Tensor, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the pairs (token row ``rows``, stored row ``ids``)
        from the stored rows and ``x`` [tokens, hidden]: one token row at a
        time, so a row's numbers do not depend on the other rows of the step."""
        assert self.exact_rows is not None
        out = torch.empty(len(ids))
        for row in rows.unique().tolist():
            at = (rows == row).nonzero().squeeze(-1)
            out[at] = self.exact_rows.dot(ids[at], x[row])
        return out

    def _low_variance(self, ids: torch.Tensor | slice) -> torch.Tensor:
        """(4ᵏ − 1)/12 · s² of rows ``ids``, per group: the variance of the
        estimate's error per unit of ``Σ_{i∈g} x_i²``."""
        assert isinstance(self.weight, Int8GroupWeight) and self.exact_rows is not None
        levels = 4.0 ** self.weight.low_bits[ids].float()
        return (levels - 1) / 12 * self.exact_rows.scale[ids].square()

    def _argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Estimates from the high bits, exact where they could be the
        argmax (the module docstring)."""
        assert isinstance(self.weight, Int8GroupWeight) and self.widest_variance is not None
        assert self.exact_rows is not None
        x = hidden.float()
        logits = self.weight.high(x, split=False).float()
        every = torch.arange(len(x))
        top = logits.argmax(-1)
        best = self._exact(every, top, x)  # B: an exact logit
        squares = x.unflatten(-1, (-1, GROUP)).square().sum(-1)  # [tokens, groups]
        # e + |e|/128 grows with e: the rows whose bound could reach B with the
        # widest σ are those above ``floor``
        reach = best - SIGMAS * (squares @ self.widest_variance).sqrt()
        floor = reach / (1 + torch.where(reach > 0, _KERNEL_ROUNDING, -_KERNEL_ROUNDING))
        rows, ids = (logits >= floor.unsqueeze(-1)).nonzero(as_tuple=True)
        # of those, the candidates by their own σ_v
        variance = (self._low_variance(ids) * squares[rows]).sum(-1)
        estimate = logits[rows, ids]
        candidate = estimate + SIGMAS * variance.sqrt() \
            + _KERNEL_ROUNDING * estimate.abs() >= best[rows]
        rows, ids = rows[candidate], ids[candidate]
        if len(ids) > MAX_CANDIDATES * len(x):
            # too flat to narrow down: the low bits too (the full head's values)
            logits += self.weight.low(x, split=False).float()
            return self._rescore_top(logits, x)
        logits[every, top] = best
        logits[rows, ids] = self._exact(rows, ids, x)
        return logits
