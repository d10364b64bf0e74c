"""Decode context parallelism: the KV of each request spread over the DCP ranks.

Unit level: the per-rank shares and the exact log-sum-exp merge against one
unsplit attention.  Worker level: TP=2 x DCP=2 (and TP=4 x DCP=2 with two KV
heads) on tiny checkpoints whose TP exceeds their KV heads, greedy tokens and
logits equal to TP=1, with prompts up to a few hundred tokens, chunked
prefill, and a rank killed mid-decode.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.model_run_driver import BLOCK_SIZE, StepDriver, make_executor  # noqa: E402
from tests.models.model_run_support import run_ranks, save_random_llama  # noqa: E402

from mpexec.errors import WorkerDiedError  # noqa: E402
from mpexec.executor.verdict import death_behind  # noqa: E402
from mpexec.models.context_parallel import (  # noqa: E402
    build_dcp_batch,
    check_dcp_heads,
    dcp_attention,
    merge_partials,
    partial_attention,
)
from mpexec.models.kv_cache import ScheduledRequest  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]
ATOL = 1e-4


def assert_rank_died(executor: Any, error: BaseException, rank: int) -> None:
    """``error`` is the death of ``rank``, or a symptom of it (a survivor's
    collective failed before the executor saw the death) whose verdict, what
    the engine raises, names that rank."""
    if not isinstance(error, WorkerDiedError):
        died = death_behind(executor, error)
        assert died is not None, error
        error = died
    assert isinstance(error, WorkerDiedError) and error.rank == rank


def reference_attention(q: Any, k: Any, v: Any) -> Any:
    """Causal softmax attention of every query over positions 0..its own, one KV head."""
    n = q.shape[0]
    scores = torch.einsum("nhd,lhd->hnl", q, k.expand(-1, q.shape[1], -1)) / math.sqrt(q.shape[2])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.expand(-1, q.shape[1], -1))


def test_the_lse_merge_of_the_shares_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    n, heads, d, dcp = 13, 3, 8, 3
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, 1, 1))
    outs, lses = [], []
    for rank in range(dcp):
        positions = torch.arange(rank, n, dcp)
        mask = positions.unsqueeze(0) <= torch.arange(n).unsqueeze(1)
        out, lse = partial_attention(q, k[positions], v[positions], mask, d ** -0.5)
        outs.append(out)
        lses.append(lse)
    assert torch.isinf(lses[2][0]).all()  # position 0: rank 2 sees no key yet
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, reference_attention(q, k, v), atol=1e-5, rtol=0)


def test_each_rank_stores_every_dcp_th_token_of_a_block_of_block_size_x_dcp() -> None:
    request = ScheduledRequest(block_ids=[5, 2, 7], start=3, num_tokens=6)  # positions 3..8
    batch = build_dcp_batch([request], block_size=2, dcp_size=2, dcp_rank=1,
                            device=torch.device("cpu"))
    # rank 1 owns positions 1, 3, 5, 7 = local 0..3: blocks 5, 5, 2, 2
    assert batch.spans[0].slots.tolist() == [10, 11, 4, 5]
    assert batch.write_rows.tolist() == [0, 2, 4]  # positions 3, 5, 7 of this step
    assert batch.write_slots.tolist() == [11, 4, 5]
    assert batch.spans[0].mask[0].tolist() == [True, True, False, False]  # query at 3
    with pytest.raises(ValueError, match="holds 2 blocks of 4 tokens"):
        build_dcp_batch([ScheduledRequest([0, 1], 0, 9)], 2, 2, 0, torch.device("cpu"))


def test_dcp_attention_on_two_threaded_ranks_equals_one_rank() -> None:
    g = torch.Generator().manual_seed(1)
    n, d, block = 11, 4, 2
    q_all = torch.randn(n, 4, d, generator=g)
    k, v = torch.randn(n, 1, d, generator=g), torch.randn(n, 1, d, generator=g)
    request = ScheduledRequest(block_ids=[0, 1, 2], start=0, num_tokens=n)

    def rank_fn(rank: int, group: Any) -> Any:
        cache = (torch.zeros(4 * block, 1, d), torch.zeros(4 * block, 1, d))
        batch = build_dcp_batch([request], block, 2, rank, torch.device("cpu"))
        heads = slice(2 * rank, 2 * rank + 2)
        return dcp_attention(q_all[:, heads], k, v, batch, cache, group, [2, 2], d ** -0.5)

    left, right = run_ranks(2, rank_fn)
    expected = reference_attention(q_all, k, v)
    torch.testing.assert_close(torch.cat((left, right), dim=1),
                               expected.reshape(n, 4 * d), atol=1e-5, rtol=0)


def test_a_dcp_group_must_share_one_kv_head() -> None:
    check_dcp_heads(9, 3, 6, 2)  # each KV head on two ranks: fine
    with pytest.raises(ValueError, match="same single KV head"):
        check_dcp_heads(9, 3, 2, 2)
    with pytest.raises(ValueError, match="must divide"):
        check_dcp_heads(9, 3, 3, 2)


# -- the model worker ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP=2 exceeds its single KV head: the layout DCP is for."""
    return save_random_llama(tmp_path_factory.mktemp("dcp1"), seed=3, num_attention_heads=4,
                             num_key_value_heads=1, hidden_size=64, intermediate_size=96,
                             max_position_embeddings=4096)


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("dcp2"), seed=4, num_attention_heads=8,
                             num_key_value_heads=2, hidden_size=64, intermediate_size=96,
                             max_position_embeddings=4096)


