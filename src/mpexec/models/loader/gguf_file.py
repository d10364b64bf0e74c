"""GGUF files (llama.cpp's format) read as Hugging Face tensors.

    file ── gguf_header.read_header (memory-mapped) ──► metadata fields ─► ModelConfig
                                                     └─► tensor table: name, type, ne, offset
    read(hf_name, dim, start, stop)
        hf name ─► gguf name (blk.N.attn_q.weight …)
        rows [start:stop] (dim 0)        → only those rows' bytes
        columns [start:stop] (last dim)  → only the blocks that cover them (32
                                           elements, 256 for K-quant super-blocks)
        ─► quants.dequantize (gguf.quants) ─► Q/K rows put back in Hugging Face order
    read_groups(hf_name, dim, start, stop)   (Q4_0, Q4_1, Q4_K, Q8_0: kept packed)
        the same blocks ─► quants.groups_of ─► (q, scale, minimum), same order

Layout: GGUF lists dimensions fastest first (``ne[0]`` is the row length), so
a torch ``(out, in)`` weight appears as ``[in, out]``; the file's bytes are the
same row-major rows either way.  llama.cpp's converter interleaves the two
rotary halves of every Q and K head (row ``h·d + 2i + j`` of the file is row
``h·d + j·d/2 + i`` of the Hugging Face tensor) for the ``llama``
architecture; a read of Q or K rows takes whole heads and undoes it.

Mixture-of-experts files stack each projection of a layer's experts into
one tensor (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``,
torch shape ``[experts, rows, columns]``); expert e's rows are contiguous,
so each expert is read as a tensor of its own at an offset
(``model.layers.N.block_sparse_moe.experts.e.w1`` …, ``moe_config``).  The
router is ``ffn_gate_inp``, Qwen2-MoE's shared expert ``ffn_*_shexp`` and
its gate ``ffn_gate_inp_shexp`` (a vector in the file, ``[1, H]`` here).

Every check that can fail is done at open: the magic and header, that
each tensor's bytes lie inside the file, its type is one we decode, and it has
the shape the metadata implies.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpexec.models.config import CheckpointError, ModelConfig
from mpexec.models.loader.base import Checkpoint, FourBitGroups
from mpexec.models.loader.gguf_header import TensorEntry, read_header
from mpexec.models.loader.quants import (
    GROUP,
    GROUPED,
    Encoding,
    dequantize,
    encoding_of,
    groups_of,
    supported_names,
)

if TYPE_CHECKING:
    import torch

    from mpexec.models.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Where a family's converter names a tensor differently (llama.cpp's tensor map).
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES,
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                     "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Mixture of experts: the router and (Qwen2-MoE) the shared expert; the
# experts themselves are stacked, one tensor per projection (_STACKED_EXPERTS).
_QWEN_MOE_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp.weight": "mlp.gate.weight",
                         "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                         "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                         "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                         "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_ARCH_LAYER_NAMES = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES,
                     "phi3": _PHI3_LAYER_NAMES,
                     "llama": {**_LAYER_NAMES,
                               "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},
                     "qwen2moe": _QWEN_MOE_LAYER_NAMES, "qwen3moe": _QWEN_MOE_LAYER_NAMES}
# blk.N.<name>: [experts, rows, columns], expert e's rows contiguous ─► (gate, up, down) index
_STACKED_EXPERTS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1,
                    "ffn_down_exps.weight": 2}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF tensor (None: not a model weight)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    table = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if match and match.group(2) in table:
        return f"model.layers.{match.group(1)}.{table[match.group(2)]}"
    return None


class _TensorInfo:
    __slots__ = ("gguf_name", "encoding", "offset", "rows", "columns")

    def __init__(self, gguf_name: str, encoding: Encoding, offset: int, rows: int,
                 columns: int) -> None:
        self.gguf_name = gguf_name
        self.encoding = encoding
        self.offset = offset      # absolute byte offset of the first row in the file
        self.rows = rows          # product of all but the last torch dimension
        self.columns = columns    # the last torch dimension (GGUF's ne[0])

    @property
    def row_bytes(self) -> int:
        return self.encoding.row_bytes(self.columns)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        header = read_header(path)
        self._data: Any = header.data
        self._fields = header.fields
        self._infos: dict[str, _TensorInfo] = {}
        self._permuted_heads: dict[str, int] = {}
        self._norm_shift = 0.0
        self._rope_freqs: TensorEntry | None = None
        arch = self._fields.get("general.architecture")
        stacked: list[tuple[int, int, _TensorInfo]] = []
        found = self._scan_tensors(path, header.tensors, str(arch), stacked)
        config = ModelConfig.from_gguf_fields(self._fields, source=path,
                                              has_output_tensor="lm_head.weight" in found)
        self._split_experts(path, config, stacked, found)
        if self._rope_freqs is not None:
            config = self._with_rope_freqs(path, config, self._rope_freqs)
        layers = {name.split(".")[2] for name in found if name.startswith("model.layers.")}
        if config.num_hidden_layers != len(layers):
            raise CheckpointError(path, f"{config.architecture}.block_count",
                                  f"{config.num_hidden_layers}, but the file has tensors "
                                  f"for {len(layers)} layers")
        super().__init__(path, config)
        if config.architecture == "llama":  # the converter permutes llama's Q and K only
            for layer in range(config.num_hidden_layers):
                for proj in ("q_proj", "k_proj"):
                    for kind in ("weight", "bias"):
                        self._permuted_heads[f"model.layers.{layer}.self_attn.{proj}.{kind}"] \
                            = config.head_dim
        # llama.cpp stores Gemma's norm weights as 1 + w (what multiplies); read gives w.
        self._norm_shift = config.features.norm_offset
        self._check_tensors(found, {})

    def _with_rope_freqs(self, path: Path, config: ModelConfig,
                         tensor: TensorEntry) -> ModelConfig:
        """Llama 3.1's rope scaling as llama.cpp stores it: a float32 factor per
        rotary frequency, which divides that frequency."""
        name, half = tensor.name, config.head_dim // 2
        if config.rope_scaling is not None:
            raise CheckpointError(path, name, "rope frequency factors together with "
                                  f"{config.architecture}.rope.scaling.type: not supported")
        if tensor.ggml_type != 0 or tuple(tensor.ne) != (half,):
            raise CheckpointError(path, name, f"expected {half} float32 factors (head size "
                                  f"{config.head_dim}), got type {tensor.ggml_type}, "
                                  f"dimensions {list(tensor.ne)}")
        if tensor.offset + 4 * half > len(self._data):
            raise CheckpointError(path, name, "tensor data runs past the end of the file: "
                                  "the file is truncated")
        factors = np.frombuffer(self._data, dtype="<f4", count=half, offset=tensor.offset)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise CheckpointError(path, name, "factors must be positive and finite")
        features = dataclasses.replace(config.features,
                                       rope_freq_factors=tuple(float(f) for f in factors))
        return dataclasses.replace(config, features=features)

    def _split_experts(self, path: Path, config: ModelConfig,
                       stacked: list[tuple[int, int, _TensorInfo]],
                       found: dict[str, tuple[int, ...]]) -> None:
        """Each stacked expert tensor as one tensor per expert, under the names of
        a transformers checkpoint (expert e's rows follow expert e - 1's)."""
        if stacked and config.moe is None:
            raise CheckpointError(path, stacked[0][2].gguf_name, "expert tensors in a model "
                                  "without <arch>.expert_count")
        for layer, which, info in stacked:
            assert config.moe is not None
            experts = config.moe.num_experts
            if info.rows % experts:
                raise CheckpointError(path, info.gguf_name, f"{info.rows} rows are not "
                                      f"{experts} experts' (expert_count)")
            rows = info.rows // experts
            for expert in range(experts):
                name = config.moe.expert_names(layer, expert)[which]
                self._infos[name] = _TensorInfo(info.gguf_name, info.encoding,
                                                info.offset + expert * rows * info.row_bytes,
                                                rows, info.columns)
                found[name] = (rows, info.columns)

    def _scan_tensors(self, path: Path, tensors: list[TensorEntry], arch: str,
                      stacked: list[tuple[int, int, _TensorInfo]]
                      ) -> dict[str, tuple[int, ...]]:
        file_size = len(self._data)
        found: dict[str, tuple[int, ...]] = {}
        for tensor in tensors:
            if tensor.name == "rope_freqs.weight":
                self._rope_freqs = tensor
                continue
            match = _LAYER.fullmatch(tensor.name)
            which = _STACKED_EXPERTS.get(match.group(2)) if match else None
            name = hf_name(tensor.name, arch)
            if name is None and which is None:
                continue
            encoding = encoding_of(tensor.ggml_type)
            if encoding is None:
                raise CheckpointError(path, tensor.name, f"ggml type {tensor.ggml_type} "
                                      f"({_type_name(tensor.ggml_type)}) cannot be dequantised "
                                      f"by the installed gguf (supported: "
                                      f"{', '.join(supported_names())})")
            shape = tuple(reversed(tensor.ne))
            if not shape or min(shape) <= 0:
                raise CheckpointError(path, tensor.name, f"dimensions {list(tensor.ne)} are "
                                      "not a tensor")
            columns = shape[-1]
            if columns % encoding.block_elements:
                raise CheckpointError(path, tensor.name, f"row of {columns} elements is not "
                                      f"whole {encoding.name} blocks")
            rows = math.prod(shape[:-1])
            info = _TensorInfo(tensor.name, encoding, tensor.offset, rows, columns)
            if info.offset + rows * info.row_bytes > file_size:
                raise CheckpointError(path, tensor.name, f"tensor data runs past the end of the "
                                      f"file ({file_size} bytes): the file is truncated")
            if which is not None:
                assert match is not None
                if len(shape) != 3:
                    raise CheckpointError(path, tensor.name, f"dimensions {list(tensor.ne)}: "
                                          "expected [columns, rows, experts]")
                stacked.append((int(match.group(1)), which, info))
                continue
            assert name is not None
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
                shape = (1, columns)  # llama.cpp stores this [1, H] weight as a vector
            self._infos[name] = info
            found[name] = shape
        return found

    def _read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        import torch

        info = self._infos[name]
        shape = self.shape(name)
        head = self._permuted_heads.get(name)
        if len(shape) == 1:
            values = self._read_block(info, 0, 1, 0, info.columns)[0]
            if head is not None:
                values = _unpermute(values[:, None], head)[:, 0]
            if self._norm_shift and name.endswith("norm.weight"):
                values = values - np.float32(self._norm_shift)
            return torch.from_numpy(np.ascontiguousarray(values[start:stop]))
        if dim == 0:
            first, last = start, stop
            if head is not None:  # whole heads, then undo the interleave, then trim
                first, last = start // head * head, -(-stop // head) * head
            values = self._read_block(info, first, last, 0, info.columns)
            if head is not None:
                values = _unpermute(values, head)
            values = values[start - first: stop - first]
        else:
            values = self._read_block(info, 0, info.rows, start, stop)
            if head is not None:
                values = _unpermute(values, head)
        return torch.from_numpy(np.ascontiguousarray(values))

    def _read_block(self, info: _TensorInfo, row0: int, row1: int, col0: int,
                    col1: int) -> np.ndarray:
        """Rows [row0:row1], columns [col0:col1] of a tensor as float32, via whole blocks."""
        per_block = info.encoding.block_elements
        block0, block1 = col0 // per_block, -(-col1 // per_block)
        width = info.encoding.block_bytes
        table = self._data[info.offset: info.offset + info.rows * info.row_bytes]
        raw = np.asarray(table).reshape(info.rows, info.row_bytes)[
            row0:row1, block0 * width: block1 * width]
        self.bytes_read += raw.size
        values = dequantize(raw, info.encoding)
        return values[:, col0 - block0 * per_block: col1 - block0 * per_block]

    def is_quantized(self, name: str) -> bool:
        view = self._views.get(name)
        info = self._infos[view[0] if view is not None else name]
        return info.encoding.block_elements > 1

    def _read_groups(self, name: str, row0: int, row1: int, col0: int,
                     col1: int) -> FourBitGroups | None:
        info = self._infos[name]
        if info.encoding.ggml_type not in GROUPED or col0 % GROUP or col1 % GROUP:
            return None
        head = self._permuted_heads.get(name)
        first, last = row0, row1
        if head is not None:  # whole heads, then undo the interleave, then trim
            first, last = row0 // head * head, -(-row1 // head) * head
        per_block, width = info.encoding.block_elements, info.encoding.block_bytes
        block0, block1 = col0 // per_block, -(-col1 // per_block)
        table = self._data[info.offset: info.offset + info.rows * info.row_bytes]
        raw = np.asarray(table).reshape(info.rows, info.row_bytes)[
            first:last, block0 * width: block1 * width]
        self.bytes_read += raw.size
        skip = col0 - block0 * per_block
        parts = []
        for part, unit in zip(groups_of(raw, info.encoding), (1, GROUP, GROUP),
                              strict=True):
            part = part[:, skip // unit: (skip + col1 - col0) // unit]
            if head is not None:
                part = _unpermute(part, head)
            parts.append(np.ascontiguousarray(part[row0 - first: row1 - first]))
        return parts[0], parts[1], parts[2]

    def metadata(self) -> dict[str, Any]:
        """Every GGUF metadata key → its decoded value."""
        return self._fields

    def tokenizer(self) -> Tokenizer:
        from mpexec.models.loader.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.metadata(), source=self.path, config=self.config)

    def close(self) -> None:
        self._data = None  # the memory map goes with the last reference


def _type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return "unknown"


def _unpermute(values: np.ndarray, head: int) -> np.ndarray:
    """File order (pairs interleaved) → Hugging Face order (two halves), per head."""
    rows, columns = values.shape
    return (values.reshape(rows // head, head // 2, 2, columns)
            .swapaxes(1, 2).reshape(rows, columns))
