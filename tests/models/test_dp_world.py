"""Dense data-parallel replicas in one torch.distributed world.

``LLM(data_parallel_size=2)`` on the model worker: every replica's workers
join one world after they start (``mpexec.models.dp_world``), so
``get_dp_group()`` in a worker holds every replica's rank of its place and a
collective over it works; the replicas still step on their own (no dummy
batches: nothing in a dense step crosses the replicas).  With
``replica_restart`` each replica keeps a world of its own, so that a failed
one can be rebuilt alone, and the log says so.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.usefixtures("leak_check")]
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 9]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_llm(path: Path, **kwargs: Any) -> Any:
    from mpexec.engine.llm import LLM

    return LLM(str(path), num_threads=1, block_size=4, kv_cache_memory_bytes=16 << 20,
               shutdown_grace_s=5.0, **kwargs)


def dp_world(wrapper: Any) -> dict[str, Any]:
    """This worker's DP group, the sum over it of (DP rank + 1), and its title."""
    from mpexec import distributed

    dp = distributed.get_dp_group()
    rank = wrapper.worker.config.parallel.data_parallel_rank
    total = dp.all_reduce(torch.tensor([float(rank + 1)]))
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().split(b"\0", 1)[0].decode()
    return {"dp": (dp.rank_in_group, dp.world_size, list(dp.ranks)),
            "sum": float(total.item()), "title": title}


def on_every_replica(llm: Any, func: Any) -> list[list[Any]]:
    """``func`` on every replica's workers at once (a collective needs them all)."""
    futures: list[concurrent.futures.Future[Any]] = [
        engine.executor.collective_rpc(func, non_block=True, timeout=60)
        for engine in llm.engine.replicas]
    return [future.result(timeout=60) for future in futures]


@pytest.fixture(scope="module")
def one_replica_tokens(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_dense_replicas_share_one_world_and_step_on_their_own(
        tiny_checkpoint: Path, one_replica_tokens: list[list[int]]) -> None:
    with make_llm(tiny_checkpoint, data_parallel_size=2) as llm:
        at = on_every_replica(llm, dp_world)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        engine = llm.engine
        assert not engine.lockstep and engine.dummy_steps == 0
        assert all(replica.stats.steps > 0 for replica in engine.replicas)
        again = on_every_replica(llm, dp_world)  # the world still works after serving
    assert tokens == one_replica_tokens
    assert [[a["dp"] for a in replica] for replica in at] == [[(0, 2, [0, 1])],
                                                               [(1, 2, [0, 1])]]
    assert [a["sum"] for replica in at + again for a in replica] == [3.0] * 4
    assert [a["title"] for [a] in at] == ["mpexec::Worker_DP0", "mpexec::Worker_DP1"]


@pytest.mark.parametrize("layout", ["tp", "pcp"])
def test_dp_groups_link_the_same_place_of_each_replica(
        tiny_checkpoint: Path, one_replica_tokens: list[list[int]], layout: str) -> None:
    """DP=2 x TP=2 (or x prefill context parallel 2): global ranks 0-1 and
    2-3; the DP groups are {0, 2} and {1, 3}."""
    size = {"tensor_parallel_size" if layout == "tp" else "prefill_context_parallel_size": 2}
    with make_llm(tiny_checkpoint, data_parallel_size=2, **size) as llm:
        at = on_every_replica(llm, dp_world)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens == one_replica_tokens
    assert [[a["dp"] for a in replica] for replica in at] == [
        [(0, 2, [0, 2]), (0, 2, [1, 3])], [(1, 2, [0, 2]), (1, 2, [1, 3])]]
    assert {a["sum"] for replica in at for a in replica} == {3.0}
    place = layout.upper()
    assert [[a["title"] for a in replica] for replica in at] == [
        [f"mpexec::Worker_DP0_{place}0", f"mpexec::Worker_DP0_{place}1"],
        [f"mpexec::Worker_DP1_{place}0", f"mpexec::Worker_DP1_{place}1"]]


def _world_and_dp(wrapper: Any) -> tuple[bool, int, int]:
    """Whether this worker is in a torch.distributed world, and its DP group's
    size and generation."""
    import torch.distributed as dist

    from mpexec import distributed

    dp = distributed.get_dp_group()
    total = dp.all_reduce(torch.ones(1))
    return dist.is_initialized(), int(total.item()), dp.generation


def test_with_replica_restart_each_dense_replica_keeps_its_own_world(
        tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A world each (a replica of one rank has none at all), and the DP group
    outside them: generation 0 over both replicas."""
    with caplog.at_level("INFO", logger="mpexec.engine.startup"), \
            make_llm(tiny_checkpoint, data_parallel_size=2, replica_restart=True) as llm:
        at = on_every_replica(llm, _world_and_dp)
    assert at == [[(False, 2, 0)], [(False, 2, 0)]]
    assert any("keep a torch.distributed world each" in r.getMessage()
               for r in caplog.records)


def test_a_killed_replica_of_one_world_is_the_typed_error_and_leaves_nothing(
        tiny_checkpoint: Path) -> None:
    """Without replica_restart a replica's death is the caller's error, as with
    separate worlds; the survivor, whose world now has a dead rank, still shuts
    down whole (leak_check)."""
    import os
    import signal

    from mpexec.errors import WorkerDiedError

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with make_llm(tiny_checkpoint, data_parallel_size=2, shutdown_term_s=5.0) as llm:
        killed: list[int] = []

        def progress(finished: int, total: int, tokens: int) -> None:
            if not killed and tokens >= 8:
                pid = llm.engine.replicas[1].executor.workers[0].proc.pid
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        with pytest.raises(WorkerDiedError):
            llm.generate(PROMPTS, params, progress=progress)
        assert killed and llm.engine.is_dead
