"""Weights kept packed in memory, multiplied by torch's weight-only CPU kernels.

    Int4Weight   4-bit values, groups of 32 along the input, each with a scale s
                 and a zero z:  w = s·(q − 8) + z            (q in 0..15)
                 aten._convert_weight_to_int4pack_for_cpu (at load)
                 aten._weight_int4pack_mm_for_cpu          (per step)
    Int8GroupWeight  5- to 8-bit values in groups of 32 (Q8_0, Q5_0), as two
                 Int4Weights: q = 2ᵏ·h + l, h the top 4 bits — two int4
                 matmuls, summed in float32
    GroupRows    groups of 32 unpacked (uint8 q, scale, minimum): embedding rows
    PaddedColumns  a grouped weight whose input starts or ends inside a group
    ExpertRows   rows sorted by expert through one packed weight per expert
                 (a mixture-of-experts block's held experts)

GGUF's 4-bit types (Q4_0, Q4_1, Q4_K) map onto ``Int4Weight`` exactly — a
group's ``x = scale·q + minimum`` is ``scale·(q − 8) + (minimum + 8·scale)``
— and Q8_0, Q5_0 and Q5_1 onto ``Int8GroupWeight``, up to the kernel's
bfloat16 scales.  Types without groups of 32 are re-quantised to Q8_0-like
groups first (``quantization.requantise``).  The int8 kernel
(``_weight_int8pack_mm``, one scale per output row) is not used: on a
tiny Q6_K model a scale per row moved logits by up to 0.37 where groups
move them by 0.27, and on 18 layers' 4096 × 640 weights read from memory
it was slower than two int4 matmuls (11.8 ms against 10.9).

Both kernels take bfloat16 activations (on this AVX-512 BF16 CPU the float32
and float16 paths are 10-30× slower than a float32 matmul: a reference loop).
Rounding ``x`` to bfloat16 costs 8 of float32's 24 bits, which moved
SmolLM2's logits by up to 0.8 and flipped greedy choices, so a step of up to
``SPLIT_ROWS`` rows passes ``x`` as two bfloat16 parts::

    high = bf16(x),  low = bf16(x − high)      (x = high + low to ~2⁻¹⁶)
    W·x  = W·high + W·low                      one kernel call on [high; low]

At batch 1 a decode step reads the weight once either way (the kernels are
bound by the weight bytes), so the second row costs little; beyond
``SPLIT_ROWS`` (prefill chunks) the kernel is compute-bound and ``x`` is
rounded once.  The result is still rounded to bfloat16 (the kernels' output
type) and the scales are bfloat16; the head's top logits are re-scored
exactly (``embedding.ParallelLMHead``).  Each row is computed alone: its
result does not depend on the other rows of the call.  The int4 packer wants
whole tiles of 16 output rows: the weight is padded with zero rows and the
padding trimmed from each result.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

_KERNEL_DTYPE = torch.bfloat16
GROUP = 32
_ROW_TILE = 16
SPLIT_ROWS = 64  # steps of at most this many rows pass x as bfloat16 high + low


def _kernel_input(x: torch.Tensor, in_features: int,
                  split: bool = True) -> tuple[torch.Tensor, int]:
    """``x`` as the kernel's bfloat16 rows: ``[high; low]`` for a step of up to
    ``SPLIT_ROWS`` rows (and ``split``), else rounded once; and the number of
    rows of ``x``."""
    flat = x.reshape(-1, in_features)
    count = flat.shape[0]
    if count > SPLIT_ROWS or not split:
        return flat.to(_KERNEL_DTYPE), count
    wide = flat.float()
    high = wide.to(_KERNEL_DTYPE)
    return torch.cat((high, (wide - high.float()).to(_KERNEL_DTYPE))), count


def _kernel_output(out: torch.Tensor, count: int) -> torch.Tensor:
    """The float32 result of the rows ``_kernel_input`` made (high + low summed)."""
    if out.shape[0] == count:
        return out.float()
    return out[:count].float() + out[count:].float()


class Int4Weight:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        """``q`` (out, in) in 0..15; ``scale``, ``minimum`` (out, in / 32):
        x = scale·q + minimum."""
        rows, columns = q.shape
        if columns % GROUP or scale.shape != (rows, columns // GROUP) \
                or minimum.shape != scale.shape:
            raise ValueError(f"4-bit weight {tuple(q.shape)} with scales {tuple(scale.shape)}: "
                             f"need whole groups of {GROUP}")
        pad = -rows % _ROW_TILE
        zero = minimum + 8 * scale
        if pad:
            q = torch.cat([q, q.new_zeros(pad, columns)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.out_features = rows
        self.in_features = columns
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # [in / 32, out, 2] as the kernel reads it
        self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(_KERNEL_DTYPE) \
            .contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes

    def __call__(self, x: torch.Tensor, split: bool = True) -> torch.Tensor:
        rows, count = _kernel_input(x, self.in_features, split)
        out = _kernel_output(self.mm(rows), count)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def mm(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel on bfloat16 ``rows`` ``[n, in]``: bfloat16 ``[n, out]``."""
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                                         self.scale_zeros)
        return out if out.shape[-1] == self.out_features else out[:, :self.out_features]


