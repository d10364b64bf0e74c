"""Open a checkpoint (Hugging Face directory or GGUF file) for slice-wise reads.

    open_checkpoint(path) ─┬─ directory with config.json ─► hf.HFCheckpoint
                           └─ file ending in .gguf        ─► gguf_file.GGUFCheckpoint

Both are a ``base.Checkpoint``: ``.config``, ``.names()``, ``.shape(name)``,
``.read(name, dim, start, stop, dtype)`` in Hugging Face layout,
``.bytes_read``, ``.tokenizer()``, ``.close()``.
"""

from __future__ import annotations

from pathlib import Path

from mpexec.models.config import CheckpointError
from mpexec.models.loader.base import Checkpoint, expected_shapes

__all__ = ["Checkpoint", "CheckpointError", "expected_shapes", "open_checkpoint"]


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path).expanduser()
    if path.is_dir():
        from mpexec.models.loader.hf import HFCheckpoint

        return HFCheckpoint(path)
    if path.is_file() and path.suffix == ".gguf":
        from mpexec.models.loader.gguf_file import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (a .gguf file or a Hugging Face "
                                "directory with config.json)")
    raise CheckpointError(path, "path", "not a .gguf file nor a directory with config.json")
