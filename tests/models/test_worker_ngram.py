"""Prompt-lookup drafts."""

from __future__ import annotations

import pytest

from mpexec.models.ngram import propose


def test_the_latest_longest_match_wins() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert propose(tokens) == [8, 7, 1]  # "1 2 3" last seen at 4..6, followed by 8 7 1
    assert propose(tokens, num_draft=1) == [8]


def test_shorter_ngrams_are_tried_when_longer_ones_fail() -> None:
    assert propose([5, 6, 4, 7, 6]) == [4, 7, 6]
    assert propose([1, 2, 3, 4]) == []
    assert propose([]) == [] and propose([3]) == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="bad n-gram settings"):
        propose([1, 2], num_draft=0)
