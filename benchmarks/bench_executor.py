"""Executor benchmarks: call latency, pipelining, start-up, failure detection.

Prints one table per measurement::

    python benchmarks/bench_executor.py [--iters 3000] [--pipelined 10000] [--reps 5]

1. no-op ``collective_rpc`` round trip with 1, 2, 4 workers (median, p99) next
   to the raw MessageQueue round trip measured in the same run (the driver
   enqueues, each worker dequeues and replies on its own queue, the driver
   dequeues every reply), and their ratio;
2. pipelined ``non_block`` throughput with N outstanding calls resolving in order;
3. start-up-to-ready and shutdown time for 1, 2, 4 trivial workers;
4. SIGKILL of a worker -> ``WorkerDiedError`` at a caller blocked in a call;
5. SIGKILL of the driver -> every worker gone, and new /dev/shm entries.

Workers are forked from this script, so the worker class below needs no import
path.  Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.errors import WorkerDiedError  # noqa: E402
from mpexec.executor import MultiprocExecutor, WorkerBase  # noqa: E402
from mpexec.ipc import MessageQueue  # noqa: E402
from mpexec.system import process_gone  # noqa: E402

CALL = (1, "noop", (), {}, None)  # the shape of a broadcast call
REPLY = (1, True, None)           # the shape of its reply


class NoopWorker(WorkerBase):
    def noop(self) -> None:
        return None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def config(workers: int, **fields: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=NoopWorker,
                          parallel=ParallelConfig(tensor_parallel_size=workers), **fields)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


# -- 1. round trip ---------------------------------------------------------------

def _raw_reader(handle: Any, rank: int, pipe: Connection, cpus: list[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    broadcast = MessageQueue.create_from_handle(handle, rank)
    reply = MessageQueue(1, 1, name=f"raw-reply{rank}")
    pipe.send(reply.export_handle())
    broadcast.wait_until_ready()
    reply.wait_until_ready()
    try:
        while True:
            msg = broadcast.dequeue(indefinite=True)
            if msg is None:
                break
            reply.enqueue(REPLY)
    finally:
        broadcast.shutdown()
        reply.shutdown()


def worker_cpus(workers: int, placement: str) -> list[list[int]] | None:
    """``apart``: worker i on CPU (i + 1) mod n, the driver on CPU 0."""
    if placement == "free":
        return None
    n = os.cpu_count() or 1
    return [[(i + 1) % n] for i in range(workers)]


@contextlib.contextmanager
def driver_placement(placement: str) -> Iterator[None]:
    if placement == "free":
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def raw_round_trip(workers: int, iters: int, placement: str = "free") -> list[float]:
    cpus = worker_cpus(workers, placement)
    ctx = multiprocessing.get_context("fork")
    broadcast = MessageQueue(workers, workers, name="raw-broadcast")
    handle = broadcast.export_handle()
    pipes, procs = [], []
    for rank in range(workers):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_raw_reader,
                           args=(handle, rank, writer, None if cpus is None else cpus[rank]),
                           daemon=True)
        proc.start()
        writer.close()
        pipes.append(reader)
        procs.append(proc)
    replies = [MessageQueue.create_from_handle(p.recv(), 0) for p in pipes]
    broadcast.wait_until_ready()
    for r in replies:
        r.wait_until_ready()
    samples = []
    for i in range(iters + iters // 10):
        t0 = time.perf_counter()
        broadcast.enqueue(CALL)
        for r in replies:
            r.dequeue()
        if i >= iters // 10:  # warm-up excluded
            samples.append(time.perf_counter() - t0)
    broadcast.enqueue(None)
    for proc in procs:
        proc.join(10)
    for q in (broadcast, *replies):
        q.shutdown()
    for p in pipes:
        p.close()
    return samples


def rpc_round_trip(workers: int, iters: int, placement: str = "free") -> list[float]:
    samples = []
    with MultiprocExecutor(config(workers, cpu_affinity=worker_cpus(workers, placement))) as ex:
        for i in range(iters + iters // 10):
            t0 = time.perf_counter()
            ex.collective_rpc("noop")
            if i >= iters // 10:
                samples.append(time.perf_counter() - t0)
    return samples


def bench_round_trip(iters: int, passes: int, placements: list[str]) -> None:
    # Raw and rpc runs alternate, ``passes`` times each: every run starts new
    # processes that the scheduler places anew, and on a small machine the
    # placement moves a median more than the code does ("apart" pins the
    # driver to CPU 0 and worker i to CPU i + 1 to take that out).  The ratio
    # is taken per pass (raw and rpc back to back) and its median reported.
    rows = []
    for placement in placements:
        for workers in (1, 2, 4):
            raw: list[float] = []
            rpc: list[float] = []
            ratios = []
            with driver_placement(placement):
                for _ in range(passes):
                    raw_pass = raw_round_trip(workers, iters, placement)
                    rpc_pass = rpc_round_trip(workers, iters, placement)
                    raw += raw_pass
                    rpc += rpc_pass
                    ratios.append(statistics.median(rpc_pass) / statistics.median(raw_pass))
            rows.append([placement, str(workers), f"{statistics.median(raw) * 1e6:.1f}",
                         f"{pct(raw, .99) * 1e6:.1f}", f"{statistics.median(rpc) * 1e6:.1f}",
                         f"{pct(rpc, .99) * 1e6:.1f}", f"{statistics.median(ratios):.2f}x",
                         " / ".join(f"{r:.2f}" for r in ratios)])
    table(f"1. no-op round trip, {passes} passes x {iters} calls (us; target rpc/raw <= 1.3x)",
          ["placement", "workers", "raw mq p50", "raw mq p99", "rpc p50", "rpc p99",
           "rpc/raw p50", "per pass"], rows)


# -- 2. pipelining ----------------------------------------------------------------

def bench_pipelined(calls: int) -> None:
    rows = []
    for workers in (1, 2, 4):
        with MultiprocExecutor(config(workers)) as ex:
            t0 = time.perf_counter()
            futures = [ex.collective_rpc("noop", non_block=True) for _ in range(calls)]
            futures[-1].result(timeout=300)
            elapsed = time.perf_counter() - t0
            in_order = all(f.done() for f in futures)
        rows.append([str(workers), str(calls), f"{calls / elapsed:,.0f}",
                     "yes" if in_order else "NO"])
    table("2. pipelined non_block calls", ["workers", "outstanding", "calls/s", "all resolved"],
          rows)


# -- 3. start-up and shutdown -----------------------------------------------------

def bench_lifecycle(reps: int) -> None:
    rows = []
    for workers in (1, 2, 4):
        starts, stops = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            ex = MultiprocExecutor(config(workers))
            t1 = time.perf_counter()
            ex.shutdown()
            t2 = time.perf_counter()
            starts.append(t1 - t0)
            stops.append(t2 - t1)
        rows.append([str(workers), f"{statistics.median(starts) * 1e3:.1f}",
                     f"{max(starts) * 1e3:.1f}", f"{statistics.median(stops) * 1e3:.1f}",
                     f"{max(stops) * 1e3:.1f}"])
    table(f"3. start-up to READY and shutdown, fork, {reps} reps (ms)",
          ["workers", "start p50", "start max", "shutdown p50", "shutdown max"], rows)


# -- 4. worker SIGKILL ------------------------------------------------------------

def bench_worker_kill(reps: int) -> None:
    samples = []
    for _ in range(reps):
        # The other worker is busy in the call: a short grace before SIGTERM.
        with MultiprocExecutor(config(2, shutdown_grace_s=0.5)) as ex:
            victim = ex.workers[1].proc.pid
            killed_at: list[float] = []

            def kill(pid: int = victim, stamp: list[float] = killed_at) -> None:
                time.sleep(0.05)
                stamp.append(time.perf_counter())
                os.kill(pid, signal.SIGKILL)

            killer = threading.Thread(target=kill)
            killer.start()
            try:
                ex.collective_rpc("sleep", args=(30.0,))
            except WorkerDiedError:
                samples.append(time.perf_counter() - killed_at[0])
            killer.join(10)
    table("4. worker SIGKILL -> WorkerDiedError at a blocked caller (ms)",
          ["reps", "p50", "max", "target"],
          [[str(len(samples)), f"{statistics.median(samples) * 1e3:.1f}",
            f"{max(samples) * 1e3:.1f}", "< 1000"]])


# -- 5. driver SIGKILL ------------------------------------------------------------

DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from mpexec.config import ExecutorConfig, ParallelConfig
    from mpexec.executor import MultiprocExecutor, WorkerBase
    class W(WorkerBase):
        pass
    ex = MultiprocExecutor(ExecutorConfig(worker_cls=W,
                           parallel=ParallelConfig(tensor_parallel_size=2)))
    print(" ".join(str(w.proc.pid) for w in ex.workers), flush=True)
    time.sleep(120)
""")


