"""Quantised GGUF weights kept packed (``quantization="auto"``) against the
same file dequantised to float32 (``"none"``).

Tolerance: 2 % of the largest logit, and the same greedy tokens.  Q4_0,
Q4_1, Q4_K and Q8_0 are packed exactly (Q8_0 as two int4 matmuls), but the
kernels take bfloat16 activations and bfloat16 group scales and return
bfloat16 results.  Measured on the tiny models below (logits up to ~16):
largest difference 0.13-0.15, mean 0.02-0.03.  A wrong group, scale or row
order gives differences of the order of the logits.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.models.model_run_support import run_ranks  # noqa: E402
from tests.models.test_model_layers import BLOCK, CPU, new_cache, run  # noqa: E402

from mpexec.models.layers.parallel import SingleRankGroup  # noqa: E402
from mpexec.models.layers.quantized import (  # noqa: E402
    Int4Weight,
    Int8GroupWeight,
    PaddedColumns,
    SplitRows,
    splitting,
)
from mpexec.models.llama import LlamaStage, load_stage  # noqa: E402
from mpexec.models.loader import open_checkpoint  # noqa: E402
from mpexec.models.loader.quants import dequantize, encoding_of, groups_of  # noqa: E402
from mpexec.models.sharding import rank_share  # noqa: E402

RELATIVE = 0.02
PROMPTS = [[1, 17, 99, 230, 5, 64], [300, 2, 2, 150]]
NEW_TOKENS = 6
QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0"]  # stored in groups of 32


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# ── the pure parts ───────────────────────────────────────────────────────────

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0"])
def test_groups_of_are_exactly_the_dequantised_values(qtype: str) -> None:
    from mpexec.models.testing_gguf import _quantize

    kind = gguf.GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    raw = _quantize(values, kind, None)
    encoding = encoding_of(int(kind))
    assert encoding is not None
    q, scale, minimum = groups_of(raw, encoding)
    assert q.max() <= {"Q8_0": 255, "Q5_0": 31, "Q5_1": 31}.get(qtype, 15)
    assert scale.shape == minimum.shape == (6, 16)
    rebuilt = (q.reshape(6, 16, 32) * scale[..., None] + minimum[..., None]).reshape(6, 512)
    np.testing.assert_array_equal(rebuilt, dequantize(raw, encoding))


@pytest.mark.parametrize("rows", [16, 40, 3])
def test_int4_weight_multiplies_like_its_float_values(rows: int) -> None:
    """Rows not a multiple of 16 are padded for the packer and trimmed after."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (rows, 64), generator=generator, dtype=torch.uint8)
    scale = torch.rand(rows, 2, generator=generator) * 0.1
    minimum = -torch.rand(rows, 2, generator=generator)
    weight = Int4Weight(q, scale, minimum)
    dense = (q.float().view(rows, 2, 32) * scale[..., None] + minimum[..., None]).view(rows, 64)
    x = torch.randn(5, 64, generator=generator)
    expected = x @ dense.T
    got = weight(x)
    assert got.shape == (5, rows) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=RELATIVE * expected.abs().max().item(), rtol=0)
    assert weight(x[:0]).shape == (0, rows)


