"""Figure 5 of ``bench_executor.py``: the crash-case table.

For each row, the time from the bad thing to the caller's error (or, for the
driver's death, to every worker and grandchild being gone), under each start
method; the median of ``reps`` runs per cell.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executor_common import ROOT, SRC, _OnlyHere, config, ms, pids_of
from harness import render, summary

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.executor import MultiprocExecutor
from mpexec.system import process_gone


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
    from executor_common import NoopWorker, config
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
