"""The GGUF header: metadata and tensor table, parsed straight from the mapped file.

    "GGUF"  u32 version (2 or 3)  u64 tensor_count  u64 kv_count
    kv_count ×     string key, u32 value type, value
    tensor_count × string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
                   u64 offset (from the start of the data section)
    padding to general.alignment (default 32), then the tensor data

    string = u64 length + UTF-8 bytes; array = u32 element type, u64 count,
    elements.  Everything little-endian.

Why not ``gguf.GGUFReader``: it builds a numpy view for every part of every
field, about six seconds for SmolLM2's 98,000 tokenizer strings on this
machine, paid by every worker process at load.  This parser reads the same
header in a fraction of a second; the tests check it against GGUFReader
field by field and tensor by tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpexec.models.config import CheckpointError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the row length
    ggml_type: int
    offset: int          # absolute, in bytes from the start of the file


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: list[TensorEntry]
    data: np.ndarray  # the whole file, memory-mapped read-only, as uint8


def read_header(path: Path) -> GGUFHeader:
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(path, "header", f"cannot map the file ({e})") from None
    parser = _Parser(data.data, path)
    try:
        return parser.parse(data)
    except (struct.error, IndexError, ValueError) as e:
        raise CheckpointError(path, "header", f"truncated or corrupt GGUF header at byte "
                              f"{parser.pos} ({e})") from None
    finally:
        parser.buffer.release()


class _Parser:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def parse(self, data: np.ndarray) -> GGUFHeader:
        if bytes(self.buffer[:4]) != MAGIC:
            raise CheckpointError(self.path, "header", f"not a GGUF file (magic "
                                  f"{bytes(self.buffer[:4])!r}, expected {MAGIC!r})")
        self.pos = 4
        version = self.scalar("<I")
        if version not in (2, 3):
            raise CheckpointError(self.path, "header", f"GGUF version {version} is not "
                                  "supported (2 or 3, little-endian)")
        tensor_count, kv_count = self.scalar("<Q"), self.scalar("<Q")
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self.string()
            fields[key] = self.value(self.scalar("<I"))
        raw_tensors = []
        for _ in range(tensor_count):
            name = self.string()
            n_dims = self.scalar("<I")
            ne = tuple(self.scalar("<Q") for _ in range(n_dims))
            raw_tensors.append((name, ne, self.scalar("<I"), self.scalar("<Q")))
        alignment = int(fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(self.path, "general.alignment",
                                  f"{alignment} is not a power of two")
        start = -(-self.pos // alignment) * alignment
        tensors = [TensorEntry(name, ne, kind, start + offset)
                   for name, ne, kind, offset in raw_tensors]
        return GGUFHeader(version, fields, tensors, data)

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise IndexError(f"string of {length} bytes runs past the end of the file")
        text = str(self.buffer[self.pos:end], "utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _NUMPY:  # numeric arrays in one go
                dtype = np.dtype(_NUMPY[item_kind])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buffer):
                    raise IndexError(f"array of {count} runs past the end of the file")
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return values.tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")
