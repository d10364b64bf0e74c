"""What sets the Qwen3, Gemma 2/3 and Phi-3 decoders apart from Llama's.

``ModelConfig.features`` is one frozen :class:`ArchFeatures`; its defaults
are the Llama decoder, so a Llama, Mistral or Qwen2 checkpoint carries the
default object and the model's code paths for them are unchanged.

    Qwen3     qk_norm (an RMSNorm over each query and key head, before rotary)
    Gemma 2   activation gelu_tanh, norm_offset 1 (norms scale by 1 + w),
              embedding_scale (embeddings × √hidden), sandwich_norms (norms
              after attention and after the MLP too), attention_scale
              (query_pre_attn_scalar ** -0.5), attention and final logit
              soft-capping (cap · tanh(x / cap)), sliding_layers: every other
              layer (0, 2, …) attends to the last ``sliding_window`` tokens
    Gemma 3   Gemma 2 without soft-capping, with qk_norm; five sliding layers
              to one global (layers 5, 11, … are global); the sliding layers
              rotate with their own base (local_rope_theta, default 10,000)
    Phi-3     the Llama decoder; its checkpoints fuse q/k/v and gate/up into
              one tensor each, which the loader splits (fused_qkv)
    Llama 3.1+ in GGUF: the rope scaling is a tensor, ``rope_freqs``, one
              factor per frequency (rope_freq_factors, set by the GGUF loader)

Read from config.json (:func:`features_from_hf`) or from GGUF metadata
(:func:`features_from_gguf`, the keys llama.cpp's converter writes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpexec.models.errors import CheckpointError

GEMMA = ("gemma2", "gemma3")
# config.json's model_type ─► architecture, for the families of this module.
HF_MODEL_TYPES = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                  "phi3": "phi3"}
HF_ARCHITECTURES = {"Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                    "Phi3ForCausalLM"}
GGUF_ARCHITECTURES = ("qwen3", "gemma2", "gemma3", "phi3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ArchFeatures:
    """The decoder's departures from Llama; see the module docstring."""

    qk_norm: bool = False
    activation: str = "silu"  # "silu" or "gelu_tanh"
    norm_offset: float = 0.0
    embedding_scale: bool = False
    sandwich_norms: bool = False
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # None: the sliding layers use rope_theta
    fused_qkv: bool = False
    # GGUF's rope_freqs tensor (Llama 3.1+): plain inverse frequencies divided by these
    rope_freq_factors: tuple[float, ...] | None = None

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None


def _number(raw: Mapping[str, Any], key: str, source: str | Path) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(source, key, f"expected a positive number, got {value!r}")
    return float(value)


def _window(raw: Mapping[str, Any], key: str, source: str | Path) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(source, key, f"expected a positive integer, got {value!r}")
    return value


def _gemma_sliding_layers(arch: str, layers: int, layer_types: Any, source: str | Path,
                          key: str) -> tuple[int, ...]:
    if layer_types is None:
        every = 2 if arch == "gemma2" else 6  # one global layer in every 2 / 6
        return tuple(i for i in range(layers) if (i + 1) % every)
    if not isinstance(layer_types, list) or len(layer_types) != layers or not all(
            t in ("sliding_attention", "full_attention") for t in layer_types):
        raise CheckpointError(source, key, f"expected {layers} entries of 'sliding_attention' "
                              f"or 'full_attention', got {layer_types!r}")
    return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


