"""A ``tokenizers`` backend rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

    tokenizer.ggml.model   "gpt2": byte-level BPE;  "llama": SentencePiece-style BPE
    tokenizer.ggml.tokens  id → token (gpt2: spelled in the byte-level alphabet)
    tokenizer.ggml.merges  "a b" pairs, highest priority first
    tokenizer.ggml.scores  llama: a score per token, which orders the merges
    tokenizer.ggml.token_type  3 (control) → special added token,
                               4 (user defined) → plain added token
    tokenizer.ggml.pre     which split regex the family's merges were learned with
    tokenizer.ggml.add_bos_token  a post-processor that prepends BOS

The pre-tokenizer follows what Hugging Face ``transformers`` builds for the
same file, so ``encode`` gives the ids the model was checked against: the
families with a regex of their own (llama3, qwen2, …) split with it before
the byte mapping; the others, SmolLM's included, use GPT-2's split.

SentencePiece vocabularies (``llama``: Llama 2, Mistral, Gemma, Phi-3) become
a BPE with byte fallback (text no token covers is spelled ``<0xNN>`` byte by
byte, and decoded back to UTF-8), ``▁`` for a space, and merges: the file's,
or, as the files usually carry none, every split of a token into two tokens,
ranked by the token's score (Gemma: by its position in the file, which is
its merge order; Gemma also spells a token of several spaces with spaces,
renamed here to ``▁``).  The space handling follows the family as
transformers does: Llama-style a ``▁`` before the first word
(``Metaspace``), Gemma none, Phi-3 a ``▁`` before the whole text.
``add_bos_token`` (true when absent) and ``add_eos_token`` build the
post-processor.
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
    if kind == "llama":
        return _sentencepiece(fields, source)
    if kind != "gpt2":
        raise CheckpointError(source, "tokenizer.ggml.model", f"{kind!r} is not supported "
                              "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
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


GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"  # ▁


def _sentencepiece(fields: Mapping[str, Any], source: str | Path) -> tokenizers.Tokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise CheckpointError(source, "tokenizer.ggml.tokens", "missing")
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise CheckpointError(source, "tokenizer.ggml.token_type",
                              f"{len(types)} entries for {len(tokens)} tokens")
    arch = fields.get("general.architecture")
    gemma = arch in GEMMA_ARCHITECTURES
    if gemma:  # a token of spaces is stored with spaces; the model looks up ▁▁
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    file_merges = fields.get("tokenizer.ggml.merges")
    merges: list[tuple[str, str]]
    if isinstance(file_merges, list):
        merges = []
        for index, merge in enumerate(file_merges):
            left, _, right = str(merge).partition(" ")
            if not right:
                raise CheckpointError(source, "tokenizer.ggml.merges",
                                      f"entry {index} ({merge!r}) is not a pair")
            merges.append((left, right))
    else:
        if gemma:
            ranks: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
        else:
            scores = fields.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise CheckpointError(source, "tokenizer.ggml.scores", "missing or not one "
                                      "score per token (needed to order the merges)")
            ranks = dict(zip(tokens, scores, strict=True))
        merges = _merges_from_vocab(vocab, ranks)
    unknown = fields.get("tokenizer.ggml.unknown_token_id")
    unk_text = tokens[int(unknown)] if isinstance(unknown, int) and \
        0 <= unknown < len(tokens) else "<unk>"
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                       byte_fallback=True,
                                       unk_token=unk_text if unk_text in vocab else None))
    except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise CheckpointError(source, "tokenizer.ggml.merges", f"not a valid BPE with "
                              f"tokenizer.ggml.tokens ({e})") from None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                                   normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE,
                                                         prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)

    special_ids = [fields.get(f"tokenizer.ggml.{key}") for key in (
        "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
    special = {tokens[i] for i in special_ids if isinstance(i, int) and 0 <= i < len(tokens)}
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in [*control, *sorted(special - set(control))]])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types, strict=True)
                        if kind == USER_DEFINED and t in vocab])
    backend.post_processor = _bos_eos_processor(fields, tokens)
    return backend


def _merges_from_vocab(vocab: dict[str, int],
                       ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a ranked token into two vocabulary tokens, best rank first
    (ties: shorter left part, then shorter right part, then file order)."""
    found: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _bos_eos_processor(fields: Mapping[str, Any], tokens: list[str]) -> Any:
    from tokenizers import processors

    ends: list[tuple[str, int]] = []
    parts = {}
    for key, default in (("bos", True), ("eos", False)):
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        wanted = fields.get(f"tokenizer.ggml.add_{key}_token", default)
        if wanted and isinstance(index, int) and 0 <= index < len(tokens):
            parts[key] = tokens[index]
            ends.append((tokens[index], index))
    bos = f"{parts['bos']}:0 " if "bos" in parts else ""
    eos = f" {parts['eos']}:0" if "eos" in parts else ""
    single = f"{bos}$A:0{eos}"
    pair = (f"{single}{' ' + parts['bos'] + ':1' if 'bos' in parts else ''} $B:1"
            f"{' ' + parts['eos'] + ':1' if 'eos' in parts else ''}")
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(ends)))
