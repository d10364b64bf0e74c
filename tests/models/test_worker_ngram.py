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


def test_a_match_near_the_end_continues_the_pattern() -> None:
    assert propose([7, 7, 7], num_draft=4) == [7, 7, 7, 7]
    assert propose([1, 2, 1, 2], num_draft=5, min_n=2) == [1, 2, 1, 2, 1]


def test_by_match_proposes_at_most_one_draft_less_than_the_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert propose(tokens, num_draft=4, max_n=5, by_match=True) == [8, 7]  # 3 matched
    assert propose(tokens, num_draft=1, max_n=5, by_match=True) == [8]
    # 6 matched (1 2 3 8 7 1 | 2 3 ...): the whole num_draft
    longer = [1, 2, 3, 8, 7, 1, 2, 3, 8, 7, 1]
    assert propose(longer, num_draft=4, max_n=8, by_match=True) == [2, 3, 8, 7]
    assert propose(longer, num_draft=4, max_n=3, by_match=True) == [2, 3]  # n capped at 3
    assert propose([5, 6, 4, 7, 6], min_n=1, by_match=True) == []  # one token vouches for none


def test_speculative_config_takes_vllm_names_and_refuses_nonsense() -> None:
    from mpexec.models.ngram import SpeculativeConfig

    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_max": 5}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == (3, 5, 2)
    assert SpeculativeConfig.from_dict({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_dict({"prompt_lookup_min": 6}).prompt_lookup_max == 6
    assert config.propose([1, 2, 3, 4, 2, 3]) == [4]  # 2 matched: draft_by_match
    fixed = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "draft_by_match": False})
    assert fixed.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    assert SpeculativeConfig().to_dict() == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
        "prompt_lookup_min": 2, "draft_by_match": True}
    for bad, match in (({"method": "eagle"}, "method"),
                       ({"draft_by_match": 1}, "draft_by_match"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "exceeds"),
                       ({"draft_model": "x"}, "unknown field"), ("[1]", "JSON object"),
                       ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)  # type: ignore[arg-type]
