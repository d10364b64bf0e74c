"""The offline LLM API on the fake model worker (no torch)."""

from __future__ import annotations

from typing import Any

import pytest

import mpexec
from mpexec.engine.llm import LLM
from mpexec.errors import WorkerDiedError
from mpexec.outputs import SamplingParams
from tests.engine.conftest import FAKE_WORKER
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens

pytestmark = pytest.mark.usefixtures("leak_check")


def fake_llm(backend: str = "uni", **kwargs: Any) -> LLM:
    worker_kwargs = {"block_size": 4, **kwargs.pop("worker_kwargs", {})}
    return LLM("fake", worker_cls=FAKE_WORKER, worker_kwargs=worker_kwargs,
               tokenizer=FakeTokenizer(), max_model_len=kwargs.pop("max_model_len", 96),
               block_size=4, executor_backend=backend, shutdown_grace_s=2.0,
               shutdown_term_s=2.0, **kwargs)


@pytest.mark.parametrize(("backend", "tp", "pp", "async_scheduling"), [
    ("uni", 1, 1, False), ("mp", 2, 1, True), ("mp", 1, 2, True)])
def test_generate_matches_the_reference(backend: str, tp: int, pp: int,
                                        async_scheduling: bool) -> None:
    tok = FakeTokenizer()
    prompts = ["Hello there", "What is two plus two?", {"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=10)
    with fake_llm(backend, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  async_scheduling=async_scheduling) as llm:
        outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == ["Hello there", "What is two plus two?", None]
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt["prompt_token_ids"]
        want, reason = reference_tokens(ids, params, eos_token_ids=(3,), max_model_len=96)
        assert out.token_ids == want and out.finish_reason == reason
        assert out.prompt_token_ids == ids
        assert out.outputs[0].text == out.text == tok.decode(want)
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time  # type: ignore[operator]
        assert out.finished


def test_stream_yields_partial_outputs_then_the_final_one() -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with fake_llm(async_scheduling=True) as llm:
        parts = list(llm.generate_stream(["abc", "defgh"], params))
        final = llm.generate(["abc", "defgh"], params)
    for want in final:
        mine = [p for p in parts if p.prompt == want.prompt]
        assert [len(p.token_ids) for p in mine] == list(range(1, 7))
        assert [p.finished for p in mine] == [False] * 5 + [True]
        assert mine[-1].token_ids == want.token_ids and mine[-1].text == want.text


def test_chat_uses_the_chat_template() -> None:
    tok = FakeTokenizer()
    conversation = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    with fake_llm() as llm:
        one = llm.chat(conversation, params)
        two = llm.chat([conversation, [{"role": "user", "content": "bye"}]], params)
    assert len(one) == 1 and len(two) == 2
    assert one[0].prompt_token_ids == tok.apply_chat_template(conversation)
    assert one[0].token_ids == two[0].token_ids


def test_per_prompt_sampling_params_and_seeds() -> None:
    with fake_llm() as llm:
        a, b = llm.generate(["same", "same"], [SamplingParams(seed=1, max_tokens=8),
                                              SamplingParams(seed=2, max_tokens=8)])
        c, = llm.generate("same", SamplingParams(seed=1, max_tokens=8))
    assert a.token_ids == c.token_ids and a.token_ids != b.token_ids


def test_user_mistakes_are_clear_errors() -> None:
    with fake_llm(max_model_len=16) as llm:
        with pytest.raises(ValueError, match="prompt 1: the prompt has 20 tokens"):
            llm.generate(["ok", "x" * 20])
        assert not llm.engine.has_unfinished_requests()  # the first one was withdrawn
        with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
            llm.generate(["a"], [SamplingParams(), SamplingParams()])
        with pytest.raises(TypeError, match="the prompt must be text"):
            llm.generate([42])  # type: ignore[list-item]
        assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].finished
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_worker_death_reaches_generate_and_the_llm_is_dead() -> None:
    llm = fake_llm("mp", tensor_parallel_size=2, worker_kwargs={"die_at_step": 3,
                                                                 "fault_rank": 1})
    try:
        with pytest.raises(WorkerDiedError):
            llm.generate(["a long enough prompt"] * 3, SamplingParams(max_tokens=20))
        with pytest.raises(mpexec.MpexecError, match="failed earlier"):
            llm.generate("again")
    finally:
        llm.shutdown()
        llm.shutdown()


def test_llm_is_a_lazy_public_name() -> None:
    assert mpexec.LLM is LLM
    assert mpexec.SamplingParams is SamplingParams


def test_a_stream_left_early_aborts_its_requests() -> None:
    with fake_llm() as llm:
        stream = llm.generate_stream(["abc", "def"], SamplingParams(max_tokens=30,
                                                                    ignore_eos=True))
        first = next(stream)
        assert not first.finished
        stream.close()
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_blocks
        assert llm.generate("next", SamplingParams(max_tokens=3))[0].finished


def test_spawned_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPEXEC_WORKER_MULTIPROC_METHOD", "spawn")
    params = SamplingParams(temperature=0, max_tokens=6)
    with fake_llm("mp", tensor_parallel_size=2, async_scheduling=True) as llm:
        spawned = llm.generate(["spawned"], params)[0]
    with fake_llm() as llm:
        local = llm.generate(["spawned"], params)[0]
    assert spawned.token_ids == local.token_ids
