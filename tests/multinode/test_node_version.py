"""The node handshake's version check: another mpexec is refused at once, on both ends.

JOIN carries the follower's ``"<NODE_PROTOCOL> <mpexec.__version__>"`` (and nnodes),
CONFIG the leader's.  A leader refuses a follower of another version (plain
text, naming both) and keeps waiting for one of its own, as for a wrong
secret; a follower refused, or sent a CONFIG of another version, exits 1
naming both versions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.errors import NodeVersionError, WorkerStartupError
from mpexec.executor.nodes import wire as nodewire
from tests.multinode.nodes import ROOT, SECRET, free_port, reap, start_follower

pytestmark = pytest.mark.usefixtures("leak_check")

OTHER = b"99 9.9.9"  # a node protocol and mpexec version no one runs


def start_follower_of_another_version(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    code = ("import sys; import mpexec.executor.nodes.wire as wire; wire.NODE_PROTOCOL = 99; "
            "from mpexec.executor.nodes.follower import run_follower; "
            f"sys.exit(run_follower(2, 1, '127.0.0.1', {port}, join_timeout_s=60))")
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_versions_are_described_and_compared() -> None:
    assert nodewire.this_version() == f"{nodewire.NODE_PROTOCOL} {_release()}".encode()
    assert nodewire.version_mismatch(nodewire.this_version(), "follower", "leader") is None
    line = nodewire.version_mismatch(OTHER, "follower", "leader")
    assert line is not None and line.startswith(nodewire.VERSION_REFUSED)
    assert f"leader runs mpexec {_release()} (node protocol {nodewire.NODE_PROTOCOL})" in line
    assert "follower mpexec 9.9.9 (node protocol 99)" in line
    assert "older than the node protocol check" in (
        nodewire.version_mismatch(None, "follower", "leader") or "")
    assert len(line.encode()) < 200  # a refusal carries at most 200 bytes


def _release() -> str:
    from mpexec import __version__

    return __version__


@pytest.mark.timeout(120)
def test_a_follower_of_another_version_is_refused_and_the_leader_waits_for_a_right_one(
        ) -> None:
    from mpexec.executor import MultiprocExecutor
    from tests.multinode.test_two_nodes import two_node_config

    port = free_port()
    made: list[Any] = []
    failed: list[BaseException] = []

    def lead() -> None:
        try:
            made.append(MultiprocExecutor(two_node_config(port, tp=2, startup_timeout_s=90.0)))
        except BaseException as exc:
            failed.append(exc)

    wrong = start_follower_of_another_version(port)
    right = None
    leader = threading.Thread(target=lead)
    leader.start()
    try:
        # Refused at once: it exits while the leader still waits (90 s).
        assert wrong.wait(60) == 1
        assert leader.is_alive() and not made and not failed
        assert wrong.stdout is not None
        out = wrong.stdout.read().decode()
        assert "NodeVersionError" in out and "refused to admit this node" in out
        assert f"leader runs mpexec {_release()} (node protocol {nodewire.NODE_PROTOCOL})" \
            in out and "(node protocol 99)" in out
        right = start_follower(port)
        leader.join(90)
        assert not failed, failed
        executor = made[0]
        assert [r[0] for r in executor.collective_rpc("whoami")] == [0, 1]
        executor.shutdown()
        assert right.wait(30) == 0
    finally:
        leader.join(100)
        for executor in made:
            executor.shutdown()
        for proc in (wrong, right):
            if proc is not None:
                reap(proc)


def _server(port: int) -> Any:
    from mpexec.executor.nodes.leader import NodeServer

    return NodeServer(SECRET, "127.0.0.1", port, 2, 1, heartbeat_s=0.2, timeout_s=5.0)


def close(server: Any) -> None:
    for node in server.nodes.values():
        node.close()  # its death pipe; the last one closes the server
    server.close()


def test_the_leader_names_the_refused_version_when_start_up_times_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.executor.nodes import follower as node_module
    from mpexec.executor.nodes.follower import NodeClient

    monkeypatch.setattr(node_module, "join_parts", lambda nonce, nnodes: [  # the JOIN
        nodewire.NONCE.pack(nonce), OTHER, str(nnodes).encode()])
    port = free_port()
    server = _server(port)
    client = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    errors: list[BaseException] = []

    def join() -> None:
        try:
            client.join(30)
        except BaseException as exc:
            errors.append(exc)

    joiner = threading.Thread(target=join)
    try:
        joiner.start()
        with pytest.raises(WorkerStartupError, match=r"did not join.*node 1 \(ranks 1-1\) "
                           r"\(refused a follower: version mismatch.*node protocol 99"):
            server.admit(lambda rank: None, time.monotonic() + 3.0, 3.0)
        joiner.join(30)
        assert len(errors) == 1 and isinstance(errors[0], NodeVersionError)
        assert "(node protocol 99)" in str(errors[0])
    finally:
        joiner.join(30)
        client.close()
        close(server)


def test_a_follower_refuses_a_config_of_another_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's CONFIG names another version: the follower refuses it
    before unpickling anything and reports FAILED, so the leader does not
    wait out the heartbeat."""
    from mpexec.executor.nodes import leader as cluster
    from mpexec.executor.nodes.follower import NodeClient

    monkeypatch.setattr(cluster, "this_version", lambda: OTHER)  # the leader's CONFIG
    port = free_port()
    server = _server(port)
    client = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    admitted = threading.Thread(
        target=server.admit, args=(lambda rank: "not unpickled", time.monotonic() + 30, 30.0))
    try:
        admitted.start()
        with pytest.raises(NodeVersionError, match=r"the follower runs mpexec .*the leader "
                           r"mpexec 9\.9\.9 \(node protocol 99\)"):
            client.join(30)
        admitted.join(30)
        node = server.nodes[1]
        assert node.gone.wait(30) and "version mismatch" in node.how
    finally:
        admitted.join(30)
        client.close()
        close(server)