class Int8GroupWeight:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        """``q`` (out, in) in 0..255, per group of 32: x = scale·q + minimum.

        Each group is cut at its own bit ``k`` (``low_bits``): the smallest that
        leaves 4 bits above it (k = 4 for 8-bit groups, 1 for 5-bit ones, 0 for
        4-bit ones).  With ``c = (2ᵏ − 1) / 2`` the mean of the low bits::

            high  (q >> k,      2ᵏ·s, m + c·s)     4 bits: the bulk of the value
            low   (q & (2ᵏ−1),  s,    −c·s)        centred: |low| <= c·s

        The low part is at most 1/31 of the group's range, so its product
        with ``x``'s bfloat16 remainder (``_kernel_input``) is below the
        kernels' own output rounding: ``low`` takes only ``x``'s high row (one
        row where ``high`` takes two).  Both zeros stay small (zeros that
        cancel would cost ~2⁻⁹ of them per element): Q8_0 (m = −128·d, k = 4)
        gives 7.5s and s/2, Q5_0 (m = −16·d, k = 1) s/2 and 7.5s.  Centred, the
        high part alone is an unbiased estimate of the product, off by
        ``Σ s·(low − c)·x`` (an LM head's candidate pass)."""
        self.out_features, self.in_features = q.shape
        self.low_bits = _low_bits(q)  # k per group: uint8 [out, in / 32]
        k = self.low_bits.repeat_interleave(GROUP, dim=1)
        mean = (2.0 ** self.low_bits - 1) / 2
        self.high = Int4Weight(q >> k, 2.0 ** self.low_bits * scale, minimum + mean * scale)
        self.low = Int4Weight(q & ((1 << k) - 1), scale, -mean * scale)

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes

    def __call__(self, x: torch.Tensor, split: bool = True) -> torch.Tensor:
        rows, count = _kernel_input(x, self.in_features, split)
        out = _kernel_output(self.high.mm(rows), count) + self.low.mm(rows[:count]).float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def _low_bits(q: torch.Tensor) -> torch.Tensor:
    """Per group of 32 of ``q`` (0..255): how many low bits lie below its top 4."""
    top = q.view(q.shape[0], -1, GROUP).amax(-1).to(torch.int32)
    bits = torch.zeros_like(top, dtype=torch.uint8)
    for k in range(1, 5):
        bits[top >= 1 << (k + 3)] = k
    return bits


class GroupRows:
    """Embedding rows as stored groups of 32 (``q`` uint8, ``scale``, ``minimum``)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        self.q, self.scale, self.minimum = q, scale, minimum
        self.out_features, self.in_features = q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.minimum.nbytes

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.q[ids].to(torch.float32).unflatten(-1, (-1, GROUP))
        values = q * self.scale[ids].unsqueeze(-1) + self.minimum[ids].unsqueeze(-1)
        return values.flatten(-2).to(dtype)

    def dot(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 ``row · x`` of rows ``ids`` (1-D) and one float32 vector ``x``:
        per group ``scale·(q·x) + minimum·Σx`` (one batched matmul over the
        groups, ~2.7 µs a row on 640 columns, most of it fetching the row)."""
        groups = x.view(-1, GROUP)  # [groups, 32]
        q = self.q[ids].to(torch.float32).view(len(ids), -1, GROUP).transpose(0, 1)
        dots = torch.bmm(q, groups.unsqueeze(-1)).squeeze(-1).t()  # [ids, groups]
        return (dots * self.scale[ids] + self.minimum[ids] * groups.sum(-1)).sum(-1)


class PaddedColumns:
    """A grouped weight over whole groups of columns, of which the input covers
    only ``[before, in − after)``: the input is padded with zeros to the
    groups (a tensor-parallel slice whose columns do not fall on group edges;
    zero inputs make the columns outside the slice contribute exactly 0)."""

    def __init__(self, weight: Int4Weight | Int8GroupWeight, before: int, after: int) -> None:
        self.weight = weight
        self.before, self.after = before, after
        self.out_features = weight.out_features
        self.in_features = weight.in_features - before - after

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, split: bool = True) -> torch.Tensor:
        return self.weight(torch.nn.functional.pad(x, (self.before, self.after)), split)


