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
SmolLM2's logits by up to 0.8 and flipped greedy choices, so a row that
samples passes ``x`` as two bfloat16 parts::

    high = bf16(x),  low = bf16(x − high)      (x = high + low to ~2⁻¹⁶)
    W·x  = W·high + W·low                      one kernel call on [high; low]

Which rows split is a property of the token, never of the step it runs in
(``mpexec.models.split_rule``): every token of a prompt of up to 64
tokens, and of a longer prompt its last token and every token after it
(the rows whose logits are sampled, and what each decode step feeds
back); the other tokens of a long prompt are rounded once.  A decode row reads the weight
once either way (the kernels are bound by the weight bytes), so its second
row costs little; a long prompt is compute-bound (splitting all of a
128-token SmolLM2 prefill took 1.6× as long), so its rows stay single.
The kernels compute each row alone (its result does not depend on the
other rows of the call), so a token comes out the same whatever shares its
step, and a request whose prefix is recomputed (after preemption, or
re-queued on another replica) rebuilds its KV cache with the precision it
was first computed with — equal up to the float32 differences of the
prefill and decode attention, which a bfloat16 result can still round one
step apart.  The model worker passes each step's rule (``SplitRows``,
``splitting``); without one (a layer called on its own) every row splits.  The
result is still rounded to bfloat16 (the kernels' output type) and the
scales are bfloat16; the head's top logits are re-scored exactly
(``embedding.ParallelLMHead``).  The int4 packer wants whole tiles of 16
output rows: the weight is padded with zero rows and the padding trimmed
from each result.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_KERNEL_DTYPE = torch.bfloat16
GROUP = 32
_ROW_TILE = 16


class SplitRows:
    """Which rows of a call pass ``x`` as bfloat16 high + low (the others are
    rounded once): from a bool mask, worked out once per step."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.count = mask.shape[0]
        self.index = torch.nonzero(mask).view(-1)  # the split rows, ascending
        self.all = self.index.shape[0] == self.count

    @classmethod
    def every(cls, count: int, device: torch.device | str = "cpu") -> SplitRows:
        return cls(torch.ones(count, dtype=torch.bool, device=device))

    def take(self, rows: torch.Tensor) -> SplitRows:
        """The rule of ``rows`` (indices into these rows), in their order."""
        return SplitRows(self.mask.index_select(0, rows))


_STEP: ContextVar[SplitRows | None] = ContextVar("mpexec_split_rows", default=None)


@contextmanager
def splitting(rows: SplitRows | None) -> Iterator[None]:
    """Within: packed weights split the rows of one step as ``rows`` says
    (``None``: every row)."""
    token = _STEP.set(rows)
    try:
        yield
    finally:
        _STEP.reset(token)


def step_rows(count: int) -> SplitRows | None:
    """The rule of the step being run, for a call on its ``count`` rows
    (``None``: no rule is set, every row splits)."""
    rows = _STEP.get()
    if rows is not None and rows.count != count:
        raise ValueError(f"a packed matmul on {count} rows in a step of {rows.count}")
    return rows


def _kernel_input(x: torch.Tensor, in_features: int,
                  split: bool = True) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``x`` as the kernel's bfloat16 rows: ``bf16(x)``, then the low parts
    of the rows that split (the step's rule; none when not ``split``); the
    number of rows of ``x``; and which rows split (``None``: all of them)."""
    flat = x.reshape(-1, in_features)
    count = flat.shape[0]
    rule = step_rows(count) if split else None
    high = flat.to(_KERNEL_DTYPE)
    if not split or (rule is not None and rule.index.shape[0] == 0):
        return high, count, None
    if rule is None or rule.all:
        return torch.cat((high, (flat.float() - high.float()).to(_KERNEL_DTYPE))), count, None
    low = (flat.index_select(0, rule.index).float()
           - high.index_select(0, rule.index).float()).to(_KERNEL_DTYPE)
    return torch.cat((high, low)), count, rule.index


def _kernel_output(out: torch.Tensor, count: int, low_at: torch.Tensor | None) -> torch.Tensor:
    """The float32 result of the rows ``_kernel_input`` made (high + low summed)."""
    if out.shape[0] == count:
        return out.float()
    if low_at is None:
        return out[:count].float() + out[count:].float()
    return out[:count].float().index_add_(0, low_at, out[count:].float())


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
        rows, count, low_at = _kernel_input(x, self.in_features, split)
        out = _kernel_output(self.mm(rows), count, low_at)
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
        rows, count, low_at = _kernel_input(x, self.in_features, split)
        out = _kernel_output(self.high.mm(rows), count, low_at) \
            + self.low.mm(rows[:count]).float()
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

    The rows are cut into the kernels' bfloat16 rows once for all experts
    and laid out expert by expert (one gather)::

        rows      high(e0) low(e0) high(e1) low(e1) ...     low: the rows that split
        kernel    one call per expert hit on its contiguous block
        result    out[high rows], + out[low rows] where split (one gather each)
                  (+ the int8 weights' low part, which takes the high rows only)

    Each row comes out exactly as its expert's own weight computes it
    (``Int4Weight.__call__``, ``Int8GroupWeight.__call__``) under ``split``,
    the rule of the sorted rows (``None``: every row splits)."""

    def __init__(self, counts: list[int], device: torch.device,
                 split: SplitRows | None = None) -> None:
        self.counts = counts
        self.hit = [expert for expert, count in enumerate(counts) if count]
        self.total = sum(counts)
        if split is None:
            split = SplitRows.every(self.total, device)
        self.split = split
        sizes = torch.tensor(counts, device=device)
        expert = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)
        lows = torch.bincount(expert[split.mask], minlength=len(counts))  # split rows, by expert
        high_starts = torch.cumsum(sizes, 0) - sizes                 # in the sorted rows
        low_starts = torch.cumsum(lows, 0) - lows                    # in the low rows
        block_starts = high_starts + low_starts                      # in the kernel's rows
        self.blocks = [(start, start + count + low) for start, count, low in
                       zip(block_starts.tolist(), counts, lows.tolist(), strict=True)]
        row = torch.arange(self.total, device=device)
        # where each sorted row's high part, and each split row's low part, sit
        self.high_at = block_starts[expert] + row - high_starts[expert]
        low_expert = expert[split.index]
        self.low_at = block_starts[low_expert] + sizes[low_expert] \
            + torch.arange(split.index.shape[0], device=device) - low_starts[low_expert]
        # the kernel's rows as picked from [bf16(x); low parts]
        self.order = torch.empty(self.total + split.index.shape[0], dtype=torch.int64,
                                 device=device)
        self.order[self.high_at] = row
        self.order[self.low_at] = self.total + torch.arange(split.index.shape[0], device=device)

    def matmul(self, x: torch.Tensor, weights: Sequence[PackedWeight]) -> torch.Tensor:
        """``x`` ``[total, in]`` (sorted by expert) times each row's expert's
        weight: ``[total, out]`` in ``x``'s dtype.  The weights of one
        projection share their padding (the same column slice of every expert)."""
        first = weights[self.hit[0] if self.hit else 0]
        if isinstance(first, PaddedColumns):
            x = torch.nn.functional.pad(x, (first.before, first.after))
        if not self.hit:
            return x.new_empty((0, first.out_features))
        high = x.to(_KERNEL_DTYPE)
        index = self.split.index
        low = (x.index_select(0, index).float()
               - high.index_select(0, index).float()).to(_KERNEL_DTYPE)
        rows = torch.cat((high, low)).index_select(0, self.order)
        outs: list[torch.Tensor] = []
        lows: list[torch.Tensor | None] = []  # the int8 weights' low parts, by expert
        for expert in self.hit:
            weight = weights[expert]
            inner = weight.weight if isinstance(weight, PaddedColumns) else weight
            start, stop = self.blocks[expert]
            block = rows[start:stop]
            if isinstance(inner, Int8GroupWeight):
                outs.append(inner.high.mm(block))
                lows.append(inner.low.mm(block[:self.counts[expert]]))
            else:
                outs.append(inner.mm(block))
                lows.append(None)
        out = torch.cat(outs)
        result = out.index_select(0, self.high_at).float()
        if index.shape[0]:
            result.index_add_(0, index, out.index_select(0, self.low_at).float())
        if any(low is not None for low in lows):  # int4 experts among them add nothing
            result += torch.cat([out.new_zeros((self.counts[expert], result.shape[1]))
                                 if low is None else low
                                 for expert, low in zip(self.hit, lows, strict=True)]).float()
        return result.to(x.dtype)
