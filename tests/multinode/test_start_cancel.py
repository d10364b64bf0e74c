"""A start-up that waits can be cancelled: ``SomeExecutor(config, cancel=event)``.

Here the start waits for a follower node that never comes (the wait a data
parallel replica's rebuild makes for a lost node); another thread sets the
event, and the constructor raises ``WorkerStartupError`` long before
``startup_timeout_s`` (600 s), having ended its workers and released its
ports: the pytest timeout bounds the test, ``leak_check`` proves nothing is
left.  The LLM-level case (``shutdown()`` during such a rebuild) is in
test_dp_nodes.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

pytest.importorskip("zmq")

from mpexec.config import ParallelConfig
from mpexec.errors import WorkerStartupError
from mpexec.executor import MultiprocExecutor
from tests.multinode.nodes import free_port
from tests.multinode.test_two_nodes import assert_port_free, two_node_config

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]


@pytest.mark.parametrize("remote_replica", [False, True],
                         ids=["a-local-rank-waits", "a-remote-replica-waits"])
def test_a_start_waiting_for_a_follower_gives_up_when_cancelled(remote_replica: bool) -> None:
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    config = two_node_config(port, tp=2, startup_timeout_s=600.0)
    if remote_replica:  # DP rank 1 wholly on node 1, driven from here with no local worker
        config = config.replace(parallel=ParallelConfig(
            tensor_parallel_size=1, data_parallel_size=2, data_parallel_rank=1, nnodes=2,
            master_port=port, remote_replica=True))
    cancel = threading.Event()
    timer = threading.Timer(1.0, cancel.set)
    timer.start()
    try:
        with pytest.raises(WorkerStartupError, match="start-up was cancelled"):
            MultiprocExecutor(config, cancel=cancel)
    finally:
        timer.cancel()
    assert_port_free(config.parallel.node_port)


def test_a_start_cancelled_before_it_begins_starts_nothing() -> None:
    port = free_port(2)  # and master_port + 1, DP rank 1's node channel
    config = two_node_config(port, tp=2, startup_timeout_s=600.0)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(WorkerStartupError, match="start-up was cancelled"):
        MultiprocExecutor(config, cancel=cancel)
    assert_port_free(port)
    assert dataclasses.is_dataclass(config)  # the config is untouched and reusable
