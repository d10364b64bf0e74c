"""A tiny deterministic random Llama checkpoint in Hugging Face format.

    write_tiny_checkpoint(dir) ─► dir/
        config.json                       9 heads / 3 KV heads, odd MLP and vocab sizes
        model-00001-of-00002.safetensors  float32 weights from numpy's PCG64(seed)
        model-00002-of-00002.safetensors
        model.safetensors.index.json
        tokenizer.json                    byte-level BPE trained on a fixed ASCII corpus
        tokenizer_config.json             ChatML chat template, add_bos_token
        generation_config.json

The head counts and sizes are chosen so tensor parallelism splits unevenly at
TP=2 and TP=3 (9 query heads, 3 KV heads, intermediate 187, vocab 389: no size
is a multiple of 2 or 3 except the heads), and the weights are scaled so a
forward pass stays in range: embeddings std 0.25, linears std 1/sqrt(fan_in),
norm weights near 1, so the logits spread over a few units and are not flat.
The same arguments always give byte-identical files.

``write_tiny_gguf`` converts such a checkpoint to a GGUF file the way
llama.cpp's converter does (names, reversed shapes, the Q/K row interleave,
the tokenizer as metadata), quantising each weight whose rows are whole
32-element blocks, so the GGUF loader can be tested without the real model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpexec.models.config import ModelConfig
from mpexec.models.loader.base import expected_shapes
from mpexec.models.loader.hf import INDEX_NAME

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS, EOS, IM_START, IM_END = range(4)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog hello world model worker tensor parallel "
    "pipeline stage token cache block prompt decode prefill sample logits weight layer "
    "attention head rotary norm embed vocab shard slice rank driver executor process "
    "shared memory ring queue reply call order one two three four five six seven eight "
    "nine ten alpha beta gamma delta what where when why how is are was were be a an of "
    "to in on at by for with from as it this that I you he she we they"
)


def write_tiny_checkpoint(
    directory: str | Path,
    *,
    hidden_size: int = 144,
    num_attention_heads: int = 9,
    num_key_value_heads: int = 3,
    head_dim: int | None = None,
    num_hidden_layers: int = 4,
    intermediate_size: int = 187,
    vocab_size: int = 389,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    rms_norm_eps: float = 1e-5,
    attention_bias: bool = False,
    tie_word_embeddings: bool = True,
    add_bos_token: bool = False,
    shards: int = 2,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write the checkpoint into ``directory`` (created) and return it.

    ``attention_bias=True`` writes a Qwen2-style checkpoint (q/k/v biases).
    ``shards=1`` writes a single ``model.safetensors`` without an index.
    ``head_dim`` decouples the head size from ``hidden_size / num_attention_heads``
    (q_proj then has ``num_attention_heads × head_dim`` rows).
    """
    import numpy as np
    from safetensors.numpy import save_file

    if vocab_size < 300:
        raise ValueError("vocab_size must be at least 300 (256 bytes, specials and merges)")
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32 or float16, got {dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_type = "qwen2" if attention_bias else "llama"
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim if head_dim is not None else hidden_size // num_attention_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": BOS,
        "eos_token_id": [EOS, IM_END],
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        config["attention_bias"] = False
    else:
        config["use_sliding_window"] = False
    parsed = ModelConfig.from_hf_dict(config, source=directory / "config.json")

    rng = np.random.Generator(np.random.PCG64(seed))
    tensors: dict[str, Any] = {}
    for name, shape in expected_shapes(parsed).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            values = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            values = 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            values = 0.25 * rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = np.ascontiguousarray(values.astype(dtype))

    _write_shards(directory, tensors, shards, save_file)
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json",
                {"bos_token_id": BOS, "eos_token_id": [EOS, IM_END]})
    _write_tokenizer(directory, vocab_size, add_bos_token)
    return directory


