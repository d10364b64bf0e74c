"""Sampling parity on a real checkpoint: logprobs, prompt logprobs and penalties
against transformers, seeds, special tokens, structured output (tiny checkpoint
and the default SmolLM2)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PROMPT = "the quick brown fox jumps over the lazy dog and the model worker"


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    import torch

    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint),
                                                             dtype=torch.float32)


def reference_logprobs(hf_model: Any, ids: list[int]) -> Any:
    """log_softmax of transformers' logits: row p scores the token at p + 1."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.timeout(300)
def test_logprobs_and_prompt_logprobs_match_transformers(tiny_checkpoint: Path,
                                                         hf_model: Any) -> None:
    from mpexec import SamplingParams

    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True,
                            logprobs=4, prompt_logprobs=3)
    # 8 tokens per step: the prompt is computed (and scored) in chunks
    with make_llm(tiny_checkpoint, max_num_batched_tokens=8) as llm:
        (out,) = llm.generate(PROMPT, params)
        decode = llm.tokenizer.decode
    prompt, completion = out.prompt_token_ids, out.outputs[0]
    assert len(prompt) > 16
    reference = reference_logprobs(hf_model, prompt + completion.token_ids)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    positions = [(p, prompt[p], out.prompt_logprobs[p], 3) for p in range(1, len(prompt))]
    positions += [(len(prompt) + i, token, completion.logprobs[i], 4)
                  for i, token in enumerate(completion.token_ids)]
    for position, token, entry, k in positions:
        row = reference[position - 1]
        order = row.argsort(descending=True).tolist()
        assert entry is not None and token in entry
        assert set(entry) == set(order[:k]) | {token}
        assert entry[token].rank == order.index(token) + 1
        for tid, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[tid]), abs=2e-4)
            assert logprob.decoded_token == decode([tid], skip_special_tokens=False)
    assert completion.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids,
                                         strict=True)))


@pytest.mark.timeout(300)
def test_greedy_with_penalties_matches_transformers_processors(tiny_checkpoint: Path,
                                                               hf_model: Any) -> None:
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from mpexec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.6, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias={7: 1.5})
    with make_llm(tiny_checkpoint, async_scheduling=True) as llm:
        (out,) = llm.generate(PROMPT, params)
        (plain,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))
    ids = list(out.prompt_token_ids)
    want: list[int] = []
    repetition = RepetitionPenaltyLogitsProcessor(1.6)
    for _ in range(12):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[:, -1].float()
        logits[0, 7] += 1.5
        logits = repetition(torch.tensor([ids]), logits)
        for token in set(want):
            logits[0, token] -= 0.4 * want.count(token) + 0.3
        token = int(logits.argmax())
        want.append(token)
        ids.append(token)
    assert out.token_ids == want
    assert plain.token_ids != want  # the penalties changed something


@pytest.mark.timeout(300)
def test_seeded_completions_do_not_depend_on_the_batch(tiny_checkpoint: Path) -> None:
    from mpexec import SamplingParams

    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=21, max_tokens=8,
                            ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=5)
    with make_llm(tiny_checkpoint) as llm:
        (alone,) = llm.generate(PROMPT, params)
        batch = llm.generate(["hello world", PROMPT, "a"], [others, params, others])
    assert [c.token_ids for c in batch[1].outputs] == [c.token_ids for c in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


@pytest.mark.timeout(300)
def test_skip_special_tokens(tiny_checkpoint: Path) -> None:
    from mpexec import SamplingParams
    from mpexec.models.testing import IM_START

    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                            logit_bias={IM_START: 100})
    with make_llm(tiny_checkpoint) as llm:
        shown, hidden = llm.generate(
            [PROMPT, PROMPT], [SamplingParams(**{**forced.__dict__,
                                                 "skip_special_tokens": False}), forced])
    assert shown.token_ids == hidden.token_ids == [IM_START] * 3
    assert shown.text == "<|im_start|>" * 3 and hidden.text == ""


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"]}


def check_structured(model: str | Path, **llm_kwargs: Any) -> None:
    from mpexec import LLM, SamplingParams
    from mpexec.outputs import GuidedDecodingParams

    pytest.importorskip("outlines_core")
    cases = [GuidedDecodingParams(json=SCHEMA),
             GuidedDecodingParams(regex=r"[0-9]{3}-[a-c]{2}"),
             GuidedDecodingParams(choice=["yes", "no", "maybe"])]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=48, guided_decoding=g)
              for g in cases for t in (0, 1.0)]
    with LLM(str(model), num_threads=1, shutdown_grace_s=2.0, shutdown_term_s=2.0,
             **llm_kwargs) as llm:
        outputs = llm.generate(["Answer in JSON:"] * len(params), params)
    texts = [o.text for o in outputs]
    assert all(o.finish_reason == "stop" for o in outputs), texts
    for text in texts[:2]:
        value = json.loads(text)
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
        assert value["color"] in ("red", "green")
    assert all(re.fullmatch(r"[0-9]{3}-[a-c]{2}", t) for t in texts[2:4]), texts
    assert all(t in ("yes", "no", "maybe") for t in texts[4:]), texts


@pytest.mark.timeout(300)
def test_structured_output_on_the_tiny_checkpoint(tiny_checkpoint: Path) -> None:
    check_structured(tiny_checkpoint, async_scheduling=True, max_num_batched_tokens=64)


