"""Structured output: an automaton per request that says which tokens may come next.

::

    GuidedDecodingParams(json= | regex= | choice=)
      │ json: outlines_core.json_schema.build_regex_from_schema; choice: an alternation
      ▼
    regex ── outlines_core.Index(regex, Vocabulary(eos, token bytes -> ids))
      │        (compiled once per (kind, spec) and kept: the costly part)
      ▼
    Guide(index) per request ── write_mask_into ─► one int32 bitmask row per step
      ▲                                             (GrammarOutput, sent with sample_tokens)
      └── advance(token) as each sampled token comes back

The vocabulary is the checkpoint's tokenizer as bytes: byte-level BPE tokens
map back through the GPT-2 byte alphabet, SentencePiece pieces through
``▁`` → space and ``<0xNN>``; special tokens are left out (only EOS ends a
constrained output, once the automaton accepts).  The bitmask is as wide as
the model's vocabulary (which may be padded past the tokenizer's).
A request with a constraint never runs on a placeholder (the scheduler
waits for its token before scheduling it again), so async scheduling
overlaps only the unconstrained requests.

``outlines-core`` is optional (``pip install 'mpexec[serve]'``).
"""

from __future__ import annotations

import array
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from mpexec.outputs import GrammarOutput, GuidedDecodingParams

INSTALL_HINT = "structured output needs outlines-core: pip install 'mpexec[serve]'"


def _outlines() -> Any:
    try:
        import outlines_core
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return outlines_core


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte → printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def vocabulary_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Token id → the bytes it stands for, special tokens left out.

    ``tokenizer`` is a :class:`mpexec.models.tokenizer.Tokenizer` (its
    ``backend`` is a ``tokenizers.Tokenizer``).
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ValueError("structured output needs the checkpoint's tokenizer "
                         f"(a tokenizers backend); {type(tokenizer).__name__} has none")
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in repr(backend.decoder)
    table = _byte_decoder()
    out: dict[int, bytes] = {}
    for text, token in backend.get_vocab(with_added_tokens=True).items():
        if token in special:
            continue
        if byte_level and all(c in table for c in text):
            out[token] = bytes(table[c] for c in text)
        elif (match := _BYTE_PIECE.match(text)) is not None:
            out[token] = bytes([int(match.group(1), 16)])
        else:
            out[token] = text.replace("▁", " ").encode()
    return out


def guide_regex(params: GuidedDecodingParams) -> str:
    """The regular expression a constraint compiles to."""
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return "(" + "|".join(re.escape(c) for c in params.choice) + ")"
    schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
    try:
        return str(_outlines().json_schema.build_regex_from_schema(
            schema, params.whitespace_pattern))
    except ImportError:
        raise
    except Exception as exc:  # the library raises its own error types
        raise ValueError(f"guided_decoding.json is not a usable JSON schema: {exc}") from None


def guided_from_response_format(response_format: Any) -> GuidedDecodingParams | None:
    """OpenAI's ``response_format`` as a constraint: ``{"type": "json_schema",
    "json_schema": {"schema": ...}}`` → that schema, ``{"type": "json_object"}``
    → any JSON object, ``{"type": "text"}`` or None → no constraint."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json={"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema (an object)")
        return GuidedDecodingParams(json=schema)
    raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'; "
                     f"got {kind!r}")


class StructuredOutputs:
    """Compiles constraints over one tokenizer's vocabulary and builds the bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        oc = _outlines()
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        by_bytes: dict[bytes, list[int]] = {}
        for token, data in vocabulary_bytes(tokenizer).items():
            if token < vocab_size and token != eos_token_id:
                by_bytes.setdefault(data, []).append(token)
        self.vocabulary = oc.Vocabulary(eos_token_id, by_bytes)
        self._indexes: dict[str, Any] = {}

    def guide(self, params: GuidedDecodingParams) -> Any:
        """A fresh automaton for one request (ValueError: a bad regex or schema)."""
        oc = _outlines()
        regex = guide_regex(params)
        index = self._indexes.get(regex)
        if index is None:
            try:
                index = oc.Index(regex, self.vocabulary)
            except Exception as exc:
                raise ValueError(f"guided_decoding: cannot compile {regex[:200]!r} over the "
                                 f"vocabulary: {exc}") from None
            self._indexes[regex] = index
        return oc.Guide(index)

    def grammar_output(self, req_ids: Sequence[str], guides: Sequence[Any]) -> GrammarOutput:
        """One bitmask row per request, in order (int32 words, bit set = allowed)."""
        mask = array.array("i", bytes(4 * self.words * len(guides)))
        address, _ = mask.buffer_info()
        for row, guide in enumerate(guides):
            guide.write_mask_into(address + 4 * self.words * row, self.words, 4)
        return GrammarOutput(structured_output_request_ids=list(req_ids),
                             grammar_bitmask=mask)
