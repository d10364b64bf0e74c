"""A follower that does not fit the leader's layout is refused at once.

JOIN carries the follower's ``nnodes`` beside its node rank.  The leader
refuses another nnodes, a node rank outside 1..nnodes-1 and a node rank a
follower already joined as, in plain words naming both sides' values, and
keeps waiting for a follower that fits; the refused follower raises
``NodeLayoutError`` (``mpexec node`` exits 2 with one line).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.errors import NodeLayoutError, WorkerStartupError
from mpexec.executor.nodes import wire as nodewire
from tests.multinode.nodes import SECRET, free_port, reap, start_follower

pytestmark = pytest.mark.usefixtures("leak_check")


def test_layout_mismatches_are_worded_with_both_values() -> None:
    assert nodewire.layout_mismatch(1, 2, 2, taken=False) is None
    wrong = nodewire.layout_mismatch(1, 3, 2, taken=False) or ""
    assert wrong.startswith(nodewire.LAYOUT_REFUSED)
    assert "the leader runs nnodes=2, this follower was started with nnodes=3" in wrong
    out = nodewire.layout_mismatch(5, 2, 2, taken=False) or ""
    assert "node_rank 5 is out of range 1..1 (nnodes=2" in out
    assert "duplicate node rank" in (nodewire.layout_mismatch(1, 2, 2, taken=True) or "")
    assert "nnodes=?" in (nodewire.layout_mismatch(1, None, 2, taken=False) or "")
    # Two data parallel ranks over 4 nodes: each leader has one follower.
    assert nodewire.layout_mismatch(1, 4, 4, taken=False, followers=1) is None
    assert "node_rank 2 is out of range 1..1 (nnodes=4" in (
        nodewire.layout_mismatch(2, 4, 4, taken=False, followers=1) or "")
    for line in (wrong, out):
        assert len(line.encode()) < 200  # a refusal carries at most 200 bytes


@pytest.mark.timeout(120)
def test_a_follower_with_the_wrong_nnodes_is_refused_at_once_and_the_right_one_admitted(
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

    wrong = start_follower(port, nnodes=3, cli=True)
    right = None
    leader = threading.Thread(target=lead)
    leader.start()
    try:
        # Refused at once: it exits (usage, 2) while the leader still waits (90 s).
        assert wrong.wait(60) == 2
        assert leader.is_alive() and not made and not failed
        assert wrong.stdout is not None
        out = wrong.stdout.read().decode()
        assert "the leader runs nnodes=2, this follower was started with nnodes=3" in out
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
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


def _close(server: Any, *clients: Any) -> None:
    for client in clients:
        client.close()
    for node in server.nodes.values():
        node.close()  # its death pipe; the last one closes the server
    server.close()


def _join(client: Any, into: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            into.append(client.join(30))
        except BaseException as exc:
            into.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_node_rank_out_of_range_is_refused_and_named_when_the_start_times_out() -> None:
    from mpexec.executor.nodes.follower import NodeClient

    port = free_port()
    server = _server(port)
    client = NodeClient(SECRET, "127.0.0.1", port, 5, 2)
    got: list[Any] = []
    joiner = _join(client, got)
    try:
        with pytest.raises(WorkerStartupError, match=r"did not join.*node 1 \(ranks 1-1\); "
                           r"also refused a follower: layout mismatch: node_rank 5 is out of "
                           r"range 1\.\.1"):
            server.admit(lambda rank: None, time.monotonic() + 3.0, 3.0)
        joiner.join(30)
        assert len(got) == 1 and isinstance(got[0], NodeLayoutError), got
        assert "node_rank 5 is out of range 1..1 (nnodes=2" in str(got[0])
    finally:
        joiner.join(30)
        _close(server, client)


def test_a_second_follower_with_a_taken_node_rank_is_refused() -> None:
    from mpexec.executor.nodes.follower import NodeClient
    from mpexec.executor.nodes.leader import node_assignment
    from tests.multinode.test_two_nodes import two_node_config

    port = free_port()
    server = _server(port)
    first = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    second = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    config = two_node_config(port, tp=2)
    got_first: list[Any] = []
    got_second: list[Any] = []
    joiners = [_join(first, got_first)]
    try:
        server.admit(lambda rank: node_assignment(config, None, "tcp://x", rank),  # type: ignore[arg-type]
                     time.monotonic() + 30, 30.0)
        joiners[0].join(30)
        assert len(got_first) == 1 and not isinstance(got_first[0], BaseException), got_first
        joiners.append(_join(second, got_second))
        joiners[1].join(30)
        assert len(got_second) == 1 and isinstance(got_second[0], NodeLayoutError)
        assert "duplicate node rank: another follower already joined as node 1" \
            in str(got_second[0])
        assert not server.nodes[1].gone.is_set()  # the first one is kept
    finally:
        for joiner in joiners:
            joiner.join(30)
        _close(server, first, second)
