"""Streaming text decodes only the new tokens and never shows half a character."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from mpexec.engine.stream_text import StreamText

TEXT = "naïve café 😀🎉 中文 done, the quick brown fox ✓"


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call got."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.mark.torch
def test_partial_texts_hold_back_unfinished_characters(tiny_checkpoint: Path) -> None:
    from mpexec.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_dir(tiny_checkpoint)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 30  # byte-level pieces: the emoji spans several tokens
    counting = CountingTokenizer(tokenizer)
    stream = StreamText(counting)
    texts = [stream.update(ids[:n], finished=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert not any("\ufffd" in t for t in texts)
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == tokenizer.decode(ids) == TEXT
    # only short windows are decoded while streaming; the one full decode is the last
    assert max(counting.lengths[:-1]) <= 8 and counting.lengths[-1] == len(ids)
