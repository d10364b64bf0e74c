"""The DP group of dense replicas with ``replica_restart``: outside each world, by generation.

Each replica keeps a world of its own (so a failed one is rebuilt alone), and
its workers' ``get_dp_group()`` is a gloo group formed outside those worlds
(``mpexec.models.dp_world``).  Checked here: it spans both replicas at start;
after a replica is SIGKILLed and rebuilt, the next generation spans the new
replica too, no request is lost and the greedy tokens are an undisturbed
run's; a stale generation's collective is ``StaleGroupError``, not a hang; a
replica frozen (SIGSTOP) while a generation forms is failed over and
rebuilt, and the generation after it forms; shared-world replicas with a
worker frozen during ``join_data_parallel`` end the start in a bounded,
typed error.  Every test ends with ``leak_check``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("leak_check")]
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 9]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
WAIT_S = 120.0  # a rebuild under load: the forkserver start and the model load


def make_llm(path: Path, **kwargs: Any) -> Any:
    from mpexec.engine.llm import LLM

    return LLM(str(path), num_threads=1, block_size=4, kv_cache_memory_bytes=16 << 20,
               shutdown_grace_s=5.0, shutdown_term_s=5.0, worker_stopped_timeout_s=1.0,
               check_health_timeout_s=5.0, **kwargs)


def dp_world(wrapper: Any) -> dict[str, Any]:
    """This worker's DP group, its generation and the sum over it of (DP rank + 1)."""
    from mpexec import distributed

    dp = distributed.get_dp_group()
    rank = wrapper.worker.config.parallel.data_parallel_rank
    total = dp.all_reduce(torch.tensor([float(rank + 1)]))
    if not hasattr(wrapper.worker, "test_kept_dp_group"):
        wrapper.worker.test_kept_dp_group = dp  # the first one, for stale_collective
    return {"dp": (dp.rank_in_group, dp.world_size), "generation": dp.generation,
            "sum": float(total.item())}


def stale_collective(wrapper: Any) -> tuple[str, int]:
    """An all-reduce on the group dp_world first saw: (error type, its generation)."""
    from mpexec.errors import StaleGroupError

    try:
        wrapper.worker.test_kept_dp_group.all_reduce(torch.ones(1))
    except StaleGroupError as exc:
        return type(exc).__name__, exc.generation
    return "no error", -2


def on_every_replica(llm: Any, func: Any) -> list[list[Any]]:
    """``func`` on every replica's workers at once (a collective needs them all)."""
    futures: list[concurrent.futures.Future[Any]] = [
        engine.executor.collective_rpc(func, non_block=True, timeout=60)
        for engine in llm.engine.replicas]
    return [future.result(timeout=60) for future in futures]


def wait_for_restarts(llm: Any, count: int) -> None:
    failover = llm.engine.failover
    deadline = time.monotonic() + WAIT_S
    while failover.restarts < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert failover.restarts == count, failover.events


def step_until_restarts(llm: Any, count: int) -> None:
    """``wait_for_restarts``, stepping meanwhile: a replica whose worker was
    frozen while it held no request is failed over at the next step (the
    front end notices a replica that died idle when it steps), and the
    generate before may have finished without another step."""
    failover = llm.engine.failover
    deadline = time.monotonic() + WAIT_S
    while failover.restarts < count and time.monotonic() < deadline:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))
        time.sleep(0.1)
    assert failover.restarts == count, failover.events


def kill_midway(llm: Any, rank: int, after_tokens: int) -> tuple[Any, list[int]]:
    killed: list[int] = []

    def progress(finished: int, total: int, tokens: int) -> None:
        if not killed and tokens >= after_tokens:
            pid = llm.engine.replicas[rank].executor.workers[0].proc.pid
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return progress, killed


@pytest.fixture(scope="module")
def undisturbed(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_dp_group_spans_a_rebuilt_replica(tiny_checkpoint: Path,
                                          undisturbed: list[list[int]]) -> None:
    with make_llm(tiny_checkpoint, data_parallel_size=2, replica_restart=True) as llm:
        llm.engine.backoff_s = 0.1
        first = on_every_replica(llm, dp_world)
        progress, killed = kill_midway(llm, 1, after_tokens=20)
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, progress=progress)]
        wait_for_restarts(llm, 1)
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # steps: regroups
        after = on_every_replica(llm, dp_world)
        stale = llm.engine.replicas[0].executor.collective_rpc(stale_collective, timeout=60)
        generation = llm.engine.dp_group_generation
        failover = llm.engine.failover
    assert killed
    assert first == [[{"dp": (0, 2), "generation": 0, "sum": 3.0}],
                     [{"dp": (1, 2), "generation": 0, "sum": 3.0}]]
    assert outputs == undisturbed and again == undisturbed  # no request lost
    assert failover.failures == 1 and failover.requeued_requests >= 1
    assert after == [[{"dp": (0, 2), "generation": 1, "sum": 3.0}],
                     [{"dp": (1, 2), "generation": 1, "sum": 3.0}]]
    assert generation == 1
    # the survivor's generation-0 group, kept by the worker: retired, typed
    assert stale == [("StaleGroupError", 0)]
    assert any("generation 0 retired" in e for e in failover.events), failover.events


