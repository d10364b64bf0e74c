"""A ``tokenizers`` backend rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

    tokenizer.ggml.model   "gpt2": byte-level BPE (the only kind built here)
    tokenizer.ggml.tokens  id → token, spelled in the byte-level alphabet
    tokenizer.ggml.merges  "a b" pairs, highest priority first
    tokenizer.ggml.token_type  3 (control) → special added token,
                               4 (user defined) → plain added token
    tokenizer.ggml.pre     which split regex the family's merges were learned with
    tokenizer.ggml.add_bos_token  a post-processor that prepends BOS

The pre-tokenizer follows what Hugging Face ``transformers`` builds for the
same file, so ``encode`` gives the ids the model was checked against: the
families with a regex of their own (llama3, qwen2, …) split with it before
the byte mapping; the others, SmolLM's included, use GPT-2's split.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpexec.models.config import CheckpointError, ModelConfig
from mpexec.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import tokenizers

CONTROL, USER_DEFINED = 3, 4

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX = {
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3, "dbrx": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_backend(fields: Mapping[str, Any], source: str | Path) -> tokenizers.Tokenizer:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(source, "tokenizer.ggml.model", f"{kind!r} is not supported "
                              "(only 'gpt2' byte-level BPE)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not isinstance(fields.get(key), list):
            raise CheckpointError(source, key, "missing")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(source, "tokenizer.ggml.token_type",
                              f"{len(types)} entries for {len(tokens)} tokens")
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:  # a raw UTF-8 token: respell it in the byte alphabet
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = []
    for index, merge in enumerate(fields["tokenizer.ggml.merges"]):
        pair = tuple(str(merge).split(" ", 1))
        if len(pair) != 2:
            raise CheckpointError(source, "tokenizer.ggml.merges",
                                  f"entry {index} ({merge!r}) is not a pair")
        merges.append(pair)
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise CheckpointError(source, "tokenizer.ggml.merges", f"not a valid BPE with "
                              f"tokenizer.ggml.tokens ({e})") from None

    split = SPLIT_REGEX.get(str(fields.get("tokenizer.ggml.pre")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    pairs = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_ in pairs if kind_ == CONTROL and set(t) <= spelled]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_ in pairs if kind_ == USER_DEFINED and t in vocab]
    backend.add_special_tokens(control)
    backend.add_tokens(user)

    bos = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_text = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B",
            special_tokens=[(bos_text, int(bos))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def tokenizer_from_gguf(fields: Mapping[str, Any], *, source: str | Path,
                        config: ModelConfig) -> Tokenizer:
    """The checkpoint's :class:`Tokenizer`, from its ``tokenizer.ggml.*`` metadata."""
    backend = build_backend(fields, source)
    tokens = fields["tokenizer.ggml.tokens"]

    def text_of(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= index < len(tokens) else None

    special = {"bos_token": text_of("bos_token_id"), "eos_token": text_of("eos_token_id"),
               "unk_token": text_of("unknown_token_id"),
               "pad_token": text_of("padding_token_id")}
    return Tokenizer(backend, bos_token_id=config.bos_token_id,
                     eos_token_ids=config.eos_token_ids, chat_template=config.chat_template,
                     special_tokens=special, source=source)
