"""SamplingParams: vLLM's fields, each bad value one ValueError naming the field;
stop strings (StopStringText) on the fake tokenizer, one character per token."""

from __future__ import annotations

from typing import Any

import pytest

from mpexec.engine.stop_strings import StopStringText
from mpexec.outputs import GuidedDecodingParams, SamplingParams
from tests.engine.fake_tokenizer import FakeTokenizer


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-308}, "repetition_penalty"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 100}, "prompt_logprobs"),
    ({"seed": "abc"}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": None}, "stop_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"guided_decoding": "json"}, "guided_decoding"),
    ({"guided_decoding": {"regex": "a+"}, "min_tokens": 2}, "min_tokens"),
])
def test_a_bad_value_names_its_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=rf"^{named}\b"):
        SamplingParams(**fields)


def test_values_float32_cannot_hold_are_brought_into_range() -> None:
    """vLLM's rules: a tiny temperature is 0.01, a tiny top_p 1e-6, a bias at most 100;
    -1 and 0 both switch top-k off."""
    params = SamplingParams(temperature=1e-300, top_p=1e-300,
                            logit_bias={5: 1e308, 6: -1e308, 7: 3.5})
    assert params.temperature == 0.01 and not params.greedy
    assert params.top_p == 1e-6
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 3.5}
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.5, top_p=0.3).temperature == 0.5
    for off in (-1, 0):
        assert SamplingParams(top_k=off).top_k == off


def test_a_tiny_temperature_samples_the_likely_token_not_token_0() -> None:
    """temperature 1e-300 used to read as 0.0 in float32: every logit became
    infinite, the probabilities NaN, and token 0 came out whatever the logits."""
    torch = pytest.importorskip("torch")
    from mpexec.models.sampler import SampleRequest, sample

    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]])
    for fields in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
                   {"temperature": 1.0, "logit_bias": {1: 1e308}}):
        tokens, _ = sample(logits, [SampleRequest(SamplingParams(**fields), seed=3,
                                                  position=0)])
        assert tokens == [1 if "logit_bias" in fields else 2], fields


def test_normalised_forms() -> None:
    params = SamplingParams(stop="###", logit_bias={"7": 1, 3: -2.5}, logprobs=True)
    assert params.stop == ["###"] and params.stop_token_ids == []
    assert params.logit_bias == {7: 1.0, 3: -2.5}
    assert params.logprobs == 0 and SamplingParams(logprobs=False).logprobs is None
    guided = SamplingParams(guided_decoding={"choice": ["yes", "no"]}).guided_decoding
    assert guided == GuidedDecodingParams(choice=["yes", "no"])


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": []},
                                    {"regex": 5}, {"regex": "(a"}, {"json": "{not json"}])
def test_guided_decoding_needs_exactly_one_valid_constraint(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="guided_decoding"):
        GuidedDecodingParams(**fields)


def tokens(text: str) -> list[int]:
    """Ids the fake tokenizer decodes to ``text`` (one per character, ' ' to 'y')."""
    ids = [4 + ord(c) - 32 for c in text]
    assert FakeTokenizer().decode(ids) == text
    return ids


def test_a_stop_string_spanning_tokens_never_shows() -> None:
    text = StopStringText(FakeTokenizer(), SamplingParams(stop=["END", "##"]))
    shown = []
    for token in tokens("abc EN"):
        assert text.add([token]) is None
        shown.append(text.visible)
    assert shown[-1] == "abc " and shown[-2] == "abc "  # "E", "EN" held back
    assert text.add(tokens("Dxy")) == "END"
    assert text.final() == "abc "
    assert all(not s.endswith(("E", "EN", "#")) for s in shown)


def test_held_back_text_comes_out_when_it_is_not_a_stop() -> None:
    text = StopStringText(FakeTokenizer(), SamplingParams(stop=["END"]))
    text.add(tokens("abcEN"))
    assert text.visible == "abc"
    text.add(tokens("x"))
    assert text.visible == "abcENx"
    text.add(tokens("E"))
    assert text.visible == "abcENx" and text.final() == "abcENxE"


def test_include_stop_str_in_output_and_the_earliest_stop_wins() -> None:
    params = SamplingParams(stop=["cd", "bcde"], include_stop_str_in_output=True)
    text = StopStringText(FakeTokenizer(), params)
    assert text.add(tokens("abcdef")) == "cd"  # after "d": "cd" completes first
    assert text.final() == "abcd"


def test_no_stop_string_before_min_tokens() -> None:
    text = StopStringText(FakeTokenizer(), SamplingParams(stop=["a"], min_tokens=3, max_tokens=9))
    assert text.add(tokens("aa")) is None
    assert text.add(tokens("ba")) == "a"
    assert text.final() == "aab"


def test_response_format_maps_to_a_constraint() -> None:
    from mpexec.engine.structured import guided_from_response_format

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert guided_from_response_format(None) is None
    assert guided_from_response_format({"type": "text"}) is None
    assert guided_from_response_format({"type": "json_object"}) == GuidedDecodingParams(
        json={"type": "object"})
    assert guided_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ) == GuidedDecodingParams(json=schema)
    for bad in ({"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "yaml"}, "json"):
        with pytest.raises(ValueError, match="response_format"):
            guided_from_response_format(bad)


def test_structured_output_without_a_tokenizer_backend_is_a_clear_error() -> None:
    pytest.importorskip("outlines_core")
    from mpexec.engine.structured import StructuredOutputs

    with pytest.raises(ValueError, match="structured output needs the checkpoint's tokenizer"):
        StructuredOutputs(FakeTokenizer(), 97, 3)


def test_missing_outlines_core_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from mpexec.engine import structured

    monkeypatch.setitem(sys.modules, "outlines_core", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'mpexec\[serve\]'"):
        structured.guide_regex(GuidedDecodingParams(json={"type": "object"}))
