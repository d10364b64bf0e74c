"""Trivial worker classes for the executor tests.

Spawned and forked workers import this module by its path
(``tests.executor.workers``), so it must stay importable from the
repository root and light: no torch, nothing slow at import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from typing import Any

from mpexec.executor.worker_base import WorkerBase
from mpexec.outputs import (
    AsyncModelRunnerOutput,
    DraftTokenIds,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

MODULE = "tests.executor.workers"


class CustomError(Exception):
    """A picklable user exception: it should come back as ``__cause__``."""


class UnpicklableError(Exception):
    """Carries a lock, so it cannot be pickled: only its text comes back."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _refuse_outside(pid: int) -> Any:
    """Unpickles only in process ``pid``."""
    if os.getpid() != pid:
        raise ValueError(f"this object cannot be unpickled outside process {pid}")
    return "decoded"


class OnlyHere:
    """Pickles anywhere; unpickles only in the process that made it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_outside, (os.getpid(),))


class _DelayedOutput(AsyncModelRunnerOutput):
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def get_output(self) -> ModelRunnerOutput:
        return self._output


def block_in_native_code() -> None:
    """Block the calling thread for good in C code that no signal interrupts
    (as a torch.distributed rendezvous does while it waits for a peer): a
    plain pthread mutex locked twice by its owner.  Python's signal handlers
    never get to run; only the signal's default action ends the process."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # all zeroes: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


class EchoWorker(WorkerBase):
    """Answers with what it is given; misbehaves on request."""

    def __init__(self, *args: Any, fail_at: str | None = None, fail_rank: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at
        self.fail_rank = fail_rank
        self.steps = 0
        self._maybe_fail("init")

    def _maybe_fail(self, stage: str) -> None:
        if self.fail_at is None or self.rank != self.fail_rank:
            return
        if self.fail_at == f"{stage}:raise":
            raise RuntimeError(f"boom in {stage} on rank {self.rank}")
        if self.fail_at == f"{stage}:exit":
            os._exit(3)
        if self.fail_at == f"{stage}:hang":
            time.sleep(60)
        if self.fail_at == f"{stage}:native":
            block_in_native_code()
        if self.fail_at == f"{stage}:kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fail_at == f"{stage}:stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # as if frozen by a signal
        if self.fail_at == f"{stage}:hold_gil":
            self.hold_gil(60.0)

    def init_device(self) -> None:
        self._maybe_fail("init_device")

    def load_model(self) -> None:
        self._maybe_fail("load_model")

    # calls ------------------------------------------------------------------
    def echo(self, value: Any) -> Any:
        return value

    def whoami(self) -> tuple[int, int, int]:
        return self.rank, self.local_rank, os.getpid()

    def add(self, a: int, b: int = 0) -> int:
        return a + b + self.rank

    def raise_custom(self, message: str) -> None:
        raise CustomError(message)

    def raise_unpicklable(self, message: str) -> None:
        raise UnpicklableError(message)

    def return_unpicklable(self) -> Any:
        return threading.Lock()

    def return_undecodable(self) -> Any:
        return OnlyHere()

    def raise_system_exit(self) -> None:
        raise SystemExit(4)

    def pid(self) -> int:
        return os.getpid()

    def start_grandchild_and_sleep(self, seconds: float, pid_file: str) -> None:
        """Start a long-lived grandchild (it inherits our descriptors), then sleep."""
        child = subprocess.Popen(["sleep", str(seconds)], close_fds=False)
        with open(f"{pid_file}.{self.rank}", "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(seconds)

    def sleep(self, seconds: float, only_rank: int | None = None) -> int:
        if only_rank is None or only_rank == self.rank:
            time.sleep(seconds)
        return self.rank

    def hold_gil(self, seconds: float, only_rank: int | None = None) -> int:
        """One C call that keeps the GIL throughout (PyDLL does not release it):
        the heartbeat thread cannot run, as in a hung interpreter."""
        if only_rank is None or only_rank == self.rank:
            libc = ctypes.PyDLL(None)
            libc.sleep.argtypes = [ctypes.c_uint]
            libc.sleep(max(1, round(seconds)))
        return self.rank

    def spin(self, seconds: float) -> int:
        """A pure-Python loop: busy, yet the interpreter hands the GIL around."""
        end = time.monotonic() + seconds
        count = 0
        while time.monotonic() < end:
            count += 1
        return self.rank

    def sigkill_self(self, only_rank: int = 0, delay_s: float = 0.0) -> None:
        if self.rank == only_rank:
            time.sleep(delay_s)
            os.kill(os.getpid(), signal.SIGKILL)

    def ignore_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def ignore_death_and_sigterm(self) -> None:
        # Keep the process busy (not reading the queue) and deaf to SIGTERM,
        # so only SIGKILL can end it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

        def spin() -> None:
            time.sleep(3600)
        threading.Thread(target=spin, daemon=False).start()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def affinity(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    # protocol methods -------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        self.steps += 1
        finished = scheduler_output.extra.get("finished_sending_by_rank", {}).get(self.rank)
        output = ModelRunnerOutput(
            req_ids=sorted(scheduler_output.scheduled_tokens),
            sampled_token_ids=[[self.rank, scheduler_output.step]],
            kv_connector_output=KVConnectorOutput(finished_sending=set(finished or ())),
        )
        if scheduler_output.extra.get("async_output"):
            return _DelayedOutput(output)
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        return ModelRunnerOutput(req_ids=["sampled"], sampled_token_ids=[[self.rank]])

    def execute_dummy_batch(self) -> None:
        time.sleep(self.kwargs.get("dummy_sleep_s", 0.0))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return DraftTokenIds(req_ids=["r"], draft_token_ids=[[self.rank]])


class FakeCudaWorker(EchoWorker):
    """Imports torch and replaces ``torch.cuda.set_device`` in this process by
    a recorder of which thread binds which device (no GPU needed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        super().__init__(*args, **kwargs)
        self.bound: list[tuple[str, str]] = []

        def set_device(device: Any) -> None:
            self.bound.append((threading.current_thread().name, str(device)))

        torch.cuda.set_device = set_device

    def bindings(self) -> list[tuple[str, str]]:
        return list(self.bound)
