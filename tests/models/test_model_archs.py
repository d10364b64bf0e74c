"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers on tiny random checkpoints.

Each family is written by transformers at test time (``save_random_family``:
7 layers, 9 query / 3 KV heads, odd sizes so TP=2 splits unevenly; Gemma
with a sliding window of 6 tokens, so a 23-token prompt crosses it), then run
by mpexec from the safetensors directory and from a GGUF file written the way
llama.cpp's converter writes that family (``testing_gguf.write_family_gguf``),
at TP=1 and TP=2: prefill logits, chunked prefill plus decode, and greedy
tokens equal transformers' ``generate``.  Tolerances as in
test_model_layers (float32, 1e-4 absolute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.model_run_support import (  # noqa: E402
    FAMILIES,
    run_ranks,
    save_random_family,
)
from tests.models.test_model_layers import ATOL, build, new_cache, run  # noqa: E402

from mpexec.models.loader import open_checkpoint  # noqa: E402

pytestmark = pytest.mark.torch
IDS = torch.randint(3, 101, (23,), generator=torch.Generator().manual_seed(1)).tolist()
BLOCKS = [9, 2, 7, 4, 0, 5, 11, 3]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    name = request.param
    directory = save_random_family(tmp_path_factory.mktemp(name) / "hf", name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
    return name, directory, oracle(model)


def oracle(model: Any, steps: int = 8) -> tuple[Any, list[int]]:
    """transformers' prompt logits and greedy continuation (plain argmax over
    full forward passes: no generation config, no EOS handling)."""
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0]
        ids = list(IDS)
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return logits, ids[len(IDS):]


def decode_run(stage: Any, steps: int) -> tuple[Any, list[int]]:
    """Prefill in two chunks, then one decode step per token: logits of every
    prompt row (chunks) and the greedy continuation."""
    cache = new_cache(stage)
    first = run(stage, cache, [(IDS[:10], BLOCKS, 0)])
    second = run(stage, cache, [(IDS[10:], BLOCKS, 10)])
    tokens: list[int] = []
    last = second[-1]
    for step in range(steps):
        token = int(last.argmax())
        tokens.append(token)
        last = run(stage, cache, [([token], BLOCKS, len(IDS) + step)])[0]
    return torch.cat([first, second]), tokens


def test_prefill_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    name, directory, (expected, _) = family
    with open_checkpoint(directory) as checkpoint:
        assert checkpoint.config.architecture == name.replace("_text", "")
        stage = build(checkpoint)
    got = run(stage, new_cache(stage), [(IDS, BLOCKS, 0)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_chunks_decode_and_greedy_tokens_match_transformers(
        family: tuple[str, Path, Any]) -> None:
    _, directory, (expected, greedy) = family
    with open_checkpoint(directory) as checkpoint:
        stage = build(checkpoint)
    logits, tokens = decode_run(stage, len(greedy))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert tokens == greedy


def test_tensor_parallel_2_matches_transformers(family: tuple[str, Path, Any]) -> None:
    _, directory, (expected, greedy) = family

    def rank(tp_rank: int, group: Any) -> Any:
        with open_checkpoint(directory) as own:
            stage = build(own, tp_rank, 2, group)
        return decode_run(stage, len(greedy))

    for logits, tokens in run_ranks(2, rank):
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert tokens == greedy


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    """Each family from a GGUF file written the way llama.cpp writes it, at TP=1
    and TP=2.  GGUF has no query_pre_attn_scalar (llama.cpp scales Gemma by
    1/sqrt(head_dim)) and Gemma 3's local rope base is 10,000: the checkpoints
    here are made to agree."""
    from mpexec.models.testing_gguf import write_family_gguf

    agree: dict[str, dict[str, Any]] = {
        "gemma2": {"query_pre_attn_scalar": 16},
        "gemma3": {"query_pre_attn_scalar": 16, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}}
    for name in FAMILIES:
        directory = save_random_family(tmp_path / name, name, seed=2, **agree.get(name, {}))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager").eval()
        expected, greedy = oracle(model)
        path = write_family_gguf(tmp_path / f"{name}.gguf", directory)
        with open_checkpoint(path) as checkpoint, open_checkpoint(directory) as hf:
            assert checkpoint.config.features == hf.config.features, name
            stage = build(checkpoint)
        logits, tokens = decode_run(stage, len(greedy))
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=name)
        assert tokens == greedy, name

        def rank(tp_rank: int, group: Any, path: Path = path, steps: int = len(greedy)) -> Any:
            with open_checkpoint(path) as own:
                return decode_run(build(own, tp_rank, 2, group), steps)

        for logits, tokens in run_ranks(2, rank):
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=name)
            assert tokens == greedy, name


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gemma3_270m_q4_k_m_matches_transformers() -> None:
    """The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors) against
    transformers loading the same file: prompt logits and 8 greedy tokens."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from mpexec.models import fetch

    path = fetch.cached_model("gemma3-270m")
    if path is None:
        pytest.skip("gemma3-270m is not in the cache (resolve_model('gemma3-270m') fetches it)")
    with open_checkpoint(path) as checkpoint:
        ids = checkpoint.tokenizer().encode("The capital of France is")
        stage = build(checkpoint)
    cache = new_cache(stage, blocks=16)
    logits = run(stage, cache, [(ids, list(range(16)), 0)])
    tokens, last = [], logits[-1]
    for step in range(8):
        tokens.append(int(last.argmax()))
        last = run(stage, cache, [(tokens[-1:], list(range(16)), len(ids) + step)])[0]
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, NotImplementedError) as e:  # an older transformers without gemma3 GGUF
        pytest.skip(f"transformers cannot load gemma3 from GGUF: {e}")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
        sequence = list(ids)
        for _ in range(8):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    assert tokens == sequence[len(ids):]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)


def test_llama3_rope_freqs_tensor_in_gguf_matches_transformers(tmp_path: Path) -> None:
    """Llama 3.1+ GGUFs carry the rope scaling as a ``rope_freqs`` tensor (one
    factor per frequency); the model divides by it, and matches transformers on
    the safetensors checkpoint with ``rope_type: llama3``."""
    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.models.testing_gguf import write_tiny_gguf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    directory = write_tiny_checkpoint(tmp_path / "hf", num_hidden_layers=2,
                                      rope_theta=500000.0, rope_scaling=scaling)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              dtype=torch.float32).eval()
    expected, greedy = oracle(model)
    path = write_tiny_gguf(tmp_path / "l31.gguf", directory, qtype="F32")
    with open_checkpoint(path) as checkpoint:
        factors = checkpoint.config.features.rope_freq_factors
        assert checkpoint.config.rope_scaling is None and factors is not None
        assert len(factors) == 8 and factors[0] == 1.0 and factors[-1] == 8.0
        stage = build(checkpoint)
    logits, tokens = decode_run(stage, len(greedy))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert tokens == greedy


@pytest.mark.parametrize(("family", "change", "field"), [
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("gemma3", {"query_pre_attn_scalar": -1}, "query_pre_attn_scalar"),
    ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                               "long_factor": [1.0] * 4}}, "rope_scaling"),
])
def test_unsupported_family_options_name_the_field_and_the_file(
        family: str, change: dict[str, Any], field: str) -> None:
    from mpexec.models.config import CheckpointError, ModelConfig

    raw = {"model_type": {"gemma3": "gemma3_text"}.get(family, family), "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
           "vocab_size": 300, "max_position_embeddings": 128, "sliding_window": 8, **change}
    with pytest.raises(CheckpointError, match=rf"^here/config\.json: {field}"):
        ModelConfig.from_hf_dict(raw, source="here/config.json")


def test_unsupported_gguf_options_name_the_field_and_the_file() -> None:
    from mpexec.models.config import CheckpointError, ModelConfig

    fields = {"general.architecture": "gemma3", "gemma3.embedding_length": 64,
              "gemma3.attention.head_count": 4, "gemma3.block_count": 6,
              "gemma3.feed_forward_length": 96, "gemma3.context_length": 128,
              "gemma3.vocab_size": 300, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
              "gemma3.attention.sliding_window": 8,
              "gemma3.attention.sliding_window_pattern": 3}
    with pytest.raises(CheckpointError, match=r"m\.gguf: gemma3\.attention\.sliding_window_"):
        ModelConfig.from_gguf_fields(fields, source="m.gguf", has_output_tensor=False)
    fields["gemma3.attention.sliding_window_pattern"] = 6
    features = ModelConfig.from_gguf_fields(fields, source="m.gguf",
                                            has_output_tensor=False).features
    assert features.sliding_layers == (0, 1, 2, 3, 4)
    assert features.attention_scale == 16 ** -0.5  # 1/sqrt(head_dim)
    big = {**fields, "gemma3.block_count": 62, "gemma3.attention.key_length": 32,
           "gemma3.attention.value_length": 32}
    del big["gemma3.attention.sliding_window_pattern"]
    # llama.cpp's rule for the 27B models: 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
    assert ModelConfig.from_gguf_fields(big, source="m.gguf", has_output_tensor=False
                                        ).features.attention_scale == 16 ** -0.5
    fields["general.architecture"] = "falcon"
    with pytest.raises(CheckpointError, match=r"m\.gguf: general\.architecture: 'falcon'"):
        ModelConfig.from_gguf_fields(fields, source="m.gguf", has_output_tensor=False)


WORKER_PROMPTS = {f"r{i}": torch.randint(3, 101, (4 + 5 * i,),
                                         generator=torch.Generator().manual_seed(5 + i)).tolist()
                  for i in range(3)}


@pytest.fixture(scope="module")
def gemma_oracles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Gemma 2 and 3 checkpoints and, per prompt, transformers' 9 greedy tokens and the
    logits they were chosen from (computed before any leak check starts)."""
    out = {}
    for name in ("gemma2", "gemma3"):
        directory = save_random_family(tmp_path_factory.mktemp(name) / "hf", name, seed=3)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager").eval()
        expected = {}
        with torch.no_grad():
            for rid, prompt in WORKER_PROMPTS.items():
                ids = list(prompt)
                for _ in range(9):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
                expected[rid] = (ids[len(prompt):], logits)
        out[name] = (directory, expected)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "layout"), [("gemma2", "tp2"), ("gemma3", "tp2"),
                                              ("gemma3", "pcp2")])
