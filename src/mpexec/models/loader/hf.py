"""Hugging Face checkpoint directories: config.json + safetensors shards.

    directory/
      config.json                     ─► ModelConfig.from_hf_dir
      model.safetensors.index.json    ─► weight_map: tensor name → shard file
      model-00001-of-00002.safetensors   (or any *.safetensors without an index)
      tokenizer.json, tokenizer_config.json ─► tokenizer()

At open each shard's header (an 8-byte length, then JSON: name → dtype,
shape, byte range) is read and checked against the file size and the config,
without torch, so a truncated or mismatched shard fails at once with its
name.  On its first read a shard is opened with ``safetensors.safe_open``
(memory-mapped) and a read goes through ``get_slice(name)[...]``, which
copies only the requested rows or columns out of the mapping.
``bytes_read`` adds the bytes of each slice returned, which is what a rank
reading its tensor-parallel share costs.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpexec.models.config import CheckpointError, ModelConfig
from mpexec.models.loader.base import Checkpoint

if TYPE_CHECKING:
    import torch

    from mpexec.models.tokenizer import Tokenizer

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20
_FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


class HFCheckpoint(Checkpoint):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory, ModelConfig.from_hf_dir(directory))
        self._files: dict[str, Any] = {}  # shard path → safe_open handle
        self._where: dict[str, Path] = {}  # tensor name → shard path
        try:
            self._open_shards()
        except BaseException:
            self.close()
            raise

    def _open_shards(self) -> None:
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(index_path, "weight_map", f"unreadable ({e!r})") from None
            shard_names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            shard_names = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shard_names:
                raise CheckpointError(self.path, "*.safetensors",
                                      "no weight files in the directory")

        found: dict[str, tuple[int, ...]] = {}
        for shard_name in shard_names:
            shard = self.path / shard_name
            if not shard.is_file():
                raise CheckpointError(shard, "file", f"missing (listed in {INDEX_NAME})")
            for name, (dtype, shape) in read_safetensors_header(shard).items():
                if weight_map is not None and weight_map.get(name) != shard_name:
                    continue
                if name in self._shapes and dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(shard, name, f"dtype {dtype} is not a float type")
                found[name] = shape
                self._where[name] = shard
        if weight_map is not None:
            for name, shard_name in weight_map.items():
                if name in self._shapes and name not in found:
                    raise CheckpointError(self.path / shard_name, name,
                                          f"tensor missing (listed in {INDEX_NAME})")
        self._check_tensors(found, dict(self._where))

    def _read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        shard = self._where[name]
        tensor_slice = self._handle(shard).get_slice(name)
        index = tuple(slice(start, stop) if d == dim else slice(None)
                      for d in range(len(self.shape(name))))
        try:
            tensor = tensor_slice[index]
        except Exception as e:  # safetensors raises its own error type for a short file
            raise CheckpointError(shard, name, f"tensor data unreadable ({e})") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _handle(self, shard: Path) -> Any:
        """The shard's safe_open handle, opened on its first read (needs torch)."""
        handle = self._files.get(str(shard))
        if handle is None:
            from safetensors import SafetensorError, safe_open

            try:
                handle = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(shard, "header", f"not a readable safetensors file ({e})"
                                      ) from None
            self._files[str(shard)] = handle
        return handle

    def tokenizer(self) -> Tokenizer:
        from mpexec.models.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(self.path, config=self.config)

    def close(self) -> None:
        # safe_open handles unmap when dropped; dropping every reference is the close.
        self._files.clear()


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def read_safetensors_header(shard: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of one safetensors file, every byte range checked."""
    size = shard.stat().st_size
    with shard.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(shard, "header", "file shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(shard, "header", f"header length {length} does not fit the "
                                  f"file ({size} bytes): truncated or not safetensors")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(shard, "header", f"not a safetensors JSON header ({e})"
                                  ) from None
    if not isinstance(header, dict):
        raise CheckpointError(shard, "header", "not a safetensors JSON header")
    data_bytes = size - 8 - length
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(shard, name, f"malformed header entry {entry!r}") from None
        if end > data_bytes:
            raise CheckpointError(shard, name, f"tensor data ends at byte {end} of a "
                                  f"{data_bytes}-byte data section: the file is truncated")
        if dtype in _ITEM_BYTES and end - begin != math.prod(shape) * _ITEM_BYTES[dtype]:
            raise CheckpointError(shard, name, f"{end - begin} bytes for a {dtype} tensor "
                                  f"of shape {shape}")
        entries[name] = (dtype, shape)
    return entries
