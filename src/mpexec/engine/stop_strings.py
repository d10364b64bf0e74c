"""Stop strings: a request's output text, decoded as its tokens arrive.

A stop string can span tokens, so the text is decoded incrementally
(:class:`~mpexec.models.tokenizer.IncrementalDecoder`: an unfinished UTF-8
character is held back) and each new piece is searched together with the
last ``len(longest stop) - 1`` characters before it::

    text so far ....... "Hello wor"   + piece "ld\\n"   stop = ["world"]
    search window             "wor" + "ld\\n"  -> "world" at 6: text = "Hello "

While the request runs, :attr:`StopStringText.visible` also holds back a
suffix that could be the start of a stop string ("Hello wor" shows as
"Hello "), so a stream never shows a stop string it later takes back.  With
``include_stop_str_in_output`` the stop string stays in the final text.  No
stop string counts before ``min_tokens`` tokens (as for EOS).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpexec.models.tokenizer import IncrementalDecoder
from mpexec.outputs import SamplingParams


class StopStringText:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.stops = list(params.stop)
        self.include = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.longest = max(len(s) for s in self.stops)
        self.decoder = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self.text = ""
        self.num_tokens = 0
        self.stop: str | None = None

    def add(self, token_ids: Iterable[int]) -> str | None:
        """Decode more tokens; the stop string if one now ends the text."""
        for token in token_ids:
            if self.stop is not None:
                return self.stop
            self.num_tokens += 1
            piece = self.decoder.push(token)
            if not piece:
                continue
            start = max(0, len(self.text) - self.longest + 1)
            self.text += piece
            if self.num_tokens > self.min_tokens:
                self._search(start)
        return self.stop

    def _search(self, start: int) -> None:
        found: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, start)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is not None:
            index, stop = found
            self.text = self.text[:index + len(stop) if self.include else index]
            self.stop = stop

    @property
    def visible(self) -> str:
        """The text a running request may show: without a possible stop-string start."""
        if self.stop is not None:
            return self.text
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold]

    def final(self) -> str:
        """The text once the request ended: held-back text released."""
        if self.stop is None:
            self.text += self.decoder.flush()
        return self.text
