"""The tiny Llama across two process trees on 127.0.0.1 gives the tokens it gives on one node.

The leader's LLM runs here; the follower is ``run_follower`` in a new
session.  Both are on this host, so ``MPEXEC_NODE_ID`` gives each "node" its
own identity: the process groups then treat the two workers as on different
machines and their collectives (TP all-reduce, PP send/recv) go through
gloo over TCP, the path two real hosts take.  (The CLI test,
test_cli_two_nodes.py, keeps the default identity: there the groups find
that both workers share this host and use shared memory between the trees.)
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.system.procs import proc_stat
from tests.multinode.nodes import ROOT, SECRET, free_port, kill_during, kill_tree, reap, tree_of

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PROMPTS = ["hello world", "the quick brown fox jumps"]
MAX_TOKENS = 8


def start_model_follower(port: int, node_id: str | None) -> subprocess.Popen[bytes]:
    """Follower node 1 of 2, in its own session, seen as node ``node_id`` by its groups."""
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    env.pop("MPEXEC_NODE_ID", None)
    if node_id is not None:
        env["MPEXEC_NODE_ID"] = node_id
    code = ("import sys; from mpexec.executor.nodes.follower import run_follower; "
            f"sys.exit(run_follower(2, 1, '127.0.0.1', {port}, join_timeout_s=60))")
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def make_llm(tiny_checkpoint: Path, tp: int, pp: int, **fields: Any) -> Any:
    from mpexec import LLM

    return LLM(str(tiny_checkpoint), tensor_parallel_size=tp, pipeline_parallel_size=pp,
               executor_backend="mp", num_threads=1, max_num_batched_tokens=64,
               shutdown_grace_s=2.0, shutdown_term_s=2.0, startup_timeout_s=60.0,
               **fields)


def greedy() -> Any:
    from mpexec import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def paths_taken(worker: Any) -> dict[str, Any]:
    """What one worker's groups used: shared memory or gloo (sent to every worker)."""
    from mpexec.distributed.shm_collectives import node_identity

    return {"node": node_identity(), "tp_shm": worker.tp_group.shm_active,
            "pp_routes": worker.pp_group.point_to_point_routes(),
            "pcp_split_steps": worker.pcp_split_steps}


@pytest.fixture(scope="module")
def one_node_tokens(tiny_checkpoint: Path) -> list[list[int]]:
    """The same model in one process.  tests/engine/test_e2e_model.py shows that
    mp with TP=2 and with PP=2 on one node give exactly these tokens too."""
    from mpexec import LLM

    with LLM(str(tiny_checkpoint), executor_backend="uni", num_threads=1,
             max_num_batched_tokens=64) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture
def leader_node_id(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The leader's workers (spawned from this process) see themselves as node "leader"."""
    monkeypatch.setenv("MPEXEC_NODE_ID", "leader")
    yield


def run_two_nodes(tiny_checkpoint: Path, tp: int, pp: int, follower_node_id: str | None,
                  prompts: list[str] = PROMPTS, **fields: Any,
                  ) -> tuple[list[list[int]], list[dict[str, Any]]]:
    port = free_port()
    follower = start_model_follower(port, follower_node_id)
    try:
        with make_llm(tiny_checkpoint, tp, pp, nnodes=2, master_port=port,
                      cluster_secret=SECRET, **fields) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, greedy())]
            paths = llm.engine.executor.collective_rpc(paths_taken, timeout=30)
        assert follower.wait(30) == 0
    finally:
        reap(follower)
    return tokens, paths


@pytest.mark.timeout(180)
def test_pp2_one_stage_per_node_through_gloo(
        tiny_checkpoint: Path, one_node_tokens: list[list[int]],
        leader_node_id: None) -> None:
    tokens, paths = run_two_nodes(tiny_checkpoint, 1, 2, "follower-1")
    assert tokens == one_node_tokens
    assert paths[0]["pp_routes"] == {(0, 1): "gloo"}  # the hidden states took gloo
    assert paths[1]["pp_routes"] == {(0, 1): "gloo"}


@pytest.mark.timeout(240)
def test_pcp2_one_rank_per_node_splits_the_prefill(tiny_checkpoint: Path,
                                                   leader_node_id: None) -> None:
    """Prefill context parallelism across the nodes: the prompts' rows split
    between the two workers, K/V gathered through gloo."""
    from mpexec import LLM

    prompts = [" ".join(f"word{i}" for i in range(40)), "a b c d e f g h i j k l"]
    with LLM(str(tiny_checkpoint), executor_backend="uni", num_threads=1,
             max_num_batched_tokens=64) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy())]
    tokens, paths = run_two_nodes(tiny_checkpoint, 1, 1, "follower-1", prompts,
                                  prefill_context_parallel_size=2)
    assert tokens == expected
    assert paths[0]["node"] != paths[1]["node"]
    assert all(p["pcp_split_steps"] > 0 for p in paths)


# -- attacks: a node dies while the model generates ----------------------------------

LEADER_SCRIPT = """
import sys
from mpexec import LLM, SamplingParams
llm = LLM({tiny_checkpoint!r}, tensor_parallel_size=2, executor_backend="mp", num_threads=1,
          max_num_batched_tokens=64, nnodes=2, master_port={port}, startup_timeout_s=60.0)
params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
while True:  # generating until killed
    for n, _ in enumerate(llm.generate_stream({prompts!r}, params)):
        if n == 3:
            print("generating", flush=True)
"""