def test_gemma_batched_through_worker_processes(gemma_oracles: dict[str, Any], name: str,
                                                layout: str, leak_check: None) -> None:
    """Requests of different lengths decoded together (padded batches, each
    request's own window) by two ModelWorker processes, at TP=2 (prompts in
    chunks of 5) or PCP=2 (whole prompts, their rows split over the two ranks):
    greedy tokens and the sampled logits equal transformers' for each request alone."""
    from tests.models.model_run_driver import StepDriver, make_executor

    from mpexec.outputs import SamplingParams

    directory, expected = gemma_oracles[name]
    parallel = {"tp2": {"tp": 2}, "pcp2": {"pcp": 2}}[layout]
    with make_executor(directory, **parallel) as executor:
        runs = StepDriver(executor, fetch_logits=True,
                          chunk=5 if layout == "tp2" else None).generate(
            {rid: (p, SamplingParams(temperature=0, max_tokens=9))
             for rid, p in WORKER_PROMPTS.items()})
        if layout == "pcp2":  # the prefill was really split
            assert min(executor.collective_rpc(lambda w: w.worker.pcp_split_steps)) > 0
    for rid, (tokens, logits) in expected.items():
        assert runs[rid].output == tokens, rid
        torch.testing.assert_close(torch.stack(runs[rid].logits), logits, atol=ATOL, rtol=0)


def test_decode_context_parallelism_refuses_windows_and_soft_caps(
        family: tuple[str, Path, Any]) -> None:
    from mpexec.models.layers.parallel import SingleRankGroup
    from mpexec.models.llama import load_stage
    from mpexec.models.sharding import rank_share

    name, directory, _ = family
    with open_checkpoint(directory) as checkpoint:
        c = checkpoint.config
        share = rank_share(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                           intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                           layers=(0, c.num_hidden_layers), tp_rank=0, tp_size=1)

        def load() -> Any:
            return load_stage(checkpoint, c, share, is_first=True, is_last=True,
                              tp_group=SingleRankGroup(), dtype=torch.float32,
                              device=torch.device("cpu"), max_positions=64,
                              dcp_group=SingleRankGroup(), dcp_head_counts=[9])

        if name.startswith("gemma"):
            with pytest.raises(ValueError, match=r"decode context parallelism.*sliding_window"):
                load()
        else:
            assert load().layers
