"""ModelConfig: the shape of a Llama-family decoder, read from a checkpoint.

Two sources give the same frozen object:

    config.json (+ generation_config.json, tokenizer_config.json)  ── from_hf_dir
    GGUF metadata (``<arch>.*`` and ``tokenizer.*`` keys)           ── from_gguf_fields

Everything the model cannot run is refused here, at load time, with a
``CheckpointError`` (a ``ValueError``) that names the file and the field:
an unknown architecture, a mixture-of-experts family other than Mixtral,
Qwen2-MoE and Qwen3-MoE (``moe_config``), a sliding window shorter than
the context, a missing field, an odd head size, a rope scaling form this
stack does not implement.  The model then trusts the config and never
re-checks it.

The head size need not tile the hidden size: config.json's ``head_dim`` or
GGUF's ``<arch>.attention.key_length`` sets it (q_proj then has ``heads ×
head_dim`` rows, o_proj as many columns; the loader checks the tensors'
shapes); only without one is it ``hidden_size / heads``, which must divide.

``rope_scaling`` is kept in Hugging Face's config.json form, normalised so the
kind is always under ``"rope_type"`` (``"linear"``, ``"dynamic"``,
``"llama3"``, ``"yarn"``); ``None`` means plain rotary embeddings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpexec.models import arch_config
from mpexec.models.arch_config import ArchFeatures
from mpexec.models.errors import CheckpointError
from mpexec.models.moe_config import MOE_MODEL_TYPES, MoEConfig, moe_from_gguf, moe_from_hf
from mpexec.models.rope_scaling import normalize_rope_scaling

# model_type of config.json ─► the architecture name the model uses.
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                   "mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3",
                   **arch_config.HF_MODEL_TYPES}
_HF_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     *arch_config.HF_ARCHITECTURES}
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3moe",
                       *arch_config.GGUF_ARCHITECTURES)
# a GGUF architecture ─► the architecture the model uses (as _HF_MODEL_TYPES)
_GGUF_MODEL_ARCHITECTURES = {"qwen2moe": "qwen2", "qwen3moe": "qwen3"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
MAX_LAYERS = 4096


@dataclass(frozen=True)
class ModelConfig:
    """What the model needs to build itself; see the module docstring."""

    # "llama" (Llama, Mistral, SmolLM), "qwen2" (q/k/v biases), "qwen3", "gemma2",
    # "gemma3", "phi3" (see arch_config)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q_proj, k_proj and v_proj carry biases (o_proj never does)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    # Qwen3 / Gemma / Phi-3 departures from the Llama decoder (arch_config)
    features: ArchFeatures = field(default_factory=ArchFeatures)
    moe: MoEConfig | None = None  # mixture-of-experts layers (moe_config); None: dense

    # ── from a Hugging Face directory ────────────────────────────────────

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> ModelConfig:
        directory = Path(directory)
        config_path = directory / "config.json"
        raw = _read_json(config_path)
        generation = _read_json(directory / "generation_config.json", missing_ok=True)
        tokenizer_config = _read_json(directory / "tokenizer_config.json", missing_ok=True)
        return cls.from_hf_dict(
            raw,
            source=config_path,
            generation_config=generation,
            chat_template=_hf_chat_template(directory, tokenizer_config),
        )

    @classmethod
    def from_hf_dict(
        cls,
        raw: Mapping[str, Any],
        *,
        source: str | Path = "config.json",
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> ModelConfig:
        field = _FieldReader(raw, source)
        model_type = field.get("model_type", str)
        if model_type not in _HF_MODEL_TYPES:
            raise CheckpointError(source, "model_type", f"{model_type!r} is not supported "
                                  f"(supported: {', '.join(sorted(_HF_MODEL_TYPES))})")
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str)
                                                          for a in architectures):
            raise CheckpointError(source, "architectures",
                                  f"expected a list of names, got {architectures!r}")
        unknown = [a for a in architectures if a not in _HF_ARCHITECTURES]
        if unknown:
            raise CheckpointError(source, "architectures", f"{unknown[0]!r} is not supported")
        moe = None
        if model_type in MOE_MODEL_TYPES:
            moe = moe_from_hf(raw, model_type, source, field.get("num_hidden_layers", int))
        else:
            for key in _MOE_KEYS:
                if raw.get(key):
                    raise CheckpointError(source, key,
                                          f"mixture-of-experts {model_type!r} is not supported")
        architecture = _HF_MODEL_TYPES[model_type]

        hidden_size = field.get("hidden_size", int)
        num_heads = field.get("num_attention_heads", int)
        num_kv_heads = field.get("num_key_value_heads", int, default=num_heads)
        head_dim = field.get("head_dim", int, default=None)
        max_pos = field.get("max_position_embeddings", int)
        if architecture not in arch_config.GEMMA:  # Gemma's windows are per layer
            _check_sliding_window(raw, source, model_type, max_pos)

        if architecture == "qwen2":
            attention_bias = bool(raw.get("qkv_bias", True))  # Qwen2-MoE may turn it off
        else:
            attention_bias = bool(raw.get("attention_bias", False))
            if attention_bias:
                # Llama's flag also puts a bias on o_proj, which this model has not.
                raise CheckpointError(source, "attention_bias",
                                      "Llama-style attention_bias (o_proj bias) is not supported")
        if raw.get("mlp_bias"):
            raise CheckpointError(source, "mlp_bias", "MLP biases are not supported")

        # transformers 5 writes rope_parameters; older files rope_theta + rope_scaling.
        rope_parameters = raw.get("rope_parameters")
        rope_theta = field.get("rope_theta", float, default=10000.0)
        if isinstance(rope_parameters, Mapping) and "full_attention" in rope_parameters:
            rope_parameters = rope_parameters["full_attention"]  # Gemma 3: per layer kind
        if isinstance(rope_parameters, Mapping):
            rope_theta = _FieldReader(rope_parameters, source).get(
                "rope_theta", float, default=rope_theta)
            rope_scaling: Any = dict(rope_parameters)
            rope_scaling.pop("rope_theta", None)
        else:
            rope_scaling = raw.get("rope_scaling")

        eos = _as_id_tuple(raw.get("eos_token_id"), source, "eos_token_id")
        if generation_config:
            eos += tuple(i for i in _as_id_tuple(generation_config.get("eos_token_id"),
                                                 source, "generation_config.eos_token_id")
                         if i not in eos)
        bos_ids = _as_id_tuple(raw.get("bos_token_id"), source, "bos_token_id")
        bos = bos_ids[0] if bos_ids else None
        num_layers = field.get("num_hidden_layers", int)

        return cls.validated(
            source,
            architecture=architecture,
            vocab_size=field.get("vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=field.get("intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=_head_dim(head_dim, hidden_size, num_heads, source, "head_dim"),
            rms_norm_eps=float(field.get("rms_norm_eps", float, default=1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(rope_scaling, source, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=chat_template,
            features=arch_config.features_from_hf(raw, architecture, source,
                                                  min(max(num_layers, 0), MAX_LAYERS)),
            moe=moe,
        )

    # ── from GGUF metadata ───────────────────────────────────────────────

    @classmethod
    def from_gguf_fields(
        cls, fields: Mapping[str, Any], *, source: str | Path, has_output_tensor: bool
    ) -> ModelConfig:
        """``fields``: GGUF key → decoded value (ints, floats, strings, lists)."""
        field = _FieldReader(fields, source)
        arch = field.get("general.architecture", str)
        if arch not in _GGUF_ARCHITECTURES:
            raise CheckpointError(source, "general.architecture", f"{arch!r} is not supported "
                                  f"(supported: {', '.join(_GGUF_ARCHITECTURES)})")
        moe = moe_from_gguf(fields, arch, source) if fields.get(f"{arch}.expert_count") \
            else None
        hidden_size = field.get(f"{arch}.embedding_length", int)
        num_heads = field.get(f"{arch}.attention.head_count", int)
        num_kv_heads = field.get(f"{arch}.attention.head_count_kv", int, default=num_heads)
        key_key = f"{arch}.attention.key_length"
        head_dim = _head_dim(field.get(key_key, int, default=None), hidden_size, num_heads,
                             source, key_key)
        # One head size serves K, V and the rotation: no split sizes, no partial rotary.
        for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
            value = field.get(key, int, default=None)
            if value is not None and value != head_dim:
                raise CheckpointError(source, key, f"{value} differs from the head size "
                                      f"{head_dim} ({key_key}, else embedding_length / "
                                      "head_count): not supported")
        max_pos = field.get(f"{arch}.context_length", int)
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab_size = field.get(f"{arch}.vocab_size", int, default=None)
        if vocab_size is None:
            if not isinstance(tokens, list):
                raise CheckpointError(source, f"{arch}.vocab_size", "missing (and no tokenizer)")
            vocab_size = len(tokens)
        eos = _as_id_tuple(fields.get("tokenizer.ggml.eos_token_id"), source,
                           "tokenizer.ggml.eos_token_id")
        eos += tuple(i for i in _as_id_tuple(fields.get("tokenizer.ggml.eot_token_id"), source,
                                             "tokenizer.ggml.eot_token_id") if i not in eos)
        bos_ids = _as_id_tuple(fields.get("tokenizer.ggml.bos_token_id"), source,
                               "tokenizer.ggml.bos_token_id")
        return cls.validated(
            source,
            architecture=_GGUF_MODEL_ARCHITECTURES.get(arch, arch),
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=field.get(f"{arch}.feed_forward_length", int),
            num_hidden_layers=field.get(f"{arch}.block_count", int),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(field.get(f"{arch}.attention.layer_norm_rms_epsilon", float)),
            rope_theta=float(field.get(f"{arch}.rope.freq_base", float, default=10000.0)),
            rope_scaling=_gguf_rope_scaling(fields, arch, source, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch in ("qwen2", "qwen2moe"),
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos,
            chat_template=fields.get("tokenizer.chat_template"),
            features=arch_config.features_from_gguf(
                fields, _GGUF_MODEL_ARCHITECTURES.get(arch, arch), source,
                min(max(field.get(f"{arch}.block_count", int), 0), MAX_LAYERS), head_dim),
            moe=moe,
        )

    # ── shared validation ────────────────────────────────────────────────

    @classmethod
    def validated(cls, source: str | Path, **values: Any) -> ModelConfig:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if values[name] <= 0:
                raise CheckpointError(source, name, f"must be positive, got {values[name]}")
        if values["num_hidden_layers"] > MAX_LAYERS:  # a damaged field, not a model
            raise CheckpointError(source, "num_hidden_layers", f"{values['num_hidden_layers']}"
                                  f" layers is beyond any real model (limit {MAX_LAYERS})")
        heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
        if heads % kv_heads:
            raise CheckpointError(source, "num_key_value_heads",
                                  f"{kv_heads} does not divide num_attention_heads={heads}")
        if values["head_dim"] % 2:
            raise CheckpointError(source, "head_dim", "rotary embeddings need an even head size")
        for name in ("rms_norm_eps", "rope_theta"):
            if not (math.isfinite(values[name]) and values[name] > 0):
                raise CheckpointError(source, name, f"must be a positive finite number, "
                                      f"got {values[name]}")
        return cls(**values)


def _head_dim(explicit: int | None, hidden_size: int, num_heads: int, source: str | Path,
              key: str) -> int:
    """The explicit head size, else ``hidden_size / num_heads`` when that divides
    (non-positive sizes are left to ``validated``, which names them)."""
    if explicit is not None:
        return explicit
    if hidden_size > 0 and num_heads > 0 and hidden_size % num_heads:
        raise CheckpointError(source, key, f"missing, and the hidden size {hidden_size} is not "
                              f"a multiple of {num_heads} heads")
    return hidden_size // max(num_heads, 1)


def _gguf_rope_scaling(
    fields: Mapping[str, Any], arch: str, source: str | Path, max_pos: int
) -> dict[str, Any] | None:
    field = _FieldReader(fields, source)
    kind = field.get(f"{arch}.rope.scaling.type", str, default=None)
    factor = field.get(f"{arch}.rope.scaling.factor", float, default=None)
    if kind in (None, "none"):
        if factor not in (None, 0.0, 1.0):
            raise CheckpointError(source, f"{arch}.rope.scaling.factor",
                                  "set without a scaling type")
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = field.get(f"{arch}.rope.scaling.original_context_length", int, default=None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return normalize_rope_scaling(scaling, source, max_pos)


def _check_sliding_window(raw: Mapping[str, Any], source: str | Path, model_type: str,
                          max_pos: int) -> None:
    window = raw.get("sliding_window")
    used = raw.get("use_sliding_window", model_type == "mistral")
    if not used or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise CheckpointError(source, "sliding_window", f"expected an integer, got {window!r}")
    if window < max_pos:
        raise CheckpointError(source, "sliding_window", f"a window of {window} tokens shorter "
                              f"than max_position_embeddings={max_pos} is not supported")


def _hf_chat_template(directory: Path, tokenizer_config: Mapping[str, Any] | None) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_id_tuple(value: Any, source: str | Path, key: str) -> tuple[int, ...]:
    """A token id or a list of them (None: none)."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(source, key, f"expected token ids, got {value!r}")
    return tuple(values)


def _read_json(path: Path, *, missing_ok: bool = False) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise CheckpointError(path, "file", "missing") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(path, "json", f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, "json", "expected an object at the top level")
    return value


class _FieldReader:
    """Typed access to one config's fields; errors name the file and the field."""

    _MISSING = object()

    def __init__(self, raw: Mapping[str, Any], source: str | Path) -> None:
        self.raw = raw
        self.source = source

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is self._MISSING:
                raise CheckpointError(self.source, key, "missing")
            return default
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(self.source, key, f"expected an integer, got {value!r}")
        if kind is float and not isinstance(value, (int, float)):
            raise CheckpointError(self.source, key, f"expected a number, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise CheckpointError(self.source, key, f"expected a string, got {value!r}")
        return value
