"""One bad request fails only itself: the front-end checks and the LLM's own streams.

Each bad request is refused before it reaches the scheduler, with one line
naming the field, and the same LLM then serves a good request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mpexec.engine.llm import LLM
from mpexec.engine.validation import RequestError, check_token_ids, prepare_prompt
from mpexec.outputs import SamplingParams
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens
from tests.engine.test_llm import fake_llm

pytestmark = pytest.mark.usefixtures("leak_check")

GOOD = SamplingParams(temperature=0, max_tokens=3)


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ({"prompt_token_ids": [5, 200]}, GOOD, r"prompt_token_ids\[1\] = 200 is outside the vocab"),
    ({"prompt_token_ids": [5, -1]}, GOOD, r"prompt_token_ids\[1\] = -1 is outside"),
    ({"prompt_token_ids": [5, 1.7]}, GOOD, r"prompt_token_ids\[1\] must be an integer; got 1.7"),
    ({"prompt_token_ids": [True]}, GOOD, r"prompt_token_ids\[0\] must be an integer"),
    ({"prompt_token_ids": None}, GOOD, "prompt_token_ids must be a list of integers"),
    (None, GOOD, "the prompt is None"),
    (b"caf\xe9", GOOD, "not valid UTF-8"),
    ("x" * 20, GOOD, "the prompt has 20 tokens; the context holds 16"),
    ({"text": "hi"}, GOOD, "a prompt dict needs 'prompt_token_ids'"),
    ("hi", {"temperature": 0}, "sampling_params must be a SamplingParams; got dict"),
])
def test_a_bad_request_is_one_clear_error_and_the_llm_serves_on(
        prompt: Any, params: Any, match: str) -> None:
    with fake_llm(max_model_len=16) as llm:
        with pytest.raises(RequestError, match=match) as caught:
            llm.generate(prompt, params)
        assert "\n" not in str(caught.value)
        assert not llm.engine.has_unfinished_requests()
        assert llm.generate("fine", GOOD)[0].finished


def test_utf8_bytes_and_prompt_dicts_are_prompts() -> None:
    with fake_llm() as llm:
        by_bytes, by_dict, by_text = llm.generate(
            ["café".encode(), {"prompt": "café"}, "café"], GOOD)  # type: ignore[list-item]
    assert by_bytes.token_ids == by_dict.token_ids == by_text.token_ids
    assert by_bytes.prompt == "café"


def test_sampling_params_refuse_none_stop_token_ids() -> None:
    with pytest.raises(ValueError, match="stop_token_ids must be integers"):
        SamplingParams(stop_token_ids=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("seed", "abc"), ("max_num_seqs", 0), ("max_model_len", 1.5), ("max_num_batched_tokens", None)])
def test_llm_arguments_are_checked_before_anything_starts(field: str, value: Any) -> None:
    with pytest.raises(RequestError, match=f"{field} must be"):
        fake_llm(**{field: value})


def test_check_helpers_directly() -> None:
    assert check_token_ids((1, 2), 10) == [1, 2]
    assert prepare_prompt("ab", FakeTokenizer().encode, 97, None) == \
        ("ab", FakeTokenizer().encode("ab"))


@pytest.mark.torch
def test_a_model_len_beyond_the_checkpoint_fails_before_any_worker(tiny_checkpoint: Path,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len 1000000000 exceeds the model's "
                                         "context length"):
        LLM(str(tiny_checkpoint), max_model_len=10**9)
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    with pytest.raises(Exception, match=r"directory without config\.json"):
        LLM(str(not_a_model))


@pytest.mark.torch
@pytest.mark.parametrize(("layout", "message"), [
    ({"tensor_parallel_size": 1000}, r"tensor_parallel_size \(1000\) exceeds"),
    ({"pipeline_parallel_size": 1000}, r"pipeline_parallel_size \(1000\) exceeds num_hidden"),
])
def test_a_layout_larger_than_the_model_fails_before_any_worker(
        tiny_checkpoint: Path, layout: dict[str, int], message: str, leak_check: None) -> None:
    """A hostile TP of 1000 once forked workers until the machine was swamped:
    the driver now checks the shares against the checkpoint before any start."""
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoint), executor_backend="mp", **layout)


# -- the workers refuse one request ------------------------------------------------------

def test_a_request_the_workers_refuse_fails_alone() -> None:
    tok = FakeTokenizer()
    poison = tok.encode("!")[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fake_llm(worker_kwargs={"refuse_token": poison}) as llm:
        good = llm.generate_stream("good prompt", params)
        first = next(good)  # running: it is in the batch when the bad one joins
        assert len(first.token_ids) == 1
        with pytest.raises(Exception, match=r"token .* refused") as caught:
            llm.generate("bad!", params)
        assert type(caught.value).__name__ == "WorkerError"
        rest = list(good)
        assert not llm.engine.is_dead
        assert rest[-1].finished and rest[-1].token_ids == reference_tokens(
            tok.encode("good prompt"), params)[0]
        assert llm.generate("again", params)[0].finished


# -- streams of one LLM, interleaved -------------------------------------------------------

def test_interleaved_streams_each_get_their_final_output() -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with fake_llm(max_model_len=96) as llm:
        a = llm.generate_stream("first stream", params)
        b = llm.generate_stream("second one", params)
        last: dict[str, Any] = {}
        while len(last) < 2 or not all(o.finished for o in last.values()):
            for name, stream in (("a", a), ("b", b)):
                if name in last and last[name].finished:
                    continue
                last[name] = next(stream)
        suspended = llm.generate_stream("suspended", params)
        head = next(suspended)
        full = llm.generate(["in between"], params)[0]  # drives every step to the end
        tail = list(suspended)
    assert [len(o.token_ids) for o in last.values()] == [40, 40]
    assert full.finished and len(full.token_ids) == 40
    assert not head.finished and tail[-1].finished and len(tail[-1].token_ids) == 40


def test_generate_aborts_when_the_progress_callback_raises() -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def progress(finished: int, total: int, tokens: int) -> None:
        if tokens >= 4:
            raise KeyboardInterrupt

    with fake_llm() as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["one", "two"], params, progress=progress)
        assert not llm.engine.has_unfinished_requests()
        free = llm.engine.scheduler.blocks.num_free_blocks
        assert free == llm.engine.num_blocks
