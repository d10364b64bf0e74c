"""``mpexec generate --nnodes 2`` on the leader plus ``mpexec node`` on the follower.

Both are subprocesses on 127.0.0.1, each in its own session, with the
default node identity (so the TP group finds one host and uses shared
memory between the two trees; test_model_two_nodes.py covers gloo); the
tiny checkpoint, greedy sampling, TP=2 split 1 + 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")

from tests.multinode.nodes import ROOT, SECRET, free_port, kill_tree

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PROMPTS = ["hello world", "the quick brown fox jumps"]


def mpexec(*args: str, node_id: str | None = None, secret: str | None = SECRET,
           **env: str) -> subprocess.Popen[str]:
    """``python -m mpexec ARGS`` in a new session (its own process tree)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
               **env}
    for name, value in (("MPEXEC_NODE_ID", node_id), ("MPEXEC_CLUSTER_SECRET", secret)):
        environ.pop(name, None)
        if value is not None:
            environ[name] = value
    return subprocess.Popen([sys.executable, "-m", "mpexec", *args], env=environ,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def generate_args(tiny_checkpoint: Path, *extra: str, tp: int = 2) -> list[str]:
    args = ["generate", "--model", str(tiny_checkpoint), "--json", "--temperature", "0",
            "--max-tokens", "8", "--tp", str(tp), *extra]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    return args


def follower_args(port: int) -> list[str]:
    return ["node", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--join-timeout", "60"]


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    """Wait for ``proc`` (its whole tree is killed if it overstays) and take its output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate(10)
        return -1, out, err + "\n(timed out)"
    return proc.returncode, out, err


def rows(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.timeout(240)
def test_generate_across_two_nodes_prints_what_one_node_prints(tiny_checkpoint: Path) -> None:
    # One process is the reference: tests/engine/test_e2e_model.py shows mp
    # with TP=2 on one node gives its tokens.
    code, out, err = finish(mpexec(*generate_args(tiny_checkpoint, "--backend", "uni", tp=1)), 120)
    assert code == 0, err
    one_node = rows(out)
    port = free_port()
    follower = mpexec(*follower_args(port))
    leader = mpexec(*generate_args(tiny_checkpoint, "--nnodes", "2", "--master-port", str(port)))
    code, out, err = finish(leader, 120)
    f_code, _f_out, f_err = finish(follower, 30)
    assert code == 0, err + f_err
    assert f_code == 0, f_err
    two_nodes = rows(out)
    assert [(r["prompt"], r["text"], r["token_ids"]) for r in two_nodes] == \
        [(r["prompt"], r["text"], r["token_ids"]) for r in one_node]


@pytest.mark.timeout(120)
def test_a_follower_that_never_comes_is_named_with_the_command_to_run(
        tiny_checkpoint: Path) -> None:
    port = free_port()
    leader = mpexec(*generate_args(tiny_checkpoint, "--nnodes", "2", "--master-port", str(port)),
                    MPEXEC_STARTUP_TIMEOUT_SECONDS="3")
    code, _out, err = finish(leader, 60)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert "did not join within 3s" in last and "node 1" in last, err
    assert (f"mpexec node --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 "
            f"--master-port {port}") in last
    assert "Traceback" not in err


@pytest.mark.timeout(240)
def test_generate_with_a_data_parallel_replica_on_the_follower(tiny_checkpoint: Path) -> None:
    """``generate -dp 2 --nnodes 2``: replica 1 lives on node 1, whose ``mpexec
    node`` dials master_port + 1; the outputs are one replica's."""
    code, out, err = finish(mpexec(*generate_args(tiny_checkpoint, "--backend", "uni", tp=1)), 120)
    assert code == 0, err
    one_replica = rows(out)
    port = free_port()
    follower = mpexec(*follower_args(port + 1))
    leader = mpexec(*generate_args(tiny_checkpoint, "--nnodes", "2", "--master-port", str(port),
                                   "--data-parallel-size", "2", tp=1))
    code, out, err = finish(leader, 120)
    f_code, _f_out, f_err = finish(follower, 30)
    assert code == 0, err + f_err
    assert f_code == 0, f_err
    assert [(r["prompt"], r["token_ids"]) for r in rows(out)] == \
        [(r["prompt"], r["token_ids"]) for r in one_replica]


def test_a_follower_rank_is_told_the_port_of_its_replica(tiny_checkpoint: Path) -> None:
    proc = mpexec(*generate_args(tiny_checkpoint, "--nnodes", "4", "--node-rank", "3",
                                 "--master-port", "7000", "-dp", "2", tp=2))
    code, _out, err = finish(proc, 60)
    assert code == 2, err
    assert "mpexec node --nnodes 4 --node-rank 3 --master-addr 127.0.0.1 --master-port 7001" \
        in err, err