@pytest.mark.timeout(120)
def test_tp2_split_across_two_nodes_through_gloo_then_the_follower_dies(
        tiny_checkpoint: Path, one_node_tokens: list[list[int]], leader_node_id: None) -> None:
    """One node's tokens, the all-reduce through gloo; then the follower is
    killed mid-generation and ``generate`` fails naming its node."""
    from mpexec import SamplingParams

    port = free_port()
    follower = start_model_follower(port, "follower-1")
    try:
        llm = make_llm(tiny_checkpoint, 2, 1, nnodes=2, master_port=port, cluster_secret=SECRET,
                       execute_model_timeout_s=60.0)
        try:
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == one_node_tokens
            paths = llm.engine.executor.collective_rpc(paths_taken, timeout=30)
            assert [p["node"] for p in paths] == ["node-id/leader", "node-id/follower-1"]
            assert [p["tp_shm"] for p in paths] == [False, False]  # the all-reduce took gloo
            stream = llm.generate_stream(PROMPTS, SamplingParams(
                temperature=0, max_tokens=400, ignore_eos=True))
            # Well before the 60 s call deadline: the node's heartbeat (2 s)
            # or its worker's death is what fails the step.
            kill_during(stream, follower.pid, after=3)
            assert llm.engine.is_dead
        finally:
            llm.shutdown()
    finally:
        reap(follower)


@pytest.mark.timeout(120)
def test_leader_killed_mid_generation_ends_the_follower(tiny_checkpoint: Path) -> None:
    port = free_port()
    follower = start_model_follower(port, "follower-1")
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET, "MPEXEC_NODE_ID": "leader",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    script = LEADER_SCRIPT.format(tiny_checkpoint=str(tiny_checkpoint), port=port, prompts=PROMPTS)
    leader = subprocess.Popen([sys.executable, "-c", script], env=env,
                              start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert leader.stdout is not None
        ready, _, _ = select.select([leader.stdout], [], [], 90)
        assert ready and leader.stdout.readline() == "generating\n"
        follower_tree = tree_of(follower.pid)
        assert len(follower_tree) >= 2  # the follower and its worker
        kill_tree(leader.pid)
        # The follower hears no heartbeat for node_timeout_s (2 s) and ends
        # its worker; 30 s is only the bound of a test that failed.
        assert follower.wait(30) == 1
        assert not alive(follower_tree, 10)
        assert follower.stdout is not None
        assert b"is gone" in follower.stdout.read()
    finally:
        for proc in (leader, follower):
            reap(proc)


def alive(pids: set[int], timeout_s: float) -> set[int]:
    """The members of ``pids`` still running (not zombies) after up to ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    left = pids
    while left and time.monotonic() < deadline:
        left = {p for p in left if _running(p)}
        time.sleep(0.05)
    return {p for p in left if _running(p)}


def _running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and not stat.exited


def test_mpexec_node_id_overrides_the_node_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from mpexec.distributed.shm_collectives import node_identity
    from mpexec.envs import load_envs

    monkeypatch.delenv("MPEXEC_NODE_ID", raising=False)
    host = node_identity()
    assert host.startswith(os.uname().nodename)
    monkeypatch.setenv("MPEXEC_NODE_ID", " rack-2/node-7 ")
    assert node_identity() == "node-id/rack-2/node-7" != host
    monkeypatch.setenv("MPEXEC_NODE_ID", "")
    assert node_identity() == host and load_envs().node_id is None


# -- a worker's own error is not a node's death ----------------------------------------

@pytest.mark.timeout(120)
def test_a_worker_value_error_across_two_nodes_arrives_at_once(
        tiny_checkpoint: Path) -> None:
    """TP=2 split 1 + 1; both workers' execute_model raise ValueError.  The
    node timeout is a minute: were the error held back for a node's verdict
    (as it once was), it would arrive after ``patience`` is spent."""
    import threading

    from mpexec import SamplingParams, WorkerError
    from tests.engine.test_worker_errors import raise_in_execute_model

    port = free_port()
    follower = start_model_follower(port, None)
    try:
        llm = make_llm(tiny_checkpoint, 2, 1, nnodes=2, master_port=port,
                       cluster_secret=SECRET, node_timeout_s=60.0, node_heartbeat_s=1.0)
        try:
            llm.engine.executor.collective_rpc(raise_in_execute_model, timeout=30)
            patience = threading.Event()
            timer = threading.Timer(30.0, patience.set)
            timer.start()
            try:
                with pytest.raises(WorkerError, match="a bad batch") as caught:
                    llm.generate(PROMPTS, SamplingParams(max_tokens=4))
                assert not patience.is_set()
            finally:
                timer.cancel()
                timer.join(5)
            assert caught.value.exc_type == "ValueError"
            # the step's requests failed alone: the engine serves on
            assert not llm.engine.is_dead and not llm.engine.executor.is_failed
        finally:
            llm.shutdown()
        assert follower.wait(30) == 0
    finally:
        reap(follower)