@pytest.mark.timeout(600)
def test_structured_output_on_smollm2() -> None:
    from mpexec.models import fetch

    model = fetch.cached_default_model()
    if model is None:
        pytest.skip("the default model is not in the cache")
    check_structured(model, max_model_len=256, dtype="float32")


def test_vocabulary_bytes_decode_like_the_tokenizer(tiny_checkpoint: Path) -> None:
    from mpexec.engine.structured import vocabulary_bytes
    from mpexec.models.loader import open_checkpoint
    from mpexec.models.testing import SPECIAL_TOKENS

    with open_checkpoint(tiny_checkpoint) as checkpoint:
        tokenizer = checkpoint.tokenizer()
    table = vocabulary_bytes(tokenizer)
    assert set(range(len(SPECIAL_TOKENS))).isdisjoint(table)  # specials left out
    assert len(table) == tokenizer.vocab_size - len(SPECIAL_TOKENS)
    for token, data in table.items():
        assert data.decode("utf-8", errors="replace") == tokenizer.decode([token]), token
    text = "hello world, the model"
    assert b"".join(table[t] for t in tokenizer.encode(text)) == text.encode()


@pytest.mark.timeout(300)
def test_chat_options_and_a_tokenizer_given_as_a_path(tiny_checkpoint: Path) -> None:
    from mpexec import SamplingParams
    from mpexec.models.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": "the quick"}]
    with make_llm(tiny_checkpoint, tokenizer=str(tiny_checkpoint)) as llm:
        tokenizer = llm.get_tokenizer()
        assert isinstance(tokenizer, Tokenizer)
        (open_turn,) = llm.chat_prompts(chat, add_generation_prompt=False,
                                        continue_final_message=True)
        assert tokenizer.decode(open_turn["prompt_token_ids"], skip_special_tokens=False) == (
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nthe quick")
        (custom,) = llm.chat_prompts(chat[:1], chat_template=(
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}"))
        assert tokenizer.decode(custom["prompt_token_ids"]) == "[user] hello\n[assistant]"
        (out,) = llm.chat(chat, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          add_generation_prompt=False, continue_final_message=True)
        assert out.prompt_token_ids == open_turn["prompt_token_ids"] and len(out.token_ids) == 4


@pytest.mark.timeout(300)
def test_a_stop_string_across_a_token_boundary_on_a_real_tokenizer(tiny_checkpoint: Path) -> None:
    from dataclasses import replace

    from mpexec import SamplingParams

    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with make_llm(tiny_checkpoint, async_scheduling=True) as llm:
        (plain,) = llm.generate(PROMPT, base)
        full, ids = plain.text, plain.token_ids
        # the last character of some token and the first of the next
        for k in range(2, len(ids) - 1):
            boundary = len(llm.tokenizer.decode(ids[:k]))
            stop = full[boundary - 1:boundary + 1]
            if len(stop) == 2 and full.find(stop) == boundary - 1:
                break
        else:
            pytest.skip("no usable token boundary in this output")
        params = replace(base, stop=[stop])
        parts = list(llm.generate_stream(PROMPT, params))
        (out,) = llm.generate(PROMPT, params)
    assert out.text == full[:boundary - 1] and out.outputs[0].stop_reason == stop
    assert out.token_ids == ids[:k + 1]  # up to the token that completed the stop string
    assert parts[-1].text == out.text
    assert all(out.text.startswith(p.text) for p in parts)


@pytest.mark.timeout(300)
def test_prompt_logprobs_under_prefill_context_parallelism(tiny_checkpoint: Path) -> None:
    """A PCP split computes the rows rank by rank: the prompt rows come back in
    request order all the same."""
    from mpexec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    prompts = [PROMPT, "hello world " * 6]
    with make_llm(tiny_checkpoint) as llm:
        want = llm.generate(prompts, params)
    with make_llm(tiny_checkpoint, "mp", prefill_context_parallel_size=2) as llm:
        got = llm.generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x is not None and y is not None and set(x) == set(y)
            for token in x:
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


@pytest.mark.timeout(300)
def test_prompt_logprobs_are_complete_with_a_cached_prefix(tiny_checkpoint: Path) -> None:
    """A request that wants prompt logprobs computes its whole prompt, even when
    the prefix cache holds it (prefix caching is on by default)."""
    from mpexec import SamplingParams

    plain = SamplingParams(temperature=0, max_tokens=2)
    wanted = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    prompt = "hello world " * 8
    with make_llm(tiny_checkpoint, block_size=4) as llm:
        llm.generate(prompt, plain)  # fills the prefix cache
        hits = llm.engine.stats.prefix_cache_hits
        (first,) = llm.generate(prompt, wanted)
        (second,) = llm.generate(prompt, wanted)
        llm.generate(prompt, plain)
        assert llm.engine.stats.prefix_cache_hits > hits  # the cache works for the others
    for out in (first, second):
        assert out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert all(entry is not None for entry in out.prompt_logprobs[1:])
    assert [set(e) for e in first.prompt_logprobs[1:]] == \
        [set(e) for e in second.prompt_logprobs[1:]]  # type: ignore[arg-type, union-attr]
