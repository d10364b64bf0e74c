"""Data-parallel replicas behind one front end (``LLM(data_parallel_size=N)``).

On the fake model worker (no torch): outputs in the caller's order and equal
to one replica's (greedy and seeded), requests spread over the replicas,
and a replica whose worker is SIGKILLed mid-generate: with
``replica_restart`` no request is lost and every one finishes with the
tokens of an undisturbed run; without it, the typed error.  The model-level
checks (tiny dense and MoE checkpoints) are in tests/models/test_moe.py.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from mpexec.engine.dp import DataParallelEngine
from mpexec.engine.llm import LLM
from mpexec.errors import WorkerDiedError, WorkerStalledError
from mpexec.outputs import SamplingParams
from tests.engine.conftest import FAKE_WORKER
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(180)]
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i]} for i in range(8)]


def fake_llm(**kwargs: Any) -> LLM:
    worker_kwargs = {"block_size": 4, **kwargs.pop("worker_kwargs", {})}
    return LLM("fake", worker_cls=FAKE_WORKER, worker_kwargs=worker_kwargs,
               tokenizer=FakeTokenizer(), max_model_len=96, block_size=4,
               executor_backend="mp", shutdown_grace_s=2.0, shutdown_term_s=2.0, **kwargs)


def expected(params: SamplingParams) -> list[list[int]]:
    return [reference_tokens(p["prompt_token_ids"], params, eos_token_ids=(3,),
                             max_model_len=96)[0] for p in PROMPTS]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=12)])
def test_two_replicas_give_one_replicas_outputs_in_order(params: SamplingParams) -> None:
    with fake_llm(data_parallel_size=2) as llm:
        assert isinstance(llm.engine, DataParallelEngine) and len(llm.engine.replicas) == 2
        outputs = llm.generate(PROMPTS, params)
        per_replica = [e.stats.sampled_tokens for e in llm.engine.replicas]
        stats = llm.engine.stats
        step_totals = [e.stats.sync_step_total_s for e in llm.engine.replicas]
        assert not llm.engine._owner  # forgotten once finished
    assert stats.sync_step_total_s == pytest.approx(sum(step_totals)) and all(step_totals)
    assert [o.token_ids for o in outputs] == expected(params)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in PROMPTS]
    assert all(per_replica)  # both replicas got work
    assert stats.sampled_tokens == sum(len(o.token_ids) for o in outputs)


def _kill_replica_midway(llm: LLM, rank: int, after_tokens: int,
                         signum: int = signal.SIGKILL) -> Any:
    killed: list[int] = []

    def progress(finished: int, total: int, tokens: int) -> None:
        if not killed and tokens >= after_tokens:
            pid = llm.engine.replicas[rank].executor.workers[0].proc.pid
            os.kill(pid, signum)
            killed.append(pid)

    return progress, killed


@pytest.mark.slow
def test_killed_replica_is_restarted_and_loses_no_request() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fake_llm(data_parallel_size=2, replica_restart=True,
                  worker_kwargs={"step_delay_s": 0.01}) as llm:
        llm.engine.backoff_s = 0.1
        progress, killed = _kill_replica_midway(llm, 1, after_tokens=20)
        outputs = llm.generate(PROMPTS, params, progress=progress)
        failover = llm.engine.failover
        # the rebuild runs in the background (forkserver start under load):
        # wait for it, bounded, then the rebuilt replica serves again
        deadline = time.monotonic() + 90
        while not failover.restarts and time.monotonic() < deadline:
            time.sleep(0.1)
        assert failover.restarts == 1, failover.events
        again = llm.generate(PROMPTS, params)
        assert llm.engine.replicas[1].stats.sampled_tokens > 0
    assert killed
    want = [reference_tokens(p["prompt_token_ids"], params, eos_token_ids=(3,),
                             max_model_len=96)[0] for p in PROMPTS]
    assert [o.token_ids for o in outputs] == want
    assert [o.token_ids for o in again] == want
    assert failover.failures == 1 and failover.requeued_requests >= 1
    assert failover.restarts == 1 and "DP rank 1 failed (WorkerDiedError" in failover.events[0]


@pytest.mark.slow
def test_killed_replica_without_restart_is_the_typed_error() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fake_llm(data_parallel_size=2, worker_kwargs={"step_delay_s": 0.01}) as llm:
        progress, killed = _kill_replica_midway(llm, 1, after_tokens=20)
        with pytest.raises(WorkerDiedError):
            llm.generate(PROMPTS, params, progress=progress)
        assert killed and llm.engine.is_dead


@pytest.mark.slow
def test_hung_replica_fails_over_within_the_stopped_bound() -> None:
    """A worker SIGSTOPped mid-generate (hung, not dead): the executor's stall
    watch names it after ``worker_stopped_timeout_s`` and kills it, the replica
    fails over like a dead one, and every request finishes with its tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fake_llm(data_parallel_size=2, replica_restart=True, worker_stopped_timeout_s=1.0,
                  worker_kwargs={"step_delay_s": 0.01}) as llm:
        llm.engine.backoff_s = 0.1
        progress, stopped = _kill_replica_midway(llm, 1, 20, signal.SIGSTOP)
        started = time.monotonic()
        outputs = llm.generate(PROMPTS, params, progress=progress)
        took = time.monotonic() - started
        failover = llm.engine.failover
    assert stopped and [o.token_ids for o in outputs] == expected(params)
    assert failover.failures == 1 and failover.requeued_requests >= 1
    assert "DP rank 1 failed (WorkerStalledError" in failover.events[0], failover.events
    assert took < 60  # the stopped bound (1 s) plus a tick, not the step deadline (60 s)


