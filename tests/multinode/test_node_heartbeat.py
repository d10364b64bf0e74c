"""Heartbeats between nodes judge silence net of the observer's own lateness.

A heartbeat thread that was not running (a loaded machine, a paused VM)
must not call its peer lost for a gap its own absence explains; a peer
silent while the observer ran on time is lost as before.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from mpexec.executor.nodes.wire import Liveness


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _turns(liveness: Liveness, clock: FakeClock, seconds: float) -> float:
    """Run the observer's loop on time for ``seconds``; the last tick's now."""
    now = liveness.tick()
    end = clock.now + seconds
    while clock.now < end:
        clock.now += liveness.period_s
        now = liveness.tick()
    return now


def test_a_peer_silent_while_the_observer_ran_on_time_is_silent() -> None:
    clock = FakeClock()
    liveness = Liveness(0.05, clock)
    liveness.tick()
    heard = liveness.stamp()
    now = _turns(liveness, clock, 3.0)
    assert liveness.silence(heard, now) == pytest.approx(3.0, abs=0.06)


def test_the_observers_own_lateness_is_not_the_peers_silence() -> None:
    clock = FakeClock()
    liveness = Liveness(0.05, clock)
    _turns(liveness, clock, 1.0)
    heard = liveness.stamp()
    clock.now += 0.05
    liveness.tick()
    clock.now += 3.0  # this thread did not run for 3 s
    now = liveness.tick()
    assert liveness.silence(heard, now) == pytest.approx(0.1, abs=0.01)
    # Lateness before the peer was last heard does not excuse it later.
    heard = liveness.stamp()
    now = _turns(liveness, clock, 2.5)
    assert liveness.silence(heard, now) == pytest.approx(2.5, abs=0.06)


def test_only_a_turn_late_beyond_the_jitter_counts() -> None:
    clock = FakeClock()
    liveness = Liveness(0.05, clock)
    liveness.tick()
    clock.now += 0.02  # a poll that returned early: not late
    liveness.tick()
    for _ in range(100):  # a few milliseconds late each turn (the GIL, timer slack)
        clock.now += 0.05 + 0.01
        liveness.tick()
    assert liveness.late_s == 0.0
    clock.now += 0.25  # a poll of 0.05 and 0.2 s without a CPU
    liveness.tick()
    assert liveness.late_s == pytest.approx(0.2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["MpexecNodeMonitor", "MpexecNodeHeartbeat"],
                         ids=["leader-wakes-first", "follower-wakes-first"])
def test_leader_and_follower_stalled_together_do_not_call_each_other_lost(
        leak_check: None, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """Both heartbeat threads stop at once (injected: what a heavily loaded
    machine or a paused VM does to them), for 2.5 s and 2.8 s, with a node
    timeout of 1 s.  The one that wakes first finds its peer silent for
    2.5 s or more, a gap its own absence explains: nobody is lost."""
    pytest.importorskip("zmq")
    from mpexec.executor.nodes.follower import NodeClient
    from mpexec.executor.nodes.leader import NodeServer, node_assignment
    from tests.multinode.nodes import SECRET, free_port
    from tests.multinode.test_two_nodes import two_node_config

    stall = threading.Event()
    stalled: set[str] = set()
    tick = Liveness.tick

    def maybe_stalled_tick(self: Liveness) -> float:
        me = threading.current_thread().name
        if stall.is_set() and me not in stalled:
            stalled.add(me)
            time.sleep(2.5 if me == first else 2.8)
        return tick(self)

    monkeypatch.setattr(Liveness, "tick", maybe_stalled_tick)
    port = free_port()
    server = NodeServer(SECRET, "127.0.0.1", port, 2, 1, heartbeat_s=0.2, timeout_s=1.0)
    client = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    config = two_node_config(port, tp=2)
    got: list[Any] = []
    joiner = threading.Thread(target=lambda: got.append(client.join(30)))
    node = server.nodes[1]
    try:
        joiner.start()
        server.admit(lambda rank: node_assignment(config, None, "tcp://x", rank),  # type: ignore[arg-type]
                     time.monotonic() + 30, 30.0)
        joiner.join(30)
        assert len(got) == 1
        client.start_heartbeat(0.2, 1.0)
        time.sleep(0.5)  # a few heartbeats both ways
        stall.set()
        deadline = time.monotonic() + 20
        while len(stalled) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stalled == {"MpexecNodeMonitor", "MpexecNodeHeartbeat"}
        time.sleep(2.8 + 1.5)  # the stall, then longer than the timeout
        assert not node.gone.is_set(), node.how
        assert not client.lost
    finally:
        joiner.join(30)
        client.close()
        node.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_follower_whose_leader_falls_silent_still_calls_it_lost(
        leak_check: None) -> None:
    pytest.importorskip("zmq")
    from mpexec.executor.nodes.follower import NodeClient
    from mpexec.executor.nodes.leader import NodeServer, node_assignment
    from tests.multinode.nodes import SECRET, free_port
    from tests.multinode.test_two_nodes import two_node_config

    port = free_port()
    server = NodeServer(SECRET, "127.0.0.1", port, 2, 1, heartbeat_s=0.2, timeout_s=30.0)
    client = NodeClient(SECRET, "127.0.0.1", port, 1, 2)
    config = two_node_config(port, tp=2)
    got: list[Any] = []
    joiner = threading.Thread(target=lambda: got.append(client.join(30)))
    try:
        joiner.start()
        server.admit(lambda rank: node_assignment(config, None, "tcp://x", rank),  # type: ignore[arg-type]
                     time.monotonic() + 30, 30.0)
        joiner.join(30)
        client.start_heartbeat(0.2, 1.0)
        server._stop.set()  # the monitor ends: no more PINGs from the leader
        server.nodes[1].gone.set()
        assert client.changed.wait(20) and "is gone (no heartbeat for" in client.lost
    finally:
        joiner.join(30)
        client.close()
        server.nodes[1].close()
        server.close()
