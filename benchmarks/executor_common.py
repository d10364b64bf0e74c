"""What the executor benchmarks share: the no-op worker, its config, formatting.

Imported by ``bench_executor.py`` and ``executor_crashes.py`` (and by the
driver script the crash table starts in a child), so a spawned worker finds
``NoopWorker`` under a module name rather than ``__main__``.  Importing it
puts ``MPEXEC_SRC`` (default: this checkout's ``src``) first on ``sys.path``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = os.environ.get("MPEXEC_SRC", str(ROOT / "src"))
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.executor import MultiprocExecutor, WorkerBase  # noqa: E402

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
