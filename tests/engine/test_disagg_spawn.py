"""Disaggregated prefill through PeerKVConnector with workers started by *spawn*
(``MPEXEC_WORKER_MULTIPROC_METHOD=spawn``), not fork: the one-copy
shared-memory path maps the producer's memfd KV cache from workers that
inherited nothing from the test process.

A TP 2 -> TP 2 transfer gives the colocated tokens; a producer SIGSTOPped
before the consumer asks costs each request a typed ``KVTransferError`` and a
local recomputation; a consumer SIGKILLed while the producer serves it
(shared-memory transport) leaves the producer holding nothing for it and
serving the next consumer.  ``leak_check`` proves no process, descriptor,
mapping or /dev/shm entry is left.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.engine.peer_producer import kill_when_stalled
from tests.engine.test_disagg_peer import (
    SECRET,
    free_ports,
    loadable_blocks,
    peer,
    producer_process,  # noqa: F401 - a fixture
    start_producer,
    zmq_zero_copy_collector,  # noqa: F401 - a fixture
)
from tests.engine.test_disagg_prefill import PROMPTS, params
from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("spawn", "leak_check")]


@pytest.fixture
def spawn(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The start method set to spawn; the methods the executors then used, recorded."""
    from mpexec.executor import multiproc

    used: list[str] = []
    real = multiproc.get_mp_context

    def recording(method: str | None = None) -> Any:
        used.append(str(method))
        return real(method)

    monkeypatch.setenv("MPEXEC_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setattr(multiproc, "get_mp_context", recording)
    return used


@pytest.fixture(scope="module")
def colocated(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint, block_size=4) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params())]


def test_shared_memory_transfer_with_spawned_workers(tiny_checkpoint: Path,
                                                     colocated: list[list[int]],
                                                     spawn: list[str]) -> None:
    from mpexec import SamplingParams

    port = free_ports(4)
    with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                  kv_transfer_config=peer("kv_consumer", port)) as consumer, \
            make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                     kv_transfer_config=peer("kv_producer", port)) as producer:
        assert spawn == ["spawn", "spawn"]  # both engines' workers
        producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        free = consumer.engine.scheduler.blocks.num_free_blocks
        out = consumer.generate(PROMPTS, params())
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        assert connector.num_loaded_blocks == loadable_blocks()
        assert connector.num_failed_loads == 0 and not connector.transfer_errors
        assert consumer.engine.scheduler.blocks.num_free_blocks == free


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_producer_sigstopped(tiny_checkpoint: Path, colocated: list[list[int]],
                             producer_process: tuple[Any, int, Path],  # noqa: F811
                             transport: str) -> None:
    """A producer that stops answering (SIGSTOP): each request fails its load with a
    KVTransferError within the timeout and is computed locally; no block leaks."""
    from mpexec.models.kv_connector import KVTransferError

    process, port, _ = producer_process
    process.send_signal(signal.SIGSTOP)
    try:
        with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                      kv_transfer_config=peer("kv_consumer", port, transport,
                                              timeout_s=1.0)) as consumer:
            free = consumer.engine.scheduler.blocks.num_free_blocks
            out = consumer.generate(PROMPTS, params())
            connector: Any = consumer.engine.scheduler.connector
            assert [o.token_ids for o in out] == colocated
            errors = connector.transfer_errors
            assert errors and all(isinstance(e, KVTransferError) for e in errors.values())
            assert connector.num_loaded_blocks == 0
            assert consumer.engine.scheduler.blocks.num_free_blocks == free
    finally:
        process.send_signal(signal.SIGCONT)


def test_consumer_sigkilled_mid_load_over_shared_memory(tiny_checkpoint: Path, tmp_path: Path,
                                                        colocated: list[list[int]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's workers (spawned, TP 2) stall once asked; the consumer (another
    process, shared-memory transport) is SIGKILLed meanwhile.  The producer keeps
    its blocks and serves a second consumer whole."""
    from mpexec import SamplingParams

    stalled = tmp_path / "stalled"
    monkeypatch.setenv("KV_STALL_MARKER", str(stalled))
    monkeypatch.setenv("KV_STALL_S", "2")
    port = free_ports(4)
    config = peer("kv_producer", port)
    config["kv_connector"] = "tests.engine.kv_connectors:StallingPeerConnector"
    config["kv_connector_extra_config"]["secret"] = SECRET
    with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                  kv_transfer_config=config) as producer:
        producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        produced: Any = producer.engine.scheduler.connector
        saved, free = produced.num_saved_blocks, producer.engine.scheduler.blocks.num_free_blocks
        process = start_producer(tiny_checkpoint, peer("kv_consumer", port, "shm",
                                                       timeout_s=30.0), tmp_path / "done")
        kill_when_stalled(process, stalled, what="the consumer")
        with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                      kv_transfer_config=peer("kv_consumer", port, "shm",
                                              timeout_s=30.0)) as consumer:
            out = consumer.generate(PROMPTS, params())
            connector: Any = consumer.engine.scheduler.connector
            assert [o.token_ids for o in out] == colocated
            assert connector.num_loaded_blocks == loadable_blocks()
            assert not connector.transfer_errors
        assert produced.num_saved_blocks == saved
        assert producer.engine.scheduler.blocks.num_free_blocks == free
