"""Executor benchmarks: call latency, pipelining, futures, start-up, crash cases.

Prints one table per figure::

    python benchmarks/bench_executor.py [--iters 3000] [--pipelined 10000] [--reps 5]
        [--only roundtrip,pipelined,future,lifecycle,crashes] [--methods fork,spawn]
    python benchmarks/bench_executor.py --remote [--iters 3000] [--reps 3]   # multi-node

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
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = os.environ.get("MPEXEC_SRC", str(ROOT / "src"))
sys.path.insert(0, SRC)
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import render, summary  # noqa: E402

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.executor import MultiprocExecutor, WorkerBase  # noqa: E402
from mpexec.ipc import MessageQueue  # noqa: E402
from mpexec.system import process_gone  # noqa: E402

CALL = (1, "noop", (), {}, None)  # the shape of a broadcast call
REPLY = (1, True, None)           # the shape of its reply
US = 1e6


class NoopWorker(WorkerBase):
    def noop(self) -> None:
        return None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def fail(self) -> None:
        raise RuntimeError("benchmark failure")

    def undecodable(self) -> Any:
        return _OnlyHere()

    def grandchild_and_sleep(self, seconds: float, pid_file: str) -> None:
        child = subprocess.Popen(["sleep", str(seconds)])
        with open(f"{pid_file}.{self.rank}", "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(seconds)

    def ignore_sigterm_and_block(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()


def _refuse_outside(pid: int) -> Any:
    if os.getpid() != pid:
        raise ValueError("cannot be unpickled here")
    return None


class _OnlyHere:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_outside, (os.getpid(),))


def config(workers: int, **fields: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=NoopWorker, device_type="cpu",
                          parallel=ParallelConfig(tensor_parallel_size=workers), **fields)


def pids_of(ex: MultiprocExecutor) -> list[int]:
    return [w.proc.pid for w in ex.workers]  # .proc: the same on older checkouts


def us(seconds: float) -> str:
    return f"{seconds * US:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


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


# -- 5. crash cases -----------------------------------------------------------------

def _timed_error(ex: MultiprocExecutor, act: Callable[[], Any],
                 before: Callable[[], None] | None = None) -> float:
    """Seconds from ``before`` (or the call) to the caller's exception."""
    t0 = time.perf_counter()
    if before is not None:
        before()
        t0 = time.perf_counter()
    try:
        act()
    except Exception:
        return time.perf_counter() - t0
    raise AssertionError("no error")


def _kill_later(pid: int, stamp: list[float], stop_first: bool = False) -> threading.Thread:
    def run() -> None:
        time.sleep(0.05)
        if stop_first:
            os.kill(pid, signal.SIGSTOP)
        stamp.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def crash_raise(method: str) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method)) as ex:
        return _timed_error(ex, lambda: ex.collective_rpc("fail"))


def crash_bad_argument(method: str) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method)) as ex:
        return _timed_error(ex, lambda: ex.collective_rpc("noop", args=(_OnlyHere(),)))


def crash_bad_reply(method: str) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method)) as ex:
        return _timed_error(ex, lambda: ex.collective_rpc("undecodable"))


def crash_timeout(method: str) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method)) as ex:
        return _timed_error(ex, lambda: ex.collective_rpc("sleep", args=(2.0,), timeout=0.2))


def _kill_mid_call(method: str, stop_first: bool) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method, shutdown_grace_s=0.5)) as ex:
        stamp: list[float] = []
        killer = _kill_later(pids_of(ex)[1], stamp, stop_first)
        try:
            ex.collective_rpc("sleep", args=(30.0,))
        except Exception:
            elapsed = time.perf_counter() - stamp[0]
        killer.join(10)
        return elapsed


