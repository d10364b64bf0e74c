"""Which weights a rank keeps packed (``quantization="auto"``) and how.

    checkpoint slice(s) of one linear ─┬─ every part a 4-bit type, columns on
                                       │  group edges  ── read_groups ─► Int4Weight
                                       ├─ every part quantised (8-, 5-, 6-bit, K, IQ …)
                                       │  ── read (float32) ─► Int8Weight (per-row scale)
                                       └─ any part float (F32/F16/BF16, safetensors)
                                          ── read ─► float tensor, as with "none"
    embedding / LM head rows, quantised  ── read ─► Int8Weight (lookup and int8 head)

``"none"`` dequantises everything to the model's dtype at load (the float
path).  Packing happens only on a CPU device (the kernels are CPU ones) and
touches the attention and MLP linears and the vocabulary rows; norms,
biases and MoE experts stay float.  A rank packs only the slices it reads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from mpexec.models.layers.quantized import Int4Weight, Int8Weight, Weight

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
            groups = [self._groups(*part) for part in parts]
            if all(g is not None for g in groups):
                q, scale, minimum = (torch.cat([torch.from_numpy(g[i]) for g in groups
                                                if g is not None]) for i in range(3))
                if len(q):
                    self.packed["int4"] += 1
                    return Int4Weight(q, scale, minimum)
            weight = torch.cat([self._float32(*part) for part in parts])
            if len(weight):
                self.packed["int8"] += 1
                return Int8Weight(weight)
        self.packed["float"] += 1
        return torch.cat([self.read(*part) for part in parts])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor | Int8Weight:
        """Vocabulary rows ``[start, stop)`` of the embedding or the LM head."""
        if self.pack and self.checkpoint.is_quantized(name) and stop > start:
            self.packed["int8"] += 1
            return Int8Weight(self._float32(name, 0, start, stop))
        self.packed["float"] += 1
        return self.read(name, 0, start, stop)

    def describe(self) -> str:
        """e.g. ``"int4 ×60, int8 ×31"`` (``"float"`` when nothing is packed)."""
        kinds = [f"{kind} ×{n}" for kind, n in sorted(self.packed.items()) if kind != "float"]
        return ", ".join(kinds) or "float"

    def _groups(self, name: str, dim: int | None, start: int, stop: int | None) -> Any:
        if self.whole:
            dim, start, stop = None, 0, None
        return self.checkpoint.read_groups(name, dim, start, stop)

    def _float32(self, name: str, dim: int | None, start: int,
                 stop: int | None) -> torch.Tensor:
        if self.whole:
            dim, start, stop = None, 0, None
        return self.checkpoint.read(name, dim=dim, start=start, stop=stop, dtype=torch.float32)
