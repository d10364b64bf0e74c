"""Executor benchmarks: call latency, pipelining, futures, start-up, crash cases.

Prints one table per figure::

    python benchmarks/bench_executor.py [--iters 3000] [--pipelined 10000] [--reps 5]
        [--only roundtrip,pipelined,future,lifecycle,crashes] [--methods fork,spawn]
    python benchmarks/bench_executor.py --remote [--iters 3000] [--reps 3]   # multi-node

Figure 5 lives in ``executor_crashes.py``; the worker and config all figures
share in ``executor_common.py``.

1. no-op ``collective_rpc`` round trip with 1, 2, 4 workers (median, p99) next
   to the raw MessageQueue round trip measured in the same run, and their ratio;
2. pipelined ``non_block`` throughput with N outstanding calls resolving in order;
3. a non-blocking future completing on its own (its done-callback fires, no
   ``result()``) against a blocking call, interleaved: the extra latency;
4. start-up-to-ready and shutdown time for 1, 2, 4 trivial workers;
5. the crash-case table: for each row, the time from the bad thing to the
   caller's error (or, for the driver's death, to every worker and
   grandchild being gone), under each start method.

``MPEXEC_SRC`` points at the ``src`` directory to measure (default: this
checkout's), so one script measures a before and an after in the same
session.  Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from executor_common import (
    CALL,
    REPLY,
    SRC,
    config,
    ms,
    us,
)
from executor_crashes import bench_crashes
from harness import render, summary

from mpexec.executor import MultiprocExecutor
from mpexec.ipc import MessageQueue

# -- 1. round trip ---------------------------------------------------------------

def _raw_reader(handle: Any, rank: int, pipe: Connection) -> None:
    broadcast = MessageQueue.create_from_handle(handle, rank)
    reply = MessageQueue(1, 1, name=f"raw-reply{rank}")
    pipe.send(reply.export_handle())
    broadcast.wait_until_ready()
    reply.wait_until_ready()
    try:
        while broadcast.dequeue(indefinite=True) is not None:
            reply.enqueue(REPLY)
    finally:
        broadcast.shutdown()
        reply.shutdown()


def raw_round_trip(workers: int, iters: int) -> list[float]:
    ctx = multiprocessing.get_context("fork")
    broadcast = MessageQueue(workers, workers, name="raw-broadcast")
    handle = broadcast.export_handle()
    pipes, procs = [], []
    for rank in range(workers):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_raw_reader, args=(handle, rank, writer), daemon=True)
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


def rpc_round_trip(workers: int, iters: int) -> list[float]:
    samples = []
    with MultiprocExecutor(config(workers)) as ex:
        for i in range(iters + iters // 10):
            t0 = time.perf_counter()
            ex.collective_rpc("noop")
            if i >= iters // 10:
                samples.append(time.perf_counter() - t0)
    return samples


def bench_round_trip(iters: int, passes: int, sizes: list[int]) -> None:
    rows = []
    for workers in sizes:
        raw: list[float] = []
        rpc: list[float] = []
        ratios = []
        for _ in range(passes):
            raw_pass = raw_round_trip(workers, iters)
            rpc_pass = rpc_round_trip(workers, iters)
            raw += raw_pass
            rpc += rpc_pass
            ratios.append(summary(rpc_pass)["median"] / summary(raw_pass)["median"])
        r, c = summary(raw), summary(rpc)
        rows.append([workers, us(r["median"]), us(r["p99"]), us(c["median"]), us(c["p99"]),
                     f"{sorted(ratios)[len(ratios) // 2]:.2f}x"])
    print(render(f"1. no-op round trip, {passes} passes x {iters} calls (us)",
                 ["workers", "raw mq p50", "raw mq p99", "rpc p50", "rpc p99", "rpc/raw"],
                 rows))


# -- 2. pipelining ----------------------------------------------------------------

def bench_pipelined(calls: int, passes: int, sizes: list[int]) -> None:
    rows = []
    for workers in sizes:
        rates = []
        for _ in range(passes):
            with MultiprocExecutor(config(workers)) as ex:
                t0 = time.perf_counter()
                futures = [ex.collective_rpc("noop", non_block=True) for _ in range(calls)]
                futures[-1].result(timeout=300)
                rates.append(calls / (time.perf_counter() - t0))
                assert all(f.done() for f in futures)
        rows.append([workers, calls, f"{sorted(rates)[len(rates) // 2]:,.0f}",
                     " / ".join(f"{r:,.0f}" for r in rates)])
    print(render("2. pipelined non_block calls (median of passes)",
                 ["workers", "outstanding", "calls/s", "per pass"], rows))


# -- 3. a future completing on its own -----------------------------------------------

def bench_future_completion(iters: int) -> None:
    rows = []
    for workers in (1, 2):
        blocking: list[float] = []
        on_its_own: list[float] = []
        missed = 0
        with MultiprocExecutor(config(workers)) as ex:
            for i in range(iters + iters // 10):
                t0 = time.perf_counter()
                ex.collective_rpc("noop")
                t1 = time.perf_counter()
                fired = threading.Event()
                stamp: list[float] = []

                def done(_: Any, stamp: list[float] = stamp, fired: threading.Event = fired,
                         ) -> None:
                    stamp.append(time.perf_counter())
                    fired.set()

                t2 = time.perf_counter()
                future = ex.collective_rpc("noop", non_block=True)
                future.add_done_callback(done)
                if not fired.wait(5.0):
                    missed += 1  # never completes on its own (an older checkout)
                    future.result(timeout=30)
                    if missed > 3:
                        break
                    continue
                if i >= iters // 10:
                    blocking.append(t1 - t0)
                    on_its_own.append(stamp[0] - t2)
        if not on_its_own:
            rows.append([workers, "-", "-", "never completes", "< 20"])
            continue
        b, f = summary(blocking), summary(on_its_own)
        rows.append([workers, us(b["median"]), us(f["median"]),
                     us(f["median"] - b["median"]), "< 20"])
    print(render(f"3. non-blocking future completing without result(), {iters} calls (us)",
                 ["workers", "blocking p50", "callback p50", "extra", "target"], rows))


# -- 4. start-up and shutdown -----------------------------------------------------

def bench_lifecycle(reps: int) -> None:
    rows = []
    for workers in (1, 2, 4):
        starts, stops = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            ex = MultiprocExecutor(config(workers))
            t1 = time.perf_counter()
            ex.shutdown()
            starts.append(t1 - t0)
            stops.append(time.perf_counter() - t1)
        s, d = summary(starts), summary(stops)
        rows.append([workers, ms(s["median"]), ms(s["max"]), ms(d["median"]), ms(d["max"])])
    print(render(f"4. start-up to READY and shutdown, fork, {reps} reps (ms)",
                 ["workers", "start p50", "start max", "shutdown p50", "shutdown max"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000, help="round trips per row")
    parser.add_argument("--pipelined", type=int, default=10_000, help="outstanding calls")
    parser.add_argument("--reps", type=int, default=3, help="repetitions for 4-5")
    parser.add_argument("--passes", type=int, default=3, help="passes for 1 and 2")
    parser.add_argument("--only", default="roundtrip,pipelined,future,lifecycle,crashes")
    parser.add_argument("--methods", default="fork,spawn", help="start methods for 5")
    parser.add_argument("--workers", default="1,2,4", help="worker counts for 1 and 2")
    parser.add_argument("--ray", action="store_true",
                        help="only the Ray executor's figures (benchmarks/bench_ray.py; "
                             "its call rows --passes times)")
    parser.add_argument("--remote", action="store_true",
                        help="only the multi-node figures (benchmarks/bench_remote.py)")
    parser.add_argument("--remote-queues", action="store_true",
                        help="only the remote-queue round trip vs raw ZeroMQ (MPEXEC_SRC-able)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.ray:
        import bench_ray

        bench_ray.run(call_reps=args.passes)  # the call rows --passes times, medians
        return
    if args.remote or args.remote_queues:
        import bench_remote

        if args.remote_queues:
            bench_remote.run_queues(args.iters)
        else:
            bench_remote.run(args.iters, args.reps)
        return
    only = set(args.only.split(","))
    sizes = [int(n) for n in args.workers.split(",")]
    print(f"mpexec executor benchmark ({SRC}): {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}\n")
    if "roundtrip" in only:
        bench_round_trip(args.iters, args.passes, sizes)
    if "pipelined" in only:
        bench_pipelined(args.pipelined, args.passes, sizes)
    if "future" in only:
        bench_future_completion(args.iters // 3)
    if "lifecycle" in only:
        bench_lifecycle(args.reps)
    if "crashes" in only:
        bench_crashes(args.methods.split(","), args.reps)


if __name__ == "__main__":
    main()
