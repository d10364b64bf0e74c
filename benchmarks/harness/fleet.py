"""A fleet of benchmark child processes, each with a control pipe.

The driver starts N children that each run one *role* (a module-level
function ``role(rank, ctrl, spec)``), hears "ready" (or a traceback) on each
child's control pipe, bounds every phase with a watchdog that kills the
children, and reaps every one of them in ``close()`` whatever happened.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class BenchError(RuntimeError):
    """A measurement could not be taken, or a reply was wrong."""


def child_main(role: Callable[[int, Any, dict[str, Any]], None], rank: int, ctrl: Any,
               spec: dict[str, Any]) -> None:
    """A fleet member's body: run ``role``; a failure goes back over ``ctrl``."""
    failed = False
    try:
        role(rank, ctrl, spec)
    except BaseException:
        failed = True
        try:
            ctrl.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
    finally:
        try:
            ctrl.close()
        except Exception:
            pass
    if failed:
        sys.exit(1)


class Fleet:
    """N reader processes, each with a control pipe; always reaped by close()."""

    def __init__(self, ctx: Any, role: str, target: Callable[[int, Any, dict[str, Any]], None],
                 specs: list[dict[str, Any]], start_timeout_s: float = 60.0) -> None:
        self.ctx = ctx
        self.role = role
        self.target = target      # a module-level function: spawned children import it
        self.specs = specs
        self.start_timeout_s = start_timeout_s
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []

    def start(self) -> None:
        for rank, spec in enumerate(self.specs):
            parent, child = self.ctx.Pipe()
            try:
                proc = self.ctx.Process(target=child_main, args=(self.target, rank, child, spec),
                                        name=f"bench-{self.role}-{rank}", daemon=True)
                proc.start()
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
            self.procs.append(proc)
            self.ctrls.append(parent)

    def recv(self, rank: int, timeout: float, what: str) -> tuple[Any, ...]:
        conn = self.ctrls[rank]
        proc = self.procs[rank]
        if not conn.poll(timeout):
            raise BenchError(f"{self.role} reader {rank}: no word within {timeout:.0f} s "
                             f"({what}); exit code {proc.exitcode}")
        try:
            msg = conn.recv()
        except EOFError:
            proc.join(2)
            raise BenchError(f"{self.role} reader {rank} exited (code {proc.exitcode}) "
                             f"during {what}") from None
        if msg[0] == "error":
            raise BenchError(f"{self.role} reader {rank} failed during {what}:\n{msg[2]}")
        return tuple(msg)

    def wait_ready(self) -> list[tuple[Any, ...]]:
        return [self.recv(rank, self.start_timeout_s, "start-up")
                for rank in range(len(self.procs))]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill_all(self) -> None:
        for proc in self.procs:
            try:
                proc.kill()
            except Exception:
                pass

    @contextmanager
    def watchdog(self, seconds: float, what: str) -> Iterator[None]:
        """Kill the readers if ``what`` takes longer than ``seconds``: blocked calls fail."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            self.kill_all()

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except BaseException as err:
            if fired.is_set():
                raise BenchError(f"{self.role}: {what} took over {seconds:.0f} s; "
                                 "readers killed") from err
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise BenchError(f"{self.role}: {what} took over {seconds:.0f} s; readers killed")

    def close(self, timeout: float = 15.0) -> list[str]:
        """Reap every reader (terminate/kill stragglers); return their errors."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
                proc.join(3)
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(3)
        errors = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.ctrls, strict=True)):
            detail = ""
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "error":
                        detail = msg[2]
            except (EOFError, OSError):
                pass
            conn.close()
            if proc.exitcode != 0:
                errors.append(f"{self.role} reader {rank} exit code {proc.exitcode}\n{detail}")
            if proc.exitcode is not None:
                proc.close()
        return errors
