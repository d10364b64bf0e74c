"""A worker's own error reaches the caller at once; only a collective's failure
waits (bounded) for the executor to declare a death (``executor.verdict``).

Promptness is shown by events, never by a measured time: the verdict's wait
is made much longer than the test's patience, and the error must arrive
before a timer thread marks that patience spent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.engine import EngineDeadError
from mpexec.errors import (
    CollectiveFailedError,
    PeerDeathSymptom,
    PeerDiedError,
    QueueClosedError,
    WorkerDiedError,
    WorkerError,
)
from mpexec.executor import verdict
from mpexec.outputs import SamplingParams

PATIENCE_S = 30.0  # far beyond a prompt error; far below the patched verdict wait


def config(**fields: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls="tests.engine.fake_worker:FakeModelWorker", **fields)


def worker_error(exc: BaseException) -> WorkerError:
    """The driver's view of ``exc`` raised in a worker, as the reply carries it."""
    from mpexec.executor.protocol import capture_failure, worker_error as to_worker_error

    return to_worker_error(0, 1, "execute_model", capture_failure(exc))


class FakeExecutor:
    """Fails (``is_failed``) when ``fail`` is set; ``failure`` then says who died."""

    def __init__(self, nnodes: int = 1) -> None:
        self.config = config(parallel=ParallelConfig(tensor_parallel_size=2, nnodes=nnodes))
        self.fail = threading.Event()

    @property
    def is_failed(self) -> bool:
        return self.fail.is_set()

    @property
    def death_verdict_s(self) -> float:  # as Executor's
        return verdict.death_verdict_s(self.config)

    @property
    def failure(self) -> BaseException | None:
        if not self.fail.is_set():
            return None
        return WorkerDiedError("worker rank 1 (pid 2) died", rank=1, pid=2, exitcode=-9)


class Patience:
    """A flag a timer sets after ``PATIENCE_S``: unset means "well before"."""

    def __init__(self) -> None:
        self.spent = threading.Event()
        self._timer = threading.Timer(PATIENCE_S, self.spent.set)
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()
        self._timer.join(5)


class UnpicklableCollectiveError(CollectiveFailedError):
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_only_peer_death_symptoms_are_symptoms_of_a_death() -> None:
    pytest.importorskip("torch")
    from mpexec.distributed.liveness import PeerDiedInCollectiveError

    symptoms = [CollectiveFailedError("gloo reset"),
                PeerDiedInCollectiveError("rank 1 exited", dead={1: 7}),
                PeerDiedError("the writer died", pid=7, role="writer"),
                UnpicklableCollectiveError("the mark travels without the pickle")]
    for exc in symptoms:
        assert isinstance(exc, PeerDeathSymptom)
        assert verdict.may_follow_a_death(worker_error(exc)), exc
    assert worker_error(symptoms[-1]).__cause__ is None
    for exc in (ValueError("x"), RuntimeError("y"), KeyError("z"),
                QueueClosedError("closed, nobody died")):
        assert not verdict.may_follow_a_death(worker_error(exc)), exc
    assert not verdict.may_follow_a_death(CollectiveFailedError("not a WorkerError"))
    assert verdict.death_verdict_s(config()) == verdict.ONE_NODE_VERDICT_S
    two = config(parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2),
                 node_timeout_s=5.0, node_heartbeat_s=1.0)
    assert verdict.death_verdict_s(two) == 7.0


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_plain_worker_error_is_not_held_back(monkeypatch: pytest.MonkeyPatch,
                                               nnodes: int) -> None:
    monkeypatch.setattr(verdict, "ONE_NODE_VERDICT_S", 10 * PATIENCE_S)
    executor = FakeExecutor(nnodes)
    if nnodes > 1:
        executor.config = executor.config.replace(node_timeout_s=10 * PATIENCE_S,
                                                  node_heartbeat_s=1.0)
    patience = Patience()
    try:
        assert verdict.death_behind(executor, worker_error(ValueError("bad"))) is None  # type: ignore[arg-type]
        assert not patience.spent.is_set()
    finally:
        patience.stop()


def test_a_collective_failure_waits_for_the_death_and_raises_it() -> None:
    executor = FakeExecutor()
    threading.Timer(0.05, executor.fail.set).start()
    died = verdict.death_behind(executor, worker_error(  # type: ignore[arg-type]
        CollectiveFailedError("rank 1 exited")))
    assert isinstance(died, WorkerDiedError) and died.rank == 1


