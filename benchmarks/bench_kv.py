"""KV reuse benchmarks: prefix caching and CPU offload, on the default model.

Prints one table from one run::

    python benchmarks/bench_kv.py [--model default] [--prefix-len 1500] [--system-len 1000]
                                  [--requests 32] [--repeats 3] [--threads 1]

1. time to first token of a request whose ``--prefix-len``-token prefix is
   in the prefix cache, against the same kind of request cold (a fresh
   prefix); median over ``--repeats`` prefixes; target <= 0.2x;
2. ``--requests`` requests sharing a ``--system-len``-token system prompt
   (each with its own 32-token question, 16 output tokens), arriving at
   once: output tokens/s with prefix caching on vs off; target >= 2x;
3. CPU offload: time to first token when the prefix is loaded from host
   memory (prefix caching off, so nothing is shared on the device) against
   recomputing it; target <= 0.5x;
4. disaggregated prefill's transfer on one node: a producer worker's
   shards of the ``--prefix-len`` prefix written to ``/dev/shm`` and read
   back into a consumer's KV cache (SmolLM2's shapes, float32, TP 1 -> 1),
   in GB/s, against a memcpy of the same bytes (cache to cache); target
   >= 0.5x.  Connector-level: no engine, no model.

One engine in this process (``uni``), ``--threads`` torch threads.
Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import render  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows = []
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
    shm, memcpy = shared_transfer(args)
    rows.append([f"disaggregated transfer via /dev/shm vs memcpy, GB/s ({args.prefix_len} "
                 "tokens)", f"{shm:.2f}", f"{memcpy:.2f}", f"{shm / memcpy:.2f}x", ">= 0.5x"])
    print(render(f"KV reuse ({args.model}, {args.threads} thread(s), median of "
                 f"{args.repeats} where timed per request)",
                 ["measure", "with", "without", "ratio", "target"], rows))


if __name__ == "__main__":
    main()
