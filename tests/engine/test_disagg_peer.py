"""Disaggregated prefill through PeerKVConnector: a producer's KV caches in shared
memory, mapped by a consumer on the same machine or fetched over authenticated ZeroMQ.

Greedy and seeded tokens equal those of one colocated engine, for TP 1 -> 2
and 2 -> 1 through shared memory and for a producer in another process
(a second "node" on loopback) through ZeroMQ; a producer SIGKILLed while a
consumer fetches from it costs each request a typed error and a local
recomputation, and no block or shared memory is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.engine.peer_producer import kill_when_stalled, wait_for_file
from tests.engine.test_disagg_prefill import PROMPTS, params
from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("leak_check")]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "kv-peer-test-secret-0123456789"


def free_ports(count: int) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` are free on loopback right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


def peer(role: str, port: int, transport: str = "shm", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "PeerKVConnector", "kv_role": role,
            "kv_connector_extra_config": {"endpoint": f"tcp://127.0.0.1:{port}",
                                          "secret": SECRET, "transport": transport,
                                          **extra}}


def loadable_blocks() -> int:
    return sum((len(p["prompt_token_ids"]) - 1) // 4 for p in PROMPTS)


@pytest.fixture(scope="module", autouse=True)
def zmq_zero_copy_collector() -> None:
    """pyzmq frees zero-copy frames through one process-wide garbage-collector
    context, started on the first such send and kept for the process's life
    (as multiprocessing's resource tracker): started here, before any test's
    ``leak_check`` counts descriptors, so that it is not taken for a leak."""
    import zmq

    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("inproc://warm-up")
    sender.connect("inproc://warm-up")
    sender.send(bytes(1 << 20), copy=False)
    assert len(receiver.recv()) == 1 << 20
    sender.close(linger=0)
    receiver.close(linger=0)
    context.term()


@pytest.fixture(scope="module")
def colocated(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint, block_size=4) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params())]


def test_settings_are_checked() -> None:
    from mpexec.models.kv_connector import KVConnectorRole, KVTransferConfig, create_connector
    from mpexec.models.kv_connector.peer import worker_endpoint
    from mpexec.models.kv_connector.shared_cache import runs

    assert list(runs([(0, 5), (1, 6), (2, 9), (7, 10), (8, 11)])) == [(0, 5, 2), (2, 9, 1),
                                                                     (7, 10, 2)]
    assert list(runs([])) == []
    assert worker_endpoint("tcp://10.0.0.1:5000", 1) == "tcp://10.0.0.1:5002"
    for extra, message in [({"endpoint": "ipc:///x"}, "tcp://host:port"),
                           ({"endpoint": "tcp://h:1", "transport": "rdma"}, "transport"),
                           ({"endpoint": "tcp://h:1", "colour": 1}, "unknown settings")]:
        config = KVTransferConfig("PeerKVConnector", "kv_consumer",
                                  {"secret": SECRET, **extra})
        with pytest.raises(ValueError, match=message):
            create_connector(config, KVConnectorRole.WORKER)
    both = KVTransferConfig("PeerKVConnector", "kv_both", {"endpoint": "tcp://h:1",
                                                           "secret": SECRET})
    with pytest.raises(ValueError, match="kv_producer or kv_consumer"):
        create_connector(both, KVConnectorRole.WORKER)


@pytest.mark.timeout(60)
def test_a_long_stream_arrives_whole_and_in_order() -> None:
    """More chunks than ZeroMQ's default high-water mark, to a client that
    reads late: none is dropped (a ROUTER drops what it cannot queue)."""
    from mpexec.models.kv_connector.peer_wire import KIND_FETCH, PeerClient, PeerServer

    count = 3000

    def handler(kind: int, request: dict[str, Any]) -> Iterator[tuple[dict[str, Any],
                                                                      list[Any]]]:
        for index in range(count):
            yield ({"more": True} if index < count - 1 else {}), [index.to_bytes(4, "little")
                                                                 * 4096]

    endpoint = f"tcp://127.0.0.1:{free_ports(1)}"
    server = PeerServer(endpoint, SECRET, handler, "test server")
    client = PeerClient(endpoint, SECRET, "test client")
    try:
        stream = client.stream(KIND_FETCH, {}, 30.0)
        got = [next(stream)]
        time.sleep(1.0)  # the server queues the rest meanwhile
        got.extend(stream)
        assert [bytes(parts[0][:4]) for _, parts in got] == \
            [index.to_bytes(4, "little") for index in range(count)]
        assert all(reply == {} for reply, _ in got)
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["repeated", "reordered", "flipped byte", "another key",
                                  "another stream"])
def test_a_stream_chunk_replayed_reordered_or_forged_is_refused(case: str) -> None:
    """Chunks of a stream carry their index under the MAC (keyed BLAKE3 of
    their bytes, HMAC of the header): an authentic chunk repeated, one out of
    its order, one with a flipped byte, one sealed with another secret and one
    replayed from another request's stream are each refused; nothing of a
    refused chunk reaches the caller."""
    import zmq

    from mpexec.ipc.auth import DropCounter
    from mpexec.models.kv_connector.peer_wire import KIND_FETCH, REPLY, PeerClient, _auths

    requests, replies = _auths(SECRET)
    _, forger = _auths("another-secret-0123456789abcdef")
    chunk = [os.urandom(200_000) for _ in range(2)]  # large: frames of their own
    endpoint = f"tcp://127.0.0.1:{free_ports(1)}"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 10_000)  # a client that never asks: no hang
    router.bind(endpoint)
    client = PeerClient(endpoint, SECRET, "test client")

    def seal(seq: int, index: int, by: Any = replies) -> list[Any]:
        return [bytes(f) for f in by.seal(KIND_FETCH | REPLY, 0, seq,
                                          [b'{"more": true}', chunk[index]], aux=index)]

    def answer(frames_of: Any) -> None:
        identity, *frames = router.recv_multipart()
        opened = requests.open(frames, DropCounter("test"))
        assert opened is not None
        for frames in frames_of(opened.seq):
            router.send_multipart([identity, *frames])

    def answers(seq: int) -> list[list[Any]]:
        if case == "repeated":
            return [seal(seq, 0), seal(seq, 0)]
        if case == "reordered":
            return [seal(seq, 1)]
        if case == "flipped byte":
            first, data = seal(seq, 0)
            return [[first, data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]], seal(seq, 1)]
        if case == "another key":
            return [seal(seq, 0, forger), seal(seq, 1)]
        return [old[0], seal(seq, 1)]  # "another stream": chunk 0 of the previous request

    old: list[list[Any]] = []
    try:
        if case == "another stream":  # an earlier request's stream, recorded
            def record(seq: int) -> list[list[Any]]:
                old.append(seal(seq, 0))
                return old

            stream = client.stream(KIND_FETCH, {}, 10.0)
            replier = threading.Thread(target=answer, args=(record,))
            replier.start()
            assert bytes(next(stream)[1][0]) == chunk[0]
            replier.join(timeout=10)
            stream.close()
        stream = client.stream(KIND_FETCH, {}, 10.0)
        replier = threading.Thread(target=answer, args=(answers,))
        replier.start()
        got = []
        with pytest.raises(ValueError, match="was due"):
            for _, parts in stream:
                got.append(bytes(parts[0]))
        replier.join(timeout=10)
        assert got == ([chunk[0]] if case == "repeated" else [])
        refused = {"flipped byte": 1, "another key": 1}.get(case, 0)
        assert client._drops.by_reason.get("bad mac", 0) == refused
    finally:
        client.close()
        router.close()
        context.term()


@pytest.mark.timeout(60)
def test_the_send_ring_refills_a_buffer_only_once_zeromq_let_go_of_it() -> None:
    """A frame still held (queued in ZeroMQ) keeps its buffer: the ring waits,
    and past its bound gives the buffer up to ZeroMQ and takes a fresh one; a
    frame let go of gives its buffer back; closing the ring ends a wait."""
    from mpexec.models.kv_connector.peer_wire import SendRing

    ring = SendRing(2, timeout_s=0.2)
    view = ring.take(1000)
    view[:] = b"a" * 1000
    held = ring.frame()
    second = ring.take(500)
    released = ring.frame()
    with pytest.raises(TimeoutError, match="still queued"):
        ring.take(1000)  # slot 0: ``held`` is still alive
    fresh = ring.take(1000)
    assert fresh.obj is not view.obj
    fresh[:] = b"b" * 1000
    assert bytes(held) == b"a" * 1000  # what ZeroMQ holds is never overwritten
    ring.frame()
    del released
    assert ring.take(400).obj is second.obj  # slot 1, let go of: the same buffer again
    ring.frame()

    waiting = SendRing(1, timeout_s=30.0)
    waiting.take(10)
    keep = waiting.frame()
    errors: list[BaseException] = []

    def take() -> None:
        try:
            waiting.take(10)
        except BaseException as exc:
            errors.append(exc)

    taker = threading.Thread(target=take)
    taker.start()
    time.sleep(0.2)
    waiting.close()
    taker.join(timeout=5)
    assert not taker.is_alive() and "closed" in str(errors[0])
    del keep, held


class _Request:
    def __init__(self, req_id: str, hashes: list[bytes]) -> None:
        self.req_id = req_id
        self.block_hashes = hashes
        self.num_tokens = len(hashes) * 4 + 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_blocks_reused_by_the_producer_are_never_loaded(transport: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Connector level (both sides in this process): the producer worker's
    cache is the shared segment; blocks it published load exactly.  Then its
    block manager hands one of them out again and its worker starts the step
    that overwrites it: a consumer that looked the request up before gets
    every block of that load reported invalid (so the scheduler recomputes
    them), and the index stops offering the block.  A block handed out again
    before its save was published is never published.  Over ZeroMQ each
    plane (a layer's K or V) is its own reply of the stream, gathered into
    the one buffer of the send ring once ZeroMQ has sent the last.  The producer's
    cache outlives its connector."""
    import torch

    from mpexec.models.kv_cache import KVCache
    from mpexec.models.kv_connector import (
        KVConnectorRole,
        KVTransferConfig,
        create_connector,
        peer as peer_module,
    )
    from mpexec.outputs import KVConnectorOutput

    monkeypatch.setattr(peer_module, "CHUNK_BYTES", 1)
    monkeypatch.setattr(peer_module, "RING_SLOTS", 1)  # each chunk waits for the last one sent
    caches = [KVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
    extra = peer("kv_producer", free_ports(2), transport)["kv_connector_extra_config"]
    sides = [create_connector(KVTransferConfig("PeerKVConnector", role, extra, block_size=4),
                              side)
             for role in ("kv_producer", "kv_consumer")
             for side in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
    index, saver, asker, loader = sides
    try:
        saver.register_kv_caches(caches[0])
        loader.register_kv_caches(caches[1])
        shared: Any = saver
        assert shared.shared.data.data_ptr() == caches[0].tensor.data_ptr()

        def produce(blocks: list[int], hashes: list[bytes], publish: bool = True) -> Any:
            index.blocks_allocated(blocks)
            index.blocks_computed(list(zip(blocks, hashes, strict=True)))
            saver.bind_connector_metadata(index.build_connector_meta(None))
            saver.start_load_kv()
            for block in blocks:  # the forward
                caches[0].tensor[:, :, block * 4:(block + 1) * 4].normal_()
            saver.wait_for_save()
            output = KVConnectorOutput(*saver.get_finished())
            if publish:
                index.update_connector_output(output)
            return output

        def look_up(req_id: str, hashes: list[bytes], into: list[int]) -> int:
            request = _Request(req_id, hashes)
            found = asker.get_num_new_matched_tokens(request, 0)
            if found:
                asker.update_state_after_alloc(request, into[:found // 4], found)
            return found

        def load() -> set[int]:
            loader.bind_connector_metadata(asker.build_connector_meta(None))
            loader.start_load_kv()
            sending, recving, invalid = loader.get_finished()
            asker.update_connector_output(KVConnectorOutput(sending, recving, invalid))
            return invalid

        hashes = [bytes([i]) * 16 for i in range(4)]
        produce([0, 1, 2, 3], hashes)
        assert look_up("a", hashes, [4, 5, 6, 7]) == 16
        assert load() == set()
        assert torch.equal(caches[1].tensor[:, :, 16:32], caches[0].tensor[:, :, 0:16])

        assert look_up("b", hashes, [0, 1, 2, 3]) == 16
        index.blocks_allocated([2])  # block 2 handed out again: its KV is overwritten
        saver.bind_connector_metadata(index.build_connector_meta(None))
        saver.start_load_kv()
        caches[0].tensor[:, :, 8:12] = -1.0
        assert load() == {0, 1, 2, 3}
        errors: Any = asker.transfer_errors
        assert set(errors) == {"b"} and errors["b"].req_id == "b"
        assert look_up("c", hashes, [0, 1, 2, 3]) == 8  # the index stops at block 2
        assert load() == set()

        late = [bytes([9]) * 16]
        output = produce([5], late, publish=False)
        index.blocks_allocated([5])  # handed out again before the save is published
        index.update_connector_output(output)
        assert look_up("d", late, [0]) == 0
    finally:
        for side in sides:
            side.close()
    # the producer's cache keeps its memory until the cache itself goes (a worker
    # closes its connector first): reading it now is no segmentation fault
    assert torch.isfinite(caches[0].tensor[:, :, :16]).all()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 2), (2, 1)])
def test_shared_memory_transfer_between_layouts(tiny_checkpoint: Path,
                                                colocated: list[list[int]], producer_tp: int,
                                                consumer_tp: int) -> None:
    from mpexec import SamplingParams

    port = free_ports(4)

    def backend(tp: int) -> str:
        return "uni" if tp == 1 else "mp"

    # the consumer first: its workers fork before the producer starts threads here
    with make_llm(tiny_checkpoint, backend(consumer_tp), consumer_tp, block_size=4,
                  kv_transfer_config=peer("kv_consumer", port)) as consumer, \
            make_llm(tiny_checkpoint, backend(producer_tp), producer_tp, block_size=4,
                     kv_transfer_config=peer("kv_producer", port)) as producer:
        producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        produced: Any = producer.engine.scheduler.connector
        assert produced.num_saved_blocks == sum(len(p["prompt_token_ids"]) // 4
                                                for p in PROMPTS)
        free = consumer.engine.scheduler.blocks.num_free_blocks
        out = consumer.generate(PROMPTS, params())
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        assert connector.num_loaded_blocks == loadable_blocks()
        assert connector.num_failed_loads == 0 and not connector.transfer_errors
        assert consumer.engine.scheduler.blocks.num_free_blocks == free


def start_producer(checkpoint: Path, config: dict[str, Any], ready: Path,
                   ) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
           "OMP_NUM_THREADS": "1", "KV_STALL_MARKER": str(ready.parent / "stalled")}
    return subprocess.Popen([sys.executable, "-m", "tests.engine.peer_producer",
                             str(checkpoint), json.dumps(config), str(ready)],
                            stdin=subprocess.PIPE, env=env, cwd=ROOT)


@pytest.fixture
def producer_process(tiny_checkpoint: Path, tmp_path: Path,
                     request: pytest.FixtureRequest) -> Iterator[tuple[Any, int, Path]]:
    port = free_ports(2)
    kind = getattr(request, "param", "PeerKVConnector")
    config = peer("kv_producer", port)
    config["kv_connector"] = kind
    config["kv_connector_extra_config"]["secret"] = SECRET
    ready = tmp_path / "ready"
    process = start_producer(tiny_checkpoint, config, ready)
    try:
        wait_for_file(process, ready, timeout_s=100, what="the producer", poll_s=0.1)
        yield process, port, tmp_path
    finally:
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        elif process.stdin is not None:
            process.stdin.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zeromq_transfer_from_another_process(tiny_checkpoint: Path, colocated: list[list[int]],
                                              producer_process: tuple[Any, int, Path]) -> None:
    _, port, _ = producer_process
    with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                  kv_transfer_config=peer("kv_consumer", port, "zmq")) as consumer:
        free = consumer.engine.scheduler.blocks.num_free_blocks
        out = consumer.generate(PROMPTS, params())
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        assert connector.num_loaded_blocks == loadable_blocks()
        assert connector.num_failed_loads == 0 and not connector.transfer_errors
        assert consumer.engine.scheduler.blocks.num_free_blocks == free


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("producer_process", ["tests.engine.kv_connectors:StallingPeerConnector"],
                         indirect=True)
