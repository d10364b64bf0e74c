"""Figure 6: the queue's own code path, in one process (no scheduling in it).

Writer and readers live in this one process, so a measurement is the CPU
work of ``enqueue`` + ``dequeue`` alone: no context switch, no wake-up.  On
a loaded machine, where round trips between processes move by multiples
with other people's work, this is the figure that shows whether a change to
the code made it slower.  Each row is the *minimum* over batches of the
per-message median (preemption only ever adds time).

Run on its own against any checkout, to compare two versions in one session::

    PYTHONPATH=<checkout>/src python benchmarks/mqbench/fig_path.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import render

MiB = 1 << 20


def _pair(n_readers: int, chunk: int = 512 * 1024) -> tuple[Any, list[Any]]:
    from mpexec.ipc import MessageQueue

    writer = MessageQueue(n_readers, n_readers, max_chunk_bytes=chunk, max_chunks=8,
                          name="path")
    handle = writer.export_handle()
    readers = [MessageQueue.create_from_handle(handle, r) for r in range(n_readers)]
    return writer, readers


def small_message_us(batches: int, per_batch: int) -> float:
    """enqueue + dequeue of a ~100-byte call, one reader: µs per message."""
    writer, (reader,) = _pair(1)
    message = (7, "execute_model", (1, 2, 3), {}, "x" * 40)
    best = float("inf")
    try:
        for _ in range(batches):
            samples = []
            for _ in range(per_batch):
                t0 = time.perf_counter_ns()
                writer.enqueue(message)
                reader.dequeue()
                samples.append(time.perf_counter_ns() - t0)
            best = min(best, statistics.median(samples) / 1000)
    finally:
        reader.shutdown()
        writer.shutdown()
    return best


def big_ms(kind: str, batches: int) -> float:
    """A 64 MiB payload to 2 readers that each read every page: ms per message."""
    import numpy as np

    writer, readers = _pair(2)
    arr = np.arange(8 * MiB, dtype=np.float64)
    blob = arr.tobytes()
    best = float("inf")
    try:
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            writer.enqueue(arr if kind == "numpy" else blob)
            for reader in readers:
                got = reader.dequeue()
                if kind == "numpy":
                    float(got[::512].sum())   # one float64 per 4 KiB page
                else:
                    got[::4096]               # bytes: the copy already read every page
                del got
            best = min(best, (time.perf_counter_ns() - t0) / 1e6)
    finally:
        for reader in readers:
            reader.shutdown()
        writer.shutdown()
    return best


def warm_memcpy_ms(batches: int) -> float:
    import numpy as np

    src = np.arange(8 * MiB, dtype=np.float64)
    dst = np.empty_like(src)
    dst[:] = src
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        dst[:] = src
        best = min(best, (time.perf_counter_ns() - t0) / 1e6)
    return best


def measure(quick: bool = False) -> dict[str, float]:
    batches = 5 if quick else 15
    memcpy = warm_memcpy_ms(batches)
    return {"small_us": small_message_us(batches, 500 if quick else 2000),
            "memcpy_ms": memcpy,
            "numpy_ms": big_ms("numpy", batches),
            "bytes_ms": big_ms("bytes", batches),
            "memcpy_after_ms": warm_memcpy_ms(batches)}


def figure_path(results: dict[str, Any], quick: bool = False) -> None:
    got = measure(quick)
    memcpy = min(got["memcpy_ms"], got["memcpy_after_ms"])
    rows = [["enqueue + dequeue, ~100-byte call, 1 reader", f"{got['small_us']:.2f} µs", "-"],
            ["warm 64 MiB memcpy", f"{memcpy:.2f} ms", "1.00x"],
            ["64 MiB numpy to 2 readers, every page read", f"{got['numpy_ms']:.2f} ms",
             f"{got['numpy_ms'] / memcpy:.2f}x"],
            ["64 MiB bytes to 2 readers", f"{got['bytes_ms']:.2f} ms",
             f"{got['bytes_ms'] / memcpy:.2f}x"]]
    print()
    print(render("6. The queue's code path in one process (best batch; ratio to the warm memcpy)",
                 ["what", "time", "ratio"], rows))
    results["path"] = dict(got, memcpy_best_ms=memcpy)


if __name__ == "__main__":
    import mpexec

    print(f"mpexec from {Path(mpexec.__file__).resolve().parent}")
    figure_path({}, quick="--quick" in sys.argv)
