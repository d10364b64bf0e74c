"""A disaggregated-prefill producer frozen (SIGSTOP) *mid-transfer*, with the
consumer's workers started by spawn: the producer has answered the lookups and
its workers are serving the consumer's fetch when it stops.  Each request gets
a typed ``KVTransferError`` within the connector's timeout and is computed
locally (the colocated tokens); no KV block leaks and ``leak_check`` finds no
process, descriptor or shared memory left.

(test_disagg_spawn.py freezes the producer before the consumer asks;
test_disagg_peer.py kills it mid-transfer.)
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_disagg_peer import (
    peer,
    producer_process,  # noqa: F401 - a fixture
    zmq_zero_copy_collector,  # noqa: F401 - a fixture
)
from tests.engine.test_disagg_prefill import PROMPTS, params
from tests.engine.test_disagg_spawn import colocated, spawn  # noqa: F401 - fixtures
from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("spawn", "leak_check")]


@pytest.mark.parametrize("producer_process", ["tests.engine.kv_connectors:StallingPeerConnector"],
                         indirect=True)
@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_producer_frozen_mid_transfer(tiny_checkpoint: Path,
                                      colocated: list[list[int]],  # noqa: F811
                                      producer_process: tuple[Any, int, Path],  # noqa: F811
                                      transport: str, spawn: list[str]) -> None:  # noqa: F811
    from mpexec.models.kv_connector import KVTransferError

    process, port, marker_dir = producer_process
    stalled = marker_dir / "stalled"
    frozen = threading.Event()

    def freeze_when_serving() -> None:
        deadline = time.monotonic() + 60
        while not stalled.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGSTOP)
        frozen.set()

    freezer = threading.Thread(target=freeze_when_serving, daemon=True)
    try:
        with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                      kv_transfer_config=peer("kv_consumer", port, transport,
                                              timeout_s=1.0)) as consumer:
            free = consumer.engine.scheduler.blocks.num_free_blocks
            freezer.start()
            out = consumer.generate(PROMPTS, params())
            freezer.join(timeout=70)
            connector: Any = consumer.engine.scheduler.connector
            assert frozen.is_set() and spawn and set(spawn) == {"spawn"}, spawn
            assert [o.token_ids for o in out] == colocated
            errors = connector.transfer_errors
            assert errors and all(isinstance(e, KVTransferError) for e in errors.values())
            assert connector.num_failed_loads >= 1
            assert consumer.engine.scheduler.blocks.num_free_blocks == free
    finally:
        # the producer sleeps in its stall for a minute more: end it here
        process.send_signal(signal.SIGKILL)
        process.send_signal(signal.SIGCONT)
        process.wait(timeout=30)
