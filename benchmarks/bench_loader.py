"""Loader benchmark: open and read times, bytes each tensor-parallel rank reads.

    python benchmarks/bench_loader.py [--model default|PATH] [--reps 3]

1. ``open_checkpoint`` (header, config, tensor table) and reading every
   tensor dequantised to float32, median of ``--reps``, one torch thread;
   for a GGUF file, ``gguf.GGUFReader`` opening the same file beside it;
2. for TP = 1, 2, 3, the bytes one rank reads when it takes the
   column-parallel weights by rows, the row-parallel ones (``o_proj``,
   ``down_proj``) by columns and the 1-D tensors whole, against the whole.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import render, summary


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def rank_bytes(path: Path, rank: int, world: int) -> int:
    from mpexec.models.loader import open_checkpoint

    with open_checkpoint(path) as ckpt:
        for name in ckpt.names():
            shape = ckpt.shape(name)
            if len(shape) == 1:
                ckpt.read(name)
                continue
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            n = shape[dim]
            ckpt.read(name, dim=dim, start=n * rank // world, stop=n * (rank + 1) // world)
        return ckpt.bytes_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import torch

    from mpexec.models.fetch import resolve_model
    from mpexec.models.loader import open_checkpoint

    torch.set_num_threads(1)
    path = resolve_model(args.model)
    opens, reads, total = [], [], 0
    for _ in range(args.reps):
        seconds, ckpt = timed(lambda: open_checkpoint(path))
        opens.append(seconds)
        reads.append(timed(lambda ckpt=ckpt: [ckpt.read(n) for n in ckpt.names()])[0])
        total = ckpt.bytes_read
        ckpt.close()
    rows = [["open_checkpoint", f"{summary(opens)['median']:.2f}"],
            ["read every tensor (float32)", f"{summary(reads)['median']:.2f}"]]
    if path.suffix == ".gguf":
        import gguf

        rows.append(["gguf.GGUFReader open", f"{timed(lambda: gguf.GGUFReader(str(path)))[0]:.2f}"])
    print(render(f"{path.name}: seconds (median of {args.reps})", ["step", "s"], rows))
    print()
    rows = []
    for world in (1, 2, 3):
        shares = [rank_bytes(path, rank, world) for rank in range(world)]
        rows.append([f"TP={world}", f"{max(shares):,}", f"{max(shares) / total:.3f}",
                     f"{1 / world:.3f}"])
    print(render(f"bytes read by one rank (whole: {total:,})",
                 ["split", "max bytes per rank", "share", "1/TP"], rows))


if __name__ == "__main__":
    main()
