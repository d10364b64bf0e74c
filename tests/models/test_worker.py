"""ModelWorker through the real executors, on the tiny checkpoint.

Tolerance on logits (1e-4 absolute, float32): the layouts differ from TP=1
only in summation order (partial sums across ranks, split matmuls), a few
float32 ulps per layer on logits of magnitude ~1-10; see test_model_layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.model_run_driver import StepDriver, make_executor  # noqa: E402

from mpexec.errors import WorkerError  # noqa: E402
from mpexec.outputs import (  # noqa: E402
    GrammarOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def prompts(count: int = 3) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {f"r{i}": torch.randint(4, 389, (5 + 4 * i,), generator=g).tolist()
            for i in range(count)}


def greedy_requests(params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], Any]]:
    return {rid: (prompt, params) for rid, prompt in prompts().items()}


@pytest.fixture(scope="module")
def reference_run(tiny_checkpoint: Path) -> dict[str, Any]:
    """TP=1 in this process: the baseline every layout must reproduce."""
    with make_executor(tiny_checkpoint, backend="uni") as executor:
        return StepDriver(executor, fetch_logits=True).generate(greedy_requests())


def test_tp1_reproduces_transformers(tiny_checkpoint: Path, reference_run: Any) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32).eval()
    for rid, prompt in prompts().items():
        run = reference_run[rid]
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      min_new_tokens=10)[0, len(prompt):].tolist()
            logits = model(torch.tensor([prompt + run.output])).logits[0]
        assert run.output == expected
        sampled_rows = logits[len(prompt) - 1:len(prompt) - 1 + len(run.output)]
        torch.testing.assert_close(torch.stack(run.logits), sampled_rows, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "partition"), [
    (2, 1, None), (3, 1, None), (1, 2, [1, 3]), (2, 2, None)])
def test_parallel_layouts_reproduce_tp1(tiny_checkpoint: Path, reference_run: Any, tp: int,
                                        pp: int, partition: list[int] | None,
                                        leak_check: None) -> None:
    with make_executor(tiny_checkpoint, tp=tp, pp=pp, pp_layer_partition=partition) as executor:
        # placeholders only where the protocol allows them (PP == 1)
        runs = StepDriver(executor, fetch_logits=True, placeholders=pp == 1,
                          chunk=6).generate(greedy_requests())
    for rid, run in runs.items():
        assert run.output == reference_run[rid].output
        torch.testing.assert_close(torch.stack(run.logits), torch.stack(reference_run[rid].logits),
                                   atol=ATOL, rtol=0)


def test_uni_and_mp_give_identical_outputs(tiny_checkpoint: Path, reference_run: Any,
                                           leak_check: None) -> None:
    with make_executor(tiny_checkpoint) as executor:
        runs = StepDriver(executor, fetch_logits=True).generate(greedy_requests())
    for rid, run in runs.items():
        assert run.output == reference_run[rid].output
        assert torch.equal(torch.stack(run.logits), torch.stack(reference_run[rid].logits))


def test_chunked_prefill_and_placeholders_change_nothing(tiny_checkpoint: Path,
                                                         reference_run: Any) -> None:
    with make_executor(tiny_checkpoint, backend="uni") as executor:
        runs = StepDriver(executor, fetch_logits=True, chunk=3,
                          placeholders=True).generate(greedy_requests())
    for rid, run in runs.items():
        assert run.output == reference_run[rid].output
        torch.testing.assert_close(torch.stack(run.logits),
                                   torch.stack(reference_run[rid].logits), atol=ATOL, rtol=0)


def test_seeded_sampling_ignores_the_batch(tiny_checkpoint: Path) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.2, top_p=0.95, top_k=50, seed=seed, max_tokens=8,
                              logprobs=True)

    requests = {rid: (prompt, params(i)) for i, (rid, prompt) in enumerate(prompts(4).items())}
    with make_executor(tiny_checkpoint, backend="uni") as executor:
        together = StepDriver(executor).generate(requests)
        driver = StepDriver(executor, first_block=64)
        alone = {rid: driver.generate({rid: request})[rid] for rid, request in requests.items()}
        unseeded = StepDriver(executor, first_block=32).generate(
            {rid: (prompts()["r0"], SamplingParams(temperature=1.0, max_tokens=8))
             for rid in ("x", "y")})
    for rid in requests:
        assert together[rid].output == alone[rid].output
        assert together[rid].logprobs == pytest.approx(alone[rid].logprobs, abs=1e-5)
        assert len(together[rid].logprobs) == 8
    # seed None: the worker's seed mixed with the request id, so two requests
    # with the same prompt do not draw the same tokens
    assert len(unseeded["x"].output) == 8 and unseeded["x"].output != unseeded["y"].output


def test_grammar_bitmask_limits_the_tokens(tiny_checkpoint: Path) -> None:
    allowed = [7, 40, 388]
    words = torch.zeros(1, (389 + 31) // 32, dtype=torch.int64)
    for token in allowed:
        words[0, token // 32] |= 1 << (token % 32)
    grammar = GrammarOutput(["r1"], words.to(torch.int32).numpy())
    requests = {"r0": (prompts()["r0"], SamplingParams(temperature=1.0, max_tokens=6, seed=1)),
                "r1": (prompts()["r1"], SamplingParams(temperature=1.0, max_tokens=6, seed=1))}
    with make_executor(tiny_checkpoint, backend="uni") as executor:
        runs = StepDriver(executor).generate(requests, grammar=grammar)
    assert set(runs["r1"].output) <= set(allowed)
    assert not set(runs["r0"].output) <= set(allowed)


@pytest.mark.slow
def test_pipeline_runs_two_micro_batches_in_flight(tiny_checkpoint: Path, reference_run: Any,
                                                   leak_check: None) -> None:
    plain = prompts()
    with make_executor(tiny_checkpoint, pp=2) as executor:
        assert executor.max_concurrent_batches == 2
        steps = [SchedulerOutput(step=i, scheduled_new_reqs=[
            NewRequestData(rid, plain[rid], GREEDY, list(range(8 * i, 8 * i + 8)))],
            scheduled_tokens={rid: plain[rid]}, num_computed_tokens={rid: 0})
            for i, rid in enumerate(["r0", "r2"])]
        # both forwards are queued before either sample: stage 0 runs the second
        # micro-batch while stage 1 still holds the first
        futures = [executor.execute_model(steps[0], non_block=True),
                   executor.execute_model(steps[1], non_block=True),
                   executor.sample_tokens(None, non_block=True),
                   executor.sample_tokens(None, non_block=True)]
        first, second = (f.result(timeout=60) for f in futures[2:])
    assert first.req_ids == ["r0"] and second.req_ids == ["r2"]
    assert first.sampled_token_ids[0][0] == reference_run["r0"].output[0]
    assert second.sampled_token_ids[0][0] == reference_run["r2"].output[0]
    assert first.extra["worker_execute_s"] > 0 and "worker_sample_s" in first.extra


@pytest.mark.slow
def test_health_warm_up_and_drafts_on_two_ranks(tiny_checkpoint: Path, leak_check: None) -> None:
    repeating = [5, 6, 7, 8, 5, 6, 7]
    lookup = {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
              "draft_by_match": False}
    with make_executor(tiny_checkpoint, tp=2, speculative_config=lookup) as executor:
        executor.check_health()
        executor.execute_dummy_batch()
        executor.execute_model(SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("a", repeating, GREEDY, [0, 1])],
            scheduled_tokens={"a": repeating}, num_computed_tokens={"a": 0}))
        sampled = executor.sample_tokens(None).sampled_token_ids[0][0]
        drafts = executor.take_draft_token_ids()
        sizes = executor.collective_rpc("kv_cache_block_bytes")
    assert drafts is not None and drafts.req_ids == ["a"]
    # the history ends ... 7, <sampled>; prompt lookup proposes what followed
    # the latest earlier match of its suffix
    history = [*repeating, sampled]
    from mpexec.models.ngram import propose

    assert drafts.draft_token_ids == [propose(history, num_draft=3, max_n=3, min_n=1)]
    assert drafts.draft_token_ids[0]
    # 9 heads / 3 KV heads on 2 ranks: 2 + 1 KV heads, so the blocks cost 2:1
    assert sizes[0] == 2 * sizes[1]


def test_bad_steps_and_configs_are_named(tiny_checkpoint: Path) -> None:
    with make_executor(tiny_checkpoint, backend="uni") as executor:
        with pytest.raises(WorkerError, match="never received its NewRequestData"):
            executor.execute_model(SchedulerOutput(scheduled_tokens={"ghost": [1]}))
        too_far = NewRequestData("big", [1, 2, 3], GREEDY, [0])
        with pytest.raises(WorkerError, match="block table holds 1 blocks"):
            executor.execute_model(SchedulerOutput(
                scheduled_new_reqs=[too_far], scheduled_tokens={"big": [1, 2, 3, 4, 5]},
                num_computed_tokens={"big": 0}))
        outside = NewRequestData("odd", [1, 389], GREEDY, [0])
        with pytest.raises(WorkerError, match=r"token id 389 is outside the vocabulary \[0, 389\)"):
            executor.execute_model(SchedulerOutput(
                scheduled_new_reqs=[outside], scheduled_tokens={"odd": [1, 389]},
                num_computed_tokens={"odd": 0}))
    with pytest.raises(Exception, match="dtype must be"):
        make_executor(tiny_checkpoint, backend="uni", dtype="int8")