def features_from_hf(raw: Mapping[str, Any], arch: str, source: str | Path,
                     layers: int) -> ArchFeatures:
    """The features of an architecture of this module from config.json."""
    if arch == "qwen3":
        return ArchFeatures(qk_norm=True)
    if arch == "phi3":
        partial = raw.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            raise CheckpointError(source, "partial_rotary_factor",
                                  f"{partial}: partial rotary embeddings are not supported")
        return ArchFeatures(fused_qkv=True)
    if arch not in GEMMA:
        return ArchFeatures()
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise CheckpointError(source, "hidden_activation", f"{activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
    scalar = _number(raw, "query_pre_attn_scalar", source) or 256.0
    local_theta = None
    if arch == "gemma3":
        parameters = raw.get("rope_parameters")
        sliding = parameters.get("sliding_attention") if isinstance(parameters, Mapping) else None
        if isinstance(sliding, Mapping):
            if sliding.get("rope_type", "default") != "default":
                raise CheckpointError(source, "rope_parameters.sliding_attention.rope_type",
                                      f"{sliding.get('rope_type')!r} is not supported")
            local_theta = _number(sliding, "rope_theta", source)
        local_theta = local_theta or _number(raw, "rope_local_base_freq", source) or 10000.0
    window = _window(raw, "sliding_window", source)
    sliding_layers = _gemma_sliding_layers(arch, layers, raw.get("layer_types"), source,
                                           "layer_types") if window else ()
    return ArchFeatures(
        qk_norm=arch == "gemma3", activation=ACTIVATIONS[activation], norm_offset=1.0,
        embedding_scale=True, sandwich_norms=True, attention_scale=scalar ** -0.5,
        attn_logit_softcapping=_number(raw, "attn_logit_softcapping", source),
        final_logit_softcapping=_number(raw, "final_logit_softcapping", source),
        sliding_window=window, sliding_layers=sliding_layers, local_rope_theta=local_theta)


# llama.cpp's rule for the 27B models (46 layers in Gemma 2, 62 in Gemma 3), whose
# query_pre_attn_scalar is hidden / heads rather than the head size
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_gemma_scale(fields: Mapping[str, Any], arch: str, layers: int,
                      head_dim: int) -> float:
    hidden = fields.get(f"{arch}.embedding_length")
    heads = fields.get(f"{arch}.attention.head_count")
    if (layers == _GEMMA_27B_LAYERS.get(arch) and isinstance(hidden, int)
            and isinstance(heads, int) and heads > 0):
        return float(hidden // heads) ** -0.5
    return float(head_dim) ** -0.5


def features_from_gguf(fields: Mapping[str, Any], arch: str, source: str | Path,
                       layers: int, head_dim: int) -> ArchFeatures:
    """The features from GGUF metadata, as llama.cpp reads them: Gemma's
    attention scale is ``1/√head_dim``, for the 27B models ``1/√(hidden/heads)``
    (the file does not store it), and Gemma 3's
    sliding layers rotate with ``<arch>.rope.freq_base_swa``, else 10,000."""
    if arch == "qwen3":
        return ArchFeatures(qk_norm=True)
    if arch == "phi3":
        return ArchFeatures(fused_qkv=True)
    if arch not in GEMMA:
        return ArchFeatures()
    window_key = f"{arch}.attention.sliding_window"
    window = _window(fields, window_key, source)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = fields.get(pattern_key)
    default = _gemma_sliding_layers(arch, layers, None, source, window_key)
    if pattern is not None and pattern != (2 if arch == "gemma2" else 6) and not (
            isinstance(pattern, list) and len(pattern) == layers
            and tuple(i for i, p in enumerate(pattern) if p) == default):
        raise CheckpointError(source, pattern_key, f"{pattern!r}: only the family's own "
                              "pattern of sliding and global layers is supported")
    return ArchFeatures(
        qk_norm=arch == "gemma3", activation="gelu_tanh", norm_offset=1.0,
        embedding_scale=True, sandwich_norms=True,
        attention_scale=_gguf_gemma_scale(fields, arch, layers, head_dim),
        attn_logit_softcapping=_number(fields, f"{arch}.attn_logit_softcapping", source),
        final_logit_softcapping=_number(fields, f"{arch}.final_logit_softcapping", source),
        sliding_window=window,
        sliding_layers=default if window else (),
        local_rope_theta=(_number(fields, f"{arch}.rope.freq_base_swa", source) or 10000.0)
        if arch == "gemma3" else None)
