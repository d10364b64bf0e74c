"""MultiprocExecutor end to end: calls, pipelining, async scheduling, placement."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tests.executor.conftest import make_config

from mpexec.config import SchedulerConfig
from mpexec.executor import MultiprocExecutor
from mpexec.outputs import ModelRunnerOutput, SchedulerOutput

pytestmark = pytest.mark.usefixtures("leak_check")

ROOT = Path(__file__).resolve().parents[2]


def test_collective_rpc_shapes() -> None:
    with MultiprocExecutor(make_config(tp=2)) as ex:
        ranks = ex.collective_rpc("whoami")
        assert [r[:2] for r in ranks] == [(0, 0), (1, 1)]
        assert [r[2] for r in ranks] == [w.pid for w in ex.workers]
        assert ex.collective_rpc(lambda worker: worker.rank * 10) == [0, 10]
        assert ex.collective_rpc("add", args=(1,), kwargs={"b": 2}, unique_reply_rank=1) == 4
        future = ex.collective_rpc("echo", args=("x",), non_block=True)
        assert future.result(timeout=30) == ["x", "x"]
        ex.check_health()
        stats = ex.stats()
        assert stats["echo"].calls == 1 and stats["whoami"].calls == 1
        assert stats["echo"].p50_s <= stats["echo"].p99_s


def test_ten_thousand_outstanding_calls_resolve_in_order() -> None:
    # Far more calls than ring slots: without the driver draining replies
    # while it waits for broadcast space, this deadlocks.
    with MultiprocExecutor(make_config(tp=2, mq_max_chunks=4)) as ex:
        futures = [ex.collective_rpc("echo", args=(i,), non_block=True) for i in range(10_000)]
        assert futures[-1].result(timeout=120) == [9_999, 9_999]
        assert all(f.done() for f in futures)
        assert [f.result(timeout=0)[0] for f in futures] == list(range(10_000))


def test_execute_model_replies_from_the_last_pipeline_stage() -> None:
    with MultiprocExecutor(make_config(tp=1, pp=2)) as ex:
        assert ex.output_rank == 1
        assert ex.max_concurrent_batches == 2
        out = ex.execute_model(SchedulerOutput(step=3, scheduled_tokens={"r": [1]}))
        assert isinstance(out, ModelRunnerOutput)
        assert out.sampled_token_ids == [[1, 3]]
        assert ex.sample_tokens(None).sampled_token_ids == [[1]]
        assert ex.take_draft_token_ids().draft_token_ids == [[1]]
        ex.execute_dummy_batch()


def test_kv_aggregation_needs_every_worker() -> None:
    with MultiprocExecutor(make_config(tp=2, aggregate_kv_outputs=True)) as ex:
        step1 = SchedulerOutput(step=1, extra={"finished_sending_by_rank": {0: ["a", "b"],
                                                                            1: ["a"]}})
        out = ex.execute_model(step1)
        assert out.sampled_token_ids == [[0, 1]]  # rank 0's output
        assert out.kv_connector_output.finished_sending == {"a"}
        step2 = SchedulerOutput(step=2, extra={"finished_sending_by_rank": {1: ["b"]}})
        assert ex.execute_model(step2).kv_connector_output.finished_sending == {"b"}


def test_async_scheduling_path() -> None:
    config = make_config(tp=2, scheduler=SchedulerConfig(async_scheduling=True))
    with MultiprocExecutor(config) as ex:
        assert ex.max_concurrent_batches == 2
        assert ex.supports_async_scheduling()
        futures = [
            ex.execute_model(SchedulerOutput(step=i, extra={"async_output": True}),
                             non_block=True)
            for i in range(20)
        ]
        assert [f.result(timeout=30).sampled_token_ids for f in futures] == [
            [[0, i]] for i in range(20)]
        assert ex.collective_rpc("echo", args=(1,)) == [1, 1]


def test_spawn_start_method() -> None:
    with MultiprocExecutor(make_config(tp=1, mp_start_method="spawn")) as ex:
        assert ex.collective_rpc("echo", args=("spawned",)) == ["spawned"]


def test_cpu_affinity_and_omp_threads_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    pins = [[cpus[0]], [cpus[-1]]]
    config = make_config(tp=2, device_type="cpu", cpu_affinity=pins, omp_num_threads=[1, 2])
    with MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("affinity") == pins
        assert ex.collective_rpc("env", args=("OMP_NUM_THREADS",)) == ["1", "2"]
    assert "OMP_NUM_THREADS" not in os.environ


def test_failure_callback_runs_once_when_registered_before() -> None:
    calls: list[int] = []
    with MultiprocExecutor(make_config(tp=2)) as ex:
        ex.register_failure_callback(lambda: calls.append(1))
        os.kill(ex.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    assert calls == [1]


def test_queues_that_sleep_at_once_still_answer_every_call() -> None:
    # mq_spin_s=0: every wait, on both sides, goes straight to the futex.
    with MultiprocExecutor(make_config(tp=2, mq_spin_s=0.0)) as ex:
        assert ex.rpc_broadcast_mq is not None
        assert ex.rpc_broadcast_mq.transport._ring.spin_s == 0.0
        assert all(mq._ring.spin_s == 0.0 for mq in ex.response_mqs)
        for i in range(200):
            assert ex.collective_rpc("echo", args=(i,)) == [i, i]


class _CountsPickling:
    """Counts how often the driver pickles it (a class attribute: driver side only)."""

    dumps = 0

    def __reduce__(self) -> tuple[type, tuple[()]]:
        _CountsPickling.dumps += 1
        return (int, ())


def test_a_call_is_pickled_once_under_back_pressure() -> None:
    # One ring slot, every worker asleep: the next call waits for space while
    # the driver retries its enqueue; the retries must send the same bytes.
    with MultiprocExecutor(make_config(tp=2, mq_max_chunks=1)) as ex:
        sleeping = [ex.collective_rpc("sleep", args=(0.3,), non_block=True) for _ in range(3)]
        _CountsPickling.dumps = 0
        assert ex.collective_rpc("echo", args=(_CountsPickling(),), timeout=30) == [0, 0]
        assert _CountsPickling.dumps == 1
        for future in sleeping:
            future.result(timeout=30)