def test_a_collective_failure_without_a_death_stays_the_workers_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdict, "ONE_NODE_VERDICT_S", 0.05)
    executor = FakeExecutor()
    assert verdict.death_behind(executor, worker_error(  # type: ignore[arg-type]
        CollectiveFailedError("gloo timed out"))) is None


def test_the_collective_guard_keeps_the_cause_and_its_message() -> None:
    pytest.importorskip("torch")
    from mpexec.distributed.liveness import CollectiveGuard, PeerDiedInCollectiveError

    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    with pytest.raises(CollectiveFailedError, match="Connection reset by peer") as caught, \
            CollectiveGuard("the tp group's all_reduce (rank 0)"):
        raise reset
    assert caught.value.__cause__ is reset
    assert "the tp group's all_reduce" in str(caught.value)
    with pytest.raises(ValueError), CollectiveGuard("x"):  # the caller's mistake
        raise ValueError("bad shape")
    inner = PeerDiedInCollectiveError("peer gone", dead={1: 2})
    with pytest.raises(PeerDiedInCollectiveError) as kept, CollectiveGuard("x"):
        raise inner
    assert kept.value is inner and isinstance(inner, CollectiveFailedError)


# -- the real thing: the tiny model, TP=2 on one node --------------------------------

def raise_in_execute_model(worker: Any) -> None:
    """Sent to every worker: from now on its execute_model raises ValueError."""
    def execute_model(scheduler_output: Any) -> None:
        raise ValueError("a bad batch (raised on purpose)")

    worker.execute_model = execute_model


def restore_execute_model(worker: Any) -> None:
    del worker.execute_model  # the class's method again


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.usefixtures("leak_check")
def test_a_worker_value_error_in_a_tp2_llm_arrives_at_once(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec import LLM, SamplingParams

    # Were a ValueError held back for a death, it would be held for this long.
    monkeypatch.setattr(verdict, "ONE_NODE_VERDICT_S", 10 * PATIENCE_S)
    llm = LLM(str(tiny_checkpoint), tensor_parallel_size=2, executor_backend="mp",
              num_threads=1, max_num_batched_tokens=64, shutdown_grace_s=2.0,
              shutdown_term_s=2.0)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    try:
        want = llm.generate(["hello world"], greedy)[0].token_ids
        llm.engine.executor.collective_rpc(raise_in_execute_model, timeout=30)
        patience = Patience()
        try:
            with pytest.raises(WorkerError, match="a bad batch") as caught:
                llm.generate(["hello world"], SamplingParams(max_tokens=4))
            assert not patience.spent.is_set()
        finally:
            patience.stop()
        assert caught.value.exc_type == "ValueError"
        # The workers refused the step's input: that request failed alone.
        assert not llm.engine.is_dead and not llm.engine.executor.is_failed
        # and the same TP=2 engine serves the next request, with the right tokens
        llm.engine.executor.collective_rpc(restore_execute_model, timeout=30)
        again = llm.generate(["hello world"], greedy)[0]
        assert again.finished and again.token_ids == want
    finally:
        llm.shutdown()


# -- a worker that dies while the engine is idle ---------------------------------------


@pytest.mark.usefixtures("leak_check")
def test_a_death_while_idle_is_named_by_the_next_request(engine_factory: Any) -> None:
    """The executor's failure callback marks the engine dead; the next request's
    EngineDeadError names the rank, the pid and the signal, the first
    WorkerDiedError as its cause."""
    engine = engine_factory("mp", tp=2)
    executor = engine.executor
    pid = executor.workers[1].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + PATIENCE_S
    while not engine.is_dead and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.is_dead
    for _ in range(2):
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pid}\) died: killed by "
                           "SIGKILL") as info:
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        cause = info.value.__cause__
        assert isinstance(cause, WorkerDiedError) and cause is executor.failure
        assert cause.rank == 1 and cause.pid == pid and cause.signal_name == "SIGKILL"


def test_the_closing_rank_is_a_field_not_parsed_from_the_role() -> None:
    import pickle

    died = PeerDiedError("reader rank 1 died", pid=7, role="reader 1", reader_rank=1)
    again = pickle.loads(pickle.dumps(died))
    assert (again.reader_rank, again.pid, again.role) == (1, 7, "reader 1")
    assert verdict.closing_rank(again, start_rank=4) == 5
    writer = PeerDiedError("the writer died", pid=7, role="writer")
    assert verdict.closing_rank(writer, start_rank=4) is None
    assert verdict.closing_rank(QueueClosedError("shut down"), start_rank=0) is None
