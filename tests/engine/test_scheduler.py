"""Scheduler unit tests: pure Python, no processes, no torch.

A step's output is produced by the fake model worker run in this process
(``drive``), which also checks every SchedulerOutput it is given.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings, strategies as st

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.engine.block_manager import BlockManager, blocks_for
from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.engine.scheduler import Scheduler, SchedulerLimits
from mpexec.executor import WorkerContext
from mpexec.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SamplingParams
from tests.engine.fake_worker import FakeModelWorker, reference_tokens

BLOCK = 4


def fake_worker(num_blocks: int, pp: int = 1) -> FakeModelWorker:
    config = ExecutorConfig(worker_cls=FakeModelWorker,
                            parallel=ParallelConfig(pipeline_parallel_size=pp))
    rank = pp - 1  # the output rank: first TP rank of the last stage
    context = WorkerContext(config=config, rank=rank, local_rank=rank, rpc_rank=rank,
                            world_size=pp, local_world_size=pp,
                            distributed_init_method="tcp://127.0.0.1:1", backend="gloo",
                            device="cpu", is_driver_worker=True)
    worker = FakeModelWorker(context, block_size=BLOCK)
    worker.initialize_cache(num_blocks)
    return worker


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, budget: int = 64,
                   max_num_seqs: int = 8, eos: tuple[int, ...] = ()) -> Scheduler:
    limits = SchedulerLimits(max_model_len=max_model_len, max_num_batched_tokens=budget,
                             max_num_seqs=max_num_seqs, block_size=BLOCK)
    return Scheduler(limits, num_blocks, eos)


def request(req_id: str, prompt_len: int, max_tokens: int = 8, **params: object) -> Request:
    prompt = [(7 * i + len(req_id)) % 50 + 1 for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


def drive(scheduler: Scheduler, depth: int = 1, pp: int = 1, max_steps: int = 10_000,
          worker: FakeModelWorker | None = None) -> list[int]:
    """Run to completion with up to ``depth`` steps in flight; tokens per step."""
    worker = worker or fake_worker(scheduler.blocks.num_blocks, pp)
    in_flight: deque = deque()
    per_step = []
    for _ in range(max_steps):
        while len(in_flight) < depth:
            out = scheduler.schedule(allow_placeholders=pp == 1)
            if out is None:
                break
            assert out.total_num_scheduled_tokens <= scheduler.limits.max_num_batched_tokens
            per_step.append(out.total_num_scheduled_tokens)
            worker.execute_model(out)
            in_flight.append((out, worker.sample_tokens(None)))
        if not in_flight:
            assert not scheduler.has_unfinished_requests()
            return per_step
        out, result = in_flight.popleft()
        scheduler.update_from_output(out, result)
    raise AssertionError("did not finish")


def test_block_manager_counts_and_rejects_double_free() -> None:
    manager = BlockManager(4, 16)
    assert blocks_for(17, 16) == 2 and blocks_for(0, 16) == 0
    a = manager.allocate("a", 3)
    assert a == [0, 1, 2] and manager.num_free_blocks == 1
    assert not manager.can_allocate(2)
    with pytest.raises(RuntimeError):
        manager.allocate("b", 2)
    with pytest.raises(RuntimeError, match="held by a"):
        manager.free("b", [0])
    manager.free("a", a)
    assert manager.num_free_blocks == 4


def test_token_budget_and_chunked_prefill() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(request("long", 40))
    scheduler.add_request(request("short", 5))
    first = scheduler.schedule()
    assert first is not None
    assert first.scheduled_tokens == {"long": first.scheduled_new_reqs[0].prompt_token_ids[:16]}
    assert first.new_block_ids == {}  # a new request's table is in NewRequestData
    assert first.scheduled_new_reqs[0].block_ids == [0, 1, 2, 3]
    # a partial chunk does not sample: an empty output is fine
    scheduler.update_from_output(first, ModelRunnerOutput())
    second = scheduler.schedule()
    assert second is not None
    assert second.num_computed_tokens == {"long": 16}
    assert len(second.scheduled_tokens["long"]) == 16
    assert second.new_block_ids == {"long": [4, 5, 6, 7]}


def test_budget_is_never_exceeded_and_every_request_matches_the_reference() -> None:
    scheduler = make_scheduler(budget=24, max_num_seqs=3)
    reqs = [request(f"r{i}", 3 + 5 * i, max_tokens=6 + i) for i in range(6)]
    for r in reqs:
        scheduler.add_request(r)
    drive(scheduler)
    for r in reqs:
        expected, reason = reference_tokens(r.prompt_token_ids, r.sampling_params)
        assert r.output_token_ids == expected and r.finish_reason.value == reason
    assert scheduler.blocks.num_free_blocks == 64


def test_max_num_seqs_bounds_the_running_queue() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", 3))
    out = scheduler.schedule()
    assert out is not None and len(out.scheduled_new_reqs) == 2
    assert len(scheduler.waiting) == 2


def test_preemption_by_recompute_then_resume_with_generated_tokens() -> None:
    # 6 blocks of 4 slots: two requests of 8-token prompts growing to 20 cannot both fit
    scheduler = make_scheduler(num_blocks=6, budget=64)
    a, b = request("a", 8, max_tokens=12), request("b", 8, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    worker = fake_worker(6)
    resumed = []
    original_execute = worker.execute_model

    def spy(out):  # type: ignore[no-untyped-def]
        for new in out.scheduled_new_reqs:
            if new.req_id in {"a", "b"} and len(new.prompt_token_ids) > 8:
                resumed.append((new.req_id, list(new.prompt_token_ids), set(out.finished_req_ids)))
        original_execute(out)

    worker.execute_model = spy  # type: ignore[method-assign]
    drive(scheduler, worker=worker)
    assert scheduler.num_preemptions >= 1
    assert b.num_preemptions >= 1  # the later arrival is preempted first
    req_id, prompt, _ = resumed[0]
    assert req_id == "b" and prompt[:8] == b.prompt_token_ids and len(prompt) > 8
    for r in (a, b):
        expected, _ = reference_tokens(r.prompt_token_ids, r.sampling_params)
        assert r.output_token_ids == expected
    assert scheduler.blocks.num_free_blocks == 6


def test_preempted_request_is_forgotten_by_workers_first() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a, b = request("a", 8, max_tokens=12), request("b", 8, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    forgotten_at = None
    step = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out is not None
        if "b" in out.finished_req_ids and forgotten_at is None:
            forgotten_at = step
            assert "b" not in out.scheduled_tokens
        tokens = {r: [1] for r in out.scheduled_tokens}
        ids = [r for r in out.scheduled_tokens
               if out.num_computed_tokens[r] + len(out.scheduled_tokens[r])
               >= scheduler.requests[r].num_tokens]
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[tokens[r] for r in ids]))
        step += 1
    assert forgotten_at is not None


def test_stop_conditions() -> None:
    scheduler = make_scheduler(eos=(3,))
    prompt = [5, 6]
    eos_req = Request("eos", prompt, SamplingParams(max_tokens=100))
    ignore = Request("ignore", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    stop = Request("stop", prompt, SamplingParams(max_tokens=100, stop_token_ids=[9]))
    for r in (eos_req, ignore, stop):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert out is not None
    changed = scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=["eos", "ignore", "stop"], sampled_token_ids=[[3], [3], [4]]))
    assert [r.req_id for r in changed] == ["eos", "ignore", "stop"]
    assert eos_req.finish_reason is FinishReason.STOP and eos_req.output_token_ids == [3]
    assert not ignore.is_finished and not stop.is_finished
    out = scheduler.schedule()
    assert out is not None and out.finished_req_ids == {"eos"}
    assert out.scheduled_tokens == {"ignore": [3], "stop": [4]}
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=["ignore", "stop"], sampled_token_ids=[[1], [9]]))
    assert stop.finish_reason is FinishReason.STOP
    while (out := scheduler.schedule()) is not None:
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["ignore"],
                                                            sampled_token_ids=[[3]]))
    assert ignore.finish_reason is FinishReason.LENGTH and len(ignore.output_token_ids) == 5


def test_max_model_len_ends_with_length() -> None:
    scheduler = make_scheduler(max_model_len=12)
    r = request("r", 9, max_tokens=100)
    scheduler.add_request(r)
    drive(scheduler)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 12


@pytest.mark.parametrize("prompt_len", [0, 12, 13])
def test_requests_that_can_never_run_are_refused(prompt_len: int) -> None:
    scheduler = make_scheduler(max_model_len=12)
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_request(request("r", prompt_len))


def test_async_depth_two_sends_placeholders_and_gives_the_same_tokens() -> None:
    def run(depth: int) -> list[list[int]]:
        scheduler = make_scheduler(budget=20, num_blocks=12)
        reqs = [request(f"r{i}", 4 + 3 * i, max_tokens=7) for i in range(5)]
        for r in reqs:
            scheduler.add_request(r)
        drive(scheduler, depth=depth)
        assert scheduler.blocks.num_free_blocks == 12
        return [r.output_token_ids for r in reqs]

    assert run(2) == run(1)


def test_placeholder_stands_for_the_token_in_flight() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(request("r", 3))
    first = scheduler.schedule()
    second = scheduler.schedule()  # first is still in flight
    assert first is not None and second is not None
    assert second.scheduled_tokens == {"r": [PLACEHOLDER_TOKEN_ID]}
    assert second.num_computed_tokens == {"r": 3}
    # without placeholders (PP > 1) a request with a step in flight waits
    assert scheduler.schedule(allow_placeholders=False) is None


def test_pipeline_micro_batches_hold_disjoint_requests() -> None:
    scheduler = make_scheduler(budget=8)
    reqs = [request(f"r{i}", 6, max_tokens=5) for i in range(4)]
    for r in reqs:
        scheduler.add_request(r)
    a = scheduler.schedule(allow_placeholders=False)
    b = scheduler.schedule(allow_placeholders=False)
    assert a is not None and b is not None
    assert not set(a.scheduled_tokens) & set(b.scheduled_tokens)
    scheduler2 = make_scheduler(budget=8)
    reqs2 = [request(f"r{i}", 6, max_tokens=5) for i in range(4)]
    for r in reqs2:
        scheduler2.add_request(r)
    drive(scheduler2, depth=2, pp=2)
    assert [r.output_token_ids for r in reqs2] == [
        reference_tokens(r.prompt_token_ids, r.sampling_params)[0] for r in reqs2]


def test_async_preemption_and_early_stop_keep_tokens_right() -> None:
    def run(depth: int) -> list[list[int]]:
        scheduler = make_scheduler(num_blocks=7, budget=16, eos=(5, 11))
        reqs = [request(f"r{i}", 5 + i, max_tokens=14) for i in range(4)]
        for r in reqs:
            scheduler.add_request(r)
        drive(scheduler, depth=depth)
        assert scheduler.num_preemptions > 0
        assert scheduler.blocks.num_free_blocks == 7
        return [r.output_token_ids for r in reqs]

    assert run(2) == run(1)


def test_abort_frees_blocks_and_tells_workers() -> None:
    scheduler = make_scheduler()
    r = request("r", 10)
    scheduler.add_request(r)
    waiting = request("w", 3)
    out = scheduler.schedule()
    scheduler.add_request(waiting)
    assert out is not None
    scheduler.abort_request("r")
    scheduler.abort_request("w")
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORT
    assert scheduler.blocks.num_free_blocks == 64
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[1]]))
    assert r.output_token_ids == []  # the late token of an aborted request is dropped
    scheduler.add_request(request("x", 2))
    nxt = scheduler.schedule()
    assert nxt is not None and nxt.finished_req_ids == {"r"}


def test_missing_token_for_a_sampling_request_is_an_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(request("r", 3))
    out = scheduler.schedule()
    assert out is not None
    with pytest.raises(RuntimeError, match="no token for r"):
        scheduler.update_from_output(out, ModelRunnerOutput())


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 30), min_size=1, max_size=7),
    max_tokens=st.lists(st.integers(1, 20), min_size=7, max_size=7),
    budget=st.integers(1, 40),
    extra_blocks=st.integers(0, 20),
    max_num_seqs=st.integers(1, 5),
    depth=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
)
def test_any_mix_gives_the_reference_tokens(prompt_lens: list[int], max_tokens: list[int],
                                            budget: int, extra_blocks: int,
                                            max_num_seqs: int, depth: int, pp: int) -> None:
    max_model_len = 40
    num_blocks = blocks_for(max_model_len, BLOCK) + extra_blocks  # one request always fits
    scheduler = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len,
                               budget=budget, max_num_seqs=max_num_seqs, eos=(5,))
    reqs = [request(f"r{i}", n, max_tokens=max_tokens[i], seed=i, temperature=1.0)
            for i, n in enumerate(prompt_lens)]
    for r in reqs:
        scheduler.add_request(r)
    drive(scheduler, depth=depth if pp == 1 else pp, pp=pp)
    for r in reqs:
        want = reference_tokens(r.prompt_token_ids, r.sampling_params, eos_token_ids=(5,),
                                max_model_len=max_model_len)
        assert (r.output_token_ids, r.finish_reason.value) == want
    assert scheduler.blocks.num_free_blocks == num_blocks
    assert not scheduler.running and not scheduler.waiting


def test_prompt_logprob_chunks_append_in_order_and_repeats_are_dropped() -> None:
    from mpexec.engine.scheduler import _add_prompt_logprobs
    from mpexec.outputs import LogprobsRow

    req = request("p", 10, prompt_logprobs=0)

    def rows(first: int, count: int) -> list[LogprobsRow]:
        return [LogprobsRow(p, -float(p), 1, [], []) for p in range(first, first + count)]

    _add_prompt_logprobs(req, 1, rows(1, 4))  # positions 1-4 (first chunk)
    _add_prompt_logprobs(req, 1, rows(1, 4))  # recomputed after a preemption
    _add_prompt_logprobs(req, 5, rows(5, 5))  # positions 5-9
    _add_prompt_logprobs(req, 3, rows(3, 7))  # a resumed request scores them again
    assert [r.token_id for r in req.prompt_logprobs] == list(range(1, 10))


def test_min_tokens_stop_ids_go_to_the_workers_until_min_tokens() -> None:
    scheduler = make_scheduler(eos=(3,))
    scheduler.add_request(request("a", 4, min_tokens=2, stop_token_ids=[9, 3]))
    scheduler.add_request(request("b", 4, min_tokens=2, ignore_eos=True, stop_token_ids=[9]))
    scheduler.add_request(request("c", 4))
    out = scheduler.schedule()
    assert out is not None
    sent = {new.req_id: new for new in out.scheduled_new_reqs}
    assert sent["a"].min_tokens_stop_ids == [3, 9]
    assert sent["b"].min_tokens_stop_ids == [9]
    assert sent["c"].min_tokens_stop_ids == []
    assert all(new.num_prompt_tokens == 4 for new in sent.values())