@pytest.mark.parametrize(("top", "offset"), [(255, -128), (31, -16), (15, -8)])
def test_int8_group_weight_multiplies_like_its_float_values(top: int, offset: int) -> None:
    """Q8_0-, Q5_0- and Q4_0-like groups, each as two int4 matmuls, with rows
    of a mixed weight (the first half 8-bit, the rest ``top``) as in a fused
    q/k/v of two types."""
    generator = torch.Generator().manual_seed(2)
    rows = 32
    q = torch.randint(0, 256, (rows, 64), generator=generator, dtype=torch.int32)
    q[rows // 2:] = q[rows // 2:] % (top + 1)
    scale = torch.rand(rows, 2, generator=generator) * 0.01 + 0.001
    minimum = scale * torch.tensor([-128.0] * (rows // 2) + [offset] * (rows // 2))[:, None]
    weight = Int8GroupWeight(q.to(torch.uint8), scale, minimum)
    dense = (q.float().view(rows, 2, 32) * scale[..., None] + minimum[..., None]).view(rows, 64)
    x = torch.randn(4, 64, generator=generator)
    expected = x @ dense.T
    torch.testing.assert_close(weight(x), expected, atol=0.01 * expected.abs().max().item(),
                               rtol=0)


def test_requantise_keeps_each_value_within_half_a_step() -> None:
    """Types without groups of 32 (Q6_K, …) become Q8_0-like groups: bfloat16
    scale max|w|/127 per group, q + 128 in a uint8."""
    from mpexec.models.quantization import requantise

    generator = torch.Generator().manual_seed(1)
    dense = torch.randn(24, 64, generator=generator) * torch.rand(24, 1, generator=generator)
    dense[3, :32] = 0.0  # an all-zero group
    q, scale, minimum = requantise(dense)
    assert q.dtype == torch.uint8 and scale.shape == minimum.shape == (24, 2)
    assert torch.equal(scale, scale.bfloat16().float())
    rebuilt = (q.float().view(24, 2, 32) * scale[..., None] + minimum[..., None]).view(24, 64)
    assert ((rebuilt - dense).abs() <= scale.repeat_interleave(32, dim=1) / 2).all()
    assert torch.equal(rebuilt[3, :32], torch.zeros(32))


def test_padded_columns_multiply_like_the_slice() -> None:
    """Columns [10, 50) of a 64-column grouped weight: packed as its two
    whole groups, the input padded with 10 zeros before and 14 after."""
    generator = torch.Generator().manual_seed(6)
    q = torch.randint(0, 256, (16, 64), generator=generator, dtype=torch.uint8)
    scale = torch.rand(16, 2, generator=generator) * 0.01 + 0.001
    weight = PaddedColumns(Int8GroupWeight(q, scale, -128 * scale), 10, 14)
    assert (weight.in_features, weight.out_features) == (40, 16)
    dense = (q.float().view(16, 2, 32) * scale[..., None] - 128 * scale[..., None]).view(16, 64)
    x = torch.randn(3, 40, generator=generator)
    expected = x @ dense[:, 10:50].T
    torch.testing.assert_close(weight(x), expected, atol=0.01 * expected.abs().max().item(),
                               rtol=0)


def _packed(kind: str) -> Any:
    generator = torch.Generator().manual_seed(4)
    q = torch.randint(0, 256 if kind == "int8" else 16, (48, 96), generator=generator,
                      dtype=torch.uint8)
    scale = torch.rand(48, 3, generator=generator) * 0.01 + 0.001
    if kind == "int8":
        return Int8GroupWeight(q, scale, -128 * scale)
    weight = Int4Weight(q, scale, -8 * scale)
    return PaddedColumns(weight, 8, 24) if kind == "padded" else weight


@pytest.mark.parametrize("kind", ["int4", "int8", "padded"])
def test_a_rows_result_follows_its_own_rule_whatever_shares_its_step(kind: str) -> None:
    """Under a step's rule each row is exactly what it is alone under its own
    (split or rounded once), at a decode step's size and a prefill's."""
    weight = _packed(kind)
    generator = torch.Generator().manual_seed(5)
    for count in (3, 100):
        x = torch.randn(count, weight.in_features, generator=generator)
        mask = torch.rand(count, generator=generator) < 0.5
        with splitting(SplitRows(mask)):
            got = weight(x)
        alone = torch.cat([weight(x[row:row + 1], bool(mask[row])) for row in range(count)])
        assert torch.equal(got, alone)
        assert not torch.equal(got, weight(x, False))  # the split rows differ from rounded
    assert torch.equal(weight(x), torch.cat([weight(x[r:r + 1]) for r in range(count)]))


def test_a_packed_matmul_refuses_a_rule_for_other_rows() -> None:
    weight = _packed("int4")
    with splitting(SplitRows(torch.ones(4, dtype=torch.bool))), \
            pytest.raises(ValueError, match="on 5 rows in a step of 4"):
        weight(torch.randn(5, weight.in_features))


def test_the_worker_splits_by_token_not_by_step() -> None:
    """Short prompts split every row, a long prompt only its last token and
    what follows; a request re-queued with its outputs (``num_prompt_tokens``
    its own prompt) splits those outputs as its decode steps did."""
    from mpexec.models.split_rule import SPLIT_PROMPT
    from mpexec.models.step import RequestTable
    from mpexec.outputs import NewRequestData, SamplingParams, SchedulerOutput

    long = SPLIT_PROMPT + 6
    params = SamplingParams(temperature=0)
    table = RequestTable(default_seed=0)
    output = SchedulerOutput(scheduled_new_reqs=[
        NewRequestData("short", [1] * 5, params, [0]),
        NewRequestData("long", [2] * long, params, list(range(1, 7))),
        NewRequestData("again", [3] * (long + 3), params, list(range(7, 13)),
                       num_prompt_tokens=long)],
        scheduled_tokens={"short": [1] * 5, "long": [2] * long, "again": [3] * (long + 3)})
    table.update(output)
    step = table.prepare(output)
    assert step.split == [True] * 5 + [False] * (long - 1) + [True] \
        + [False] * (long - 1) + [True] * 4


# ── whole models from tiny GGUFs ─────────────────────────────────────────────

@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny Llama (rows of 256: whole Q4_K super-blocks) per quantisation type."""
    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.models.testing_gguf import write_tiny_gguf

    base = tmp_path_factory.mktemp("packed")
    directory = write_tiny_checkpoint(base / "hf", hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=512,
                                      num_hidden_layers=2)
    return {qtype: write_tiny_gguf(base / f"{qtype}.gguf", directory, qtype=qtype)
            for qtype in [*QTYPES, "Q6_K"]}


def build(path: Path, quantization: str, tp_rank: int = 0, tp: int = 1,
          group: Any = None) -> LlamaStage:
    with open_checkpoint(path) as checkpoint:
        c = checkpoint.config
        share = rank_share(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                           intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                           layers=(0, c.num_hidden_layers), tp_rank=tp_rank, tp_size=tp)
        return load_stage(checkpoint, c, share, is_first=True, is_last=True,
                          tp_group=group or SingleRankGroup(), dtype=torch.float32, device=CPU,
                          max_positions=c.max_position_embeddings, quantization=quantization)


def greedy(stage: LlamaStage) -> tuple[list[Any], list[list[int]]]:
    """Per prompt: the prompt's logits, then NEW_TOKENS greedy tokens."""
    cache = new_cache(stage)
    prompt_logits, outputs = [], []
    for index, prompt in enumerate(PROMPTS):
        blocks = list(range(index * 8, index * 8 + 8))
        logits = run(stage, cache, [(prompt, blocks, 0)], prompt_lens=[len(prompt)])
        prompt_logits.append(logits)
        tokens, last = [], logits[-1]
        for step in range(NEW_TOKENS):
            tokens.append(int(last.argmax()))
            last = run(stage, cache, [(tokens[-1:], blocks, len(prompt) + step)],
                       prompt_lens=[len(prompt)])[0]
        outputs.append(tokens)
    return prompt_logits, outputs


@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_model_matches_the_dequantised_one(tiny_ggufs: dict[str, Path],
                                                  qtype: str) -> None:
    packed = build(tiny_ggufs[qtype], "auto")
    linears = "int8 in groups" if qtype in ("Q8_0", "Q5_0") else "int4"
    assert packed.packed.startswith(f"{linears} ×"), packed.packed
    assert "rows ×1" in packed.packed  # the tied embedding's rows, kept as stored
    dense = build(tiny_ggufs[qtype], "none")
    assert dense.packed == "float"
    got_logits, got_tokens = greedy(packed)
    want_logits, want_tokens = greedy(dense)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=RELATIVE * want.abs().max().item(), rtol=0)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_a_requests_logits_do_not_depend_on_what_shares_its_step(
        tiny_ggufs: dict[str, Path], qtype: str) -> None:
    """A short prompt, then its decode step, each alone and each beside a
    long prompt's prefill (a step of over 64 rows, which once rounded every
    row): the same logits, bit for bit."""
    stage = build(tiny_ggufs[qtype], "auto")
    prompt, long = PROMPTS[0], [(7 * i) % 380 + 3 for i in range(90)]
    mine, other = list(range(8)), list(range(8, 40))

    def steps(beside: bool) -> list[Any]:
        cache = new_cache(stage, blocks=40)
        first = [(prompt, mine, 0)] + [(long, other, 0)] * beside
        lens = [len(prompt)] + [len(long)] * beside
        logits = run(stage, cache, first, prompt_lens=lens)
        token = int(logits[len(prompt) - 1].argmax())
        second = [([token], mine, len(prompt))] + [([5], other, len(long))] * beside
        return [logits[:len(prompt)], run(stage, cache, second, prompt_lens=lens)[0]]

    for alone, beside in zip(steps(False), steps(True), strict=True):
        assert torch.equal(alone, beside)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_tensor_parallel_2_packed_equals_one_rank_packed(tiny_ggufs: dict[str, Path],
                                                        qtype: str) -> None:
    """Each rank packs only its slice (Q4_K: o_proj and down_proj columns cut
    through super-blocks, on 32-element group edges)."""
    want_logits, want_tokens = greedy(build(tiny_ggufs[qtype], "auto"))

    def rank(tp_rank: int, group: Any) -> Any:
        return greedy(build(tiny_ggufs[qtype], "auto", tp_rank, 2, group))

    for got_logits, got_tokens in run_ranks(2, rank):
        for got, want in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=RELATIVE * want.abs().max().item(),
                                       rtol=0)
        assert got_tokens == want_tokens


REQUANTISED = 0.03


def test_a_requantised_model_follows_the_dequantised_one(tiny_ggufs: dict[str, Path]) -> None:
    """Q6_K has no groups of 32: its weights (the tied embedding too) are
    re-quantised to Q8_0-like groups (``quantization.requantise``), which
    adds Q8_0's rounding to the kernels'.  Tolerance: 3 % of the largest
    logit (measured: 0.27 on logits of ~15, 1.8 %; the Q8_0 file, packed
    exactly, 0.16), and the same greedy tokens."""
    packed = build(tiny_ggufs["Q6_K"], "auto")
    assert packed.packed == "int8 in groups ×9, rows ×1, 15 re-quantised", packed.packed
    got_logits, got_tokens = greedy(packed)
    want_logits, want_tokens = greedy(build(tiny_ggufs["Q6_K"], "none"))
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=REQUANTISED * want.abs().max().item(), rtol=0)
    assert got_tokens == want_tokens


