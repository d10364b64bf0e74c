"""GGUF mixture-of-experts experts kept packed (``quantization="auto"``).

A tiny random Mixtral / Qwen2-MoE written by transformers, converted to GGUF
the way llama.cpp does and its expert tensors (and Qwen2-MoE's shared expert)
quantised; every other tensor stays float32, so what differs from the oracle
is the packed experts alone.  The oracle: transformers loading the same
file's values dequantised (``testing_gguf.dequantized_checkpoint``),
at TP=1, TP=2 and EP=2; DP=2 x EP against one replica.

Tolerance, as the dense packed tests (``test_quantized``): 2 % of the largest
logit, and the same greedy tokens but where transformers' top two logits are
closer than the packed logits moved (``check_against_transformers``).  The
packed kernels take bfloat16 activations (split into high + low parts at
decode) and bfloat16 group scales and return bfloat16; measured here
(logits up to ~6) the largest difference is ~0.01-0.04.  A wrong expert, row slice or padding gives
differences of the order of the logits.

Shapes: hidden 256, 5 experts (EP=2 holds 3 + 2), 96 expert rows (TP=2: 48
each, so the down projections' column slices end inside a group of 32 and
are padded: ``PaddedColumns``); Q4_K's 256-element super-blocks cover the
gate/up rows but not the 96-element down rows, which stay float (a block
with one projection packed and the other float).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.models.model_run_driver import StepDriver, make_executor  # noqa: E402
from tests.models.test_model_layers import CPU  # noqa: E402

from mpexec.models.layers.parallel import SingleRankGroup  # noqa: E402
from mpexec.models.layers.quantized import (  # noqa: E402
    ExpertRows,
    Int4Weight,
    Int8GroupWeight,
    PaddedColumns,
    SplitRows,
)
from mpexec.models.llama import load_stage  # noqa: E402
from mpexec.models.loader import open_checkpoint  # noqa: E402
from mpexec.models.sharding import rank_share  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]
RELATIVE = 0.02
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SHAPE = dict(vocab_size=101, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False, num_experts_per_tok=2, initializer_range=0.1)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# ── the kernel path alone ────────────────────────────────────────────────────

def _weight(kind: str, out: int, columns: int, generator: Any) -> Any:
    top = 256 if kind == "int8" else 16
    q = torch.randint(0, top, (out, columns), generator=generator, dtype=torch.uint8)
    scale = torch.rand(out, columns // 32, generator=generator) * 0.01
    minimum = -scale * (top // 2)
    if kind == "int8":
        return Int8GroupWeight(q, scale, minimum)
    weight = Int4Weight(q, scale, minimum)
    return PaddedColumns(weight, 16, 0) if kind == "padded" else weight


@pytest.mark.parametrize("kind", ["int4", "int8", "padded"])
@pytest.mark.parametrize("counts", [[2, 0, 3, 1, 0], [20, 0, 30, 15, 5], [0, 0, 0]])
@pytest.mark.parametrize("rule", ["every", "none", "mixed"])
def test_expert_rows_multiply_each_row_by_its_experts_weight(kind: str, counts: list[int],
                                                             rule: str) -> None:
    """Each row exactly as its expert's weight computes it alone, split into
    bfloat16 high + low or rounded once as the row's own rule says."""
    generator = torch.Generator().manual_seed(0)
    weights = [_weight(kind, 40, 64, generator) for _ in counts]
    total = sum(counts)
    x = torch.randn(total, weights[0].in_features, generator=generator)
    mask = {"every": torch.ones(total, dtype=torch.bool),
            "none": torch.zeros(total, dtype=torch.bool),
            "mixed": torch.rand(total, generator=generator) < 0.3}[rule]
    got = ExpertRows(counts, CPU, SplitRows(mask)).matmul(x, weights)
    expert_of = [expert for expert, count in enumerate(counts) for _ in range(count)]
    want = [weights[expert](x[row:row + 1], bool(mask[row]))
            for row, expert in enumerate(expert_of)]
    assert got.shape == (total, 40)
    assert torch.equal(got, torch.cat(want) if want else got)
    if rule == "every":  # the default when no rule is given
        assert torch.equal(ExpertRows(counts, CPU).matmul(x, weights), got)


# ── tiny quantised MoE checkpoints ───────────────────────────────────────────