@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_producer_killed_mid_transfer(tiny_checkpoint: Path, colocated: list[list[int]],
                                      producer_process: tuple[Any, int, Path],
                                      transport: str) -> None:
    """The producer's workers stall on every request once the lookups are answered;
    the test SIGKILLs the producer meanwhile.  Each request gets a KVTransferError
    within the timeout and is computed by the consumer."""
    from mpexec.models.kv_connector import KVTransferError

    process, port, marker_dir = producer_process
    stalled = marker_dir / "stalled"

    with make_llm(tiny_checkpoint, "mp", 2, block_size=4,
                  kv_transfer_config=peer("kv_consumer", port, transport,
                                          timeout_s=1.0)) as consumer, \
            ThreadPoolExecutor(1) as pool:  # kill_when_stalled's own waits bound its exit
        free = consumer.engine.scheduler.blocks.num_free_blocks
        killer = pool.submit(kill_when_stalled, process, stalled, timeout_s=60,
                             what="the producer")
        started = time.monotonic()
        out = consumer.generate(PROMPTS, params())
        elapsed = time.monotonic() - started
        killer.result(timeout=90)
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        assert process.wait(timeout=10) == -signal.SIGKILL
        errors = connector.transfer_errors
        assert errors and all(isinstance(e, KVTransferError) for e in errors.values())
        assert set(errors) <= {o.request_id for o in out}
        assert connector.num_failed_loads >= 1
        assert consumer.engine.scheduler.blocks.num_free_blocks == free
        # one timeout per producer shard, then the peer is left alone (RETRY_S)
        assert elapsed < 60


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_consumer_killed_mid_transfer(tiny_checkpoint: Path, tmp_path: Path,
                                      colocated: list[list[int]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer SIGKILLed while the producer serves it: the producer holds
    nothing for it (its reply goes nowhere) and serves the next consumer."""
    from mpexec import SamplingParams

    stalled = tmp_path / "stalled"
    monkeypatch.setenv("KV_STALL_MARKER", str(stalled))
    monkeypatch.setenv("KV_STALL_S", "2")
    port = free_ports(2)
    config = peer("kv_producer", port)
    config["kv_connector"] = "tests.engine.kv_connectors:StallingPeerConnector"
    with make_llm(tiny_checkpoint, block_size=4, kv_transfer_config=config) as producer:
        producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        produced: Any = producer.engine.scheduler.connector
        saved, free = produced.num_saved_blocks, producer.engine.scheduler.blocks.num_free_blocks
        process = start_producer(tiny_checkpoint, peer("kv_consumer", port, "zmq",
                                                       timeout_s=30.0), tmp_path / "done")
        kill_when_stalled(process, stalled, what="the consumer")
        with make_llm(tiny_checkpoint, block_size=4,
                      kv_transfer_config=peer("kv_consumer", port, "zmq",
                                              timeout_s=30.0)) as consumer:
            out = consumer.generate(PROMPTS, params())
            connector: Any = consumer.engine.scheduler.connector
            assert [o.token_ids for o in out] == colocated
            assert connector.num_loaded_blocks == loadable_blocks()
            assert not connector.transfer_errors
        assert produced.num_saved_blocks == saved
        assert producer.engine.scheduler.blocks.num_free_blocks == free
