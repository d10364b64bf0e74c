"""Which weights a rank keeps packed (``quantization="auto"``) and how.

    checkpoint slice(s) of one linear ─┬─ every part Q4_0/Q4_1/Q4_K, columns on group
                                       │  edges  ── read_groups ─► Int4Weight
                                       ├─ every part one of those or Q8_0
                                       │  ── read_groups ─► Int8GroupWeight
                                       ├─ every part quantised otherwise (Q5_*, Q6_K,
                                       │  other K and IQ types) ── read (float32)
                                       │  ─► Int8Weight (re-quantised, per-row scale)
                                       └─ any part float (F32/F16/BF16, safetensors)
                                          ── read ─► float tensor, as with "none"
    vocabulary rows, quantised ─┬─ grouped: embedding GroupRows, head as a linear
                                └─ otherwise: one Int8Weight for both

The first two are exact up to the kernels' bfloat16 scales and activations;
the re-quantised ones lose more (a scale per row, not per 32 elements).

``"none"`` dequantises everything to the model's dtype at load (the float
path).  Packing happens only on a CPU device (the kernels are CPU ones) and
touches the attention and MLP linears and the vocabulary rows; norms,
biases and MoE experts stay float.  A rank packs only the slices it reads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from mpexec.models.layers.quantized import (
    GroupRows,
    Int4Weight,
    Int8GroupWeight,
    Int8Weight,
    PackedRows,
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
            groups = self._groups(parts)
            if groups is not None:
                return self._grouped(*groups)
            weight = torch.cat([self._float32(*part) for part in parts])
            if len(weight):
                self.packed["int8 per row"] += 1
                return Int8Weight(weight)
        self.packed["float"] += 1
        return torch.cat([self.read(*part) for part in parts])

    def vocab(self, name: str, start: int, stop: int, *, embedding: bool,
              head: bool) -> tuple[Rows | None, Weight | None, PackedRows | None]:
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
            weight = self._float32(name, 0, start, stop)
            if len(weight):
                self.packed["int8 per row"] += 1
                both = Int8Weight(weight)
                return both if embedding else None, both if head else None, \
                    both if head else None
        self.packed["float"] += 1
        rows_read = self.read(name, 0, start, stop)
        return rows_read if embedding else None, rows_read if head else None, None

    def _groups(self, parts: list[Slice]) -> tuple[torch.Tensor, ...] | None:
        """(q, scale, minimum) of the parts' rows concatenated; None if one part
        has no groups of 32 (or the slice is empty)."""
        found = []
        for name, dim, start, stop in parts:
            if self.whole:
                dim, start, stop = None, 0, None
            groups = self.checkpoint.read_groups(name, dim, start, stop)
            if groups is None:
                return None
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
        """e.g. ``"int4 ×120, int8 in groups ×1, rows ×1"`` (``"float"``: nothing packed)."""
        kinds = [f"{kind} ×{n}" for kind, n in sorted(self.packed.items()) if kind != "float"]
        return ", ".join(kinds) or "float"

    def _float32(self, name: str, dim: int | None, start: int,
                 stop: int | None) -> torch.Tensor:
        if self.whole:
            dim, start, stop = None, 0, None
        return self.checkpoint.read(name, dim=dim, start=start, stop=stop, dtype=torch.float32)
