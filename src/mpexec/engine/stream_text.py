"""The text of a request as its tokens arrive, decoding only the new ones.

Each update pushes the tokens sampled since the last one through an
:class:`~mpexec.models.tokenizer.IncrementalDecoder`, which decodes a short
window and holds back the bytes of a character that the next token will
finish (byte-level BPE splits an emoji over several tokens): a partial text
never ends in U+FFFD.  The text only grows, so a streaming client can send
``text[len(previous):]`` as the delta.

At the end the held-back bytes are flushed, and the full decode of every
token replaces the text when it extends what was streamed (the usual case),
so the last text equals what ``LLM.generate`` returns for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StreamText:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        from mpexec.models.tokenizer import IncrementalDecoder

        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.text = ""
        self._done = False

    def update(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """The text of ``token_ids`` (all output tokens so far); grows monotonically."""
        if self._done:
            return self.text
        pushed = len(self._decoder.ids)
        if len(token_ids) > pushed:
            self.text += self._decoder.extend(token_ids[pushed:])
        if finished:
            self._done = True
            self.text += self._decoder.flush()
            full = self._tokenizer.decode(list(token_ids), skip_special_tokens=self._skip)
            if full.startswith(self.text):
                self.text = full
        return self.text
