"""``mpexec demo --executor``: the executor end to end, as a short report.

The driver starts ``--workers`` :class:`DemoWorker` processes with the
multiprocess executor and then, step by step:

1. asks every worker for its rank and pid with a lambda (``collective_rpc``
   ships the cloudpickled function once to all of them);
2. broadcasts a random payload of a few MiB; every worker hashes it and sums
   its own shard of the bytes, and the driver checks the hashes agree and the
   shard sums add up;
3. times a run of no-op calls and prints the median and p99 round trip;
4. makes one worker raise and shows the ``WorkerError`` that arrives, with the
   last line of the remote traceback;
5. prints ``executor.stats()``, shuts down and checks that no worker process
   is left.

``run`` returns 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Iterable
from typing import Any, TextIO

from mpexec.errors import WorkerError
from mpexec.executor.worker_base import WorkerBase
from mpexec.system.procs import proc_stat

PROCESS_EXIT_TIMEOUT_S = 10.0


class DemoWorker(WorkerBase):
    """A worker that does a little CPU work on what the driver broadcasts."""

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    def ping(self) -> None:
        """The no-op whose round trip the demo times."""

    def digest(self, payload: bytes) -> str:
        return hashlib.sha256(payload).hexdigest()

    def shard_sum(self, payload: bytes) -> int:
        """Sum of the bytes at positions rank, rank + world_size, ..."""
        return sum(memoryview(payload)[self.rank :: self.world_size])

    def fail(self, message: str) -> None:
        if self.rank == self.world_size - 1:
            raise ValueError(f"{message} (raised on rank {self.rank})")


def run(
    *, workers: int, calls: int, payload_bytes: int, out: TextIO, log_level: str = "WARNING"
) -> int:
    """Run the demo with ``workers`` processes, printing the report to ``out``."""
    from mpexec.config import ExecutorConfig, ParallelConfig
    from mpexec.executor import Executor

    # from_env: MPEXEC_WORKER_MULTIPROC_METHOD=spawn mpexec demo tries another start method.
    config = ExecutorConfig.from_env(
        worker_cls=f"{__name__}:DemoWorker",
        parallel=ParallelConfig(tensor_parallel_size=workers),
        device_type="cpu",
        log_level=log_level,
    )
    report = _Report(out)
    out.write(f"mpexec demo: {workers} worker processes, {calls} timed calls\n")
    started = time.perf_counter()
    with Executor.get_class(config)(config) as executor:
        report.line(
            "start",
            f"{workers} workers ({type(executor).__name__}, "
            f"start method {config.mp_start_method!r}) in "
            f"{time.perf_counter() - started:.2f} s",
        )

        who = executor.collective_rpc(lambda worker: (worker.rank, os.getpid()))
        pids = [pid for _, pid in who]
        report.line("ranks", ", ".join(f"rank {r} pid {p}" for r, p in who))

        payload = os.urandom(payload_bytes)
        t0 = time.perf_counter()
        digests = executor.collective_rpc("digest", args=(payload,))
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        expected = hashlib.sha256(payload).hexdigest()
        same = all(d == expected for d in digests)
        report.check(
            "broadcast",
            same,
            f"{payload_bytes / 2**20:.1f} MiB to {workers} workers "
            f"in {elapsed_ms:.1f} ms; sha256 {expected[:12]}... on every worker",
        )
        sums = executor.collective_rpc("shard_sum", args=(payload,))
        report.check(
            "shard sums",
            sum(sums) == sum(payload),
            f"{workers} shards add up to the driver's total {sum(payload)}",
        )

        latencies = _time_calls(lambda: executor.collective_rpc("ping"), calls)
        report.line(
            "latency",
            f"{calls} no-op calls: median {_us(statistics.median(latencies))}, "
            f"p99 {_us(_p99(latencies))}",
        )

        try:
            executor.collective_rpc("fail", args=("demo failure",))
        except WorkerError as exc:
            last = (exc.remote_traceback.strip().splitlines() or ["?"])[-1]
            report.check(
                "worker error",
                True,
                f"{type(exc).__name__} from rank {exc.rank} ({exc.exc_type}): {last}",
            )
        else:
            report.check("worker error", False, "the failing call returned normally")
        alive = executor.collective_rpc(lambda worker: worker.rank)
        report.check("after error", alive == list(range(workers)), "executor still answers")

        report.line("stats", "per method, as executor.stats() reports them")
        report.table(_stats_rows(executor.stats()))
        stop = time.perf_counter()
    left = _wait_gone(pids, PROCESS_EXIT_TIMEOUT_S)
    report.check(
        "shutdown",
        not left,
        f"in {time.perf_counter() - stop:.2f} s; worker "
        f"processes left: {', '.join(left) or 'none'}",
    )
    return 0 if report.ok else 1


class _Report:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.ok = True

    def line(self, label: str, text: str) -> None:
        self.out.write(f"  {label:<13}{text}\n")
        self.out.flush()

    def check(self, label: str, passed: bool, text: str) -> None:
        self.ok = self.ok and passed
        self.line(label, f"{'ok' if passed else 'FAILED'}: {text}")

    def table(self, rows: list[list[str]]) -> None:
        if not rows:
            return
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            self.out.write("    " + "  ".join(cells) + "\n")


def _stats_rows(stats: Any) -> list[list[str]]:
    rows = [["method", "calls", "failures", "p50", "p99", "max"]]
    for method, s in sorted(dict(stats).items()):
        rows.append(
            [method, str(s.calls), str(s.failures), _us(s.p50_s), _us(s.p99_s), _us(s.max_s)]
        )
    return rows


def _time_calls(call: Any, n: int) -> list[float]:
    latencies = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
    return latencies


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _us(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def _wait_gone(pids: Iterable[int], timeout_s: float) -> list[str]:
    """Worker processes still there after ``timeout_s``, described (``"123 zombie"``)."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while True:
        left = [pid for pid in left if _state(pid) != "gone"]
        if not left or time.monotonic() >= deadline:
            return [f"{pid} {_state(pid)}" for pid in left]
        time.sleep(0.05)


def _state(pid: int) -> str:
    """``"gone"``, ``"zombie"`` (exited, not reaped) or ``"running"``."""
    stat = proc_stat(pid)
    if stat is not None:
        return "zombie" if stat.exited else "running"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "running"
    return "running"
