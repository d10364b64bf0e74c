"""Tiny GGUF files for tests, written the way llama.cpp's converter writes them.

    write_tiny_gguf(path, hf_dir)     a ``testing.write_tiny_checkpoint`` directory
                                      (llama / qwen2) as GGUF: names, reversed shapes,
                                      the Q/K row interleave, the tokenizer as metadata
    write_family_gguf(path, hf_dir)   a transformers-saved Qwen3, Gemma 2/3 or Phi-3
    write_moe_gguf(path, hf_dir)      a transformers-saved Mixtral, Qwen2-MoE or Qwen3-MoE
    add_spm_tokenizer(writer, vocab)  a SentencePiece-style vocabulary as GGUF metadata
    quantize_q4_k / quantize_q6_k     plain reference quantisers for the two K-quants
                                      gguf's Python package cannot write
    quantize_gguf(source, path, qt)   a float GGUF rewritten with its weights in ``qt``
                                      (routers, norms, odd rows stay float, as llama.cpp
                                      leaves them)
    dequantized_checkpoint(...)       the values a reader dequantises from such a file,
                                      written back into the transformers checkpoint it
                                      came from (the oracle's weights)

Each weight whose rows are whole blocks of the chosen type is quantised (by
``gguf.quants`` where it can, by the reference quantisers above for Q4_K and
Q6_K, as random blocks otherwise), so the GGUF loader can be tested without a
real model.  The tiny safetensors checkpoints these files are made from, and
their tokenizer, live in :mod:`mpexec.models.testing`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpexec.models.config import ModelConfig
from mpexec.models.testing import BOS, IM_END, SPECIAL_TOKENS, training_corpus


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
        _add_weight(writer, name, values, qtype, rng)
    _write_out(writer)
    return path



def _add_weight(writer: Any, name: str, values: Any, qtype: str, rng: Any) -> None:
    """``values`` as tensor ``name``: in ``qtype`` when it is a matrix whose rows
    are whole blocks of it, else as float32."""
    import gguf
    import numpy as np

    quant = gguf.GGMLQuantizationType[qtype]
    whole_blocks = values.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0
    if values.ndim == 2 and qtype != "F32" and whole_blocks:
        writer.add_tensor(name, _quantize(values, quant, rng), raw_dtype=quant)
    else:
        writer.add_tensor(name, np.ascontiguousarray(values))


def _write_out(writer: Any) -> None:
    """Header, metadata and tensors to the file, closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    rng = np.random.Generator(np.random.PCG64(1))
    for hf, values in tensors.items():
        name = gguf_names.get(hf)
        if name is None:
            continue  # lm_head of a tied checkpoint
        values = values.astype(np.float32)
        if features.norm_offset and name.endswith("norm.weight"):
            values = values + np.float32(features.norm_offset)
        _add_weight(writer, name, values, qtype, rng)
    _write_out(writer)
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
    _write_out(writer)
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
    trainer_model.train_from_iterator(training_corpus(), trainer=trainer)
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


_KEEP_FLOAT = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def quantize_gguf(source: str | Path, path: str | Path, qtype: str, *,
                  select: Callable[[str], bool] | None = None,
                  tokenizer: str | Path | None = None) -> Path:
    """Write ``source`` (a GGUF of float tensors) to ``path`` with its weights in
    ``qtype`` (a ``gguf.GGMLQuantizationType`` name: Q8_0, Q4_0, Q4_1, Q4_K …);
    with ``select``, only the weights whose GGUF name it accepts (e.g. the
    experts: ``lambda name: "_exps." in name``).  ``tokenizer``: a checkpoint
    directory with the tiny checkpoint's tokenizer (``testing``), added to
    the file as its vocabulary (an engine serving the file reads it there)."""
    import gguf
    import numpy as np

    quant = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[quant][0]
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main, sub_type=sub)
    if tokenizer is not None:
        vocab = reader.fields[f"{arch}.vocab_size"].contents()
        _add_gguf_tokenizer(writer, Path(tokenizer), int(vocab))
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        values: Any = np.array(tensor.data)  # torch order: the row is the last dimension
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{source}: {tensor.name} is {tensor.tensor_type.name}, "
                             "not float32")
        if (values.ndim >= 2 and values.shape[-1] % block == 0
                and not tensor.name.endswith(_KEEP_FLOAT)
                and (select is None or select(tensor.name))):
            raw = _quantize(values.reshape(-1, values.shape[-1]), quant, rng)
            writer.add_tensor(tensor.name, raw.reshape(*values.shape[:-1], -1),
                              raw_dtype=quant)
        else:
            writer.add_tensor(tensor.name, values)
    _write_out(writer)
    return Path(path)


def dequantized_checkpoint(gguf_path: str | Path, hf_dir: str | Path,
                           directory: str | Path) -> Path:
    """``hf_dir`` (the transformers checkpoint ``gguf_path`` was written from)
    copied to ``directory`` with every tensor replaced by the GGUF's values as
    this package's loader dequantises them: transformers loads the same
    weights the quantised file holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mpexec.models.loader import open_checkpoint

    hf_dir, directory = Path(hf_dir), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for item in hf_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, directory / item.name)
    with open_checkpoint(gguf_path) as checkpoint:
        for shard in sorted(hf_dir.glob("*.safetensors")):
            tensors = load_file(str(shard))
            values = {name: checkpoint.read(name).to(tensor.dtype).reshape(tensor.shape)
                      for name, tensor in tensors.items()}
            save_file({n: v.contiguous() for n, v in values.items()},
                      str(directory / shard.name), metadata={"format": "pt"})
    return directory