@pytest.fixture(scope="module")
def uneven_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """1024 MLP rows, which TP=3 splits 342/341/341: down_proj's column slices
    start at 342 and 683, inside a group of 32 and a super-block of 256."""
    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.models.testing_gguf import write_tiny_gguf

    base = tmp_path_factory.mktemp("uneven")
    directory = write_tiny_checkpoint(base / "hf", hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=1024,
                                      num_hidden_layers=2)
    return {qtype: write_tiny_gguf(base / f"{qtype}.gguf", directory, qtype=qtype)
            for qtype in ("Q4_K", "Q8_0", "Q6_K")}


@pytest.mark.parametrize(("qtype", "quantization"), [
    ("Q4_K", "auto"), ("Q8_0", "auto"), ("Q6_K", "auto"), ("Q4_K", "none"), ("Q6_K", "none")])
def test_tensor_parallel_3_slices_off_group_edges(uneven_ggufs: dict[str, Path], qtype: str,
                                                 quantization: str) -> None:
    """Each rank reads the blocks that cover its columns.  Packed, it packs
    the covering groups whole (Q6_K: re-quantised from the covering
    super-blocks' values) and pads its input with zeros to them
    (``PaddedColumns``); dequantised, it cuts the columns after
    dequantising.  The tokens and logits of one rank holding everything."""
    path = uneven_ggufs[qtype]
    want_logits, want_tokens = greedy(build(path, quantization))
    tolerance = RELATIVE if qtype != "Q6_K" or quantization == "none" else REQUANTISED

    def rank(tp_rank: int, group: Any) -> Any:
        stage = build(path, quantization, tp_rank, 3, group)
        down = stage.layers[0].down
        assert down is not None
        if quantization == "auto":
            padding = {0: (0, 10), 1: (22, 21), 2: (11, 0)}[tp_rank]
            assert isinstance(down.weight, PaddedColumns)
            assert (down.weight.before, down.weight.after) == padding
        return greedy(stage)

    for got_logits, got_tokens in run_ranks(3, rank):
        for got, want in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(),
                                       rtol=0)
        assert got_tokens == want_tokens