def bench_driver_kill(reps: int) -> None:
    samples, leftovers, new_shm = [], 0, 0
    for _ in range(reps):
        shm_before = set(os.listdir("/dev/shm"))
        driver = subprocess.Popen([sys.executable, "-c", DRIVER.format(src=str(ROOT / "src"))],
                                  stdout=subprocess.PIPE, text=True)
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        t0 = time.perf_counter()
        driver.kill()
        driver.wait(10)
        deadline = t0 + 10
        while not all(process_gone(p) for p in pids) and time.perf_counter() < deadline:
            time.sleep(0.001)
        samples.append(time.perf_counter() - t0)
        leftovers += sum(not process_gone(p) for p in pids)
        new_shm += len(set(os.listdir("/dev/shm")) - shm_before)
        driver.stdout.close()
    table("5. driver SIGKILL -> workers gone (ms)",
          ["reps", "p50", "max", "workers left", "new /dev/shm", "target"],
          [[str(reps), f"{statistics.median(samples) * 1e3:.1f}",
            f"{max(samples) * 1e3:.1f}", str(leftovers), str(new_shm), "< 2000, 0"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000, help="round trips per row")
    parser.add_argument("--pipelined", type=int, default=10_000, help="outstanding calls")
    parser.add_argument("--reps", type=int, default=5, help="repetitions for 3-5")
    parser.add_argument("--passes", type=int, default=3,
                        help="alternating raw/rpc passes for 1")
    parser.add_argument("--placements", default="free,apart",
                        help="CPU placements for 1: free (the scheduler's), apart (pinned)")
    parser.add_argument("--ray", action="store_true",
                        help="only the Ray executor's figures (benchmarks/bench_ray.py)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.ray:
        import bench_ray

        bench_ray.run()
        return
    print(f"mpexec executor benchmark: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    bench_round_trip(args.iters, args.passes, args.placements.split(","))
    bench_pipelined(args.pipelined)
    bench_lifecycle(args.reps)
    bench_worker_kill(args.reps)
    bench_driver_kill(args.reps)


if __name__ == "__main__":
    main()
