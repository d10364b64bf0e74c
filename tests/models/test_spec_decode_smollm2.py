"""Speculative decoding on SmolLM2-135M (the default GGUF): greedy tokens equal
with and without prompt-lookup drafts on a prompt that invites copying."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.usefixtures("leak_check")]

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


print(area(3, 4), perimeter(3, 4))
"""


def test_greedy_tokens_are_the_same_with_drafts(smollm2_gguf: Path) -> None:
    from mpexec import LLM, SamplingParams

    messages = [{"role": "user", "content": "Repeat this code, renaming width to w:\n\n"
                 f"```python\n{CODE}```"}]
    params = SamplingParams(temperature=0, max_tokens=96)
    outputs = {}
    for name, spec in (("off", None), ("on", {"method": "ngram", "num_speculative_tokens": 4})):
        with LLM(str(smollm2_gguf), executor_backend="uni", num_threads=1, max_model_len=512,
                 speculative_config=spec) as llm:
            outputs[name] = llm.chat(messages, params)[0].outputs[0].token_ids
            stats = llm.engine.stats
    assert outputs["on"] == outputs["off"]
    assert stats.spec_accepted_tokens > 10  # the answer copies the code: drafts land