def test_a_rank_reads_only_its_share_of_a_packed_file(tiny_ggufs: dict[str, Path]) -> None:
    path = tiny_ggufs["Q4_K"]
    whole = []
    for tp_rank in range(2):
        with open_checkpoint(path) as checkpoint:
            c = checkpoint.config
            share = rank_share(num_heads=c.num_attention_heads,
                               num_kv_heads=c.num_key_value_heads,
                               intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                               layers=(0, c.num_hidden_layers), tp_rank=tp_rank, tp_size=2)
            load_stage(checkpoint, c, share, is_first=True, is_last=True,
                       tp_group=_NoCollectives(tp_rank), dtype=torch.float32, device=CPU,
                       max_positions=64, quantization="auto")
            whole.append(checkpoint.bytes_read)
    size = path.stat().st_size
    assert all(0.4 * size < n < 0.6 * size for n in whole), (whole, size)


class _NoCollectives:
    """A TP group of two whose collectives are never called (loading only)."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank_in_group = rank

    def all_reduce(self, tensor: Any) -> Any:
        raise AssertionError("no collective at load")

    def all_gather(self, tensor: Any, dim: int = -1) -> Any:
        raise AssertionError("no collective at load")


def test_quantization_is_checked_by_name() -> None:
    from mpexec.models.quantization import check_quantization

    assert check_quantization("none") == "none"
    with pytest.raises(ValueError, match="quantization must be one of auto, none; got 'int3'"):
        check_quantization("int3")


def test_safetensors_stay_float_under_auto(tmp_path: Path) -> None:
    from mpexec.models.testing import write_tiny_checkpoint

    directory = write_tiny_checkpoint(tmp_path / "hf")
    assert build(directory, "auto").packed == "float"


# ── the real default model ───────────────────────────────────────────────────

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_packed_follows_the_dequantised_greedy_tokens(smollm2_gguf: Path) -> None:
    """The packed model's linears round their results to bfloat16 (logits
    differ by up to 0.73 on logits of ~20, measured over 48 tokens of seven
    prompts; the top token's by up to 0.27), so a greedy choice between two
    tokens whose dequantised logits lie closer than that can go either way.
    Teacher-forced on the dequantised model's greedy tokens, logits must stay
    within 1.0 (5 % of the top logits) and every step pick the same token:
    measured, these three continuations agree for 16 tokens (the third
    differs at its 17th; with activations rounded once to bfloat16, at its
    14th, on a 0.14 margin)."""
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,"]
    with open_checkpoint(smollm2_gguf) as checkpoint:
        tokenizer = checkpoint.tokenizer()
        prompts = [tokenizer.encode(text) for text in texts]
    dense = build(smollm2_gguf, "none")
    reference = [greedy_run(dense, prompt, None) for prompt in prompts]
    del dense
    packed = build(smollm2_gguf, "auto")
    agree = steps = 0
    for prompt, (want_logits, tokens) in zip(prompts, reference, strict=True):
        got_logits, _ = greedy_run(packed, prompt, tokens)
        torch.testing.assert_close(got_logits, want_logits, atol=1.0, rtol=0)
        for got, want in zip(got_logits, want_logits, strict=True):
            agree += int(got.argmax()) == int(want.argmax())
            steps += 1
    assert agree == steps, f"{agree} of {steps} steps agree"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_packed_gives_the_demo_answers_of_the_dequantised_model(
        smollm2_gguf: Path) -> None:
    """The demo's four questions, 48 greedy tokens each (the demo's
    max_tokens): packed weights (the default) answer word for word as the
    dequantised ones (the packed head taking its argmax-only pass, as for
    the demo's greedy requests).  Before activations went to the kernels as bfloat16
    high + low parts and the head's top logits were re-scored exactly, two
    of the four answers changed (the first at its first token: "L'Étoile…"
    instead of "The capital of France is Paris.")."""
    from mpexec.cli.common import DEMO_CONVERSATIONS

    with open_checkpoint(smollm2_gguf) as checkpoint:
        tokenizer = checkpoint.tokenizer()
        prompts = [tokenizer.apply_chat_template(c) for c in DEMO_CONVERSATIONS]
    dense = build(smollm2_gguf, "none")
    want = [greedy_run(dense, prompt, None, steps=48)[1] for prompt in prompts]
    del dense
    packed = build(smollm2_gguf, "auto")
    got = [greedy_run(packed, prompt, None, steps=48, argmax_only=True)[1]
           for prompt in prompts]
    assert [tokenizer.decode(t) for t in got] == [tokenizer.decode(t) for t in want]
    assert got == want


def greedy_run(stage: LlamaStage, prompt: list[int], forced: list[int] | None,
               steps: int = 16, argmax_only: bool = False) -> tuple[Any, list[int]]:
    """``steps`` decode steps (``forced`` tokens, else greedy): each step's
    logits, the tokens (``argmax_only``: the head's pass for greedy sampling,
    as the worker runs greedy requests)."""
    blocks = list(range(-(-(len(prompt) + steps) // BLOCK)))
    cache = new_cache(stage, blocks=len(blocks))
    rows = [run(stage, cache, [(prompt, blocks, 0)], argmax_only=argmax_only,
                prompt_lens=[len(prompt)])[-1]]
    tokens: list[int] = []
    for step in range(steps):
        tokens.append(forced[step] if forced is not None else int(rows[-1].argmax()))
        if step < steps - 1:
            rows.append(run(stage, cache, [(tokens[-1:], blocks, len(prompt) + step)],
                            argmax_only=argmax_only, prompt_lens=[len(prompt)])[0])
    return torch.stack(rows), tokens


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_command_line_passes_quantization_to_the_llm(command: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.cli import build_parser
    from mpexec.cli.generate import start_llm
    from mpexec.engine import llm as llm_module

    parser = build_parser()
    args = parser.parse_args([command, "--quantization", "none"])
    assert args.quantization == "none"
    assert parser.parse_args([command]).quantization == "auto"  # packed by default
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--quantization", "int3"])
    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, model: str, **kwargs: Any) -> None:
            seen.update(kwargs)

    monkeypatch.setattr(llm_module, "LLM", Recorder)
    args.log_level = "warning"  # set by mpexec.cli.main
    start_llm(args, 1, 1)
    assert seen["quantization"] == "none"


def test_llm_refuses_an_unknown_quantization_before_starting_workers() -> None:
    from mpexec import LLM

    with pytest.raises(ValueError, match="quantization must be one of auto, none; got 'q4'"):
        LLM("default", quantization="q4")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_worker_processes_at_tp2_packed_give_the_in_process_tokens(
        tiny_ggufs: dict[str, Path], qtype: str, leak_check: None) -> None:
    """Two ModelWorker processes (mp executor, TP=2, quantization="auto")
    against one packed rank in this process.  Q8_0: the requests are greedy,
    so the workers' head takes its argmax-only pass (``ParallelLMHead``),
    whose logits are exact where they can be the argmax: the sampled token's."""
    from tests.models.model_run_driver import StepDriver, make_executor

    from mpexec.outputs import SamplingParams

    path = tiny_ggufs[qtype]
    want_logits, want_tokens = greedy(build(path, "auto"))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    with make_executor(path, tp=2, quantization="auto") as executor:
        runs = StepDriver(executor, fetch_logits=True).generate(
            {f"r{i}": (prompt, params) for i, prompt in enumerate(PROMPTS)})
    for i, tokens in enumerate(want_tokens):
        assert runs[f"r{i}"].output == tokens
        first, want = runs[f"r{i}"].logits[0], want_logits[i][-1]
        if qtype == "Q8_0":
            first, want = first[tokens[0]], want[tokens[0]]
        torch.testing.assert_close(first, want,
                                   atol=RELATIVE * want_logits[i].abs().max().item(), rtol=0)


def test_the_demo_runs_the_default_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpexec demo has no --quantization: it must get LLM's default, not its own."""
    from mpexec.cli import build_parser
    from mpexec.cli.generate import start_llm
    from mpexec.engine import llm as llm_module

    args = build_parser().parse_args(["demo"])
    assert not hasattr(args, "quantization")
    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, model: str, **kwargs: Any) -> None:
            seen.update(kwargs)

    default = inspect.signature(llm_module.LLM).parameters["quantization"].default
    monkeypatch.setattr(llm_module, "LLM", Recorder)
    args.log_level = "warning"
    start_llm(args, 1, 1)
    assert seen["quantization"] == default == "auto"
