"""Open a checkpoint (Hugging Face directory or GGUF file) for slice-wise reads.

    open_checkpoint(path) ─┬─ directory with config.json ─► hf.HFCheckpoint
                           └─ file ending in .gguf        ─► gguf_file.GGUFCheckpoint

Both are a ``base.Checkpoint``: ``.config``, ``.names()``, ``.shape(name)``,
``.read(name, dim, start, stop, dtype)`` in Hugging Face layout,
``.bytes_read``, ``.tokenizer()``, ``.close()``.

``checkpoint_tokenizer(path, config)`` is the tokenizer alone, for a caller
that read the checkpoint's config before: it reads only what the tokenizer
needs (``tokenizer.json``, or the GGUF header that holds the vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mpexec.models.config import CheckpointError, ModelConfig
from mpexec.models.loader.base import Checkpoint, expected_shapes

if TYPE_CHECKING:
    from mpexec.models.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "checkpoint_tokenizer", "expected_shapes",
           "open_checkpoint"]


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


def checkpoint_tokenizer(path: str | Path, config: ModelConfig) -> Tokenizer:
    """The tokenizer of the checkpoint at ``path``, whose config ``config``
    was read from it before (``open_checkpoint(path).config``): neither
    config.json nor the GGUF tensor table is read again."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from mpexec.models.loader.gguf_header import read_header
        from mpexec.models.loader.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(read_header(path).fields, source=path, config=config)
    from mpexec.models.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(path, config=config)