PackedWeight = Int4Weight | Int8GroupWeight | PaddedColumns
Weight = torch.Tensor | Int4Weight | Int8GroupWeight | PaddedColumns
Rows = torch.Tensor | GroupRows


def matmul(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a float or a packed weight."""
    if isinstance(weight, torch.Tensor):
        return torch.nn.functional.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out + bias


class ExpertRows:
    """Rows sorted by expert, ``counts[e]`` of them for expert ``e``, as the
    packed kernels' input: built once per MoE layer, used by each projection
    of the experts (gate/up, then down, on rows in the same order).

    The rows are cut into the kernels' bfloat16 ``[high; low]`` once for all
    experts and laid out expert by expert (one gather)::

        rows      high(e0) low(e0) high(e1) low(e1) ...     (SPLIT_ROWS or fewer)
                  bf16(x) as sorted                          (more: rounded once)
        kernel    one call per expert hit on its contiguous block
        result    out[high rows] + out[low rows]             (one gather each)
                  (+ the int8 weights' low part, which takes the high rows only)

    Each row comes out exactly as its expert's own weight computes it
    (``Int4Weight.__call__``, ``Int8GroupWeight.__call__``) with ``split``
    as the whole step's rows decide: split when all the experts' rows
    together are ``SPLIT_ROWS`` or fewer."""

    def __init__(self, counts: list[int], device: torch.device) -> None:
        self.counts = counts
        self.hit = [expert for expert, count in enumerate(counts) if count]
        self.starts = list(accumulate([0, *counts]))
        self.total = self.starts[-1]
        self.split = self.total <= SPLIT_ROWS
        self.order: torch.Tensor | None = None
        self.high_at: torch.Tensor | None = None
        self.low_at: torch.Tensor | None = None
        if self.split and self.hit:
            order: list[int] = []
            high_at: list[int] = []
            low_at: list[int] = []
            for expert in self.hit:
                start, count = self.starts[expert], counts[expert]
                order += [*range(start, start + count),
                          *range(self.total + start, self.total + start + count)]
                high_at += range(2 * start, 2 * start + count)
                low_at += range(2 * start + count, 2 * start + 2 * count)
            self.order, self.high_at, self.low_at = (
                torch.tensor(index, device=device) for index in (order, high_at, low_at))

    def block(self, expert: int) -> tuple[int, int]:
        """``[start, stop)`` of the expert's block in the kernel's rows."""
        start, count = self.starts[expert], self.counts[expert]
        return (2 * start, 2 * (start + count)) if self.split else (start, start + count)

    def matmul(self, x: torch.Tensor, weights: Sequence[PackedWeight]) -> torch.Tensor:
        """``x`` ``[total, in]`` (sorted by expert) times each row's expert's
        weight: ``[total, out]`` in ``x``'s dtype.  The weights of one
        projection share their padding (the same column slice of every expert)."""
        first = weights[self.hit[0] if self.hit else 0]
        if isinstance(first, PaddedColumns):
            x = torch.nn.functional.pad(x, (first.before, first.after))
        if not self.hit:
            return x.new_empty((0, first.out_features))
        flat = x.float()
        if self.split:
            assert self.order is not None
            high = flat.to(_KERNEL_DTYPE)
            rows = torch.cat((high, (flat - high.float()).to(_KERNEL_DTYPE))) \
                .index_select(0, self.order)
        else:
            rows = flat.to(_KERNEL_DTYPE)
        outs: list[torch.Tensor] = []
        lows: list[torch.Tensor | None] = []  # the int8 weights' low parts, by expert
        for expert in self.hit:
            weight = weights[expert]
            inner = weight.weight if isinstance(weight, PaddedColumns) else weight
            start, stop = self.block(expert)
            block = rows[start:stop]
            if isinstance(inner, Int8GroupWeight):
                outs.append(inner.high.mm(block))
                lows.append(inner.low.mm(block[:self.counts[expert]]))
            else:
                outs.append(inner.mm(block))
                lows.append(None)
        out = torch.cat(outs)
        if self.split:
            assert self.high_at is not None and self.low_at is not None
            result = out.index_select(0, self.high_at).float() \
                + out.index_select(0, self.low_at).float()
        else:
            result = out.float()
        if any(low is not None for low in lows):  # int4 experts among them add nothing
            result += torch.cat([out.new_zeros((self.counts[expert], result.shape[1]))
                                 if low is None else low
                                 for expert, low in zip(self.hit, lows, strict=True)]).float()
        return result.to(x.dtype)