def save_moe(directory: Path, kind: str, **overrides: Any) -> Path:
    torch.manual_seed(0)
    shape = {**SHAPE, **overrides}
    if kind == "mixtral":
        config = transformers.MixtralConfig(**shape, intermediate_size=96, num_local_experts=5)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            **shape, intermediate_size=128, moe_intermediate_size=96,
            shared_expert_intermediate_size=64, num_experts=5, norm_topk_prob=False,
            mlp_only_layers=[])
        model = transformers.Qwen2MoeForCausalLM(config)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(kind, qtype) -> (gguf path, transformers model of its values)``, built once."""
    from mpexec.models.testing_gguf import dequantized_checkpoint, quantize_gguf, write_moe_gguf

    base = tmp_path_factory.mktemp("moe-packed")
    built: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(kind: str, qtype: str) -> tuple[Path, Any]:
        if (kind, qtype) not in built:
            hf_dir = save_moe(base / kind, kind)
            plain = base / f"{kind}.gguf"
            if not plain.exists():
                write_moe_gguf(plain, hf_dir)
            path = quantize_gguf(plain, base / f"{kind}-{qtype}.gguf", qtype,
                                 select=lambda name: "_exps." in name or "_shexp." in name)
            oracle = dequantized_checkpoint(path, hf_dir, base / f"{kind}-{qtype}-hf")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                oracle, dtype=torch.float32, experts_implementation="eager").eval()
            built[(kind, qtype)] = (path, model)
        return built[(kind, qtype)]

    return get


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(0, 101, (4 + 5 * i,), generator=g).tolist()
            for i in range(3)}


def check_against_transformers(runs: dict[str, Any], model: Any) -> None:
    """transformers' logits on each prompt and mpexec's own tokens: within the
    tolerance, and each greedy token transformers' choice, except where its
    top two are closer than twice the difference there (a near tie that the
    packed rounding may break either way; such a position is allowed, not
    expected: at most one per prompt)."""
    ties = 0
    for rid, prompt in prompts().items():
        run = runs[rid]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + run.output])).logits[0]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(run.output)]
        got = torch.stack(run.logits)
        torch.testing.assert_close(got, rows, atol=RELATIVE * rows.abs().max().item(), rtol=0)
        top = rows.topk(2, dim=-1).values
        gap, moved = top[:, 0] - top[:, 1], (got - rows).abs().max(dim=-1).values
        for step, (token, want) in enumerate(zip(run.output, rows.argmax(-1).tolist(),
                                                 strict=True)):
            if token != want:
                assert gap[step] <= 2 * moved[step], (rid, step, token, want)
                ties += 1
    assert ties <= len(runs)


def build(path: Path, quantization: str) -> Any:
    with open_checkpoint(path) as checkpoint:
        c = checkpoint.config
        share = rank_share(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                           intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                           layers=(0, c.num_hidden_layers), tp_rank=0, tp_size=1)
        return load_stage(checkpoint, c, share, is_first=True, is_last=True,
                          tp_group=SingleRankGroup(), dtype=torch.float32, device=CPU,
                          max_positions=c.max_position_embeddings, quantization=quantization)


@pytest.mark.parametrize(("qtype", "gate_up", "down"), [
    ("Q8_0", Int8GroupWeight, Int8GroupWeight), ("Q4_0", Int4Weight, Int4Weight),
    ("Q4_K", Int4Weight, None)])
def test_quantised_experts_load_packed_and_none_keeps_them_float(
        checkpoints: Any, qtype: str, gate_up: type, down: type | None) -> None:
    path, _ = checkpoints("qwen2_moe", qtype)
    block = build(path, "auto").layers[0].moe
    assert isinstance(block.gate_up, list) and len(block.gate_up) == 5
    assert all(isinstance(w, gate_up) for w in block.gate_up)
    assert block.gate_up[0].out_features == 2 * 96
    if down is None:  # rows of 96: not whole Q4_K super-blocks, stored float32
        assert isinstance(block.down, torch.Tensor) and block.down.shape == (5, 256, 96)
    else:
        assert all(isinstance(w, down) for w in block.down)
    assert not isinstance(block.shared.gate_up, torch.Tensor) or down is None
    dense = build(path, "none").layers[0].moe
    assert isinstance(dense.gate_up, torch.Tensor) and dense.gate_up.shape == (5, 192, 256)
    assert isinstance(dense.down, torch.Tensor)
    assert isinstance(dense.shared.gate_up, torch.Tensor)


@pytest.mark.parametrize(("kind", "qtype"), [
    ("mixtral", "Q8_0"), ("mixtral", "Q4_0"), ("mixtral", "Q4_K"), ("qwen2_moe", "Q8_0")])
def test_packed_experts_at_tp1_follow_transformers(checkpoints: Any, kind: str,
                                                   qtype: str) -> None:
    path, model = checkpoints(kind, qtype)
    with make_executor(path, backend="uni", quantization="auto") as executor:
        runs = StepDriver(executor, fetch_logits=True).generate(
            {rid: (p, GREEDY) for rid, p in prompts().items()})
    check_against_transformers(runs, model)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "qtype", "ep"), [
    ("mixtral", "Q8_0", False), ("mixtral", "Q4_K", False), ("mixtral", "Q8_0", True),
    ("qwen2_moe", "Q4_0", True)])
def test_packed_experts_split_over_two_ranks_follow_transformers(
        checkpoints: Any, kind: str, qtype: str, ep: bool, leak_check: None) -> None:
    """TP=2: each rank packs 48 of every expert's 96 rows (its down columns
    padded to the groups that cover them); EP=2: 3 + 2 whole experts."""
    path, model = checkpoints(kind, qtype)
    with make_executor(path, tp=2, ep=ep, quantization="auto") as executor:
        runs = StepDriver(executor, fetch_logits=True, chunk=5).generate(
            {rid: (p, GREEDY) for rid, p in prompts().items()})
    check_against_transformers(runs, model)


@pytest.fixture
def gguf_with_tokenizer(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A Q8_0-experts Mixtral GGUF with the tiny checkpoint's vocabulary (for
    LLM); written before the test's leak check (transformers' progress bar
    keeps a semaphore)."""
    import shutil

    from mpexec.models.testing_gguf import quantize_gguf, write_moe_gguf

    hf_dir = save_moe(tmp_path / "mixtral", "mixtral", vocab_size=389)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, hf_dir / name)
    return quantize_gguf(write_moe_gguf(tmp_path / "f32.gguf", hf_dir), tmp_path / "q8.gguf",
                         "Q8_0", select=lambda name: "_exps." in name, tokenizer=hf_dir)


