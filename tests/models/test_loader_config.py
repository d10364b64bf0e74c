"""ModelConfig from config.json: what is accepted, normalised, refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from mpexec.models.config import CheckpointError, ModelConfig

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 100,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def parse(tmp_path: Path, **changes: Any) -> ModelConfig:
    raw = {**BASE, **changes}
    raw = {k: v for k, v in raw.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf_dir(tmp_path)


def test_llama_fields(tmp_path: Path) -> None:
    config = parse(tmp_path)
    assert config.architecture == "llama"
    assert config.head_dim == 16
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is None
    assert config.eos_token_ids == (2,)
    assert not config.attention_bias and not config.tie_word_embeddings


def test_qwen2_has_qkv_bias_and_eos_from_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = parse(tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                   use_sliding_window=False, sliding_window=32)
    assert config.architecture == "qwen2" and config.attention_bias
    assert config.eos_token_ids == (2, 7)


def test_an_explicit_head_dim_need_not_tile_the_hidden_size(tmp_path: Path) -> None:
    config = parse(tmp_path, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=16)
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (72, 9, 16)


def test_mistral_without_window_is_llama(tmp_path: Path) -> None:
    config = parse(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"],
                   sliding_window=None)
    assert config.architecture == "llama"


@pytest.mark.parametrize(("scaling", "expected"), [
    ({"type": "linear", "factor": 2}, {"rope_type": "linear", "factor": 2.0}),
    ({"rope_type": "dynamic", "factor": 4.0}, {"rope_type": "dynamic", "factor": 4.0}),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ({"rope_type": "yarn", "factor": 4.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
      "beta_fast": 32.0, "beta_slow": 1.0}),
    ({"rope_type": "default"}, None),
])
def test_rope_scaling_forms(tmp_path: Path, scaling: dict[str, Any],
                            expected: dict[str, Any] | None) -> None:
    assert parse(tmp_path, rope_scaling=scaling).rope_scaling == expected


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    config = parse(tmp_path, rope_theta=..., rope_parameters={
        "rope_theta": 1234.0, "rope_type": "linear", "factor": 2.0})
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_chat_template_sources(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                   "template": "D"}]}))
    assert parse(tmp_path).chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert parse(tmp_path).chat_template == "J"


# One row per refusal: the change to config.json, the field the error must name.
REFUSED = [
    ({"model_type": "gpt2"}, "model_type"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "architectures"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
      "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [99]},
     "mlp_only_layers"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64},
     "sliding_window"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 64}, "sliding_window"),
    ({"hidden_size": ...}, "hidden_size"),
    ({"max_position_embeddings": ...}, "max_position_embeddings"),
    ({"vocab_size": "many"}, "vocab_size"),
    ({"head_dim": 7}, "head_dim"),
    ({"head_dim": 0}, "head_dim"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, "head_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_attention_heads": 64, "head_dim": 1}, "head_dim"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"intermediate_size": 0}, "intermediate_size"),
]


@pytest.mark.parametrize(("changes", "field"), REFUSED)
def test_refused_configs_name_file_and_field(tmp_path: Path, changes: dict[str, Any],
                                             field: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        parse(tmp_path, **changes)
    assert str(tmp_path / "config.json") in str(caught.value)
    assert caught.value.what == field
    assert isinstance(caught.value, ValueError)


def test_missing_and_broken_config_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: file: missing"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_hf_dir(tmp_path)


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                 st.lists(st.integers(-2, 5), max_size=3),
                 st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "x"]),
                                 st.one_of(st.integers(-1, 9), st.text(max_size=6)),
                                 max_size=3))
KEYS = [*BASE, "head_dim", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "sliding_window", "use_sliding_window", "attention_bias", "num_local_experts"]


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(KEYS), JUNK, min_size=1, max_size=3))
def test_junk_in_any_field_is_a_checkpoint_error_or_a_valid_config(
        changes: dict[str, Any]) -> None:
    raw = {**BASE, **changes}
    try:
        config = ModelConfig.from_hf_dict(raw, source="junk/config.json")
    except CheckpointError as e:
        assert str(e).startswith("junk/config.json: ")
        return
    for name in ("rms_norm_eps", "rope_theta"):
        assert math.isfinite(getattr(config, name)) and getattr(config, name) > 0
    assert config.head_dim == (raw.get("head_dim")
                               or config.hidden_size // config.num_attention_heads)
    assert config.head_dim % 2 == 0
    assert all(isinstance(i, int) for i in config.eos_token_ids)


GGUF_BASE: dict[str, Any] = {
    "general.architecture": "llama", "llama.context_length": 128,
    "llama.embedding_length": 64, "llama.block_count": 2, "llama.feed_forward_length": 100,
    "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
    "llama.vocab_size": 300, "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}
GGUF_KEYS = [*GGUF_BASE, "llama.rope.scaling.type", "llama.rope.scaling.factor",
             "llama.rope.scaling.original_context_length", "llama.attention.key_length",
             "llama.attention.value_length", "llama.rope.dimension_count",
             "llama.expert_count", "llama.expert_used_count",
             "llama.expert_feed_forward_length", "tokenizer.ggml.eot_token_id"]


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(GGUF_KEYS), JUNK, min_size=1, max_size=3))
def test_junk_in_gguf_metadata_is_a_checkpoint_error_or_a_valid_config(
        changes: dict[str, Any]) -> None:
    fields = {k: v for k, v in {**GGUF_BASE, **changes}.items() if v is not None}
    try:
        config = ModelConfig.from_gguf_fields(fields, source="m.gguf", has_output_tensor=False)
    except CheckpointError as e:
        assert str(e).startswith("m.gguf: ")
        return
    assert config.head_dim == (fields.get("llama.attention.key_length")
                               or config.hidden_size // config.num_attention_heads)
    assert config.head_dim % 2 == 0
    assert math.isfinite(config.rms_norm_eps) and math.isfinite(config.rope_theta)
