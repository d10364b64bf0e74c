"""SmolLM2-135M (the default GGUF, Q4_1) against transformers, and across layouts.

Greedy equivalence is checked by teacher forcing: transformers runs once
over prompt + our 32 tokens; if its argmax at every step is the token we
produced, its own greedy generation yields exactly our sequence (by
induction on the steps), without relying on generate's EOS handling (the
worker does not stop at EOS; that is the engine's job).

Logit tolerance 2e-3 absolute: both sides dequantise the same Q4_1 blocks
to float32 and differ only in summation order (fused matmuls, SDPA, 30
layers); the largest difference seen is ~6e-5 on logits of magnitude ~40,
so 2e-3 is 30x margin and still far below any real error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.models.model_run_driver import StepDriver, make_executor  # noqa: E402

from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(900)]
ATOL = 2e-3
TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a small village,", "The three primary colors are"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(smollm2_gguf: Path) -> dict[str, list[int]]:
    from mpexec.models.loader import open_checkpoint

    with open_checkpoint(smollm2_gguf) as checkpoint:
        tokenizer = checkpoint.tokenizer()
        return {f"p{i}": tokenizer.encode(text) for i, text in enumerate(TEXTS)}


def requests(prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], SamplingParams]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    return {rid: (prompt, params) for rid, prompt in prompts.items()}


@pytest.fixture(scope="module")
def tp1(smollm2_gguf: Path, prompts: dict[str, list[int]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    with make_executor(smollm2_gguf, backend="uni", block_size=16, max_model_len=256,
                       num_blocks=64) as executor:
        return StepDriver(executor, fetch_logits=True).generate(requests(prompts))


def test_tp1_reproduces_transformers_greedy(smollm2_gguf: Path, prompts: dict[str, list[int]],
                                            tp1: dict[str, Any]) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    for rid, prompt in prompts.items():
        run = tp1[rid]
        assert len(run.output) == NEW_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([prompt + run.output])).logits[0]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]
        assert rows.argmax(-1).tolist() == run.output, rid
        torch.testing.assert_close(torch.stack(run.logits), rows, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_layouts_give_tp1_tokens(smollm2_gguf: Path, prompts: dict[str, list[int]],
                                          tp1: dict[str, Any], tp: int, pp: int,
                                          leak_check: None) -> None:
    with make_executor(smollm2_gguf, tp=tp, pp=pp, block_size=16, max_model_len=256,
                       num_blocks=64) as executor:
        runs = StepDriver(executor, fetch_logits=True, placeholders=pp == 1).generate(
            requests(prompts))
    for rid, run in runs.items():
        assert run.output == tp1[rid].output, rid
        torch.testing.assert_close(torch.stack(run.logits), torch.stack(tp1[rid].logits),
                                   atol=ATOL, rtol=0)
