"""Starting follower nodes as separate process trees on 127.0.0.1 (tests only)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import descendants

SECRET = "a-test-cluster-secret-0123456789"
ROOT = Path(__file__).resolve().parents[2]


def free_port(count: int = 1) -> int:
    """A loopback port free right now (the follower dials it before the leader
    binds), and with ``count`` > 1 the ``count - 1`` after it too (data
    parallel replicas' nodes dial ``master_port + DP rank``: a port the kernel
    picked is free, the one after it need not be)."""
    for _ in range(100):
        with contextlib.ExitStack() as probes:
            probe = probes.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
            try:
                for offset in range(1, count):
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            except (OSError, OverflowError):  # taken, or past 65535
                continue
            return port
    raise RuntimeError(f"no {count} consecutive free loopback ports in 100 tries")


def start_follower(port: int, node_rank: int = 1, nnodes: int = 2,
                   secret: str = SECRET, cli: bool = False,
                   node_id: str | None = None) -> subprocess.Popen[bytes]:
    """A follower in a new session: its own process tree, not one of ours
    (``node_id``: seen as that node, MPEXEC_NODE_ID)."""
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": secret,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    if node_id is not None:
        env["MPEXEC_NODE_ID"] = node_id
    if cli:
        args = [sys.executable, "-m", "mpexec", "node", "--nnodes", str(nnodes),
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    else:
        args = [sys.executable, "-c",
                "import sys, logging; logging.basicConfig(level=logging.INFO); "
                "from mpexec.executor.nodes.follower import run_follower; "
                f"sys.exit(run_follower({nnodes}, {node_rank}, '127.0.0.1', {port}, "
                "join_timeout_s=60))"]
    return subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def tree_of(pid: int) -> set[int]:
    return {pid} | descendants(pid)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` first, then its descendants (found before): a leader
    killed after one of its workers could still see that death and end its
    followers in order (BYE), which is not the crash a test means."""
    tree = tree_of(pid)
    for p in [pid, *(tree - {pid})]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(proc: subprocess.Popen[bytes]) -> None:
    """However a test ended: the process tree killed, waited for, its pipe closed."""
    kill_tree(proc.pid)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def signal_tree(pid: int, signum: int) -> set[int]:
    """Send ``signum`` to ``pid`` and each of its descendants; the pids signalled."""
    tree = tree_of(pid)
    for p in tree:
        try:
            os.kill(p, signum)
        except ProcessLookupError:
            pass
    return tree


def kill_during(stream: Any, pid: int, after: int) -> None:
    """Read ``stream`` and kill ``pid``'s tree after ``after`` outputs: the
    stream must end in the ``WorkerDiedError`` that names node 1."""
    from mpexec.errors import WorkerDiedError

    with pytest.raises(WorkerDiedError, match="node 1"):
        for n, _ in enumerate(stream):
            if n == after:
                kill_tree(pid)
