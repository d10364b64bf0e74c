"""Tensor-parallel linears over weights already sliced for this rank.

A column-parallel linear holds some *output* rows of a weight (``y_local =
x @ W[rows].T``): its result stays sharded, one slice per rank, which is
what the next, row-parallel linear wants.  A row-parallel linear holds the
matching *input* columns (``W[:, cols]``); every rank's partial product is
summed by the TP all-reduce, and the bias (held whole by every rank) is
added once, after the sum.  Several column-parallel weights that read the
same input (q/k/v, gate/up) are stored concatenated so that one matmul
replaces three or two.  A weight is a float tensor or a packed one
(``quantized.Int4Weight``, ``Int8GroupWeight``, …); ``quantized.matmul`` applies either.
"""

from __future__ import annotations

import torch

from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import Weight, matmul


class ColumnParallelLinear:
    """``x @ weight.T + bias`` for this rank's output rows; no communication."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class RowParallelLinear:
    """This rank's input columns; the partial products summed over the group."""

    def __init__(self, weight: Weight, group: ParallelGroup,
                 bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x, self.weight)
        if self.group.world_size > 1:
            out = self.group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