def requests(lengths: list[int], max_tokens: int = 6) -> dict[str, tuple[list[int], Any]]:
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return {f"r{n}": (torch.randint(4, 100, (n,), generator=g).tolist(), params)
            for n in lengths}


def run(model: Path, reqs: dict[str, Any], **layout: Any) -> dict[str, Any]:
    dcp = layout.get("dcp", 1)
    chunk = layout.pop("chunk", None)
    backend = "uni" if layout.get("tp", 1) * layout.get("pcp", 1) == 1 else "mp"
    with make_executor(model, backend=backend, num_blocks=1024, max_num_batched_tokens=4096,
                       **layout) as executor:
        runs = StepDriver(executor, fetch_logits=True, chunk=chunk,
                          block_tokens=BLOCK_SIZE * dcp).generate(reqs)
        if layout.get("pcp", 1) > 1:  # the prefills were really split
            assert min(executor.collective_rpc(lambda w: w.worker.pcp_split_steps)) > 0
    return runs


def assert_same(runs: dict[str, Any], reference: dict[str, Any]) -> None:
    for rid, ran in runs.items():
        assert ran.output == reference[rid].output, rid
        torch.testing.assert_close(torch.stack(ran.logits), torch.stack(reference[rid].logits),
                                   atol=ATOL, rtol=0)


@pytest.mark.slow
def test_tp2_dcp2_reproduces_tp1(one_kv_head: Path, leak_check: None) -> None:
    reqs = requests([1, 2, 7, 33, 300, 2000])
    reference = run(one_kv_head, reqs)
    assert_same(run(one_kv_head, reqs, tp=2, dcp=2), reference)
    assert_same(run(one_kv_head, reqs, tp=2, dcp=2, chunk=13), reference)  # chunked prefill


@pytest.mark.slow
def test_tp4_dcp2_with_two_kv_heads_reproduces_tp1(two_kv_heads: Path, leak_check: None) -> None:
    reqs = requests([5, 64])
    assert_same(run(two_kv_heads, reqs, tp=4, dcp=2), run(two_kv_heads, reqs))


def test_dcp_that_cannot_share_kv_heads_fails_start_up(two_kv_heads: Path,
                                                       leak_check: None) -> None:
    from mpexec.errors import WorkerStartupError

    with pytest.raises(WorkerStartupError, match="same single KV head"):
        make_executor(two_kv_heads, tp=2, dcp=2)


@pytest.mark.slow
def test_a_dcp_rank_killed_mid_decode_is_a_worker_death(one_kv_head: Path,
                                                        leak_check: None) -> None:
    with make_executor(one_kv_head, tp=2, dcp=2) as executor:
        driver = StepDriver(executor, block_tokens=BLOCK_SIZE * 2)
        driver.generate(requests([9], max_tokens=2))
        os.kill(executor.workers[1].pid, signal.SIGKILL)
        with pytest.raises(Exception) as info:
            driver.generate(requests([9], max_tokens=4))
        assert_rank_died(executor, info.value, 1)


