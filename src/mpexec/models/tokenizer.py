"""Text ⇄ token ids, and chat prompts, the way the checkpoint's own tokenizer does it.

    tokenizer.json + tokenizer_config.json ─┐
                                            ├─► tokenizers.Tokenizer (the backend)
    GGUF tokenizer.ggml.* metadata ─────────┘     (loader.gguf_tokenizer builds it)

    encode(text)                 plain text, special tokens kept whole; BOS only
                                 when the checkpoint's post-processor adds it
                                 (tokenizer.json's, or for GGUF the one built
                                 from tokenizer.ggml.add_bos_token), which is
                                 what transformers follows too
    chat_prompt(messages)        the checkpoint's Jinja chat template, rendered in
                                 a sandbox with the variables transformers passes
    apply_chat_template(...)     chat_prompt encoded without adding specials (the
                                 template writes its own)
    IncrementalDecoder           streaming text: holds back text while the last
                                 token ends inside a multi-byte character

No transformers import: the backend is the ``tokenizers`` library, the
template engine ``jinja2``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpexec.models.config import CheckpointError

if TYPE_CHECKING:
    import tokenizers

    from mpexec.models.config import ModelConfig

Message = Mapping[str, Any]


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        special_tokens: Mapping[str, str | None],
        source: str | Path = "",
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # bos_token, eos_token, ... → text
        self.source = str(source)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._render: Callable[..., str] | None = None

    # ── construction ─────────────────────────────────────────────────────

    @classmethod
    def from_hf_dir(cls, directory: str | Path, config: ModelConfig | None = None) -> Tokenizer:
        import tokenizers

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(path, "file", "missing (only tokenizer.json is supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise CheckpointError(path, "json", f"not a readable tokenizer ({e})") from None
        settings_path = directory / "tokenizer_config.json"
        settings: dict[str, Any] = {}
        if settings_path.is_file():
            try:
                settings = json.loads(settings_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise CheckpointError(settings_path, "json", f"not valid JSON ({e})") from None
        special = {key: _token_text(settings.get(key))
                   for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if config is None:
            from mpexec.models.config import ModelConfig

            config = ModelConfig.from_hf_dir(directory)
        bos_id = config.bos_token_id
        if bos_id is None and special["bos_token"] is not None:
            bos_id = backend.token_to_id(special["bos_token"])
        eos_ids = list(config.eos_token_ids)
        eos_text = special["eos_token"]
        eos_id = backend.token_to_id(eos_text) if eos_text is not None else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                   chat_template=config.chat_template, special_tokens=special,
                   source=directory)

    # ── text ⇄ ids ───────────────────────────────────────────────────────

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return int(found) if found is not None else None

    # ── chat ─────────────────────────────────────────────────────────────

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    template: str | None = None, **extra: Any) -> str:
        """The conversation rendered by the checkpoint's template (or ``template``)."""
        if template is not None:
            render = _compile_template(template)
        else:
            if self.chat_template is None:
                raise ValueError(f"{self.source}: the checkpoint has no chat template")
            if self._render is None:
                self._render = _compile_template(self.chat_template)
            render = self._render
        variables = {key: value for key, value in self.special_tokens.items()
                     if value is not None}
        return render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                      **variables, **extra)

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        prompt = self.chat_prompt(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(prompt, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


class IncrementalDecoder:
    """Turn a stream of token ids into a stream of text pieces.

    A character can span tokens (byte-level BPE splits a UTF-8 sequence
    anywhere), and some decoders treat the first token of a call specially
    (dropping a leading space), so each step decodes a short window that
    starts a few tokens back and emits only what the new token added; text
    ending in U+FFFD (an unfinished character) is held until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: text before it has been emitted
        self._read = 0    # ids[:read] have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def extend(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is held back (an unfinished character comes out as U+FFFD)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _compile_template(template: str) -> Callable[..., str]:
    """A sandboxed Jinja template with the globals transformers' templates expect."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)

    def render(**variables: Any) -> str:
        return compiled.render(**variables)

    return render


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None
