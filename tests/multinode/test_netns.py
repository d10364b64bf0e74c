"""Two nodes in two network namespaces joined by a veth pair, the link cut
mid-stream (root only: skipped with the reason elsewhere).

The leader runs here, in the root namespace, on 10.77.N.1; the follower runs
in a namespace of its own (``ip netns exec``) on 10.77.N.2.  Every name
(namespace, veth ends, subnet) is unique to the test, and the fixture removes
them even when the test fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("zmq")

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.errors import WorkerDiedError
from mpexec.executor import MultiprocExecutor
from tests.multinode.nodes import ROOT, SECRET, reap

WORKER = "tests.executor.workers:EchoWorker"


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"mpxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_WHY_NOT = _why_not()
pytestmark = [pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT)),
              pytest.mark.timeout(120)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Link:
    ns: str
    host_end: str
    leader_ip: str
    follower_ip: str

    def down(self) -> None:
        _ip("link", "set", self.host_end, "down")

    def up(self) -> None:
        _ip("link", "set", self.host_end, "up")


def _exists(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


@pytest.fixture
def link() -> Iterator[Link]:
    tag = uuid.uuid4().hex[:6]
    subnet = 1 + int(tag[:4], 16) % 250
    made = Link(f"mpx{tag}", f"mpxh{tag}", f"10.77.{subnet}.1", f"10.77.{subnet}.2")
    ns_end = f"mpxn{tag}"
    try:
        _ip("netns", "add", made.ns)
        _ip("link", "add", made.host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", made.ns)
        _ip("addr", "add", f"{made.leader_ip}/24", "dev", made.host_end)
        _ip("link", "set", made.host_end, "up")
        _ip("-n", made.ns, "addr", "add", f"{made.follower_ip}/24", "dev", ns_end)
        _ip("-n", made.ns, "link", "set", ns_end, "up")
        _ip("-n", made.ns, "link", "set", "lo", "up")
        yield made
    finally:
        # Deleting the namespace deletes its veth end, and with it the pair.
        subprocess.run(["ip", "netns", "del", made.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", made.host_end], capture_output=True)
    assert not _exists("link", "show", made.host_end)
    assert made.ns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                         text=True).stdout


def _free_port(ip: str) -> int:
    with socket.socket() as probe:
        probe.bind((ip, 0))
        return int(probe.getsockname()[1])


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError:
            return False
        return True


def _start_follower(link: Link, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    code = ("import sys; from mpexec.executor.nodes.follower import run_follower; "
            f"sys.exit(run_follower(2, 1, {link.leader_ip!r}, {port}, "
            f"bind_addr={link.follower_ip!r}, join_timeout_s=60))")
    return subprocess.Popen(["ip", "netns", "exec", link.ns, sys.executable, "-c", code],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _config(link: Link, port: int, **fields: Any) -> ExecutorConfig:
    return ExecutorConfig(
        worker_cls=WORKER, device_type="cpu", shutdown_grace_s=2.0, shutdown_term_s=2.0,
        cluster_secret=SECRET, startup_timeout_s=60.0,
        parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2, master_addr=link.leader_ip,
                                master_port=port), **fields)


def _stop(follower: subprocess.Popen[bytes]) -> None:
    reap(follower)


def test_a_short_cut_mid_stream_loses_no_call(link: Link, leak_check: None) -> None:
    port = _free_port(link.leader_ip)
    follower = _start_follower(link, port)
    try:
        executor = MultiprocExecutor(_config(link, port, node_timeout_s=3.0))
        try:
            assert executor.collective_rpc("add", args=(1,), kwargs={"b": 1}) == [2, 3]
            futures = []
            for i in range(120):
                if i == 40:
                    link.down()
                futures.append(executor.collective_rpc("add", args=(i,), non_block=True))
                if i == 40:
                    time.sleep(0.5)  # well under node_timeout_s
                    link.up()
            assert [f.result(60) for f in futures] == [[i, i + 1] for i in range(120)]
            assert executor.collective_rpc("echo", args=("after",)) == ["after", "after"]
        finally:
            executor.shutdown()
        assert follower.wait(30) == 0
        assert _port_free(link.leader_ip, port)
    finally:
        _stop(follower)


def test_a_long_cut_fails_calls_naming_the_node_and_the_follower_exits(
        link: Link, leak_check: None) -> None:
    port = _free_port(link.leader_ip)
    follower = _start_follower(link, port)
    try:
        executor = MultiprocExecutor(_config(link, port))
        try:
            assert executor.collective_rpc("echo", args=(1,)) == [1, 1]
            pending = executor.collective_rpc("sleep", args=(60,), non_block=True)
            link.down()
            with pytest.raises(WorkerDiedError, match=r"node 1 \(rank"):
                pending.result(30)  # node_timeout_s (2 s), well before the call's 60 s
            with pytest.raises(WorkerDiedError, match="node 1"):
                executor.collective_rpc("echo", args=(2,), timeout=30)
            # The follower hears no heartbeat either: it ends its workers and exits.
            assert follower.wait(30) == 1
        finally:
            executor.shutdown()
        assert _port_free(link.leader_ip, port)
    finally:
        _stop(follower)
