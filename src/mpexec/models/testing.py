"""A tiny deterministic random Llama checkpoint in Hugging Face format, for tests.

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

``training_corpus`` is the fixed text the tokenizers are trained on.
:mod:`mpexec.models.testing_gguf` converts such a checkpoint to GGUF.
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
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
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


def training_corpus() -> list[str]:
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