@pytest.mark.slow
def test_hung_replica_without_restart_is_the_typed_error() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fake_llm(data_parallel_size=2, worker_stopped_timeout_s=1.0,
                  worker_kwargs={"step_delay_s": 0.01}) as llm:
        progress, stopped = _kill_replica_midway(llm, 1, 20, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerStalledError, match="has been stopped"):
            llm.generate(PROMPTS, params, progress=progress)
        assert time.monotonic() - started < 60 and stopped and llm.engine.is_dead


def test_lockstep_failure_names_the_rank_that_died_not_its_peers() -> None:
    from mpexec.errors import WorkerError, root_failure

    peer = WorkerError("rank 0 raised PeerDiedInCollectiveError", rank=0, pid=2,
                       method="execute_model", exc_type="PeerDiedInCollectiveError",
                       remote_traceback="")
    stalled = WorkerStalledError("worker rank 0 has been stopped", rank=0, pid=1,
                                 seen="stopped")
    assert root_failure([peer, stalled]) is stalled
    assert root_failure([peer]) is peer


def test_absurd_layouts_are_refused_up_front(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="steps the replicas in lockstep: it needs"):
        LLM("default", data_parallel_size=2, enable_expert_parallel=True,
            async_scheduling=True)
    # Replicas across nodes (tests/multinode/test_dp_nodes.py) need the port
    # their nodes dial, and a layout where nodes and replicas divide evenly.
    with pytest.raises(ValueError, match="needs master_port"):
        LLM("default", data_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match=r"nnodes \(3\) must be a multiple of data_parallel"):
        LLM("default", data_parallel_size=2, nnodes=3, master_port=29500)
    with pytest.raises(ValueError, match="replicas on other nodes need executor_backend 'mp'"):
        LLM("default", data_parallel_size=2, nnodes=2, master_port=29500,
            executor_backend="ray")


def test_asyncio_engine_over_two_replicas() -> None:
    """AsyncLLM drives the data-parallel front end as it drives one engine."""
    import asyncio

    from mpexec.engine.async_llm import AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=12)

    async def main(engine: AsyncLLM) -> list[list[int]]:
        async def one(prompt: dict[str, Any]) -> list[int]:
            outs = [o async for o in engine.generate(prompt, params)]
            return list(outs[-1].token_ids)

        loads = engine.load()
        assert loads["running"] == 0 and loads["kv_cache_usage"] == 0
        return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 60))

    with AsyncLLM(llm=fake_llm(data_parallel_size=2)) as engine:
        results = asyncio.run(main(engine))
    assert results == expected(params)


