"""Prefix caching end to end on real checkpoints: the same tokens with and without it.

The prompts share a long prefix; the first request runs alone, so the
others find its blocks cached.  Tokens are compared with an engine that
has caching switched off, greedy and seeded, across layouts (chunked
prefill, TP, PP, async scheduling, preemption on a small KV cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PREFIX = [(37 * i) % 250 + 20 for i in range(45)]
PROMPTS = [{"prompt_token_ids": PREFIX + [300 + i] * (i + 1)} for i in range(4)]


def params() -> list[Any]:
    from mpexec import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=20, seed=1, max_tokens=10, ignore_eos=True)]


def generate_in_two_waves(llm: Any) -> list[list[int]]:
    """The first prompt alone (it fills the cache), then the rest together."""
    first = llm.generate(PROMPTS[:1], params()[:1])
    rest = llm.generate(PROMPTS[1:], params()[1:])
    return [o.token_ids for o in first + rest]


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint, block_size=4, enable_prefix_caching=False) as llm:
        tokens = generate_in_two_waves(llm)
        assert llm.engine.stats.prefix_cache_hits == 0
        return tokens


@pytest.mark.parametrize(("backend", "tp", "pp", "async_scheduling", "budget", "cp"), [
    ("uni", 1, 1, False, 64, {}),
    ("uni", 1, 1, False, 8, {}),  # chunked prefill around the cached prefix
    ("mp", 2, 1, True, 64, {}),
    ("mp", 1, 2, True, 16, {}),
    ("mp", 1, 1, False, 64, {"prefill_context_parallel_size": 2}),
])
def test_cached_prefix_gives_the_same_tokens(tiny_checkpoint: Path, uncached: list[list[int]],
                                             backend: str, tp: int, pp: int,
                                             async_scheduling: bool, budget: int,
                                             cp: dict[str, int]) -> None:
    with make_llm(tiny_checkpoint, backend, tp, pp, async_scheduling, block_size=4,
                  max_num_batched_tokens=budget, **cp) as llm:
        assert generate_in_two_waves(llm) == uncached
        stats = llm.engine.stats
        # each later prompt finds the 44 tokens (11 full blocks) of the prefix
        assert stats.prefix_cache_hits >= 3 * 44
        assert stats.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in PROMPTS)


def test_preemption_with_shared_blocks(tiny_checkpoint: Path,
                                       uncached: list[list[int]]) -> None:
    with make_llm(tiny_checkpoint, "uni", block_size=4) as probe:
        block_bytes = probe.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
    # one request takes up to 15 blocks; three sharing 11 of them need 23
    blocks = 20
    with make_llm(tiny_checkpoint, "mp", 1, 1, True, block_size=4,
                  kv_cache_memory_bytes=blocks * block_bytes) as llm:
        assert llm.engine.num_blocks == blocks
        assert generate_in_two_waves(llm) == uncached
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats.prefix_cache_hits > 0
        assert llm.engine.scheduler.blocks.num_free_blocks == blocks


@pytest.mark.timeout(600)
def test_smollm2_shared_system_prompt() -> None:
    from mpexec import LLM, SamplingParams
    from mpexec.models import fetch

    smollm2_gguf = fetch.cached_default_model()
    if smollm2_gguf is None:
        pytest.skip("SmolLM2 (the default model) is not in the cache")

    system = ("You are a careful assistant. Answer briefly and precisely, and say when you "
              "do not know. ") * 4
    questions = ["What is the capital of France?", "Name a prime number.",
                 "What colour is the sky?"]
    prompts = [system + q for q in questions]
    sampling = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    results = {}
    for caching in (False, True):
        with LLM(str(smollm2_gguf), executor_backend="uni", num_threads=1, max_model_len=512,
                 enable_prefix_caching=caching) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts[:1], sampling[:1])]
            tokens += [o.token_ids for o in llm.generate(prompts[1:], sampling[1:])]
            results[caching] = (tokens, llm.engine.stats.prefix_cache_hits)
    assert results[True][0] == results[False][0]
    assert results[False][1] == 0 and results[True][1] >= 2 * 16
