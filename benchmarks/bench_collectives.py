#!/usr/bin/env python3
"""Benchmark of ``mpexec.distributed``: shared-memory collectives against gloo.

Run from the repository root::

    .venv/bin/python benchmarks/bench_collectives.py [--quick] [--ranks 2,4] [--idle-s 5]

One table per run, every figure measured in the same run:

1. all_reduce of float32 tensors of 576 elements, 64 KiB and 4 MiB across 2
   and 4 local ranks: ``GroupCoordinator.all_reduce`` (shared memory) against
   ``torch.distributed.all_reduce`` on the same group's gloo process group;
2. all_gather of the same sizes (each rank contributes that size):
   ``GroupCoordinator.all_gather`` against gloo's ``all_gather`` plus the
   ``cat`` that makes it one tensor;
3. send/recv of a [16, 576] float32 hidden state between two stages, half
   of a measured round trip: ``GroupCoordinator.send``/``recv`` (a
   MessageQueue per direction) against gloo's ``send``/``recv``;
4. CPU used by a rank waiting ``--idle-s`` seconds in an all_reduce for a
   peer that sleeps.

Ranks are forked processes of one ``file://`` world, run by
``harness.spmd.run_ranks`` (the runner the distributed tests use too); each
iteration is a collective, so the ranks stay in step.  The two paths
alternate call by call, so that the load of a shared machine weighs on both
alike.  The figures are rank 0's.  Exit status 0 when every run finished and
every result checked out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for path in (_HERE, _HERE.parent / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness import percentile, render  # noqa: E402
from harness.spmd import run_ranks  # noqa: E402

SIZES = [("576 elem", 576), ("64 KiB", 16 << 10), ("4 MiB", 1 << 20)]  # float32 elements


def timed(fn: Any, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def timed_pair(shm: Any, gloo: Any, iters: int,
               prepare: Any = None) -> tuple[list[float], list[float]]:
    """Alternate the two paths call by call, so that a change of load on a
    shared machine hits both alike; ``prepare()`` runs untimed before each."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, out in zip((shm, gloo), samples, strict=True):
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e6)
    return samples


def iterations(numel: int, quick: bool) -> int:
    n = 1000 if numel < 10_000 else 300 if numel < 100_000 else 40
    return max(n // 5, 10) if quick else n


def measure_size(tp: Any, rank: int, world_size: int, label: str, numel: int,
                 quick: bool) -> dict[tuple[str, str, str], list[float]]:
    import torch
    import torch.distributed as dist

    out = {}
    x = torch.full((numel,), float(rank + 1))
    expected = float(world_size * (world_size + 1) // 2)
    # warm up (the first shared-memory call builds or grows the segment)
    for _ in range(3):
        tp.all_reduce(x.clone())
        dist.all_reduce(x.clone(), group=tp.cpu_group)
    assert tp.shm_active
    n = iterations(numel, quick)
    buf = x.clone()
    shm, gloo = timed_pair(lambda: tp.all_reduce(buf),
                           lambda: dist.all_reduce(buf, group=tp.cpu_group), n,
                           prepare=lambda: buf.copy_(x))
    out[("all_reduce", label, "shm")], out[("all_reduce", label, "gloo")] = shm, gloo
    assert buf[0].item() == expected
    parts = [torch.empty_like(x) for _ in range(world_size)]

    def gloo_gather() -> Any:
        dist.all_gather(parts, x, group=tp.cpu_group)
        return torch.cat(parts)

    for _ in range(3):
        tp.all_gather(x, dim=0)
        gloo_gather()
    shm, gloo = timed_pair(lambda: tp.all_gather(x, dim=0), gloo_gather, n)
    out[("all_gather", label, "shm")], out[("all_gather", label, "gloo")] = shm, gloo
    assert torch.equal(tp.all_gather(x, dim=0), gloo_gather())
    return out


def run_rank(rank: int, world_size: int, init: str, quick: bool,
             idle_s: float) -> dict[str, Any] | None:
    """One rank's measurements (run by ``harness.spmd.run_ranks``); rank 0's come back."""
    import torch
    import torch.distributed as dist

    import mpexec.distributed as d

    d.init_distributed_environment(world_size, rank, rank, init, "gloo")
    d.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = d.get_tp_group()
    out: dict[str, Any] = {}
    for label, numel in SIZES:
        out.update(measure_size(tp, rank, world_size, label, numel, quick))
    if world_size == 2:
        hidden = torch.randn(16, 576)
        peer = 1 - rank

        def ping_pong() -> None:
            if rank == 0:
                dist.send(hidden, peer, group=tp.cpu_group)
                dist.recv(hidden, peer, group=tp.cpu_group)
            else:
                dist.recv(hidden, peer, group=tp.cpu_group)
                dist.send(hidden, peer, group=tp.cpu_group)

        def shm_ping_pong() -> None:
            if rank == 0:
                tp.send(hidden, peer)
                tp.recv(hidden.shape, hidden.dtype, peer)
            else:
                got = tp.recv(hidden.shape, hidden.dtype, peer)
                tp.send(got, peer)

        timed(shm_ping_pong, 20)
        timed(ping_pong, 20)
        shm, gloo = timed_pair(shm_ping_pong, ping_pong, 200 if quick else 1000)
        out[("send/recv [16,576]", "36 KiB", "shm")] = [s / 2 for s in shm]
        out[("send/recv [16,576]", "36 KiB", "gloo")] = [s / 2 for s in gloo]
        assert tp.point_to_point_routes() == {(rank, peer): "shm", (peer, rank): "shm"}
        tp.barrier()
        if rank == 0:
            before = time.process_time()
            tp.all_reduce(torch.ones(576))
            out["idle_cpu_s"] = time.process_time() - before
        else:
            time.sleep(idle_s)
            tp.all_reduce(torch.ones(576))
    d.destroy_distributed_environment()
    return out if rank == 0 else None


def run_world(world_size: int, quick: bool, idle_s: float) -> dict[str, Any]:
    results = run_ranks(world_size, run_rank, quick, idle_s, timeout=600.0)
    return results[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--idle-s", type=float, default=5.0)
    args = parser.parse_args()
    rows = []
    idle = None
    for world_size in (int(w) for w in args.ranks.split(",")):
        out = run_world(world_size, args.quick, args.idle_s)
        idle = out.pop("idle_cpu_s", idle)
        for op, label in dict.fromkeys((op, label) for op, label, _path in out):
            shm = out.get((op, label, "shm"))
            gloo = out[(op, label, "gloo")]
            gloo_med = percentile(gloo, 50)
            row = [op, label, world_size, len(gloo)]
            if shm is None:
                row += ["-", "-"]
            else:
                row += [f"{percentile(shm, 50):.1f}", f"{percentile(shm, 99):.1f}"]
            row += [f"{gloo_med:.1f}", f"{percentile(gloo, 99):.1f}"]
            row.append("-" if shm is None else f"{gloo_med / percentile(shm, 50):.1f}x")
            rows.append(row)
    print(render(f"collectives on {os.cpu_count()} CPUs (rank 0's latency, µs)",
                 ["op", "size", "ranks", "iters", "shm p50", "shm p99", "gloo p50",
                  "gloo p99", "gloo/shm"], rows, left=2))
    if idle is not None:
        print(f"\nCPU of a rank waiting {args.idle_s:.0f} s in all_reduce: {idle:.4f} CPU-s "
              f"(target < 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
