"""A float linear's weight row-major (as read) against column-major (as held).

::

    python benchmarks/bench_linear_layout.py [--rows 1,8,32,64,2048] [--dtypes float32,bfloat16]

``F.linear(x, W)`` with ``W`` of shape ``[out, in]``: row-major (strides
``(in, 1)``) the BLAS gets a transposed operand; column-major (strides
``(1, out)``, the same values) it gets ``x @ W.T`` with ``W.T`` contiguous.
The shapes are SmolLM2-135M's (q/k/v, o, gate/up, down), one intra-op
thread, thread CPU time per call (less disturbed by other load than wall
time; the load average is printed).

``mpexec.models.layers.linear`` keeps weights as read (row-major).  On the
2-vCPU Xeon of this project's CI (MKL, one thread, float32) column-major
measured 1.2-1.4x faster at 4-64 rows, even at 1 and at a prefill's
thousands, but 0.6-0.9x at 2 rows, and SmolLM2 end to end decoded 2
requests 13% slower with it (32 and 64 requests 10-12% faster), so the
layout stays a trade-off, not a default; bfloat16 gains nothing from it.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from harness import render

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def cpu_us(fn: Any, calls: int) -> float:
    fn()
    started = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - started) / calls * 1e6


def main() -> None:
    import torch
    import torch.nn.functional as F

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# {os.cpu_count()} CPUs, load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        rows_out = []
        for rows in (int(r) for r in args.rows.split(",")):
            row_major = col_major = 0.0
            for out_features, in_features in SHAPES.values():
                w = torch.randn(out_features, in_features).to(dtype)
                w_col = w.t().contiguous().t()
                x = torch.randn(rows, in_features).to(dtype)
                calls = max(3, int(4e7 / (out_features * in_features * max(rows, 8))))
                row_major += cpu_us(lambda: F.linear(x, w), calls)  # noqa: B023
                col_major += cpu_us(lambda: F.linear(x, w_col), calls)  # noqa: B023
            rows_out.append([str(rows), f"{row_major:.0f}", f"{col_major:.0f}",
                             f"{row_major / col_major:.2f}x"])
        print(render(f"one layer's four linears (SmolLM2-135M shapes), {dtype_name}, "
                     f"{args.threads} thread(s): CPU us per call",
                     ["rows", "row-major", "column-major", "speed-up"], rows_out))
        print()


if __name__ == "__main__":
    main()
