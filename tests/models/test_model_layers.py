"""The decoder against transformers (the oracle) on small random configs.

Tolerances: float32 throughout; our kernels differ from the reference only
in summation order (fused q/k/v and gate/up matmuls, SDPA, partial sums
across TP ranks), which moves a logit of magnitude ~1 by a few float32 ulps
per layer; 1e-4 absolute leaves two orders of magnitude of margin and still
catches any real error (a wrong head, bias or rotation moves logits by >1e-2).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.model_run_support import run_ranks, save_random_llama  # noqa: E402

from mpexec.models.kv_cache import KVCache, ScheduledRequest, build_attention_batch  # noqa: E402
from mpexec.models.layers.parallel import SingleRankGroup  # noqa: E402
from mpexec.models.layers.quantized import SplitRows, splitting  # noqa: E402
from mpexec.models.layers.rotary import rope_tables  # noqa: E402
from mpexec.models.llama import LlamaStage, load_stage  # noqa: E402
from mpexec.models.loader import Checkpoint, open_checkpoint  # noqa: E402
from mpexec.models.sharding import rank_share  # noqa: E402
from mpexec.models.split_rule import row_splits  # noqa: E402

pytestmark = pytest.mark.torch
ATOL = 1e-4
BLOCK = 4
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def build(checkpoint: Checkpoint, tp_rank: int = 0, tp: int = 1, group: Any = None,
          dtype: Any = torch.float32) -> LlamaStage:
    c = checkpoint.config
    share = rank_share(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                       intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                       layers=(0, c.num_hidden_layers), tp_rank=tp_rank, tp_size=tp)
    return load_stage(checkpoint, c, share, is_first=True, is_last=True,
                      tp_group=group or SingleRankGroup(), dtype=dtype, device=CPU,
                      max_positions=c.max_position_embeddings)


def new_cache(stage: LlamaStage, blocks: int = 64) -> KVCache:
    return KVCache(num_layers=len(stage.layers), num_blocks=blocks, block_size=BLOCK,
                   num_kv_heads=stage.num_kv_heads, head_dim=stage.head_dim,
                   dtype=stage.dtype, device=CPU)


def run(stage: LlamaStage, cache: KVCache, chunks: list[tuple[list[int], list[int], int]],
        verify: bool = False, argmax_only: bool = False,
        prompt_lens: list[int] | None = None) -> Any:
    """One step: per request (tokens, block table, start); logits of every row
    (``verify``: each chunk is a decode token with its drafts; ``argmax_only``:
    the head's pass for greedy sampling, see ``ParallelLMHead``; ``prompt_lens``:
    each request's prompt length, for packed weights to split the rows as the
    worker does, else every row splits)."""
    layout = [ScheduledRequest(blocks, start, len(tokens), verify)
              for tokens, blocks, start in chunks]
    ids = torch.tensor([t for tokens, _, _ in chunks for t in tokens])
    positions = torch.tensor([start + i for tokens, _, start in chunks
                              for i in range(len(tokens))])
    batch = build_attention_batch(layout, BLOCK, CPU)
    rule = None if prompt_lens is None else SplitRows(torch.tensor(
        [row_splits(start + i, length) for (tokens, _, start), length in zip(chunks, prompt_lens,
                                                                        strict=True)
         for i in range(len(tokens))]))
    with splitting(rule):
        hidden, residual = stage.forward(positions=positions, batch=batch, cache=cache,
                                         token_ids=ids)
    return stage.compute_logits(hidden, residual, torch.arange(len(ids)), argmax_only)


def reference_logits(directory: Path, ids: list[int], qwen2: bool = False) -> Any:
    cls = transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM
    model = cls.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


CONFIGS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "qwen2-biases": {"qwen2": True},
    "head-dim-16": {"head_dim": 16},
    "mha-4-heads": {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 32},
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "rope-llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}},
    "rope-yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path: Path, name: str) -> None:
    overrides = dict(CONFIGS[name])
    directory = save_random_llama(tmp_path, **overrides)
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = reference_logits(directory, ids, qwen2=overrides.get("qwen2", False))
    with open_checkpoint(directory) as checkpoint:
        stage = build(checkpoint)
    got = run(stage, new_cache(stage), [(ids, [9, 2, 7, 4, 0, 5], 0)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_dynamic_rope_rotates_each_position_as_a_sequence_of_its_length() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=32,
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    cos, sin = rope_tables(head_dim=16, rope_theta=config.rope_parameters["rope_theta"],
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                           max_position_embeddings=32, max_positions=100)
    for position in (0, 31, 32, 57, 99):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, CPU, seq_len=position + 1)
        angles = position * inv_freq
        torch.testing.assert_close(cos[position, :8], angles.cos(), atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[position, 8:], angles.sin(), atol=1e-5, rtol=0)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        rope_tables(head_dim=8, rope_theta=1e4, rope_scaling={"rope_type": "longrope"},
                    max_position_embeddings=8, max_positions=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Checkpoint]]:
    directory = save_random_llama(tmp_path_factory.mktemp("llama"))
    with open_checkpoint(directory) as checkpoint:
        yield directory, checkpoint


def test_chunked_prefill_and_decode_equal_one_whole_prefill(llama: Any) -> None:
    _, checkpoint = llama
    stage = build(checkpoint)
    ids = list(range(3, 30))
    whole = run(stage, new_cache(stage), [(ids, [1, 8, 3, 6, 2, 7, 5], 0)])
    blocks = [11, 4, 9, 0, 13, 2, 6]
    cache = new_cache(stage)
    parts = [run(stage, cache, [(ids[0:10], blocks, 0)]),
             run(stage, cache, [(ids[10:21], blocks, 10)])]
    for position in range(21, 27):
        parts.append(run(stage, cache, [(ids[position:position + 1], blocks, position)]))
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)


def test_a_mixed_batch_equals_each_request_alone(llama: Any) -> None:
    _, checkpoint = llama
    stage = build(checkpoint)
    prompts = {"a": list(range(5, 14)), "b": list(range(40, 42)), "c": list(range(60, 77))}
    tables = {"a": [0, 1, 2], "b": [3], "c": [4, 5, 6, 7, 8]}
    cache = new_cache(stage)
    alone = {}
    for name, prompt in prompts.items():
        alone[name] = run(stage, new_cache(stage), [(prompt, tables[name], 0)])[-1]
    # prefill a and b, leaving their last tokens to a batched decode with c's prefill
    run(stage, cache, [(prompts["a"][:-1], tables["a"], 0), (prompts["b"][:-1], tables["b"], 0)])
    mixed = run(stage, cache, [(prompts["a"][-1:], tables["a"], 8),
                               (prompts["c"], tables["c"], 0),
                               (prompts["b"][-1:], tables["b"], 1)])
    torch.testing.assert_close(mixed[0], alone["a"], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[-2], alone["c"], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[-1], alone["b"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tp", [2, 3, 4, 9])
def test_tensor_parallel_shards_reproduce_one_rank(llama: Any, tp: int) -> None:
    directory, checkpoint = llama
    prompt = list(range(7, 20))
    blocks = [3, 1, 4, 0]
    expected = run(build(checkpoint), new_cache(build(checkpoint)), [(prompt, blocks, 0)])

    def rank(tp_rank: int, group: Any) -> Any:
        with open_checkpoint(directory) as own:
            stage = build(own, tp_rank, tp, group)
        cache = new_cache(stage)
        prefill = run(stage, cache, [(prompt[:-1], blocks, 0)])
        decode = run(stage, cache, [(prompt[-1:], blocks, len(prompt) - 1)])
        return torch.cat([prefill, decode])

    for result in run_ranks(tp, rank):
        torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)


def test_bfloat16_stays_close_to_float32(llama: Any) -> None:
    _, checkpoint = llama
    prompt = list(range(7, 20))
    full = build(checkpoint)
    half = build(checkpoint, dtype=torch.bfloat16)
    expected = run(full, new_cache(full), [(prompt, [0, 1, 2, 3], 0)])
    got = run(half, new_cache(half), [(prompt, [0, 1, 2, 3], 0)])
    assert got.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: ~0.4% per rounding, a few roundings per layer.
    assert float((got - expected).abs().max()) < 0.1 * float(expected.abs().max())


def test_a_decoupled_head_dim_matches_transformers_on_hf_gguf_and_tp2(tmp_path: Path) -> None:
    """6 heads of 24 on a hidden size of 96 (not 96 / 6 = 16): q_proj has 144 rows and
    o_proj 144 columns.  (transformers wants hidden_size divisible by the heads even
    then; the loader does not, test_loader_config checks that.)"""
    pytest.importorskip("gguf")
    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.models.testing_gguf import write_tiny_gguf

    directory = write_tiny_checkpoint(tmp_path / "hf", hidden_size=96, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=24, num_hidden_layers=2,
                                      tie_word_embeddings=False)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", directory, qtype="F32")
    ids = torch.randint(0, 389, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = reference_logits(directory, ids)
    blocks = [2, 0, 5, 1, 3]
    for path in (directory, gguf_path):
        with open_checkpoint(path) as checkpoint:
            assert checkpoint.config.head_dim == 24
            assert checkpoint.shape("model.layers.0.self_attn.o_proj.weight") == (96, 144)
            stage = build(checkpoint)
        torch.testing.assert_close(run(stage, new_cache(stage), [(ids, blocks, 0)]), expected,
                                   atol=ATOL, rtol=0)

    def rank(tp_rank: int, group: Any) -> Any:
        with open_checkpoint(directory) as own:
            stage = build(own, tp_rank, 2, group)
        cache = new_cache(stage)
        prefill = run(stage, cache, [(ids[:-1], blocks, 0)])
        return torch.cat([prefill, run(stage, cache, [(ids[-1:], blocks, len(ids) - 1)])])

    for result in run_ranks(2, rank):
        torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)
