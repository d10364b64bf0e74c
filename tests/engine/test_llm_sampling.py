"""vLLM's sampling surface through LLM on the fake model worker: n, stop strings,
stop_reason, min_tokens, prompt forms, chat options, get_tokenizer, use_tqdm."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpexec.outputs import SamplingParams
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens
from tests.engine.test_llm import fake_llm

pytestmark = pytest.mark.usefixtures("leak_check")

PROMPT = "Hello there"


def test_n_completions_each_with_its_own_seed() -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    ids = FakeTokenizer().encode(PROMPT)
    with fake_llm() as llm:
        (out,) = llm.generate(PROMPT, params)
        again = llm.generate([PROMPT, "other"], [params, replace(params, n=1)])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for i, completion in enumerate(out.outputs):
        want, _ = reference_tokens(ids, replace(params, n=1, seed=11 + i))
        assert completion.token_ids == want
        assert completion.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def greedy_text(llm: object, max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(PROMPT, params)[0].text  # type: ignore[attr-defined, no-any-return]


def test_a_stop_string_ends_the_text_and_never_leaks_into_the_stream() -> None:
    with fake_llm(async_scheduling=True) as llm:
        full = greedy_text(llm)
        stop = full[4:6]  # spans two tokens (one character per token)
        cut = full.index(stop)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        (out,) = llm.generate(PROMPT, params)
        parts = list(llm.generate_stream(PROMPT, params))
        (kept,) = llm.generate(PROMPT, replace(params, include_stop_str_in_output=True))
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) == cut + len(stop)  # the tokens up to the stop's end
    assert kept.text == full[:cut + len(stop)]
    assert parts[-1].finished and parts[-1].text == out.text
    for part in parts:
        assert out.text.startswith(part.text), part.text  # never more than the final text
    # the stream held back the stop string's first character while it could start it
    assert all(not p.text.endswith(stop[0]) or p.finished for p in parts)


def test_stop_reason_is_the_stop_token_and_min_tokens_defers_it() -> None:
    with fake_llm() as llm:
        base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        tokens = llm.generate(PROMPT, base)[0].token_ids
        (stopped,) = llm.generate(PROMPT, replace(base, stop_token_ids=[tokens[1]]))
        later = llm.generate(PROMPT, replace(base, stop_token_ids=[tokens[1]], min_tokens=2))
    assert stopped.token_ids == tokens[:2]
    assert stopped.outputs[0].stop_reason == tokens[1] and stopped.finish_reason == "stop"
    # a stop token before min_tokens does not count (the fake model cannot be
    # steered away from it, so the request runs on)
    assert later[0].token_ids[:2] == tokens[:2] and len(later[0].token_ids) > 2


def test_prompt_forms_tokenizer_chat_options_and_progress_bar(
        capsys: pytest.CaptureFixture[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    with fake_llm() as llm:
        assert llm.get_tokenizer() is llm.tokenizer
        text, as_dict = llm.generate([PROMPT, {"prompt": PROMPT}], params, use_tqdm=True)
        assert as_dict.prompt == PROMPT and as_dict.token_ids == text.token_ids
        chat = [{"role": "user", "content": "hi"}]
        open_turn = llm.chat_prompts(chat, add_generation_prompt=False)
        assert open_turn[0]["prompt_token_ids"] == llm.tokenizer.apply_chat_template(
            chat, add_generation_prompt=False)
        with pytest.raises(ValueError, match="add_generation_prompt=False"):
            llm.chat(chat, params, continue_final_message=True)
        with pytest.raises(ValueError, match=r"'prompt_token_ids'.* or 'prompt'"):
            llm.generate({"text": PROMPT}, params)
    assert "2/2" in capsys.readouterr().err
