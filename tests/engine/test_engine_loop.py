"""The engine loop on the fake model worker: every executor, sync and async, layouts."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from mpexec.engine import Engine, EngineDeadError, FinishReason, Request
from mpexec.errors import WorkerDiedError, WorkerError
from mpexec.outputs import SamplingParams
from tests.engine.conftest import EOS, fake_limits
from tests.engine.fake_worker import reference_tokens

pytestmark = pytest.mark.usefixtures("leak_check")

PROMPTS = [[(5 * i + j) % 60 + 4 for j in range(3 + 7 * i)] for i in range(6)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0.8, seed=7, max_tokens=20),
    SamplingParams(temperature=1.0, max_tokens=9, stop_token_ids=[11, 12]),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.5, seed=1, max_tokens=16),
    SamplingParams(temperature=0, max_tokens=5),
]


def run_all(engine: Engine, steps_limit: int = 5000) -> list[Request]:
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    for _ in range(steps_limit):
        if not engine.has_unfinished_requests():
            return requests
        engine.step()
    raise AssertionError("the engine did not finish")


def expected() -> list[tuple[list[int], str]]:
    return [reference_tokens(p, s, eos_token_ids=EOS, max_model_len=128)
            for p, s in zip(PROMPTS, PARAMS, strict=True)]


LAYOUTS = [
    ("uni", 1, 1, False), ("uni", 1, 1, True),
    ("mp", 1, 1, False), ("mp", 1, 1, True),
    ("mp", 2, 1, False), ("mp", 2, 1, True),
    ("mp", 1, 2, False), ("mp", 1, 2, True),
    ("mp", 2, 2, True),
]


@pytest.mark.parametrize(("backend", "tp", "pp", "async_scheduling"), LAYOUTS)
def test_same_tokens_on_every_executor_and_layout(
        engine_factory: Callable[..., Engine], backend: str, tp: int, pp: int,
        async_scheduling: bool) -> None:
    engine = engine_factory(backend, tp, pp, async_scheduling)
    requests = run_all(engine)
    got = [(r.output_token_ids, r.finish_reason.value) for r in requests]
    assert got == expected()
    assert engine.scheduler.blocks.num_free_blocks == engine.num_blocks
    if not async_scheduling:
        assert engine.stats.executor_share is not None


def test_step_timings_keep_a_bounded_window_and_running_totals(
        engine_factory: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    import mpexec.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SYNC_STEP_WINDOW", 4)
    engine = engine_factory("uni", 1, 1, False)
    run_all(engine)
    stats = engine.stats
    assert stats.steps > 4
    assert len(stats.sync_step_s) == len(stats.sync_worker_s) == 4  # the last 4 steps
    assert stats.sync_step_total_s > sum(stats.sync_step_s) > 0  # every step
    assert stats.sync_worker_total_s >= sum(stats.sync_worker_s)
    assert stats.executor_share is not None


def test_async_keeps_two_steps_in_flight(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("mp", 1, 1, True)
    assert engine.max_steps_in_flight == 2 and engine.allow_placeholders
    seen = []
    original = engine._dispatch

    def spy(out):  # type: ignore[no-untyped-def]
        seen.append(len(engine._in_flight))
        original(out)

    engine._dispatch = spy  # type: ignore[method-assign]
    run_all(engine)
    assert 1 in seen  # a step went out while another was in flight


def test_pipeline_async_has_one_batch_per_stage(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("mp", 1, 2, True)
    assert engine.max_steps_in_flight == 2 and not engine.allow_placeholders
    engine_sync = engine_factory("uni", 1, 1, False)
    assert engine_sync.max_steps_in_flight == 1


def test_kv_cache_is_sized_from_the_workers(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("uni", kv_bytes=40 * 1024)
    assert engine.num_blocks == 40
    assert engine.limits.max_model_len == 128
    small = engine_factory("uni", kv_bytes=10 * 1024)
    assert small.num_blocks == 10 and small.limits.max_model_len == 40  # capped to the cache
    # never more blocks than max_num_seqs full-length requests could use
    big = engine_factory("uni", kv_bytes=10**9, limits=fake_limits(max_num_seqs=2))
    assert big.num_blocks == 2 * 128 // 4


def test_preemption_through_the_engine_gives_the_same_tokens(
        engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("mp", 1, 1, True, kv_bytes=14 * 1024)  # 14 blocks of 4 tokens
    requests = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    want = [reference_tokens(p, s, eos_token_ids=EOS, max_model_len=engine.limits.max_model_len)
            for p, s in zip(PROMPTS, PARAMS, strict=True)]
    assert [(r.output_token_ids, r.finish_reason.value) for r in requests] == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_worker_killed_mid_generation_fails_pending_requests(
        engine_factory: Callable[..., Engine], async_scheduling: bool) -> None:
    engine = engine_factory("mp", 2, 1, async_scheduling, die_at_step=6, fault_rank=1)
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    with pytest.raises(WorkerDiedError) as info:
        for _ in range(1000):
            engine.step()
    assert info.value.rank == 1
    # Started by the fork server (the driver has threads): the status must not be
    # the 255 of two threads racing for the server's status pipe.
    assert info.value.signal_name == "SIGKILL"
    assert engine.is_dead
    assert all(r.is_finished for r in requests)
    aborted = [r for r in requests if r.finish_reason is FinishReason.ABORT]
    assert aborted and all(r.error is info.value for r in aborted)
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2], SamplingParams())


def test_failure_callback_marks_an_idle_engine_dead(
        engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("mp", 2, 1, False)
    os.kill(engine.executor.workers[1].proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    assert engine._dead.wait(30)  # the executor's failure callback, not a call, noticed
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3], SamplingParams())


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_worker_error_reaches_the_caller_typed(engine_factory: Callable[..., Engine],
                                               backend: str) -> None:
    engine = engine_factory(backend, 1, 1, True, raise_at_step=3)
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    with pytest.raises(WorkerError, match="fake failure at step 3"):
        for _ in range(1000):
            engine.step()
    assert engine.is_dead and all(r.is_finished for r in requests)


def test_pipeline_micro_batches_share_the_requests(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory("mp", 1, 2, True, limits=fake_limits(max_num_batched_tokens=256))
    sizes = []
    original = engine._dispatch

    def spy(out):  # type: ignore[no-untyped-def]
        sizes.append(len(out.scheduled_tokens))
        original(out)

    engine._dispatch = spy  # type: ignore[method-assign]
    requests = run_all(engine)
    assert sizes[:2] == [3, 3]  # six requests over two stages
    assert [(r.output_token_ids, r.finish_reason.value) for r in requests] == expected()
