"""KV reuse benchmarks: prefix caching and CPU offload, on the default model.

Prints one table from one run::

    python benchmarks/bench_kv.py [--model default] [--prefix-len 1500] [--system-len 1000]
                                  [--requests 32] [--repeats 3] [--threads 1]
                                  [--decoders 4] [--decode-tokens 24] [--long-len 384]
                                  [--arrival-every 5] [--parts reuse,transfer,mixed]

1. time to first token of a request whose ``--prefix-len``-token prefix is
   in the prefix cache, against the same kind of request cold (a fresh
   prefix); median over ``--repeats`` prefixes; target <= 0.2x;
2. ``--requests`` requests sharing a ``--system-len``-token system prompt
   (each with its own 32-token question, 16 output tokens), arriving at
   once: output tokens/s with prefix caching on vs off; target >= 2x;
3. CPU offload: time to first token when the prefix is loaded from host
   memory (prefix caching off, so nothing is shared on the device) against
   recomputing it; target <= 0.5x;
4. disaggregated prefill's transfer on one node, ``--prefix-len`` tokens
   of SmolLM2's KV (float32, TP 1 -> 1), in GB/s, against a memcpy of the
   same bytes (cache to cache); target >= 0.5x.  Connector-level: no
   engine, no model.  ``SharedStorageConnector`` (one file per block in
   ``/dev/shm``), and ``PeerKVConnector`` over shared memory: the
   producer worker marking the blocks whole (save: generations only, its
   cache is the shared segment) plus the consumer's one copy from the
   producer's cache into its own (load), and the load alone; the memcpy (the
   same bytes between the same two caches) is the faster of one right
   before and one right after each transfer;
5. the same bytes fetched with ``PeerKVConnector`` over authenticated
   ZeroMQ on loopback (the consumer worker's FETCH: the producer's gather,
   the MAC of every byte on both sides - keyed BLAKE3 under an HMAC, or
   SHA-256 without the blake3 package - the copy into the cache, in
   chunks of a few layers that overlap)
   against raw pyzmq moving the same bytes the same way (ROUTER thread ->
   DEALER, zero-copy, no MAC); target >= 0.7x.  Then the CPU seconds the
   process spends per transfer (all threads, ZeroMQ's included) for both,
   which a loaded machine disturbs far less than wall time; each stage of
   the fetch alone on one thread (thread CPU time: gather, seal, open,
   copy into the cache); and the SHA-256 and keyed BLAKE3 rates;
6. inter-token latency of ``--decoders`` decoding requests while three
   ``--long-len``-token prompts arrive (every ``--arrival-every`` steps):
   one colocated engine, against a consumer engine whose long prompts'
   KV a producer engine (in this process) computed beforehand; p99 and
   median; target: disaggregated lower.

Engines in this process (``uni``), ``--threads`` torch threads.
Numbers depend on the machine and its load (printed with the table);
compare within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import free_ports, percentile, render  # noqa: E402

from mpexec.engine.llm import LLM  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": prompt}], ONE)[0]
    value = out.metrics.time_to_first_token_s
    assert value is not None
    return value


def make(args: argparse.Namespace, **kwargs: Any) -> LLM:
    return LLM(args.model, executor_backend="uni", num_threads=args.threads,
               max_model_len=4096, **kwargs)


def cached_vs_cold(args: argparse.Namespace, rng: random.Random, **kwargs: Any,
                   ) -> tuple[float, float]:
    cold, warm = [], []
    with make(args, **kwargs) as llm:
        ttft(llm, tokens(rng, 64))  # warm-up: first-call costs out of the way
        for _ in range(args.repeats):
            prefix = tokens(rng, args.prefix_len)
            cold.append(ttft(llm, prefix + tokens(rng, 16)))
            warm.append(ttft(llm, prefix + tokens(rng, 16)))
    return statistics.median(cold), statistics.median(warm)


def shared_system_prompt(args: argparse.Namespace, rng: random.Random, caching: bool) -> float:
    system = tokens(rng, args.system_len)
    batch = [{"prompt_token_ids": system + tokens(rng, 32)} for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with make(args, enable_prefix_caching=caching) as llm:
        ttft(llm, tokens(rng, 64))
        started = time.perf_counter()
        outputs = llm.generate(batch, params)
        elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def shared_transfer(args: argparse.Namespace) -> tuple[float, float]:
    """GB/s of save + load through SharedStorageConnector, and of a plain copy."""
    import shutil
    import tempfile

    import torch

    from mpexec.models.kv_cache import KVCache
    from mpexec.models.kv_connector import KVConnectorRole, KVTransferConfig, create_connector
    from mpexec.models.kv_connector.offload import LoadSpec, OffloadMetadata

    size, blocks = 16, -(-args.prefix_len // 16)
    caches = [KVCache(num_layers=30, num_blocks=blocks, block_size=size, num_kv_heads=3,
                      head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
              for _ in range(2)]
    caches[0].tensor.normal_()
    nbytes = caches[0].tensor[:, :, :blocks * size].numel() * 4
    root = tempfile.mkdtemp(prefix="mpexec-bench-", dir="/dev/shm")
    try:
        rates, copies = [], []
        for attempt in range(args.repeats):
            config = KVTransferConfig("SharedStorageConnector", "kv_both",
                                      {"path": f"{root}/{attempt}"}, block_size=size)
            sides = [create_connector(config, KVConnectorRole.WORKER) for _ in range(2)]
            for side, cache in zip(sides, caches, strict=True):
                side.register_kv_caches(cache)
            hashes = [random.randbytes(16) for _ in range(blocks)]
            started = time.perf_counter()
            sides[0].bind_connector_metadata(OffloadMetadata(
                save_id="s", saves=list(zip(range(blocks), hashes, strict=True))))
            sides[0].wait_for_save()
            sides[1].bind_connector_metadata(OffloadMetadata(
                loads=[LoadSpec("r", list(range(blocks)), hashes)]))
            sides[1].start_load_kv()
            rates.append(nbytes / (time.perf_counter() - started) / 1e9)
            assert not sides[1].get_finished()[2]
            assert torch.equal(caches[0].tensor[:, :, :blocks * size],
                               caches[1].tensor[:, :, :blocks * size])
            started = time.perf_counter()
            caches[1].tensor[:, :, :blocks * size].copy_(caches[0].tensor[:, :, :blocks * size])
            copies.append(nbytes / (time.perf_counter() - started) / 1e9)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(rates), statistics.median(copies)


def _kv_caches(blocks: int, count: int = 2) -> list[Any]:
    import torch

    from mpexec.models.kv_cache import KVCache

    caches = [KVCache(num_layers=30, num_blocks=blocks, block_size=16, num_kv_heads=3,
                      head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
              for _ in range(count)]
    for cache in caches:
        cache.tensor.normal_()  # every page mapped before anything is timed
    return caches


class _Request:
    def __init__(self, hashes: list[bytes]) -> None:
        self.req_id = secrets.token_hex(4)
        self.block_hashes = hashes
        self.num_tokens = len(hashes) * 16 + 1


def _copy_s(caches: list[Any], tokens: slice) -> float:
    started = time.perf_counter()
    caches[1].tensor[:, :, tokens].copy_(caches[0].tensor[:, :, tokens])
    return time.perf_counter() - started


def peer_transfer(args: argparse.Namespace, transport: str) -> dict[str, float]:
    """Seconds (medians) of PeerKVConnector's save and load of the prefix, and of a memcpy.

    The producer side runs as in an engine: the blocks are handed out
    (``blocks_allocated``), the producer worker marks them before the
    "forward" (here: fresh random KV) and whole after it (``wait_for_save``,
    the save), the index publishes them; the consumer worker loads them.
    """
    import torch

    from mpexec.models.kv_connector import KVConnectorRole, KVTransferConfig, create_connector
    from mpexec.outputs import KVConnectorOutput

    blocks = -(-args.prefix_len // 16)
    caches = _kv_caches(blocks)
    extra = {"endpoint": f"tcp://127.0.0.1:{free_ports(2)}", "secret": secrets.token_hex(16),
             "transport": transport, "timeout_s": 60.0}
    producer = KVTransferConfig("PeerKVConnector", "kv_producer", extra, block_size=16)
    consumer = KVTransferConfig("PeerKVConnector", "kv_consumer", extra, block_size=16)
    sides = [create_connector(producer, KVConnectorRole.SCHEDULER),
             create_connector(producer, KVConnectorRole.WORKER),
             create_connector(consumer, KVConnectorRole.SCHEDULER),
             create_connector(consumer, KVConnectorRole.WORKER)]
    index, saver, asker, loader = sides
    saver.register_kv_caches(caches[0])  # its tensor is now the shared segment
    loader.register_kv_caches(caches[1])
    tokens = slice(0, blocks * 16)
    times: dict[str, list[float]] = {"save": [], "load": [], "memcpy": [], "load_cpu": []}
    try:
        for attempt in range(args.repeats + 1):  # the first maps the pages: not counted
            hashes = [random.randbytes(16) for _ in range(blocks)]
            index.blocks_allocated(list(range(blocks)))
            index.blocks_computed(list(zip(range(blocks), hashes, strict=True)))
            saver.bind_connector_metadata(index.build_connector_meta(None))
            saver.start_load_kv()
            caches[0].tensor[:, :, tokens].normal_()  # the forward
            # the baseline: the faster of a copy before and one after the transfer
            # (a loaded machine slows some copies down; this errs against the connector)
            memcpy = _copy_s(caches, tokens)
            caches[1].tensor.zero_()
            started = time.perf_counter()
            saver.wait_for_save()
            save = time.perf_counter() - started
            index.update_connector_output(KVConnectorOutput(*saver.get_finished()))
            request = _Request(hashes)
            found = asker.get_num_new_matched_tokens(request, 0)
            assert found == blocks * 16, found
            asker.update_state_after_alloc(request, list(range(blocks)), found)
            loader.bind_connector_metadata(asker.build_connector_meta(None))
            started, cpu = time.perf_counter(), _process_cpu_s()
            loader.start_load_kv()
            load = time.perf_counter() - started
            load_cpu = _process_cpu_s() - cpu
            assert not loader.get_finished()[2], "a load failed"
            assert torch.equal(caches[0].tensor[:, :, tokens], caches[1].tensor[:, :, tokens])
            memcpy = min(_copy_s(caches, tokens), memcpy)
            if attempt:
                times["save"].append(save)
                times["load"].append(load)
                times["memcpy"].append(memcpy)
                times["load_cpu"].append(load_cpu)
        if transport == "zmq":
            stages = fetch_stages(saver, loader, loader._metadata.loads[0])
    finally:
        for side in sides:
            side.close()
    result = {name: statistics.median(values) for name, values in times.items()}
    if transport == "zmq":
        result.update(stages)
    result["bytes"] = float(caches[0].tensor[:, :, tokens].numel() * 4)
    return result


def _process_cpu_s() -> float:
    """CPU seconds of this process so far, all its threads (ZeroMQ's included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fetch_stages(saver: Any, loader: Any, load: Any) -> dict[str, float]:
    """Thread CPU seconds of each stage of one ZeroMQ fetch of ``load``, run one
    after the other on this thread (no sockets, no overlap): the producer's
    gather (cache -> chunk buffers), the seal of every chunk, the consumer's
    open (MAC check) and its copy into the cache."""
    import json

    from mpexec.ipc.auth import DropCounter
    from mpexec.models.kv_connector.peer import worker_endpoint
    from mpexec.models.kv_connector.peer_wire import KIND_FETCH, REPLY, _auths

    shape = saver.shared.shape
    request = {"blocks": load.sources, "gens": load.gens, "layers": list(shape.layers),
               "heads": list(shape.heads)}
    _, replies = _auths(saver._secret)
    chunks, gather = [], 0.0
    fetch = saver._fetch(request)
    while True:  # each chunk's frame let go of at once: its ring buffer comes round again
        started = time.thread_time()
        chunk = next(fetch, None)
        gather += time.thread_time() - started
        if chunk is None:
            break
        chunks.append((chunk[0], [bytes(part) for part in chunk[1]]))
        del chunk
    started = time.thread_time()
    sealed = [replies.seal(KIND_FETCH | REPLY, 0, 1, [json.dumps(reply).encode(), *data],
                           aux=index) for index, (reply, data) in enumerate(chunks)]
    seal = time.thread_time() - started
    drops = DropCounter("bench")
    started = time.thread_time()
    opened = [replies.open(frames, drops) for frames in sealed]
    open_ = time.thread_time() - started
    assert all(o is not None for o in opened) and not drops.total

    class _Replayed:  # the stream, already opened
        def stream(self, *_: Any) -> Any:
            return ((json.loads(bytes(o.parts[0])), o.parts[1:]) for o in opened)

    endpoint = worker_endpoint(loader.endpoint, 0)
    real, loader._clients[endpoint] = loader._clients[endpoint], _Replayed()
    try:
        started = time.thread_time()
        assert loader._copy_zmq(endpoint, load, shape.layers, shape.heads)
        copy = time.thread_time() - started
    finally:
        loader._clients[endpoint] = real
    return {"gather_cpu": gather, "seal_cpu": seal, "open_cpu": open_, "copy_cpu": copy}


def raw_zmq(nbytes: int, repeats: int) -> tuple[float, float]:
    """Median seconds for pyzmq to bring ``nbytes`` from a ROUTER thread to a
    DEALER, and median CPU seconds of this process (all threads) meanwhile."""
    import zmq

    port = free_ports(1)
    payload = bytearray(os.urandom(1 << 20)) * (nbytes >> 20) + bytearray(nbytes % (1 << 20))
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def serve() -> None:
        for _ in range(repeats + 1):
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, b"ok", memoryview(payload)], copy=False)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    times, cpus = [], []
    try:
        for attempt in range(repeats + 1):
            started, cpu = time.perf_counter(), _process_cpu_s()
            dealer.send(b"fetch")
            frames = dealer.recv_multipart(copy=False)
            assert len(frames[1].buffer) == nbytes
            if attempt:
                times.append(time.perf_counter() - started)
                cpus.append(_process_cpu_s() - cpu)
        server.join(timeout=30)
    finally:
        router.close()
        dealer.close()
        context.term()
    return statistics.median(times), statistics.median(cpus)