@pytest.mark.slow
def test_packed_experts_split_across_two_replicas_match_one(gguf_with_tokenizer: Path,
                                                            leak_check: None) -> None:
    """DP=2 x TP=1 with EP (3 + 2 packed experts, the tokens dispatched
    all-to-all, an idle replica in dummy steps) gives one replica's tokens:
    each row goes through the same packed expert either way, computed alone."""
    from tests.models.test_moe import one_replica_then_split

    one, split = one_replica_then_split(gguf_with_tokenizer, quantization="auto")
    assert one == split


@pytest.mark.slow
def test_packed_experts_failed_over_keep_every_requests_tokens(gguf_with_tokenizer: Path,
                                                                leak_check: None) -> None:
    """replica_restart on packed experts across the replicas: replica 1's
    worker killed mid-generate; its requests, prompts over 64 tokens among
    them, recompute their prefix on replica 0 and finish with the tokens of
    an undisturbed run (a token's rows split or round by the token, so the
    recomputed prefix is the one first computed)."""
    import signal

    from tests.models.test_moe import _stop_replica_midway

    from mpexec.engine.llm import LLM

    g = torch.Generator().manual_seed(9)
    prompts_ = [{"prompt_token_ids": torch.randint(4, 389, (length,), generator=g).tolist()}
                for length in (70, 5, 90, 12, 66, 8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(gguf_with_tokenizer), data_parallel_size=2, enable_expert_parallel=True,
             replica_restart=True, num_threads=1, block_size=4, quantization="auto",
             kv_cache_memory_bytes=16 << 20, shutdown_grace_s=5.0) as llm:
        want = [o.token_ids for o in llm.generate(prompts_, params)]
        progress, hit = _stop_replica_midway(llm, 1, 15, signal.SIGKILL)
        got = [o.token_ids for o in llm.generate(prompts_, params, progress=progress)]
        failover = llm.engine.failover
    assert hit and failover.restarts == 1 and failover.requeued_requests, failover.events
    assert got == want


@pytest.fixture
def bare_gguf(tiny_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a float Mixtral GGUF written without a vocabulary, the checkpoint
    directory it came from, with the tiny tokenizer); written before the
    test's leak check (transformers' progress bar keeps a semaphore)."""
    import shutil

    from mpexec.models.testing_gguf import write_moe_gguf

    hf_dir = save_moe(tmp_path / "mixtral", "mixtral", vocab_size=389)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, hf_dir / name)
    return write_moe_gguf(tmp_path / "f32.gguf", hf_dir), hf_dir


def test_a_gguf_without_a_vocabulary_serves_with_the_tokenizer_given(
        bare_gguf: tuple[Path, Path], leak_check: None) -> None:
    """``tokenizer=`` wins over the checkpoint's: a GGUF written without a
    vocabulary is served with the tokenizer of the checkpoint it came from
    (the front end used to read the file's own vocabulary and fail)."""
    from mpexec.engine.llm import LLM

    bare, hf_dir = bare_gguf
    with LLM(str(bare), tokenizer=str(hf_dir), num_threads=1, block_size=4,
             kv_cache_memory_bytes=16 << 20, shutdown_grace_s=5.0) as llm:
        [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True))
    assert len(out.token_ids) == 3