def test_dp_groups_link_each_place_of_the_replicas(tiny_checkpoint: Path,
                                                  undisturbed: list[list[int]]) -> None:
    """DP=2 x TP=2: two DP groups (one per TP place) formed at once over one
    store, each under its own prefix."""
    with make_llm(tiny_checkpoint, data_parallel_size=2, tensor_parallel_size=2,
                  replica_restart=True) as llm:
        at = on_every_replica(llm, dp_world)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens == undisturbed
    assert at == [[{"dp": (0, 2), "generation": 0, "sum": 3.0}] * 2,
                  [{"dp": (1, 2), "generation": 0, "sum": 3.0}] * 2]


@pytest.mark.parametrize("frozen", [0, 1], ids=["store-host", "member"])
def test_replica_frozen_while_the_dp_group_forms_is_restarted(
        tiny_checkpoint: Path, undisturbed: list[list[int]], frozen: int) -> None:
    """Replica 1 is killed and rebuilt; as generation 1 forms, replica
    ``frozen``'s worker is SIGSTOPped (replica 0's rank 0 hosts the store).
    Its executor names it (worker_stopped_timeout_s) and it is failed over;
    the other's join ends in the typed error within the group's timeout; the
    requests finish with their tokens, and once the frozen one is rebuilt,
    generation 2 spans both."""
    with make_llm(tiny_checkpoint, data_parallel_size=2, replica_restart=True) as llm:
        engine = llm.engine
        engine.backoff_s = 0.1
        stopped: list[int] = []
        call = engine._dp_call

        def freeze_then_call(live: Any, method: str, args: Any) -> Any:
            if method == "join_dp_group" and not stopped:
                pid = engine.replicas[frozen].executor.workers[0].proc.pid
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            return call(live, method, args)

        # in place before the kill: generation 1 forms at the first step after
        # the rebuild, which may come before this generate returns
        engine._dp_call = freeze_then_call
        progress, killed = kill_midway(llm, 1, after_tokens=20)
        first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, progress=progress)]
        assert killed
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        step_until_restarts(llm, 2)  # the kill's, then the freeze's
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        after = on_every_replica(llm, dp_world)
        failover = engine.failover
    assert stopped and first == outputs == again == undisturbed
    assert failover.failures == 2
    assert any(f"DP rank {frozen} failed (WorkerStalledError" in e
               for e in failover.events), failover.events
    assert any("generation 1 did not form" in e for e in failover.events), failover.events
    assert [[a["generation"], a["sum"]] for [a] in after] == [[2, 3.0], [2, 3.0]]


def test_shared_world_replica_frozen_during_join_is_a_bounded_typed_error(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without replica_restart dense replicas share one world; a worker frozen
    while they join it ends the start in the executor's typed error, bounded
    by its stall watch, and the other replica's worker (waiting in the
    rendezvous) is shut down with it."""
    from mpexec.engine import startup
    from mpexec.errors import WorkerStalledError

    join = startup._join_replicas
    stopped: list[int] = []

    def freeze_then_join(executors: list[Any], host: str) -> None:
        pid = executors[1].workers[0].proc.pid
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        join(executors, host)

    monkeypatch.setattr(startup, "_join_replicas", freeze_then_join)
    with pytest.raises(WorkerStalledError, match="stopped"):
        make_llm(tiny_checkpoint, data_parallel_size=2)
    assert stopped


def test_shared_world_replica_that_never_joins_is_a_bounded_start_up_error(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose workers stay alive but never reach the world's
    rendezvous (its join call never answers): the start ends at
    startup_timeout_s with one error naming it, not at torch's rendezvous
    timeout, and the other replica's worker (waiting in the rendezvous) is
    shut down with it."""
    import concurrent.futures

    from mpexec.engine import startup
    from mpexec.errors import WorkerStartupError

    join = startup._join_replicas

    def one_never_answers(executors: list[Any], host: str) -> None:
        real = executors[1].collective_rpc

        def rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
            if method == "join_data_parallel":
                return concurrent.futures.Future()  # never done
            return real(method, *args, **kwargs)

        executors[1].collective_rpc = rpc
        join(executors, host)

    monkeypatch.setattr(startup, "_join_replicas", one_never_answers)
    # replica 0 waits for it in the rendezvous: neither has finished
    with pytest.raises(WorkerStartupError,
                       match=r"DP replica\(s\) 0, 1 did not join .* within 8s"):
        make_llm(tiny_checkpoint, data_parallel_size=2, startup_timeout_s=8.0)
