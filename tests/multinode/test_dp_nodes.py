"""Data parallel replicas across nodes, on 127.0.0.1.

The leader's ``LLM(data_parallel_size=2, nnodes=2)`` runs replica 0 here
and drives replica 1, whose workers all live on follower node 1: its
executor on the leader has no local worker and admits node 1 on
``master_port + 1`` (each replica's nodes dial ``master_port + its DP
rank``).  Each "node" gets its own ``MPEXEC_NODE_ID``, so collectives
between them (the expert parallel all-to-all, the DP group) take gloo over
TCP, as between two hosts.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.config import ParallelConfig
from mpexec.executor.nodes import wire as nodewire
from tests.multinode.nodes import SECRET, free_port, kill_during, kill_tree, reap, start_follower

pytestmark = [pytest.mark.usefixtures("leak_check")]

PROMPTS = ["hello world", "the quick brown fox jumps", "a b c d", "one two three"]
MAX_TOKENS = 8


# -- the layout arithmetic (no processes) ----------------------------------------------

def test_node_and_data_parallel_rank_must_name_the_same_place() -> None:
    with pytest.raises(ValueError, match="node_rank 2 belongs to data parallel rank 1"):
        ParallelConfig(nnodes=4, data_parallel_size=2, node_rank=2, data_parallel_rank=0)
    with pytest.raises(ValueError, match=r"node_rank 1 runs data parallel ranks \[2, 4\)"):
        ParallelConfig(nnodes=2, data_parallel_size=4, node_rank=1, data_parallel_rank=1)
    # node 3 is the second node of replica 1 (2 nodes per replica)
    p = ParallelConfig(nnodes=4, data_parallel_size=2, node_rank=3, data_parallel_rank=1,
                       tensor_parallel_size=2, master_port=5000)
    assert (p.nnodes_within_dp, p.node_rank_within_dp, p.local_world_size) == (2, 1, 1)
    assert p.replica_nodes == range(2, 4) and p.node_port == 5001


def test_a_remote_replica_is_driven_from_node_0_with_no_local_worker() -> None:
    p = ParallelConfig(nnodes=4, data_parallel_size=2, data_parallel_rank=1,
                       tensor_parallel_size=2, remote_replica=True, master_port=5000)
    assert p.local_world_size == 0 and p.follower_nodes == range(2, 4)
    # several replicas per node: replica 3 of 4 is node 1's second
    p = ParallelConfig(nnodes=2, data_parallel_size=4, data_parallel_rank=3,
                       remote_replica=True, master_port=5000)
    assert p.follower_nodes == range(1, 2) and p.node_port == 5003
    # replica 0 lives on node 0: it is not remote
    with pytest.raises(ValueError, match="remote_replica drives"):
        ParallelConfig(nnodes=2, data_parallel_size=2, data_parallel_rank=0,
                       remote_replica=True)
    with pytest.raises(ValueError, match="must be a port"):
        ParallelConfig(nnodes=2, data_parallel_size=2, master_port=65535)


def test_a_follower_at_another_replicas_port_is_told_so() -> None:
    line = nodewire.layout_mismatch(1, 4, 4, taken=False, nodes=[2, 3]) or ""
    assert line.startswith(nodewire.LAYOUT_REFUSED)
    assert "admits node(s) 2..3" in line and "master_port + its data parallel rank" in line
    assert len(line.encode()) < 200
    assert nodewire.layout_mismatch(3, 4, 4, taken=False, nodes=[2, 3]) is None


# -- two nodes, one replica each -------------------------------------------------------

def start_node(port: int, node_rank: int, nnodes: int, node_id: str,
               cli: bool = False) -> subprocess.Popen[bytes]:
    """Follower ``node_rank`` in its own session, seen as node ``node_id``."""
    return start_follower(port, node_rank, nnodes, cli=cli, node_id=node_id)


@pytest.fixture
def leader_node_id(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MPEXEC_NODE_ID", "leader")
    yield


def greedy(max_tokens: int = MAX_TOKENS) -> Any:
    from mpexec import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(path: Path, **fields: Any) -> Any:
    from mpexec import LLM

    fields.setdefault("kv_cache_memory_bytes", 16 << 20)
    fields.setdefault("startup_timeout_s", 60.0)
    return LLM(str(path), executor_backend="mp", num_threads=1, max_num_batched_tokens=64,
               block_size=4, shutdown_grace_s=2.0, shutdown_term_s=2.0, **fields)


def where(worker: Any) -> dict[str, Any]:
    """One worker's node, process title and data parallel group (sent to it)."""
    from mpexec.distributed.shm_collectives import node_identity

    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().split(b"\0", 1)[0].decode()
    out: dict[str, Any] = {"node": node_identity(), "title": title, "pid": os.getpid()}
    try:
        from mpexec import distributed

        dp = distributed.get_dp_group()
        out["dp"] = (dp.rank_in_group, dp.world_size, list(dp.ranks))
    except Exception:  # a replica of one rank in a world of its own has no groups
        out["dp"] = None
    return out


