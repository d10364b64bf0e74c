"""Which weights a rank keeps packed (``quantization="auto"``) and how.

    checkpoint slice(s) of one linear ─┬─ every part Q4_0/Q4_1/Q4_K
                                       │  ── read_groups ─► Int4Weight
                                       ├─ every part quantised, one of them
                                       │  Q8_0/Q5_0/Q5_1 or of another type
                                       │  (Q6_K, Q5_K, other K and IQ types: read
                                       │  as float32, re-quantised to groups)
                                       │  ── read_groups / requantise ─► Int8GroupWeight
                                       └─ any part float (F32/F16/BF16, safetensors)
                                          ── read ─► float tensor, as with "none"
    vocabulary rows, quantised ── the same groups: embedding GroupRows, head as
                                  a linear (its top logits re-scored from them)

The grouped types are exact up to the kernels' bfloat16 scales and
activations.  The others are re-quantised (:func:`requantise`) to groups
of 32 at 8 bits with a bfloat16 scale, Q8_0's layout: each value moves by
at most 1/254 of its group's largest (Q6_K's own rounding moves it by up
to 1/62 of its 16-element sub-block's largest), and the head's exact
re-score reads the re-quantised rows, not the file's.  Measured on a
tiny Q6_K model (logits up to ~15, ``test_quantized``): within 0.27 of the
dequantised logits (mean 0.06), same greedy tokens; with one scale per row
instead (the int8 kernel), 0.37 (mean 0.07).
A tensor-parallel column slice (o_proj, down_proj) that does not start or
end on a group edge (an uneven split: 1024 MLP columns at TP=3 give
[0, 342), [342, 683), [683, 1024)) reads the groups that cover it, whole,
and its input is padded with zeros to them (``PaddedColumns``): exact too.
(The re-quantised types and the float path read the covering blocks, 256
elements for the K-quants, and cut the columns after dequantising.)

``"none"`` dequantises everything to the model's dtype at load (the float
path).  Packing happens only on a CPU device (the kernels are CPU ones) and
touches the attention and MLP linears, the vocabulary rows and a
mixture-of-experts block's experts (each held expert's gate/up and down as
two linears, ``mpexec.models.moe``); norms, biases and the routers stay
float.  A rank packs only the slices it reads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from mpexec.models.layers.quantized import (
    GROUP,
    GroupRows,
    Int4Weight,
    Int8GroupWeight,
    PaddedColumns,
    Rows,
    Weight,
)

QUANTIZATION_MODES = ("auto", "none")

# (name, dim, start, stop) of Checkpoint.read
Slice = tuple[str, int | None, int, int | None]


def check_quantization(value: Any) -> str:
    """``value`` if it is a known mode; ValueError naming the field otherwise."""
    if value not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; "
                         f"got {value!r}")
    return str(value)


class WeightBuilder:
    """Builds a stage's weights from checkpoint slices, packed where the mode says.

    ``whole``: read whole tensors (one rank holds everything), ignoring the
    slice bounds, as one contiguous read.  ``packed`` counts what was built
    (``int4``, ``int8``, ``float``) for the stage's description.
    """

    def __init__(self, checkpoint: Any, *, quantization: str, dtype: torch.dtype,
                 device: torch.device, whole: bool) -> None:
        self.checkpoint = checkpoint
        self.pack = (check_quantization(quantization) == "auto" and device.type == "cpu"
                     and hasattr(checkpoint, "read_groups"))
        self.dtype = dtype
        self.device = device
        self.whole = whole
        self.packed: Counter[str] = Counter()
        self.requantised = 0  # checkpoint tensors (or slices) without groups of 32

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """A float slice in the model's dtype (norms, biases, what is not packed)."""
        if self.whole:
            dim, start, stop = None, 0, None
        return self.checkpoint.read(name, dim=dim, start=start, stop=stop,
                                    dtype=self.dtype).to(self.device).contiguous()

    def linear(self, parts: list[Slice]) -> Weight:
        """The slices concatenated along the output rows, as one weight."""
        if self.pack and all(self.checkpoint.is_quantized(p[0]) for p in parts):
            before, after, covering = self._group_edges(parts)
            groups = self._groups(covering)
            if groups is not None:
                grouped = self._grouped(*groups)
                return PaddedColumns(grouped, before, after) if before or after else grouped
        self.packed["float"] += 1
        return torch.cat([self.read(*part) for part in parts])

    def vocab(self, name: str, start: int, stop: int, *, embedding: bool,
              head: bool) -> tuple[Rows | None, Weight | None, GroupRows | None]:
        """Vocabulary rows ``[start, stop)`` as the embedding's rows and/or the
        head's weight (tied: one read serves both), and for a packed head the
        same rows readable one by one (its top logits are re-scored exactly)."""
        if self.pack and self.checkpoint.is_quantized(name):
            groups = self._groups([(name, 0, start, stop)])
            if groups is not None:
                rows = GroupRows(*groups)  # shares the tensors of ``groups``
                if embedding:
                    self.packed["rows"] += 1
                if not head:
                    return rows, None, None
                return rows if embedding else None, self._grouped(*groups), rows
        self.packed["float"] += 1
        rows_read = self.read(name, 0, start, stop)
        return rows_read if embedding else None, rows_read if head else None, None

    def _group_edges(self, parts: list[Slice]) -> tuple[int, int, list[Slice]]:
        """A column slice widened to whole groups of 32 (``before`` and ``after``
        columns more), so that its groups can be packed whole; rows as they are."""
        if self.whole or len(parts) != 1 or parts[0][1] != 1:
            return 0, 0, parts
        name, dim, start, stop = parts[0]
        columns = self.checkpoint.shape(name)[1]
        stop = columns if stop is None else stop
        first, last = start - start % GROUP, min(-(-stop // GROUP) * GROUP, columns)
        return start - first, last - stop, [(name, dim, first, last)]

    def _groups(self, parts: list[Slice]) -> tuple[torch.Tensor, ...] | None:
        """(q, scale, minimum) of the parts' rows concatenated: each part's
        stored groups of 32, or its values re-quantised to groups (types
        without such groups); None for an empty slice."""
        found = []
        for name, dim, start, stop in parts:
            if self.whole:
                dim, start, stop = None, 0, None
            groups = self.checkpoint.read_groups(name, dim, start, stop)
            if groups is None:
                values = self.checkpoint.read(name, dim=dim, start=start, stop=stop,
                                              dtype=torch.float32)
                if values.shape[-1] % GROUP:
                    return None
                self.requantised += 1
                groups = tuple(t.numpy() for t in requantise(values))
            found.append(groups)
        q, scale, minimum = (torch.from_numpy(np.concatenate([g[i] for g in found]))
                             for i in range(3))
        return (q, scale, minimum) if len(q) else None

    def _grouped(self, q: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor) -> Int4Weight | Int8GroupWeight:
        if int(q.max()) <= 15:
            self.packed["int4"] += 1
            return Int4Weight(q, scale, minimum)
        self.packed["int8 in groups"] += 1
        return Int8GroupWeight(q, scale, minimum)

    def describe(self) -> str:
        """e.g. ``"int4 ×120, int8 in groups ×1, rows ×1"`` (``"float"``: nothing
        packed), and how many checkpoint tensors were re-quantised."""
        kinds = [f"{kind} ×{n}" for kind, n in sorted(self.packed.items()) if kind != "float"]
        if self.requantised:
            kinds.append(f"{self.requantised} re-quantised")
        return ", ".join(kinds) or "float"


def requantise(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float ``values`` (rows, cols; cols a multiple of 32) as groups of 32 at 8
    bits, Q8_0's way: scale ``s = max|w| / 127`` (rounded to bfloat16, the
    kernels' scale type), ``q = round(w / s) + 128``, minimum ``−128·s``.
    Each value moves by at most ``s/2``: 1/254 of its group's largest."""
    groups = values.float().unflatten(-1, (-1, GROUP))
    scale = (groups.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny) \
        .to(torch.bfloat16).float()
    q = torch.round(groups / scale.unsqueeze(-1)).clamp(-127, 127) + 128
    return q.to(torch.uint8).flatten(-2), scale, -128 * scale
