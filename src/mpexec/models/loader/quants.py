"""GGUF tensor encodings, dequantised with numpy from their block layout.

A GGUF tensor is stored row by row (a row is the last torch dimension, GGUF's
``ne[0]``).  Float types store each element; the quantised types cut a row
into blocks of 32 elements, each block self-contained:

    Q8_0  34 bytes: f16 scale d, 32 × int8 q               x = d·q
    Q4_0  18 bytes: f16 scale d, 16 bytes of nibbles       x = d·(q − 8)
    Q4_1  20 bytes: f16 scale d, f16 minimum m, 16 bytes   x = d·q + m

In the 4-bit types byte ``i`` of a block holds element ``i`` in its low
nibble and element ``i + 16`` in its high nibble.  Rows are independent and
so are blocks, which is what lets a reader take a slice of rows, or of
whole blocks along a row, without touching the rest of the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_ELEMENTS = 32


@dataclass(frozen=True)
class Encoding:
    name: str
    block_elements: int  # elements per block (1 for plain floats)
    block_bytes: int

    def row_bytes(self, columns: int) -> int:
        return columns // self.block_elements * self.block_bytes


# GGML type number → encoding (numbers from ggml's type enum).
ENCODINGS = {
    0: Encoding("F32", 1, 4),
    1: Encoding("F16", 1, 2),
    2: Encoding("Q4_0", BLOCK_ELEMENTS, 18),
    3: Encoding("Q4_1", BLOCK_ELEMENTS, 20),
    8: Encoding("Q8_0", BLOCK_ELEMENTS, 34),
    30: Encoding("BF16", 1, 2),
}


def dequantize(raw: Any, encoding: Encoding) -> np.ndarray:
    """``raw``: uint8 array ``(rows, bytes per row)`` of whole blocks → float32 ``(rows, cols)``.

    Scales that are inf or NaN in the file come out as inf/NaN values, silently:
    the bytes are what they are, and numpy's floating-point warnings would only
    turn a damaged weight into an exception in one place and not another.
    """
    with np.errstate(all="ignore"):
        return _dequantize(np.ascontiguousarray(raw, dtype=np.uint8), encoding)


def _dequantize(raw: np.ndarray, encoding: Encoding) -> np.ndarray:
    rows = raw.shape[0]
    if encoding.name == "F32":
        return raw.view(np.float32).reshape(rows, -1).copy()
    if encoding.name == "F16":
        return raw.view(np.float16).reshape(rows, -1).astype(np.float32)
    if encoding.name == "BF16":
        # bfloat16 is the top half of a float32.
        upper = raw.view(np.uint16).reshape(rows, -1).astype(np.uint32)
        return (upper << 16).view(np.float32)
    blocks = raw.reshape(rows, -1, encoding.block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    if encoding.name == "Q8_0":
        values = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (scale * values).reshape(rows, -1)
    if encoding.name == "Q4_0":
        return (scale * (_nibbles(blocks[..., 2:]) - 8.0)).reshape(rows, -1)
    if encoding.name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        return (scale * _nibbles(blocks[..., 4:]) + minimum).reshape(rows, -1)
    raise ValueError(f"no dequantisation for {encoding.name}")


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 packed bytes per block → 32 values: low nibbles first, then high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
