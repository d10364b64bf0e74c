#!/usr/bin/env python3
"""Experts across data parallel replicas: all-to-all against all-gather + all-reduce.

Run from the repository root::

    .venv/bin/python benchmarks/bench_moe_dispatch.py [--tokens 1,4,16,64,256] [--iters 200]

Two forked ranks (DP=2, TP=1, experts split 4 + 4: the layout of
``LLM(data_parallel_size=2, enable_expert_parallel=True)``), one MoE block
as the model worker builds it (8 experts, top-2, hidden 512, expert rows
1024, float32, random weights), ``--tokens`` tokens on each rank.  Per token
count, rank 0's median microseconds of:

- the MoE block with ``dispatch="all_to_all"`` (route here, send each (token,
  expert) pair to the expert's rank, run, send back, weight and sum: two
  all-to-alls of the routed rows) and with ``dispatch="all_gather"``
  (all-gather the counts and the tokens, every rank runs its experts on all
  of them, all-reduce the outputs: three collectives, the last over both
  replicas' rows);
- the collectives alone: the two all-to-alls against the all-gathers plus
  the all-reduce, with the same payloads.

Both go through ``GroupCoordinator`` (the shared-memory collectives on one
node).  The two ways alternate call by call, so that the load of a shared
machine weighs on both alike; one intra-op thread per rank.  The outputs of
the two ways are compared (float32, atol 1e-5).
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

EXPERTS, TOP_K, HIDDEN, ROWS = 8, 2, 512, 1024


def block(rank: int, ep: Any, dp: Any, tp: Any) -> Any:
    import torch

    from mpexec.models.layers.moe import MoEBlock

    g = torch.Generator().manual_seed(0)  # every rank: the same router
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05
    local = EXPERTS // 2
    g = torch.Generator().manual_seed(1 + rank)
    return MoEBlock(router=router, gate_up=torch.randn(local, 2 * ROWS, HIDDEN, generator=g) * 0.02,
                    down=torch.randn(local, HIDDEN, ROWS, generator=g) * 0.02,
                    expert_start=rank * local, top_k=TOP_K, renormalize=True, group=ep,
                    dp_group=dp, tp_group=tp, expert_bounds=[0, local, EXPERTS])


def collectives(ep: Any, dp: Any, hidden: Any, iters: int) -> dict[str, list[float]]:
    """The collectives alone, with the payloads of the block's calls."""
    import torch

    n = hidden.shape[0]
    pairs = n * TOP_K
    sent = torch.zeros(pairs, HIDDEN * 4 + 8, dtype=torch.uint8)
    splits = [pairs // 2, pairs - pairs // 2]
    rows = torch.zeros(pairs, HIDDEN)
    count = torch.tensor([[float(n)]])

    def a2a() -> None:
        _, counts = ep.all_to_all(sent, splits)
        ep.all_to_all(rows[:sum(counts)], counts)

    def gather_reduce() -> None:
        dp.all_gather(count, dim=0)
        everyone = dp.all_gather(hidden, dim=0)
        ep.all_reduce(torch.zeros_like(everyone))

    samples: dict[str, list[float]] = {"all_to_all": [], "all_gather": []}
    for i in range(iters + 3):
        for way, fn in (("all_to_all", a2a), ("all_gather", gather_reduce)):
            started = time.perf_counter()
            fn()
            if i >= 3:
                samples[way].append((time.perf_counter() - started) * 1e6)
    return samples


def run_rank(rank: int, world_size: int, init: str, tokens: list[int],
             iters: int) -> dict[Any, Any] | None:
    import torch

    import mpexec.distributed as d

    d.init_distributed_environment(world_size, rank, rank, init, "gloo")
    d.initialize_model_parallel(data_parallel_size=2, enable_expert_parallel=True)
    ep, dp, tp = d.get_ep_group(), d.get_dp_group(), d.get_tp_group()
    moe = block(rank, ep, dp, tp)
    out: dict[Any, Any] = {}
    with torch.inference_mode():
        for n in tokens:
            hidden = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(7 + rank))
            results = {}
            samples: dict[str, list[float]] = {"all_to_all": [], "all_gather": []}
            for i in range(iters + 3):  # three warm-up calls each
                for way in samples:
                    moe.dispatch = way
                    started = time.perf_counter()
                    results[way] = moe(hidden)
                    if i >= 3:
                        samples[way].append((time.perf_counter() - started) * 1e6)
            torch.testing.assert_close(results["all_to_all"], results["all_gather"],
                                       atol=1e-5, rtol=0)
            out[("block", n)] = samples
            out[("collectives", n)] = collectives(ep, dp, hidden, iters)
    d.destroy_distributed_environment()
    return out if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,256",
                        help="tokens per rank, comma-separated")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    out = run_ranks(2, run_rank, tokens, args.iters, timeout=1800.0)[0]
    rows = []
    for what in ("block", "collectives"):
        for n in tokens:
            samples = out[(what, n)]
            a2a, ag = (percentile(samples[w], 50) for w in ("all_to_all", "all_gather"))
            rows.append([what, n, len(samples["all_to_all"]), f"{a2a:.0f}", f"{ag:.0f}",
                         f"{ag / a2a:.2f}x"])
    print(render(f"MoE dispatch across 2 replicas ({EXPERTS} experts top-{TOP_K}, hidden "
                 f"{HIDDEN}, rows {ROWS}, float32, 1 thread per rank; rank 0's median µs; "
                 f"{os.cpu_count()} CPUs, load average {load} before)",
                 ["measured", "tokens/rank", "iters", "all_to_all", "all_gather+reduce",
                  "gather/a2a"], rows, left=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