@pytest.fixture(scope="module")
def one_replica_tokens(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replica_1_on_the_follower_gives_one_replicas_tokens(
        tiny_checkpoint: Path, one_replica_tokens: list[list[int]],
        leader_node_id: None) -> None:
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    follower = start_node(port + 1, 1, 2, "follower-1")  # replica 1's port
    try:
        with make_llm(tiny_checkpoint, data_parallel_size=2, nnodes=2, master_port=port,
                      cluster_secret=SECRET) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == \
                one_replica_tokens
            replicas = llm.engine.replicas
            at = [e.executor.collective_rpc(where, timeout=30) for e in replicas]
            # the replicas share one world: a collective over the DP group crosses the nodes
            from tests.models.test_dp_world import dp_world, on_every_replica

            sums = [a["sum"] for [a] in on_every_replica(llm, dp_world)]
            # replica 1's executor here holds only the follower node's handle
            assert [h.pid for h in replicas[1].executor.workers] == [None]
            assert all(e.stats.steps > 0 for e in replicas)  # both served
        assert follower.wait(30) == 0
    finally:
        reap(follower)
    assert [a["node"] for [a] in at] == ["node-id/leader", "node-id/follower-1"]
    assert [a["title"] for [a] in at] == ["mpexec::Worker_DP0", "mpexec::Worker_DP1"]
    assert [a["dp"] for [a] in at] == [(0, 2, [0, 1]), (1, 2, [0, 1])] and sums == [3.0, 3.0]
    assert at[1][0]["pid"] != follower.pid


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_follower_killed_mid_generate_is_the_typed_error(
        tiny_checkpoint: Path, leader_node_id: None) -> None:

    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    follower = start_node(port + 1, 1, 2, "follower-1")
    try:
        llm = make_llm(tiny_checkpoint, data_parallel_size=2, nnodes=2, master_port=port,
                       cluster_secret=SECRET, execute_model_timeout_s=60.0)
        try:
            kill_during(llm.generate_stream(PROMPTS, greedy(300)), follower.pid, after=6)
            assert llm.engine.is_dead
        finally:
            llm.shutdown()
    finally:
        reap(follower)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_follower_killed_with_replica_restart_loses_no_request_and_rejoins(
        tiny_checkpoint: Path, leader_node_id: None) -> None:
    """replica_restart: the lost node's requests finish on replica 0 with the
    undisturbed tokens; replica 1 cannot be restarted here (its workers were
    on the lost node), so its rebuild waits for a follower to join its port
    again: a new ``mpexec node`` brings it back.  The DP group, outside each
    replica's world, crosses the nodes at start (generation 0) and again,
    over the new node's worker, once it serves (generation 1)."""
    from tests.models.test_dp_group_restart import dp_world, on_every_replica

    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    followers = [start_node(port + 1, 1, 2, "follower-1")]
    try:
        with make_llm(tiny_checkpoint, data_parallel_size=2, nnodes=2, master_port=port,
                      cluster_secret=SECRET, replica_restart=True,
                      execute_model_timeout_s=60.0) as llm:
            params = greedy(24)
            want = [o.token_ids for o in llm.generate(PROMPTS, params)]
            first = on_every_replica(llm, dp_world)
            hit: list[int] = []

            def progress(finished: int, total: int, tokens: int) -> None:
                if not hit and tokens >= 12:
                    kill_tree(followers[0].pid)
                    hit.append(followers[0].pid)

            got = [o.token_ids for o in llm.generate(PROMPTS, params, progress=progress)]
            assert hit and got == want
            failover = llm.engine.failover
            assert failover.failures == 1 and failover.requeued_requests >= 1
            assert "DP rank 1 failed" in failover.events[0]
            # The rebuild waits for node 1: start it again.
            followers.append(start_node(port + 1, 1, 2, "follower-1b"))
            assert_rejoins(llm)
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
            assert all(e is not None and e.stats.steps > 0 for e in llm.engine.replicas)
            after = on_every_replica(llm, dp_world)
    finally:
        for proc in followers:
            reap(proc)
    assert [[(a["generation"], a["sum"]) for a in replica] for replica in first + after] == \
        [[(0, 3.0)], [(0, 3.0)], [(1, 3.0)], [(1, 3.0)]]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_shutdown_while_a_rebuild_waits_for_the_lost_node_returns_at_once(
        tiny_checkpoint: Path, leader_node_id: None) -> None:
    """replica_restart: replica 1's node is lost and its rebuild waits for a
    node to join (``startup_timeout_s`` 600 s).  ``shutdown()`` cancels that
    wait (the rebuild's executor gets the engine's closing event as its
    start-up cancel): the pytest timeout bounds the test, and leak_check and
    the free port show the waiting executor is gone with it."""
    from tests.multinode.test_two_nodes import assert_port_free

    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    follower = start_node(port + 1, 1, 2, "follower-1")
    try:
        llm = make_llm(tiny_checkpoint, data_parallel_size=2, nnodes=2, master_port=port,
                       cluster_secret=SECRET, replica_restart=True, startup_timeout_s=600.0,
                       execute_model_timeout_s=60.0)
        try:
            hit: list[int] = []

            def progress(finished: int, total: int, tokens: int) -> None:
                if not hit and tokens >= 6:
                    kill_tree(follower.pid)
                    hit.append(follower.pid)

            outputs = llm.generate(PROMPTS, greedy(24), progress=progress)
            assert hit and all(len(o.token_ids) == 24 for o in outputs)
            failover = llm.engine.failover
            while not any(phase == "rebuilding" for *_, phase in failover.timeline):
                time.sleep(0.05)  # bounded by the test's timeout
        finally:
            llm.shutdown()
        assert failover.restarts == 0
        assert any("start-up was cancelled" in event for event in failover.events), \
            failover.events
    finally:
        reap(follower)
    assert_port_free(port + 1)


def assert_rejoins(llm: Any, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while llm.engine.failover.restarts < 1:
        assert time.monotonic() < deadline, llm.engine.failover.events
        time.sleep(0.1)


# -- a replica across two nodes; experts across the replicas' nodes --------------------

@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_replica_spans_two_nodes(tiny_checkpoint: Path,
                                      one_replica_tokens: list[list[int]],
                                      leader_node_id: None) -> None:
    """DP=2 x TP=2 over 4 nodes: replica 0 on nodes 0-1 (here and a follower),
    replica 1 on nodes 2-3 (both followers, at master_port + 1); each TP
    all-reduce crosses two nodes through gloo."""
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    followers = [start_node(port, 1, 4, "follower-1"), start_node(port + 1, 2, 4, "follower-2"),
                 start_node(port + 1, 3, 4, "follower-3")]
    try:
        with make_llm(tiny_checkpoint, data_parallel_size=2, tensor_parallel_size=2, nnodes=4,
                      master_port=port, cluster_secret=SECRET) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == \
                one_replica_tokens
            at = [e.executor.collective_rpc(where, timeout=30) for e in llm.engine.replicas]
        assert [f.wait(30) for f in followers] == [0, 0, 0]
    finally:
        for proc in followers:
            reap(proc)
    assert [[a["node"] for a in replica] for replica in at] == [
        ["node-id/leader", "node-id/follower-1"], ["node-id/follower-2", "node-id/follower-3"]]
    assert [[a["title"] for a in replica] for replica in at] == [
        ["mpexec::Worker_DP0_TP0", "mpexec::Worker_DP0_TP1"],
        ["mpexec::Worker_DP1_TP0", "mpexec::Worker_DP1_TP1"]]
    assert [[a["dp"] for a in replica] for replica in at] == [
        [(0, 2, [0, 2]), (0, 2, [1, 3])], [(1, 2, [0, 2]), (1, 2, [1, 3])]]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_replicas_per_node(tiny_checkpoint: Path, one_replica_tokens: list[list[int]],
                               leader_node_id: None) -> None:
    """DP=4 over 2 nodes: replicas 0-1 here, 2-3 on node 1, which runs one
    ``mpexec node`` per replica (at master_port + 2 and + 3)."""
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    followers = [start_node(port + 2, 1, 2, "follower-1"),
                 start_node(port + 3, 1, 2, "follower-1", cli=True)]
    try:
        with make_llm(tiny_checkpoint, data_parallel_size=4, nnodes=2, master_port=port,
                      cluster_secret=SECRET) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == \
                one_replica_tokens
            at = [e.executor.collective_rpc(where, timeout=30) for e in llm.engine.replicas]
            assert all(e.stats.steps > 0 for e in llm.engine.replicas)  # each took one
        assert [f.wait(30) for f in followers] == [0, 0]
    finally:
        for proc in followers:
            reap(proc)
    assert [a["node"] for [a] in at] == ["node-id/leader"] * 2 + ["node-id/follower-1"] * 2
    assert [a["title"] for [a] in at] == [f"mpexec::Worker_DP{d}" for d in range(4)]
    assert [a["dp"] for [a] in at] == [(d, 4, [0, 1, 2, 3]) for d in range(4)]


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral (5 experts, top-2) with the tiny checkpoint's tokenizer."""
    pytest.importorskip("transformers")
    import shutil

    from tests.models.test_moe import save_random_moe

    path = save_random_moe(tmp_path_factory.mktemp("moe-dp-nodes"), "mixtral", vocab_size=389)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, path / name)
    return path


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_experts_across_the_nodes_of_two_replicas(moe_checkpoint: Path,
                                                  leader_node_id: None) -> None:
    """DP=2 x EP over two nodes: the replicas join one world, so each worker's
    DP group holds both nodes' ranks; experts 3 + 2 across them, the
    all-to-all through gloo, replicas in lockstep; tokens as one replica's."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 250, 9][: 3 + i % 3]}
               for i in range(5)]
    params = [greedy(2 + 3 * i) for i in range(5)]  # uneven: an idle replica runs dummies
    with make_llm(moe_checkpoint) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    follower = start_node(port + 1, 1, 2, "follower-1")
    try:
        with make_llm(moe_checkpoint, data_parallel_size=2, enable_expert_parallel=True,
                      nnodes=2, master_port=port, cluster_secret=SECRET) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
            assert llm.engine.lockstep and llm.engine.dummy_steps > 0
            at = [e.executor.collective_rpc(where, timeout=30) for e in llm.engine.replicas]
        assert follower.wait(30) == 0
    finally:
        reap(follower)
    assert [a["node"] for [a] in at] == ["node-id/leader", "node-id/follower-1"]
    assert [a["dp"] for [a] in at] == [(0, 2, [0, 1]), (1, 2, [0, 1])]
    assert [a["title"] for [a] in at] == ["mpexec::Worker_DP0_EP0", "mpexec::Worker_DP1_EP1"]
