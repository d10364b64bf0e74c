"""Executor start-up to READY under each start method, with the driver's
threads running (what ``maybe_force_spawn`` decides about).

Rows, all in one run:

* ``fork``, no other thread: the fast path (reference; not with
  ``--driver-torch``, whose import starts a thread);
* ``spawn``: what ``fork`` fell back to whenever a thread ran (before);
* ``forkserver``: what it falls back to now; the first executor of the
  process pays for starting the server, later ones fork from it;
* ``fork requested``: what ``maybe_force_spawn`` makes of it (forkserver);

each with a trivial worker and with one that imports torch in its
constructor (a model worker's share).  Usage::

    python benchmarks/bench_start_methods.py --reps 5 --workers 2 [--driver-torch]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("MPEXEC_SRC", str(ROOT / "src")))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from harness import render, summary  # noqa: E402

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.executor import MultiprocExecutor, WorkerBase  # noqa: E402


class TrivialWorker(WorkerBase):
    def noop(self) -> None:
        pass


class TorchWorker(WorkerBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch  # noqa: F401  (what every model worker pays at start)

    def noop(self) -> None:
        pass


def start_ms(worker: str, method: str, workers: int) -> float:
    config = ExecutorConfig(worker_cls=f"bench_start_methods:{worker}", device_type="cpu",
                            mp_start_method=method,
                            parallel=ParallelConfig(tensor_parallel_size=workers))
    t0 = time.perf_counter()
    ex = MultiprocExecutor(config)
    ex.collective_rpc("noop")
    elapsed = time.perf_counter() - t0
    ex.shutdown()
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--driver-torch", action="store_true",
                        help="import torch in the driver first (as a model test or the "
                             "engine does): the fork server then preloads it")
    args = parser.parse_args()
    if args.driver_torch:
        import torch  # noqa: F401
    from mpexec.system import running_thread_count

    rows = []
    samples: dict[tuple[str, str], list[float]] = {}
    for worker in ("TrivialWorker", "TorchWorker"):
        if running_thread_count() == 1:
            samples[worker, "fork (no thread)"] = [start_ms(worker, "fork", args.workers)
                                                   for _ in range(args.reps)]
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="a-driver-thread")
    helper.start()  # from here on, fork is unsafe
    try:
        # The first forkserver start of this process pays for the server.
        samples["TrivialWorker", "forkserver, first"] = [
            start_ms("TrivialWorker", "forkserver", args.workers)]
        for worker in ("TrivialWorker", "TorchWorker"):
            for label, method in (("spawn", "spawn"), ("forkserver, later", "forkserver"),
                                  ("fork requested", "fork")):
                samples[worker, label] = [start_ms(worker, method, args.workers)
                                          for _ in range(args.reps)]
    finally:
        stop.set()
        helper.join()
    for (worker, label), values in samples.items():
        s = summary(values)
        rows.append([worker, label, f"{s['median']:.0f}", f"{s['max']:.0f}"])
    print(render(f"start-up to the first reply, {args.workers} workers, {args.reps} reps, "
                 f"driver torch {'imported' if args.driver_torch else 'not imported'} (ms)",
                 ["worker", "start method", "median", "max"], rows, left=2))


if __name__ == "__main__":
    main()
