"""GGUF tensor encodings, dequantised by ``gguf``'s own ``gguf.quants``.

A GGUF tensor is stored row by row (a row is the last torch dimension, GGUF's
``ne[0]``).  Float types store each element; the quantised types cut a row
into self-contained blocks: 32 elements for the legacy types (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4), 256-element *super-blocks* for the K-quants
(Q2_K … Q6_K) and most IQ types.  Rows are independent and so are blocks,
which is what lets a reader take a slice of rows, or of whole blocks along a
row, without touching the rest of the tensor.

Which types load is decided by the installed ``gguf``: every type its
``gguf.quants.dequantize`` implements (block sizes from
``gguf.GGML_QUANT_SIZES``), checked once per type by dequantising one zero
block.  Integer tensors and the types it cannot dequantise are refused at
open (:func:`encoding_of` returns None).

Five encodings keep a numpy path of their own, bit-identical to gguf's and
1.4-2.3× faster on SmolLM2's tensors (``gguf`` splits a tensor into groups
of 16 rows and splits each block again; these work on the whole slice):

    F32, F16, BF16   the values, widened to float32
    Q8_0  34 bytes: f16 scale d, 32 × int8 q               x = d·q
    Q4_0  18 bytes: f16 scale d, 16 bytes of nibbles       x = d·(q − 8)
    Q4_1  20 bytes: f16 scale d, f16 minimum m, 16 bytes   x = d·q + m

In the 4-bit types byte ``i`` of a block holds element ``i`` in its low
nibble and element ``i + 16`` in its high nibble.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGML type numbers of the encodings decoded here (ggml's type enum).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_OWN = (F32, F16, Q4_0, Q4_1, Q8_0, BF16)


@dataclass(frozen=True)
class Encoding:
    name: str
    ggml_type: int
    block_elements: int  # elements per block (1 for plain floats)
    block_bytes: int

    def row_bytes(self, columns: int) -> int:
        return columns // self.block_elements * self.block_bytes


@functools.cache
def encoding_of(ggml_type: int) -> Encoding | None:
    """The encoding of GGML type ``ggml_type``, or None when it cannot be dequantised."""
    import gguf

    try:
        kind = gguf.GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    elements, size = gguf.GGML_QUANT_SIZES[kind]
    encoding = Encoding(kind.name, int(kind), elements, size)
    if ggml_type in _OWN:
        return encoding
    try:  # one zero block: does this gguf implement the type?
        with np.errstate(all="ignore"):
            out = gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), kind)
    except NotImplementedError:
        return None
    if out.shape != (1, elements) or out.dtype != np.float32:  # an integer type
        return None
    return encoding


def supported_names() -> list[str]:
    """Names of every GGML type this installation loads."""
    import gguf

    return [kind.name for kind in gguf.GGMLQuantizationType if encoding_of(int(kind))]


def dequantize(raw: Any, encoding: Encoding) -> np.ndarray:
    """``raw``: uint8 array ``(rows, bytes per row)`` of whole blocks → float32 ``(rows, cols)``.

    Scales that are inf or NaN in the file come out as inf/NaN values, silently:
    the bytes are what they are, and numpy's floating-point warnings would only
    turn a damaged weight into an exception in one place and not another.
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if encoding.ggml_type in _OWN:
        rows = raw.shape[0]
        out = np.empty((rows, raw.shape[1] // encoding.block_bytes * encoding.block_elements),
                       dtype=np.float32)
        # in chunks of about 1 MB of input: the temporaries stay in cache
        step = max(1, (1 << 20) // max(raw.shape[1], 1))
        with np.errstate(all="ignore"):
            for row in range(0, rows, step):
                out[row:row + step] = _dequantize_own(raw[row:row + step], encoding)
        return out
    import gguf

    kind = gguf.GGMLQuantizationType(encoding.ggml_type)
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(raw, kind)
    return np.asarray(values, dtype=np.float32).reshape(raw.shape[0], -1)


def _dequantize_own(raw: np.ndarray, encoding: Encoding) -> np.ndarray:
    rows = raw.shape[0]
    kind = encoding.ggml_type
    if kind == F32:
        return raw.view(np.float32).reshape(rows, -1).copy()
    if kind == F16:
        return raw.view(np.float16).reshape(rows, -1).astype(np.float32)
    if kind == BF16:
        # bfloat16 is the top half of a float32.
        upper = raw.view(np.uint16).reshape(rows, -1).astype(np.uint32)
        return (upper << 16).view(np.float32)
    blocks = raw.reshape(rows, -1, encoding.block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    if kind == Q8_0:
        values = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (scale * values).reshape(rows, -1)
    if kind == Q4_0:
        return (scale * (_nibbles(blocks[..., 2:]) - 8.0)).reshape(rows, -1)
    minimum = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)  # Q4_1
    return (scale * _nibbles(blocks[..., 4:]) + minimum).reshape(rows, -1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 packed bytes per block → 32 values: low nibbles first, then high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)


# ── groups of 32, for weights kept packed ─────────────────────────────────

Q5_0, Q5_1, Q4_K = 6, 7, 12
GROUP = 32  # elements that share one scale and minimum in every type below
GROUPED = (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0)


def groups_of(raw: Any, encoding: Encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``raw`` (rows, bytes per row) of a type in ``GROUPED`` → ``(q, scale, minimum)``,
    exactly.

    ``q``: uint8 ``(rows, cols)`` (0..15 for the 4-bit types, 0..31 for the
    5-bit ones, 0..255 for Q8_0);
    ``scale``, ``minimum``: float32 ``(rows, cols / 32)``; element
    ``x = scale·q + minimum`` of its group of 32.

        Q8_0   scale d, minimum −128·d   (q = the stored int8 + 128)
        Q5_0   22 bytes: f16 d, 32 high bits (bit j: element j), 16 bytes of
               nibbles as Q4_0;  scale d, minimum −16·d
        Q5_1   24 bytes: f16 d, f16 m, then as Q5_0;  scale d, minimum m
        Q4_0   scale d, minimum −8·d
        Q4_1   scale d, minimum m
        Q4_K   144-byte super-block of 256: f16 d, f16 dmin, 12 bytes of eight
               6-bit (sc, m) pairs, 128 bytes of nibbles (chunk j of 64 elements:
               32 bytes, sub-block 2j in the low nibbles, 2j+1 in the high);
               sub-block s: scale d·sc[s], minimum −dmin·m[s]
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows, kind = raw.shape[0], encoding.ggml_type
    blocks = raw.reshape(rows, -1, encoding.block_bytes)
    half = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    if kind == Q8_0:
        q = (blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(rows, -1), half, -128 * half
    if kind in (Q5_0, Q5_1):
        start = 4 if kind == Q5_1 else 2
        bits = blocks[..., start:start + 4].copy().view(np.uint32)  # (rows, blocks, 1)
        high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        nibbles = blocks[..., start + 4:]
        q = (np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | high << 4)
        if kind == Q5_0:
            return q.reshape(rows, -1), half, -16 * half
        minimum = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        return q.reshape(rows, -1), half, minimum
    if kind in (Q4_0, Q4_1):
        nibbles = blocks[..., 4:] if kind == Q4_1 else blocks[..., 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
        if kind == Q4_0:
            return q, half, -8 * half
        return q, half, blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    if kind != Q4_K:
        raise ValueError(f"{encoding.name} is not a type with groups of {GROUP}")
    import gguf

    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(rows, -1, 8).astype(np.float32)
    m = m.reshape(rows, -1, 8).astype(np.float32)
    scale = (half[..., None] * sc).reshape(rows, -1)
    minimum = (-dmin * m).reshape(rows, -1)
    nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-2).reshape(rows, -1)
    return q, scale, minimum