def test_the_failed_replicas_teardown_aborts_none_of_the_requests_it_hands_over() -> None:
    """A replica failed over while its scheduler still holds requests (it
    died idle, or its DP group join failed): they are re-queued on the
    survivor, and the failed replica's teardown (``Engine.shutdown``, which
    aborts what its scheduler holds) must not finish them.  It used to: a
    waiting request came back ABORTed, a running one crashed the teardown
    thread on ``deque.remove``."""
    from mpexec.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with fake_llm(data_parallel_size=2, replica_restart=True) as llm:
        engine = llm.engine
        engine.backoff_s = 30.0  # the failed replica stays down during the test
        failed = engine.replicas[1]
        held = [Request(f"held-{i}", list(p["prompt_token_ids"]), params)
                for i, p in enumerate(PROMPTS[:3])]
        for request in held:
            failed.scheduler.add_request(request)
        engine._fail_over([(1, failed, held, RuntimeError("test: replica 1 failed"))])
        engine._teardowns[1].join(30)
        assert not engine._teardowns[1].is_alive()
        states = [(r.is_finished, r.finish_reason) for r in held]
    assert states == [(False, None)] * 3, states  # (the shutdown after aborts them)


def test_a_replica_that_dies_while_the_server_is_idle_is_rebuilt_without_a_request() -> None:
    """AsyncLLM's loop sleeps while nothing runs; the dead listener wakes it and
    it steps once to fail the replica over, so the rebuild starts at once
    (it used to wait for the next request) and later requests find both
    replicas serving."""
    import asyncio

    from mpexec.engine.async_llm import AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=12)

    async def one(engine: AsyncLLM, prompt: dict[str, Any]) -> list[int]:
        outs = [o async for o in engine.generate(prompt, params)]
        return list(outs[-1].token_ids)

    async def all_of(engine: AsyncLLM) -> list[list[int]]:
        return list(await asyncio.wait_for(
            asyncio.gather(*(one(engine, p) for p in PROMPTS)), 60))

    with AsyncLLM(llm=fake_llm(data_parallel_size=2, replica_restart=True)) as engine:
        dp = engine.engine
        assert isinstance(dp, DataParallelEngine)
        dp.backoff_s = 0.0
        os.kill(dp.replicas[1].executor.workers[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while dp.failover.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        failover = dp.failover
        assert failover.failures == 1 and failover.restarts == 1, failover.events
        assert failover.requeued_requests == 0
        results = asyncio.run(all_of(engine))
        served = [e.stats.sampled_tokens for e in dp.replicas]
    assert results == expected(params)
    assert all(served), served  # the rebuilt replica took work


def test_a_request_that_waits_for_a_rebuilt_replica_is_built_as_any_other() -> None:
    """With every replica down, a request waits in the front end; it is checked
    and given its stop strings as a replica would (it used to be a bare
    Request: its stop strings and constraint were lost, its token ids unchecked)."""
    params = SamplingParams(temperature=0, max_tokens=4, stop=["xyz"])
    with fake_llm(data_parallel_size=2, replica_restart=True) as llm:
        engine = llm.engine
        engine.backoff_s = 30.0  # both stay down during the test
        engine._fail_over([(rank, e, [], RuntimeError("test: down"))
                           for rank, e in enumerate(engine.replicas)])
        waiting = engine.add_request([5, 6, 7], params)
        with pytest.raises(ValueError, match="logit_bias: token id"):
            engine.add_request([5], SamplingParams(logit_bias={10**9: 1.0}))
        assert engine._orphans == [waiting] and waiting.stop_text is not None
        for thread in engine._teardowns.values():
            thread.join(30)