def hash_rates(nbytes: int) -> dict[str, float]:
    """GB/s of SHA-256 and of keyed BLAKE3 (if installed) over ``nbytes``, one thread."""
    import hashlib

    data = os.urandom(nbytes)
    hashers: dict[str, Any] = {"SHA-256": hashlib.sha256}
    try:
        from blake3 import blake3

        key = os.urandom(32)
        hashers["keyed BLAKE3"] = lambda data: blake3(data, key=key)
    except ImportError:
        pass
    rates = {}
    for name, hasher in hashers.items():
        started = time.thread_time()
        hasher(data).digest()
        rates[name] = nbytes / (time.thread_time() - started) / 1e9
    return rates


def _decode_gaps(llm: LLM, decoders: list[list[int]], longs: list[list[int]],
                 args: argparse.Namespace) -> list[float]:
    """Seconds between consecutive tokens of the decoding requests while ``longs`` arrive."""
    engine: Any = llm.engine
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    requests = [engine.add_request(p, decode) for p in decoders]
    seen = dict.fromkeys((r.req_id for r in requests), 0)
    last: dict[str, float] = {}
    gaps: list[float] = []
    arriving = list(longs)
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if arriving and step % args.arrival_every == 0:
            engine.add_request(arriving.pop(0), ONE)
        engine.step()
        now = time.perf_counter()
        for request in requests:
            count = len(request.output_token_ids)
            if count > seen[request.req_id]:
                if request.req_id in last:
                    gaps.append(now - last[request.req_id])
                last[request.req_id] = now
                seen[request.req_id] = count
    return gaps


