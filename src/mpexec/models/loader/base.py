"""What every checkpoint format gives the model: names, shapes, slices.

    model (one rank) ── read(name, dim, start, stop) ──► Checkpoint ──► disk
                                                          │  only the bytes of
                                                          │  that slice (where
                                                          ▼  the format allows)
                                          torch tensor in Hugging Face layout

A rank of a tensor-parallel model asks for its rows (``dim=0``) or columns
(``dim=1``) of each weight, and the replicated tensors whole.  The format
classes (``hf.HFCheckpoint``, ``gguf_file.GGUFCheckpoint``) implement
``_shape`` and ``_read_slice``; this class checks the request, counts nothing
itself (``bytes_read`` is the format's count of bytes taken from the file),
and on open checks every tensor the config implies is there with the shape it
implies (``expected_shapes``), so a damaged or mismatched checkpoint fails at
open with the file and the tensor named, not later inside a matmul.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from mpexec.models.config import CheckpointError, ModelConfig

# (q, scale, minimum): uint8 values, float32 per group of 32; x = scale·q + minimum
FourBitGroups = tuple["np.ndarray", "np.ndarray", "np.ndarray"]

if TYPE_CHECKING:
    import numpy as np
    import torch

    from mpexec.models.tokenizer import Tokenizer


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter stored in the checkpoint, in Hugging Face names, with its shape."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    features = config.features
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if features.fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if features.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if features.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if config.moe is not None and config.moe.is_sparse(layer):
            shapes.update(config.moe.shapes(layer, h))
        elif features.fused_qkv:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def split_views(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Parameters stored fused (Phi-3's qkv_proj and gate_up_proj) under the
    names the model reads: name → (stored name, first row, rows)."""
    if not config.features.fused_qkv:
        return {}
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    i = config.intermediate_size
    views = {}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        qkv, gate_up = p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"
        views[p + "self_attn.q_proj.weight"] = (qkv, 0, q)
        views[p + "self_attn.k_proj.weight"] = (qkv, q, kv)
        views[p + "self_attn.v_proj.weight"] = (qkv, q + kv, kv)
        views[p + "mlp.gate_proj.weight"] = (gate_up, 0, i)
        views[p + "mlp.up_proj.weight"] = (gate_up, i, i)
    return views


class Checkpoint:
    """An open checkpoint; see the module docstring.  Use as a context manager."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        self.path = path
        self.config = config
        self.bytes_read = 0
        self._shapes = expected_shapes(config)
        self._views = split_views(config)
        fused = {stored for stored, _, _ in self._views.values()}
        self._names = [n for n in self._shapes if n not in fused] + list(self._views)

    # ── the API the model uses ───────────────────────────────────────────

    def names(self) -> list[str]:
        """The parameters the model reads (a fused tensor under its parts' names)."""
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        view = self._views.get(name)
        if view is not None:
            return (view[2], *self._shapes[view[0]][1:])
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"{self.path}: no parameter {name!r}") from None

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int = 0,
        stop: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``tensor[start:stop]`` along ``dim`` (the whole tensor when ``dim`` is None)."""
        import torch

        shape = self.shape(name)
        dim, start, stop = self._check_slice(name, dim, start, stop)
        if start == stop:  # an empty share (more ranks than rows) reads nothing
            empty = list(shape)
            empty[dim] = 0
            return torch.empty(empty, dtype=torch.float32 if dtype is None else dtype)
        view = self._views.get(name)
        if view is not None:  # rows of a fused tensor
            stored, first, rows = view
            if dim == 0:
                tensor = self._read_slice(stored, 0, first + start, first + stop)
            else:
                tensor = self._read_slice(stored, 0, first, first + rows).narrow(
                    dim, start, stop - start)
        else:
            tensor = self._read_slice(name, dim, start, stop)
        return tensor.to(torch.float32 if dtype is None else dtype)

    def is_quantized(self, name: str) -> bool:
        """Whether the file stores ``name`` in a quantised (block) encoding."""
        return False

    def read_groups(self, name: str, dim: int | None = None, start: int = 0,
                    stop: int | None = None) -> FourBitGroups | None:
        """The slice of a 2-D weight as its stored groups of 32 (see
        ``quants.groups_of``), exactly; None when the tensor's type has no such
        groups or a column slice does not fall on group edges."""
        shape = self.shape(name)
        if len(shape) != 2:
            return None
        dim, start, stop = self._check_slice(name, dim, start, stop)
        if start == stop:
            return None
        stored, first = name, 0
        view = self._views.get(name)
        if view is not None:
            stored, first = view[0], view[1]
        if dim == 0:
            return self._read_groups(stored, first + start, first + stop, 0, shape[1])
        return self._read_groups(stored, first, first + shape[0], start, stop)

    def _check_slice(self, name: str, dim: int | None, start: int,
                     stop: int | None) -> tuple[int, int, int]:
        shape = self.shape(name)
        if dim is None:
            return 0, 0, shape[0]
        if not -len(shape) <= dim < len(shape):
            raise IndexError(f"{self.path}: {name} has {len(shape)} dims, asked for dim {dim}")
        dim %= len(shape)
        stop = shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= shape[dim]:
            raise IndexError(f"{self.path}: {name}: slice [{start}:{stop}] outside "
                             f"0..{shape[dim]} along dim {dim}")
        return dim, start, stop

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def close(self) -> None:
        """Release file handles and mappings; idempotent."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    # ── what a format implements ─────────────────────────────────────────

    def _read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def _read_groups(self, name: str, row0: int, row1: int, col0: int,
                     col1: int) -> FourBitGroups | None:
        return None

    def _check_tensors(self, found: dict[str, tuple[int, ...]], where: dict[str, Any]) -> None:
        """Every expected tensor present with its shape; ``where[name]`` names its file."""
        for name, want in self._shapes.items():
            if name not in found:
                raise CheckpointError(self.path, name, "tensor missing from the checkpoint")
            if tuple(found[name]) != want:
                raise CheckpointError(where.get(name, self.path), name,
                                      f"shape {tuple(found[name])} does not match the "
                                      f"config's {want}")
