"""Small parts: termination policy (fake clock), stats, KV aggregation, uniproc."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest
from tests.executor.workers import CustomError

from mpexec.config import ExecutorConfig
from mpexec.errors import WorkerError
from mpexec.executor import TerminationPolicy, UniProcExecutor
from mpexec.executor.stats import CallStats
from mpexec.outputs import KVConnectorOutput, KVOutputAggregator, ModelRunnerOutput


class FakeProc:
    """Exits ``exit_after`` fake seconds after the signal it honours."""

    def __init__(self, clock: list[float], name: str, honours: str | None,
                 exit_at: float | None = None) -> None:
        self.clock = clock
        self.name = name
        self.pid = 100 + len(name)
        self.honours = honours
        self.exit_at = exit_at
        self.signals: list[str] = []

    def is_alive(self) -> bool:
        return self.exit_at is None or self.clock[0] < self.exit_at

    def _signal(self, sig: str) -> None:
        self.signals.append(sig)
        if self.honours == sig or (sig == "SIGKILL" and self.honours != "nothing"):
            self.exit_at = self.clock[0] + 0.5

    def terminate(self) -> None:
        self._signal("SIGTERM")

    def kill(self) -> None:
        self._signal("SIGKILL")


def make_policy() -> tuple[TerminationPolicy, list[float]]:
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    return TerminationPolicy(grace_s=4, term_s=4, kill_s=2, clock=lambda: clock[0],
                             sleep=sleep), clock


@pytest.mark.parametrize(
    ("honours", "exit_at", "stage", "signals"),
    [
        (None, 1.0, "exited", []),
        ("SIGTERM", None, "sigterm", ["SIGTERM"]),
        ("SIGKILL", None, "sigkill", ["SIGTERM", "SIGKILL"]),
        ("nothing", None, "survived", ["SIGTERM", "SIGKILL"]),
    ],
)
def test_termination_escalates_only_as_far_as_needed(
        honours: str | None, exit_at: float | None, stage: str, signals: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    policy, clock = make_policy()
    proc = FakeProc(clock, "w1", honours, exit_at)
    done = FakeProc(clock, "w0", None, exit_at=0.0)
    with caplog.at_level(logging.DEBUG, logger="mpexec.executor.termination"):
        report = policy.terminate([done, proc])
    assert report.stage == stage
    assert proc.signals == signals
    assert done.signals == []
    if "SIGKILL" in signals:
        assert report.killed == [f"w1 (pid {proc.pid})"]
        assert "sending SIGKILL" in caplog.text
    if stage == "survived":
        assert report.survivors == [f"w1 (pid {proc.pid})"]
        assert "still alive" in caplog.text
    assert clock[0] <= 4 + 4 + 2 + 0.1


def test_call_stats_percentiles_and_bounded_memory() -> None:
    stats = CallStats(reservoir_size=100)
    for i in range(1, 1001):
        stats.record("step", i / 1000, ok=i % 10 != 0)
    snap = stats.snapshot()["step"]
    assert snap.calls == 1000
    assert snap.failures == 100
    assert snap.max_s == 1.0
    assert 0 < snap.p50_s <= snap.p90_s <= snap.p99_s <= 1.0
    assert len(stats._methods["step"].samples) == 100


def kv(sending: set[str] | None = None, recving: set[str] | None = None) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=["x"], kv_connector_output=KVConnectorOutput(
        finished_sending=sending, finished_recving=recving))


def test_kv_aggregator_waits_for_every_worker() -> None:
    agg = KVOutputAggregator(expected_finished_count=2)
    first = agg.aggregate([kv({"a", "b"}, {"c"}), kv({"a"})], output_rank=1)
    assert first.kv_connector_output == KVConnectorOutput({"a"}, None)
    assert first.req_ids == ["x"]
    second = agg.aggregate([kv(), kv({"b"}, {"c"})], output_rank=0)
    assert second.kv_connector_output == KVConnectorOutput({"b"}, {"c"})
    with pytest.raises(ValueError, match="expected_finished_count"):
        KVOutputAggregator(0)


def test_kv_aggregator_merges_failed_loads_over_the_workers() -> None:
    agg = KVOutputAggregator(expected_finished_count=2)
    failed = ModelRunnerOutput(kv_connector_output=KVConnectorOutput(
        finished_recving={"r"}, invalid_block_ids={7}))
    merged = agg.aggregate([kv(recving={"r"}), failed], output_rank=0)
    assert merged.kv_connector_output == KVConnectorOutput(None, {"r"}, {7})
    assert not merged.kv_connector_output.is_empty()


def test_uniproc_executor_runs_the_worker_in_process() -> None:
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                            executor_backend="uni")
    with UniProcExecutor(config) as executor:
        assert executor.collective_rpc("echo", args=(5,)) == [5]
        assert executor.collective_rpc("add", args=(1,), unique_reply_rank=0) == 1
        assert executor.collective_rpc(lambda w, k: w.rank + k, args=(3,)) == [3]
        future = executor.collective_rpc("echo", args=("x",), non_block=True)
        assert isinstance(future, Future) and future.result() == ["x"]
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("raise_custom", args=("bad",))
        assert isinstance(info.value.__cause__, CustomError)
        assert info.value.exc_type == "tests.executor.workers.CustomError"
        executor.check_health()
        assert executor.stats()["echo"].calls == 2
    with pytest.raises(ValueError, match="world_size"):
        UniProcExecutor(config.replace(parallel=config.parallel.__class__(
            tensor_parallel_size=2)))


def test_uniproc_passes_the_lock_and_honours_timeout() -> None:
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                            executor_backend="uni", shared_worker_lock=True)
    with UniProcExecutor(config) as executor:
        assert executor.collective_rpc(lambda w: w.shared_worker_lock is not None) == [True]
        with pytest.raises(TimeoutError, match=r"sleep timed out after 0\.1s"):
            executor.collective_rpc("sleep", args=(0.5,), timeout=0.1)
        # The next call waits for the one still running, then answers.
        assert executor.collective_rpc("echo", args=(1,), timeout=30) == [1]
        with pytest.raises(WorkerError, match="SystemExit"):
            executor.collective_rpc("raise_system_exit")
        with pytest.raises(ValueError, match="unique_reply_rank"):
            executor.collective_rpc("echo", args=(1,), unique_reply_rank=1)
        with pytest.raises(TypeError, match="args must be a tuple"):
            executor.collective_rpc("echo", args=[1])  # type: ignore[arg-type]
    plain = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                           executor_backend="uni")
    with UniProcExecutor(plain) as executor:
        assert executor.collective_rpc(lambda w: w.shared_worker_lock) == [None]
        assert executor.collective_rpc(lambda w: w.context.distributed_init_method) == [
            "tcp://127.0.0.1:0"]