@pytest.mark.slow
def test_a_dcp_rank_frozen_mid_decode_is_named_within_the_stop_bound(
        one_kv_head: Path, leak_check: None) -> None:
    """SIGSTOP, not SIGKILL: the survivor waits in the all-gather for a rank that
    will never answer; the executor sees the stopped state and names that rank
    long before the 120 s step deadline."""
    from mpexec.errors import WorkerStalledError

    with make_executor(one_kv_head, tp=2, dcp=2,
                       executor_fields={"worker_stopped_timeout_s": 1.0}) as executor:
        driver = StepDriver(executor, block_tokens=BLOCK_SIZE * 2)
        driver.generate(requests([9], max_tokens=2))
        os.kill(executor.workers[1].pid, signal.SIGSTOP)
        with pytest.raises(Exception) as info:
            driver.generate(requests([9], max_tokens=4))
        error = info.value
        if not isinstance(error, WorkerStalledError):
            error = death_behind(executor, error)
        assert isinstance(error, WorkerStalledError), info.value
        assert error.rank == 1 and error.seen == "stopped"


# -- through LLM: the scheduler counts blocks of block_size x DCP tokens ----------------


@pytest.fixture(scope="module")
def one_kv_head_llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpexec.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("dcp-llm") / "ckpt",
                                 num_attention_heads=4, num_key_value_heads=1)


def make_llm(path: Path, **kwargs: Any) -> Any:
    from mpexec import LLM

    return LLM(str(path), num_threads=1, max_num_batched_tokens=64, block_size=4,
               shutdown_grace_s=2.0, shutdown_term_s=2.0, **kwargs)


