"""What a caller sees when teardown races start-up, a worker stops or hangs, or a
worker dies while the executor is idle.

Every case names the worker (rank, pid) well within a bound that does not
depend on the longest legitimate call, and ``leak_check`` proves every
process, descriptor and mapping was released (a stopped worker included).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from tests.executor.conftest import make_config

from mpexec.errors import WorkerDiedError, WorkerStartupError
from mpexec.executor import MultiprocExecutor

pytestmark = pytest.mark.usefixtures("leak_check")

WAIT_S = 30.0


def test_queues_torn_down_before_the_handshake_fail_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A monitor tearing the queues down while start-up is at the handshake:
    the caller gets WorkerStartupError, never an error from released memory."""
    import mpexec.executor.multiproc as multiproc

    original = multiproc.handshake

    def torn_down(broadcast: Any, replies: Any, *args: Any, **kwargs: Any) -> None:
        thread = threading.Thread(target=broadcast.shutdown)
        thread.start()
        thread.join(WAIT_S)
        original(broadcast, replies, *args, **kwargs)

    monkeypatch.setattr(multiproc, "handshake", torn_down)
    with pytest.raises(WorkerStartupError, match="queue handshake was cut short"):
        MultiprocExecutor(make_config())


def test_a_reply_queue_torn_down_during_the_handshake_fails_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import mpexec.executor.multiproc as multiproc

    original = multiproc.handshake

    def torn_down(broadcast: Any, replies: Any, *args: Any, **kwargs: Any) -> None:
        threading.Timer(0.0, replies[1].shutdown).start()
        original(broadcast, replies, *args, **kwargs)

    monkeypatch.setattr(multiproc, "handshake", torn_down)
    with pytest.raises(WorkerStartupError):
        MultiprocExecutor(make_config())