def write_tiny_gguf(
    path: str | Path,
    hf_dir: str | Path,
    *,
    qtype: str = "Q8_0",
    skip: tuple[str, ...] = (),
    metadata_changes: dict[str, Any] | None = None,
    tokenizer: str = "gpt2",
) -> Path:
    """Write ``hf_dir`` (a tiny checkpoint) as a GGUF file at ``path``.

    ``tokenizer="llama"`` stores a SentencePiece-style vocabulary of the same
    size instead of the checkpoint's byte-level BPE (:func:`add_spm_tokenizer`).

    ``qtype`` (a ``gguf.GGMLQuantizationType`` name) is used for every 2-D
    weight whose rows are whole blocks; others and all 1-D tensors are F32.
    Types nothing here quantises (K-quants but Q4_K and Q6_K, IQ types) get
    random blocks (see ``_quantize``): for loader tests, not for comparing
    outputs.
    ``skip`` leaves out GGUF tensors by name, and ``metadata_changes``
    overrides ``llama.*`` integer keys: both only to make damaged files.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    arch = "qwen2" if config["model_type"] == "qwen2" else "llama"
    tensors: dict[str, Any] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    ints = {"context_length": config["max_position_embeddings"],
            "embedding_length": config["hidden_size"],
            "block_count": config["num_hidden_layers"],
            "feed_forward_length": config["intermediate_size"],
            "attention.head_count": config["num_attention_heads"],
            "attention.head_count_kv": config["num_key_value_heads"],
            "vocab_size": config["vocab_size"],
            # as llama.cpp's converter writes an explicit head_dim
            "attention.key_length": head_dim,
            "attention.value_length": head_dim,
            "rope.dimension_count": head_dim}
    ints.update(metadata_changes or {})
    for key, value in ints.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # as llama.cpp's converter: a factor per rotary frequency, no scaling keys
        writer.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, config["rope_theta"],
                                                                scaling))
    if tokenizer == "llama":
        settings = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        add_spm_tokenizer(writer, config["vocab_size"], add_bos=bool(settings["add_bos_token"]))
        writer.add_chat_template(settings["chat_template"])
    else:
        _add_gguf_tokenizer(writer, hf_dir, config["vocab_size"])

    gguf_names = {v: k for k, v in _gguf_name_table(config["num_hidden_layers"]).items()}
    quant = gguf.GGMLQuantizationType[qtype]
    rng = np.random.Generator(np.random.PCG64(1))
    for hf, values in tensors.items():
        name = gguf_names[hf]
        if name in skip:
            continue
        values = values.astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            # llama.cpp's converter interleaves the two rotary halves of each head.
            heads = values.shape[0] // head_dim
            values = (values.reshape(heads, 2, head_dim // 2, *values.shape[1:])
                      .swapaxes(1, 2).reshape(values.shape))
        whole_blocks = values.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0
        if values.ndim == 2 and qtype != "F32" and whole_blocks:
            writer.add_tensor(name, _quantize(values, quant, rng), raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_factors(head_dim: int, base: float, scaling: dict[str, Any]) -> Any:
    """Llama 3.1's rope scaling as the factors that divide each inverse frequency."""
    import math

    import numpy as np

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _quantize(values: Any, quant: Any, rng: Any) -> Any:
    """``values`` in ``quant``'s blocks; random blocks where gguf cannot quantise.

    gguf's Python package quantises the legacy types only; Q4_K and Q6_K are
    written by :func:`quantize_q4_k` and :func:`quantize_q6_k`.  For the others
    (other K-quants, IQ types) the blocks are random bytes of the right size,
    with bit 6 of every odd byte cleared so that every little-endian float16
    at an even offset (all the scales of these layouts) is finite and below 2:
    such a file tests the loader's blocks and slices, not the model's numerics.
    """
    import gguf
    import numpy as np

    if quant == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(values)
    if quant == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(values)
    try:
        return gguf.quants.quantize(values, quant)
    except NotImplementedError:
        pass
    elements, size = gguf.GGML_QUANT_SIZES[quant]
    shape = (*values.shape[:-1], values.shape[-1] // elements * size)
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[..., 1::2] &= 0xBF
    return raw


def quantize_q4_k(values: Any) -> Any:
    """float32 ``(rows, cols)`` (cols a multiple of 256) as Q4_K blocks, by a plain
    min/max rounding per 32-element sub-block (llama.cpp searches for better
    scales; a test model needs real numerics, not the best ones).

    Block (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales ``sc`` and mins
    ``m`` (bytes 0-3: sc[0:4] | sc[4:8]>>4 << 6; 4-7: m likewise; 8-11:
    sc[4:8] & 15 | (m[4:8] & 15) << 4), 128 bytes of nibbles; x = d·sc·q − dmin·m.
    """
    import numpy as np

    rows = values.shape[0]
    sub = values.astype(np.float32).reshape(rows, -1, 8, 32)  # (rows, super-blocks, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    spread = (sub.max(-1) - low) / 15
    d = (spread.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] > 0, np.round(spread / d[..., None].astype(np.float32)), 0)
        m = np.where(dmin[..., None] > 0, np.round(-low / dmin[..., None].astype(np.float32)), 0)
        sc, m = np.clip(sc, 0, 63).astype(np.uint8), np.clip(m, 0, 63).astype(np.uint8)
        scale = d[..., None].astype(np.float32) * sc
        offset = dmin[..., None].astype(np.float32) * m
        q = np.where(scale[..., None] > 0, np.round((sub + offset[..., None])
                                                   / scale[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(*sub.shape[:2], 4, 2, 32)
    packed_scales = np.concatenate([
        sc[..., :4] | (sc[..., 4:] >> 4) << 6,
        m[..., :4] | (m[..., 4:] >> 4) << 6,
        (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)
    nibbles = (q[..., 0, :] | q[..., 1, :] << 4).reshape(*sub.shape[:2], 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                             packed_scales, nibbles], axis=-1)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def quantize_q6_k(values: Any) -> Any:
    """float32 ``(rows, cols)`` (cols a multiple of 256) as Q6_K blocks, by a plain
    max-abs rounding per 16-element sub-block.

    Block (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2
    bits), 16 int8 sub-block scales ``sc``, f16 ``d``; x = d·sc·(q − 32), q in
    0..63.  Each half of 128 elements holds four runs of 32 (``j``): run j's
    element l sits in the low (j = 0, 1) or high (j = 2, 3) nibble of
    ``ql[64·half + 32·(j % 2) + l]`` and in bits ``2j, 2j+1`` of ``qh[32·half + l]``.
    """
    import numpy as np

    rows = values.shape[0]
    sub = values.astype(np.float32).reshape(rows, -1, 16, 16)  # (rows, super-blocks, 16, 16)
    spread = np.abs(sub).max(-1) / 31
    d = (spread.max(-1) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] > 0, np.round(spread / d[..., None].astype(np.float32)), 0)
        sc = np.clip(sc, 0, 127).astype(np.int8)
        scale = d[..., None].astype(np.float32) * sc
        q = np.where(scale[..., None] > 0, np.round(sub / scale[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(*sub.shape[:2], 2, 4, 32)
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
                         q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], axis=-1)
    qh = (q[..., 0, :] >> 4 | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4
          | (q[..., 3, :] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(*sub.shape[:2], 128), qh.reshape(*sub.shape[:2], 64),
                             sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def write_family_gguf(path: str | Path, hf_dir: str | Path, *, qtype: str = "F32") -> Path:
    """Write a transformers-saved Qwen3, Gemma 2/3 or Phi-3 directory as GGUF,
    the way llama.cpp's converter writes that family: its tensor names (Phi-3's
    fused ``attn_qkv`` / ``ffn_up``), Gemma's norm weights stored as ``1 + w``,
    the ``<arch>.*`` keys (Gemma's window and soft-caps).  No tokenizer: for
    weight and output tests.  Gemma's attention scale in GGUF is ``1/√head_dim``
    and Gemma 3's local rope base 10,000, whatever config.json said.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from mpexec.models.loader.gguf_file import hf_name

    hf_dir, path = Path(hf_dir), Path(path)
    parsed = ModelConfig.from_hf_dir(hf_dir)
    arch = parsed.architecture
    tensors: dict[str, Any] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    writer = gguf.GGUFWriter(str(path), arch)
    ints = {"context_length": parsed.max_position_embeddings,
            "embedding_length": parsed.hidden_size, "block_count": parsed.num_hidden_layers,
            "feed_forward_length": parsed.intermediate_size,
            "attention.head_count": parsed.num_attention_heads,
            "attention.head_count_kv": parsed.num_key_value_heads,
            "attention.key_length": parsed.head_dim, "attention.value_length": parsed.head_dim,
            "vocab_size": parsed.vocab_size}
    features = parsed.features
    if features.sliding_window:
        ints["attention.sliding_window"] = features.sliding_window
    for key, value in ints.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", parsed.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", parsed.rope_theta)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(features, key) is not None:
            writer.add_float32(f"{arch}.{key}", getattr(features, key))
    names = [f"blk.{layer}.{part}" for layer in range(parsed.num_hidden_layers) for part in (
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight",
        "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight",
        "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    names += ["token_embd.weight", "output_norm.weight", "output.weight"]
    gguf_names = {hf_name(n, arch): n for n in names}
    quant = gguf.GGMLQuantizationType[qtype]
    rng = np.random.Generator(np.random.PCG64(1))
    for hf, values in tensors.items():
        name = gguf_names.get(hf)
        if name is None:
            continue  # lm_head of a tied checkpoint
        values = values.astype(np.float32)
        if features.norm_offset and name.endswith("norm.weight"):
            values = values + np.float32(features.norm_offset)
        whole_blocks = values.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0
        if values.ndim == 2 and qtype != "F32" and whole_blocks:
            writer.add_tensor(name, _quantize(values, quant, rng), raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_moe_gguf(path: str | Path, hf_dir: str | Path) -> Path:
    """Write a transformers-saved Mixtral, Qwen2-MoE or Qwen3-MoE directory as GGUF
    (float32), the way llama.cpp's converter writes them: Mixtral as ``llama``
    (Q/K rows interleaved), the others as ``qwen2moe`` / ``qwen3moe``; each
    layer's experts stacked into ``ffn_{gate,up,down}_exps`` ``[experts, rows,
    columns]``, the router
    ``ffn_gate_inp``, the shared expert ``ffn_*_shexp`` and its gate
    ``ffn_gate_inp_shexp`` as a vector.  No tokenizer: for weight and output
    tests.  Every layer must be sparse (GGUF has no ``mlp_only_layers``)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    parsed = ModelConfig.from_hf_dir(hf_dir)
    moe = parsed.moe
    if moe is None or not all(moe.is_sparse(n) for n in range(parsed.num_hidden_layers)):
        raise ValueError(f"{hf_dir}: not a mixture-of-experts model with experts on every layer")
    arch = {"llama": "llama", "qwen2": "qwen2moe", "qwen3": "qwen3moe"}[parsed.architecture]
    tensors: dict[str, Any] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = parsed.head_dim
    ints = {"context_length": parsed.max_position_embeddings,
            "embedding_length": parsed.hidden_size, "block_count": parsed.num_hidden_layers,
            "feed_forward_length": parsed.intermediate_size,
            "attention.head_count": parsed.num_attention_heads,
            "attention.head_count_kv": parsed.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "rope.dimension_count": head_dim, "vocab_size": parsed.vocab_size,
            "expert_count": moe.num_experts, "expert_used_count": moe.top_k}
    if arch != "llama":
        ints["expert_feed_forward_length"] = moe.moe_intermediate_size
        ints["expert_shared_feed_forward_length"] = moe.shared_expert_intermediate_size
    for key, value in ints.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", parsed.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", parsed.rope_theta)
    names = {hf: gguf_name for gguf_name, hf in _gguf_name_table(
        parsed.num_hidden_layers).items()}
    for layer in range(parsed.num_hidden_layers):
        prefix = moe.prefix(layer)
        for norm in ("q_norm", "k_norm"):  # Qwen3-MoE
            names[f"model.layers.{layer}.self_attn.{norm}.weight"] = \
                f"blk.{layer}.attn_{norm}.weight"
        names[prefix + "gate.weight"] = f"blk.{layer}.ffn_gate_inp.weight"
        for part, kind in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            names[f"{prefix}shared_expert.{part}.weight"] = f"blk.{layer}.ffn_{kind}_shexp.weight"
        names[prefix + "shared_expert_gate.weight"] = f"blk.{layer}.ffn_gate_inp_shexp.weight"
        for which, kind in enumerate(("gate", "up", "down")):
            stacked = np.stack([tensors.pop(moe.expert_names(layer, e)[which])
                                for e in range(moe.num_experts)]).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", stacked)
    for hf, values in tensors.items():
        name = names[hf]
        values = values.astype(np.float32)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = values.shape[0] // head_dim  # the converter's interleave, as above
            values = (values.reshape(heads, 2, head_dim // 2, *values.shape[1:])
                      .swapaxes(1, 2).reshape(values.shape))
        writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name_table(layers: int) -> dict[str, str]:
    from mpexec.models.loader.gguf_file import hf_name

    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for layer in range(layers):
        names += [f"blk.{layer}.{part}" for part in (
            "attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
            "attn_v.weight", "attn_v.bias", "attn_output.weight", "ffn_norm.weight",
            "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    return {name: str(hf_name(name)) for name in names}


def _add_gguf_tokenizer(writer: Any, hf_dir: Path, vocab_size: int) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [""] * max(vocab_size, len(vocab))
    for token, index in vocab.items():
        tokens[index] = token
    types = [3 if t in special else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
    for index, token in enumerate(tokens):
        if not token:
            tokens[index], types[index] = f"<unused{index}>", 5  # 5: UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(IM_END)
    writer.add_add_bos_token(bool(settings.get("add_bos_token")))
    writer.add_chat_template(settings["chat_template"])


def add_spm_tokenizer(writer: Any, vocab_size: int, *, add_bos: bool = True,
                      add_eos: bool | None = None, space_tokens: bool = False) -> None:
    """A SentencePiece-style vocabulary (``tokenizer.ggml.model = llama``) as GGUF metadata.

    ids 0-3 are ``<s>``, ``</s>``, ``<|im_start|>``, ``<|im_end|>`` (control,
    the same ids as the tiny checkpoint's tokenizer), 4 ``<unk>``, then the 256
    byte-fallback tokens ``<0x00>``…``<0xFF>``, then pieces learned from the
    fixed corpus with ``▁`` for a space, scored best first; no merges, as in
    llama.cpp's files.  ``space_tokens`` adds tokens of two and three plain
    spaces (how Gemma's files spell them).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = [*SPECIAL_TOKENS, "<unk>"]
    extra = ["  ", "   "] if space_tokens else []
    room = vocab_size - len(specials) - 256 - len(extra)
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                           prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=room, show_progress=False)
    trainer_model.train_from_iterator(_corpus(), trainer=trainer)
    learned = sorted(trainer_model.get_vocab().items(), key=lambda item: item[1])
    pieces = [token for token, _ in learned][:room]
    pieces += [f"<unused{i}>" for i in range(room - len(pieces))]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces, *extra]
    # 1 normal, 2 unknown, 3 control, 5 unused, 6 byte
    types = [3, 3, 3, 3, 2] + [6] * 256 + [5 if p.startswith("<unused") else 1 for p in pieces]
    types += [1] * len(extra)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    scores += [-1000.0] * len(extra)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(IM_END)
    writer.add_unk_token_id(4)
    writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)


def _write_shards(directory: Path, tensors: dict[str, Any], shards: int, save_file: Any) -> None:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    for stale in [*directory.glob("*.safetensors"), directory / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names = list(tensors)
    total = sum(t.nbytes for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = 0
    for name in names:  # contiguous groups of about equal bytes, in parameter order
        groups[min(shards - 1, running * shards // max(total, 1))].append(name)
        running += tensors[name].nbytes
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / file_name))
        weight_map.update(dict.fromkeys(group, file_name))
    _write_json(directory / INDEX_NAME,
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_tokenizer(directory: Path, vocab_size: int, add_bos_token: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if add_bos_token:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[IM_END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


def _corpus() -> list[str]:
    """Fixed text covering every printable ASCII character and some common words."""
    printable = "".join(chr(c) for c in range(32, 127))
    lines = [printable, printable[::-1]]
    words_list = _WORD_TEXT.split(" ")
    for i in range(200):
        words = [words_list[(i * 7 + j * 13) % len(words_list)]
                 for j in range(12)]
        lines.append(" ".join(words) + (", " if i % 3 else ". ") + str(i * 37))
    return lines


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
