"""A decode token verified with its drafts gives, row by row, the very logits
plain one-token decode steps give (``ScheduledRequest.verify``).

Packed weights make this sharp: their kernels round the activations to
bfloat16, so a difference in the last float32 bit of an attention output
(a masked multi-row attention sums in another order than a one-row one)
can flip a rounding and move a logit by a few tenths: on SmolLM2 that
changed a greedy choice at a near tie.  The int4 kernels compute each row
alone, and verified rows attend as decode rows, so the logits are equal
to the bit.  The same holds for decode rows of differing context lengths
batched together: each equals the row decoded alone.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.models.test_model_layers import new_cache, run as step  # noqa: E402
from tests.models.test_quantized import build  # noqa: E402

PROMPT_LEN = 481  # long enough that a multi-row attention sums differently (301: it did not)
STEPS = 12
DRAFTS = 4
VOCAB = 389  # write_tiny_checkpoint's


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def packed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.models.testing_gguf import write_tiny_gguf

    base = tmp_path_factory.mktemp("verify")
    directory = write_tiny_checkpoint(base / "hf", hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=512,
                                      num_hidden_layers=2, max_position_embeddings=1024)
    return write_tiny_gguf(base / "q4_0.gguf", directory, qtype="Q4_0")


def decode(stage: Any, cache: Any, prompt: list[int], blocks: list[int]
           ) -> tuple[list[int], list[Any]]:
    """Greedy one-token steps after the prompt: the sequence and each step's logits."""
    last = step(stage, cache, [(prompt, blocks, 0)])[-1]
    tokens, rows = list(prompt), []
    for _ in range(STEPS):
        tokens.append(int(last.argmax()))
        last = step(stage, cache, [(tokens[-1:], blocks, len(tokens) - 1)])[0]
        rows.append(last)
    return tokens, rows


@pytest.mark.parametrize("prompt_len", [PROMPT_LEN, 506])  # 506: rows on both sides of 512
def test_verified_rows_equal_one_token_decode_steps(packed_gguf: Path, prompt_len: int) -> None:
    stage = build(packed_gguf, "auto")
    assert stage.packed.startswith("int4"), stage.packed
    cache = new_cache(stage, blocks=160)
    blocks = list(range(160))
    prompt = random.Random(5).choices(range(VOCAB), k=prompt_len)
    tokens, rows = decode(stage, cache, prompt, blocks)
    for first in range(STEPS - DRAFTS):
        start = prompt_len + first  # the decode token, then DRAFTS tokens as drafts
        verified = step(stage, cache, [(tokens[start:start + DRAFTS + 1], blocks, start)],
                        verify=True)
        for offset in range(DRAFTS + 1):
            assert torch.equal(verified[offset], rows[first + offset]), (first, offset)


def test_decode_rows_of_differing_lengths_equal_each_row_alone(packed_gguf: Path) -> None:
    stage = build(packed_gguf, "auto")
    cache = new_cache(stage, blocks=640)
    lengths = [PROMPT_LEN, 40, PROMPT_LEN - 4, PROMPT_LEN - 2]
    tables = [list(range(160 * i, 160 * i + 160)) for i in range(len(lengths))]
    generator = random.Random(7)
    prompts = [generator.choices(range(VOCAB), k=n) for n in lengths]
    alone = []
    for prompt, blocks in zip(prompts, tables, strict=True):
        step(stage, cache, [(prompt, blocks, 0)])
        alone.append(step(stage, cache, [([3], blocks, len(prompt))])[0])
    together = step(stage, cache, [([3], blocks, len(prompt))
                                   for prompt, blocks in zip(prompts, tables, strict=True)])
    for row, want in enumerate(alone):
        assert torch.equal(together[row], want), row