def crash_frozen_peer(method: str) -> float:
    with MultiprocExecutor(config(2, mp_start_method=method, shutdown_grace_s=2.0,
                                  shutdown_term_s=2.0)) as ex:
        frozen, victim = pids_of(ex)[1], pids_of(ex)[0]
        stamp: list[float] = []
        os.kill(frozen, signal.SIGSTOP)
        killer = _kill_later(victim, stamp)
        try:
            ex.collective_rpc("sleep", args=(30.0,))
        except Exception:
            elapsed = time.perf_counter() - stamp[0]
        killer.join(10)
        os.kill(frozen, signal.SIGCONT)
        return elapsed


def crash_startup(method: str) -> float:
    """A worker class that cannot be imported in the worker: its start fails."""
    t0 = time.perf_counter()
    try:
        MultiprocExecutor(ExecutorConfig(worker_cls="no_such_module_for_bench:Worker",
                                         mp_start_method=method, device_type="cpu",
                                         parallel=ParallelConfig(tensor_parallel_size=2)))
    except Exception:
        return time.perf_counter() - t0
    raise AssertionError("started")


def crash_sigterm_ignored(method: str) -> float:
    ex = MultiprocExecutor(config(1, mp_start_method=method, shutdown_grace_s=0.3,
                                  shutdown_term_s=0.3))
    ex.collective_rpc("ignore_sigterm_and_block")
    t0 = time.perf_counter()
    ex.shutdown()
    return time.perf_counter() - t0


DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r}); sys.path.insert(0, {bench!r})
    from bench_executor import NoopWorker, config
    from mpexec.executor import MultiprocExecutor
    ex = MultiprocExecutor(config(2, mp_start_method={method!r}))
    ex.collective_rpc("grandchild_and_sleep", args=(60.0, {pid_file!r}), non_block=True)
    print("busy", flush=True)
    time.sleep(120)
""")


def crash_driver_sigkill(method: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        pid_file = f"{tmp}/pids"
        code = DRIVER.format(src=SRC, bench=str(ROOT / "benchmarks"), method=method,
                             pid_file=pid_file)
        driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  text=True)
        assert driver.stdout is not None and driver.stdout.readline() == "busy\n"
        files = [Path(f"{pid_file}.{r}") for r in (0, 1)]
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text().endswith("\n") for f in files):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        pids = [int(p) for f in files for p in f.read_text().split()]
        t0 = time.perf_counter()
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 70
        while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        left = [p for p in pids if not process_gone(p)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        driver.stdout.close()
        return elapsed


CRASH_ROWS: list[tuple[str, Callable[[str], float], str]] = [
    ("worker raises", crash_raise, "WorkerError"),
    ("argument fails to unpickle in the worker", crash_bad_argument, "WorkerError"),
    ("reply fails to unpickle in the driver", crash_bad_reply, "WorkerError"),
    ("hang past timeout=0.2s", crash_timeout, "TimeoutError"),
    ("SIGKILL mid-call (from the kill)", lambda m: _kill_mid_call(m, False),
     "WorkerDiedError"),
    ("SIGSTOP then SIGKILL (from the kill)", lambda m: _kill_mid_call(m, True),
     "WorkerDiedError"),
    ("peer frozen, other killed (grace 2s + 2s)", crash_frozen_peer, "WorkerDiedError"),
    ("start-up failure (from the constructor call)", crash_startup, "WorkerStartupError"),
    ("SIGTERM ignored at shutdown (0.3s + 0.3s)", crash_sigterm_ignored, "shutdown returns"),
    ("driver SIGKILL, workers in a 60s call", crash_driver_sigkill, "all gone (< 2000)"),
]


def bench_crashes(methods: list[str], reps: int) -> None:
    rows = []
    for name, run, what in CRASH_ROWS:
        row: list[Any] = [name, what]
        for method in methods:
            times = []
            for _ in range(reps):
                try:
                    times.append(run(method))
                except Exception as exc:
                    print(f"  {name} ({method}): {type(exc).__name__}: {exc}", file=sys.stderr)
            row.append(ms(summary(times)["median"]) if times else "failed")
        rows.append(row)
    print(render(f"5. crash cases: time to the caller's error, median of {reps} (ms)",
                 ["case", "caller sees", *methods], rows, left=2))


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