@pytest.mark.slow
def test_llm_with_dcp_preempts_resumes_and_admits_twice_the_context(
        one_kv_head_llm_dir: Path, leak_check: None) -> None:
    from mpexec import SamplingParams

    prompts = ["hello world", "the quick brown fox", "a", "one two three four five six"]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=20, ignore_eos=True)
              for t in (0, 0.8, 0, 1.0)]
    with make_llm(one_kv_head_llm_dir, executor_backend="uni") as reference:
        block_bytes = reference.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
        longest = max(len(reference.tokenizer.encode(p)) for p in prompts) + 20
        want = [o.token_ids for o in reference.generate(prompts, params)]
    # per rank, room for the longest request alone with DCP=2 (blocks of 8 tokens)
    blocks = -(-longest // 8) + 1
    with make_llm(one_kv_head_llm_dir, tensor_parallel_size=2, decode_context_parallel_size=2,
                  kv_cache_memory_bytes=blocks * block_bytes, max_num_seqs=4) as llm:
        assert llm.engine.num_blocks == blocks
        assert llm.engine.scheduler.limits.block_size == 8  # 4 tokens on each of 2 ranks
        outputs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == want


def test_a_profile_times_each_phase_of_dcp_attention_on_every_rank(
        one_kv_head_llm_dir: Path, tmp_path: Path, leak_check: None) -> None:
    from mpexec import SamplingParams

    with make_llm(one_kv_head_llm_dir, tensor_parallel_size=2,
                  decode_context_parallel_size=2) as llm:
        llm.start_profile(trace_dir=str(tmp_path / "trace"))
        llm.generate("hello world", SamplingParams(temperature=0, max_tokens=4))
        summaries = llm.stop_profile()
        with pytest.raises(Exception, match="no profile is running"):
            llm.stop_profile()
    assert [s.rank for s in summaries] == [0, 1]
    layers = 4  # write_tiny_checkpoint's default
    for summary in summaries:
        assert set(summary.spans) == {"dcp.gather_q", "dcp.attention", "dcp.gather_out",
                                      "dcp.merge"}
        # one prefill step and three decode steps, each through every layer
        assert {t.calls for t in summary.spans.values()} == {4 * layers}
        assert 0 < summary.share("dcp.") < 1
        assert summary.trace_path is not None and Path(summary.trace_path).stat().st_size > 0


@pytest.mark.slow
def test_smollm2_tp6_dcp2_reproduces_tp1(smollm2_gguf: Path, leak_check: None) -> None:
    """SmolLM2's 3 KV heads on 6 ranks: each KV head's two ranks split its tokens."""
    reqs = requests([3, 120], max_tokens=4)
    reference = run(smollm2_gguf, reqs)
    runs = run(smollm2_gguf, reqs, tp=6, dcp=2)
    for rid, ran in runs.items():
        assert ran.output == reference[rid].output, rid
        # 30 layers of a real model in float32: a few ulps more than the tiny one
        torch.testing.assert_close(torch.stack(ran.logits), torch.stack(reference[rid].logits),
                                   atol=2e-3, rtol=0)


# -- prefill context parallelism -------------------------------------------------------


def test_a_step_is_split_into_row_ranges_that_continue_each_prompt() -> None:
    from mpexec.models.prefill_parallel import rows_layout, split_step

    assert split_step(15, 2) is None  # small steps run whole on every rank
    assert split_step(40, 2) == [(0, 20), (20, 40)]
    layout = [ScheduledRequest([0], 0, 30), ScheduledRequest([1], 7, 1),
              ScheduledRequest([2], 4, 9)]  # rows 0-29, 30, 31-39
    assert rows_layout(layout, 20, 40) == [ScheduledRequest([0], 20, 10),
                                           ScheduledRequest([1], 7, 1),
                                           ScheduledRequest([2], 4, 9)]
    assert rows_layout(layout, 0, 20) == [ScheduledRequest([0], 0, 20)]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "pcp"), [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_pcp_reproduces_tp1(two_kv_heads: Path, tp: int, pp: int, pcp: int,
                            leak_check: None) -> None:
    reqs = requests([1, 5, 40, 300, 2000])
    reference = run(two_kv_heads, reqs)
    assert_same(run(two_kv_heads, reqs, tp=tp, pp=pp, pcp=pcp), reference)
    # chunked prefill: a chunk's rows continue a prompt on the second rank
    assert_same(run(two_kv_heads, reqs, tp=tp, pp=pp, pcp=pcp, chunk=37), reference)


def test_pcp_with_dcp_is_refused(two_kv_heads: Path, leak_check: None) -> None:
    from mpexec.errors import WorkerStartupError

    with pytest.raises(WorkerStartupError, match="cannot be combined"):
        make_executor(two_kv_heads, tp=4, dcp=2, pcp=2, backend="mp")


@pytest.mark.slow
def test_smollm2_pcp2_reproduces_tp1(smollm2_gguf: Path, leak_check: None) -> None:
    reqs = requests([3, 500], max_tokens=4)
    reference = run(smollm2_gguf, reqs)
    runs = run(smollm2_gguf, reqs, pcp=2)
    for rid, ran in runs.items():
        assert ran.output == reference[rid].output, rid
        torch.testing.assert_close(torch.stack(ran.logits), torch.stack(reference[rid].logits),
                                   atol=2e-3, rtol=0)


@pytest.mark.slow
def test_a_pcp_rank_killed_mid_prefill_is_a_worker_death(two_kv_heads: Path,
                                                         leak_check: None) -> None:
    from mpexec.outputs import NewRequestData, SchedulerOutput

    prompt = list(range(4, 100)) * 10
    with make_executor(two_kv_heads, pcp=2, num_blocks=300) as executor:
        output = SchedulerOutput(step=0)
        params = SamplingParams(temperature=0, max_tokens=1)
        output.scheduled_new_reqs.append(
            NewRequestData("long", prompt, params, list(range(-(-len(prompt) // BLOCK_SIZE)))))
        output.scheduled_tokens["long"] = prompt
        output.num_computed_tokens["long"] = 0
        future = executor.execute_model(output, non_block=True)
        os.kill(executor.workers[1].pid, signal.SIGKILL)
        with pytest.raises(Exception) as info:
            future.result(timeout=60)
            executor.sample_tokens(None)
        assert_rank_died(executor, info.value, 1)
