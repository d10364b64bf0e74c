"""Speculative decoding (prompt-lookup drafts) end to end on the tiny checkpoint.

The property under test: a request's tokens are the ones it gets without
speculation - greedy and seeded sampling alike, on every layout, under
preemption, with every stop condition - while steps do accept drafts.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("leak_check")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
# the tiny random model loops quickly, so prompt lookup finds drafts
PROMPTS = ["hello world hello world hello", "the quick brown fox jumps over the quick brown",
           "a", "one two three four five six seven one two three"]


def params() -> list[Any]:
    from mpexec import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=21),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=30, ignore_eos=True,
                           logprobs=2)]


def generate(llm: Any, prompts: list[str], sampling: list[Any]) -> list[Any]:
    return [o.outputs[0] for o in llm.generate(prompts, sampling)]


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint: Path) -> list[Any]:
    with make_llm(tiny_checkpoint) as llm:
        return generate(llm, PROMPTS, params())


def check_same(outputs: list[Any], baseline: list[Any]) -> None:
    assert [o.token_ids for o in outputs] == [o.token_ids for o in baseline]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in baseline]
    for got, want in zip(outputs, baseline, strict=True):
        assert (got.logprobs is None) == (want.logprobs is None)
        for got_row, want_row in zip(got.logprobs or [], want.logprobs or [], strict=True):
            assert got_row.keys() == want_row.keys()
            for token, entry in got_row.items():
                assert entry.logprob == pytest.approx(want_row[token].logprob, abs=1e-4)


def check_accepting(stats: Any) -> None:
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_num_drafts <= stats.spec_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_accepted_tokens
    assert 0 < stats.spec_acceptance_rate <= 1


def test_uni_tp1_gives_the_same_tokens_and_logprobs(tiny_checkpoint: Path,
                                                      baseline: list[Any]) -> None:
    with make_llm(tiny_checkpoint, speculative_config=SPEC) as llm:
        outputs = generate(llm, PROMPTS, params())
        stats = llm.engine.stats
        assert stats.sampled_tokens == sum(len(o.token_ids) for o in outputs)
        assert stats.steps < sum(len(o.token_ids) for o in baseline)
    check_same(outputs, baseline)
    check_accepting(stats)


LAYOUTS = [("mp", 2, 1, False), ("mp", 1, 1, True), ("mp", 2, 1, True), ("mp", 1, 2, False),
           ("mp", 1, 2, True)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "tp", "pp", "async_scheduling"), LAYOUTS)
def test_every_layout_gives_the_same_tokens(tiny_checkpoint: Path, baseline: list[Any],
                                            backend: str, tp: int, pp: int,
                                            async_scheduling: bool) -> None:
    with make_llm(tiny_checkpoint, backend, tp, pp, async_scheduling,
                  speculative_config=SPEC) as llm:
        outputs = generate(llm, PROMPTS, params())
        stats = llm.engine.stats
    check_same(outputs, baseline)
    check_accepting(stats)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_on_a_small_kv_cache_gives_the_same_tokens(
        tiny_checkpoint: Path, async_scheduling: bool) -> None:
    from mpexec import SamplingParams

    long_params = [SamplingParams(temperature=t, seed=5, max_tokens=40, ignore_eos=True)
                   for t in (0, 0.8, 0, 1.0)]
    with make_llm(tiny_checkpoint, block_size=4) as reference:
        block_bytes = reference.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
        longest = max(len(reference.tokenizer.encode(p)) for p in PROMPTS) + 40
        want = [o.token_ids for o in generate(reference, PROMPTS, long_params)]
    blocks = -(-longest // 4) + 2  # the longest request alone, and its drafts
    with make_llm(tiny_checkpoint, "mp", 1, 1, async_scheduling, block_size=4,
                  kv_cache_memory_bytes=blocks * block_bytes, speculative_config=SPEC) as llm:
        outputs = generate(llm, PROMPTS, long_params)
        assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.engine.stats
        assert llm.engine.scheduler.blocks.num_free_blocks == blocks  # nothing leaked
    assert [o.token_ids for o in outputs] == want
    check_accepting(stats)


def test_stops_inside_an_accepted_run_cut_the_output(tiny_checkpoint: Path,
                                                     baseline: list[Any]) -> None:
    """Stop token ids, stop strings, max_tokens and min_tokens, each placed where
    several tokens arrive in one step: the output ends where it ends without drafts."""
    from mpexec import SamplingParams

    greedy = baseline[0].token_ids  # a run: the same token over and over, then others
    changes = [i for i in range(1, len(greedy)) if greedy[i] != greedy[i - 1]]
    stop_at = changes[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy[stop_at]]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy[0]],
                       min_tokens=3),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1,
                       stop=[baseline[0].text[len(baseline[0].text) // 2:][:3]]),
    ]
    prompts = [PROMPTS[0]] * len(cases)
    with make_llm(tiny_checkpoint) as llm:
        want = generate(llm, prompts, cases)
    with make_llm(tiny_checkpoint, speculative_config=SPEC) as llm:
        got = generate(llm, prompts, cases)
        check_accepting(llm.engine.stats)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
    assert len(want[0].token_ids) == stop_at + 1 and want[0].stop_reason == greedy[stop_at]
    assert len(got[3].logprobs) == len(got[3].token_ids)


def _chi_square_999(df: int) -> float:
    """The 99.9% quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_sample_chi_square(a: Counter[Any], b: Counter[Any]) -> tuple[float, int]:
    """The chi-square statistic that ``a`` and ``b`` come from one distribution
    (categories rarer than 5 in both samples together are pooled)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    pooled: dict[Any, tuple[int, int]] = {}
    for key in a.keys() | b.keys():
        name = key if a[key] + b[key] >= 10 else "rare"
        x, y = pooled.get(name, (0, 0))
        pooled[name] = (x + a[key], y + b[key])
    statistic = 0.0
    for x, y in pooled.values():
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(pooled) - 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sampled_tokens_keep_their_distribution(tiny_checkpoint: Path) -> None:
    """Many draws with different seeds, with and without drafts: each of the
    first output positions has the same distribution (two-sample chi-square
    at 0.1%), and the drafts were both accepted and rejected along the way."""
    from mpexec import SamplingParams

    draws, positions = 600, 6
    prompt = [PROMPTS[0]]
    # sharp but not degenerate: each position spreads over a few tokens
    sampling = {"temperature": 0.8, "top_k": 4, "max_tokens": positions, "ignore_eos": True,
                "n": draws}
    with make_llm(tiny_checkpoint, max_num_seqs=128, max_num_batched_tokens=1024) as llm:
        plain = llm.generate(prompt, SamplingParams(seed=0, **sampling))[0].outputs
    with make_llm(tiny_checkpoint, max_num_seqs=128, max_num_batched_tokens=1024,
                  speculative_config=SPEC) as llm:
        # other seeds: not the same draws replayed
        spec = llm.generate(prompt, SamplingParams(seed=10 * draws, **sampling))[0].outputs
        stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 100
    assert stats.spec_draft_tokens - stats.spec_accepted_tokens > 100  # rejections too
    for position in range(positions):
        a = Counter(o.token_ids[position] for o in plain)
        b = Counter(o.token_ids[position] for o in spec)
        statistic, df = _two_sample_chi_square(a, b)
        if df:
            assert statistic < _chi_square_999(df), (position, a, b)


def test_seeded_sampling_gives_the_same_tokens(tiny_checkpoint: Path) -> None:
    """The noise of a position depends on the seed and the position only, so a
    seeded request samples the very tokens it samples without drafts."""
    from mpexec import SamplingParams

    sampling = SamplingParams(temperature=0.8, top_k=4, max_tokens=12, ignore_eos=True,
                              seed=7, n=16)
    with make_llm(tiny_checkpoint) as llm:
        want = [o.token_ids for o in llm.generate([PROMPTS[0]], sampling)[0].outputs]
    with make_llm(tiny_checkpoint, speculative_config=SPEC) as llm:
        got = [o.token_ids for o in llm.generate([PROMPTS[0]], sampling)[0].outputs]
        check_accepting(llm.engine.stats)
    assert got == want


def test_penalties_and_bad_settings(tiny_checkpoint: Path) -> None:
    """A request with penalties never carries drafts (and decodes as without
    speculation); a bad speculative_config is one ValueError before any worker."""
    from mpexec import LLM, SamplingParams

    penalised = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               repetition_penalty=1.3)
    with make_llm(tiny_checkpoint) as llm:
        want = generate(llm, [PROMPTS[0]], [penalised])[0].token_ids
    with make_llm(tiny_checkpoint, speculative_config=SPEC) as llm:
        assert generate(llm, [PROMPTS[0]], [penalised])[0].token_ids == want
        assert llm.engine.stats.spec_draft_tokens == 0
    for bad, match in (({"method": "eagle"}, "method"), ('{"num_speculative_tokens": 0}',
                                                         "num_speculative_tokens")):
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_checkpoint), speculative_config=bad)
    with pytest.raises(ValueError, match="context parallelism"):
        LLM(str(tiny_checkpoint), speculative_config=SPEC, tensor_parallel_size=2,
            decode_context_parallel_size=2)