def mixed_load(args: argparse.Namespace, rng: random.Random,
               ) -> tuple[list[float], list[float]]:
    """Decode gaps colocated, and on a consumer whose long prompts a producer computed."""
    decoders = [tokens(rng, 32) for _ in range(args.decoders)]
    longs = [tokens(rng, args.long_len) for _ in range(3)]
    with make(args) as llm:
        ttft(llm, tokens(rng, 64))
        colocated = _decode_gaps(llm, decoders, longs, args)
    extra = {"endpoint": f"tcp://127.0.0.1:{free_ports(2)}", "secret": secrets.token_hex(16)}
    with make(args, kv_transfer_config={"kv_connector": "PeerKVConnector",
                                        "kv_role": "kv_consumer",
                                        "kv_connector_extra_config": extra}) as consumer, \
            make(args, kv_transfer_config={"kv_connector": "PeerKVConnector",
                                           "kv_role": "kv_producer",
                                           "kv_connector_extra_config": extra}) as producer:
        producer.generate([{"prompt_token_ids": p} for p in longs], ONE)
        ttft(consumer, tokens(rng, 64))
        disaggregated = _decode_gaps(consumer, decoders, longs, args)
        connector: Any = consumer.engine.scheduler.connector  # type: ignore[union-attr]
        assert connector.num_loaded_blocks > 0 and not connector.transfer_errors
    return colocated, disaggregated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--long-len", type=int, default=384)
    parser.add_argument("--arrival-every", type=int, default=5)
    parser.add_argument("--parts", default="reuse,transfer,mixed",
                        help="comma-separated: reuse (rows 1-3), transfer (4, 5), mixed (6)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows: list[list[str]] = []
    load_start = os.getloadavg()
    parts = set(args.parts.split(","))
    if parts - {"reuse", "transfer", "mixed"}:
        parser.error(f"--parts: unknown {sorted(parts - {'reuse', 'transfer', 'mixed'})}")
    if "reuse" in parts:
        reuse_rows(args, rng, rows)
    if "transfer" in parts:
        transfer_rows(args, rows)
    if "mixed" in parts:
        colocated, disaggregated = mixed_load(args, rng)
        for q in (99, 50):
            co, dis = percentile(colocated, q), percentile(disaggregated, q)
            rows.append([f"ITL p{q} of {args.decoders} decoding requests, {args.long_len}-token "
                         "prompts arriving: disaggregated vs colocated, ms",
                         f"{dis * 1e3:.0f}", f"{co * 1e3:.0f}", f"{dis / co:.2f}x",
                         "< 1x" if q == 99 else ""])
    load_end = os.getloadavg()
    print(render(f"KV reuse and transfer ({args.model}, {args.threads} thread(s), median of "
                 f"{args.repeats} where timed per request; load average "
                 f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end, "
                 f"{os.cpu_count()} CPUs)",
                 ["measure", "with", "without", "ratio", "target"], rows))


def reuse_rows(args: argparse.Namespace, rng: random.Random, rows: list[list[str]]) -> None:
    cold, warm = cached_vs_cold(args, rng)
    rows.append([f"TTFT, {args.prefix_len}-token prefix cached vs cold",
                 f"{warm * 1e3:.0f} ms", f"{cold * 1e3:.0f} ms", f"{warm / cold:.3f}x",
                 "<= 0.2x"])
    on = shared_system_prompt(args, rng, True)
    off = shared_system_prompt(args, rng, False)
    rows.append([f"{args.requests} requests, {args.system_len}-token system prompt: "
                 "tok/s caching on vs off", f"{on:.1f}", f"{off:.1f}", f"{on / off:.2f}x",
                 ">= 2x"])
    offload = {"kv_connector": "CPUOffloadConnector",
               "kv_connector_extra_config": {"num_cpu_blocks": 1024}}
    recompute, reload = cached_vs_cold(args, rng, enable_prefix_caching=False,
                                       kv_transfer_config=offload)
    rows.append([f"TTFT, {args.prefix_len}-token prefix from CPU offload vs recomputed",
                 f"{reload * 1e3:.0f} ms", f"{recompute * 1e3:.0f} ms",
                 f"{reload / recompute:.3f}x", "<= 0.5x"])


def transfer_rows(args: argparse.Namespace, rows: list[list[str]]) -> None:
    files, memcpy = shared_transfer(args)
    rows.append([f"SharedStorageConnector (files in /dev/shm) vs memcpy, GB/s "
                 f"({args.prefix_len} tokens)", f"{files:.2f}", f"{memcpy:.2f}",
                 f"{files / memcpy:.2f}x", ">= 0.5x"])
    shm = peer_transfer(args, "shm")
    size = shm["bytes"]
    base = size / shm["memcpy"] / 1e9
    for label, seconds in (("save + load", shm["save"] + shm["load"]), ("load", shm["load"])):
        rate = size / seconds / 1e9
        rows.append([f"PeerKVConnector shm {label} vs memcpy, GB/s ({size / 1e6:.0f} MB)",
                     f"{rate:.2f}", f"{base:.2f}", f"{rate / base:.2f}x",
                     ">= 0.5x" if label == "save + load" else ""])
    net = peer_transfer(args, "zmq")
    raw_s, raw_cpu = raw_zmq(int(size), args.repeats)
    raw, rate = size / raw_s / 1e9, size / net["load"] / 1e9
    rows.append([f"PeerKVConnector ZeroMQ fetch ({body_mac()}) vs raw pyzmq, loopback, GB/s",
                 f"{rate:.2f}", f"{raw:.2f}", f"{rate / raw:.2f}x", ">= 0.7x"])
    rows.append(["  CPU seconds of the process (all threads) per transfer, ms",
                 f"{net['load_cpu'] * 1e3:.0f}", f"{raw_cpu * 1e3:.0f}",
                 f"{net['load_cpu'] / raw_cpu:.2f}x", ""])
    for stage in ("gather", "seal", "open", "copy"):
        cpu = net[f"{stage}_cpu"]
        rows.append([f"  stage {stage}, one thread alone: CPU ms, GB/s", f"{cpu * 1e3:.1f}",
                     f"{size / cpu / 1e9:.2f}", "", ""])
    for name, hashed in hash_rates(int(size)).items():
        rows.append([f"{name} of the same bytes (one thread), GB/s", f"{hashed:.2f}", "", "",
                     ""])


def body_mac() -> str:
    """What authenticates a large frame's bytes here (see mpexec.ipc.auth)."""
    from mpexec.ipc import auth

    return "keyed BLAKE3" if auth._blake3 is not None else "HMAC-SHA256"


if __name__ == "__main__":
    main()
