"""Ending worker processes: wait, then SIGTERM, then SIGKILL.

The driver first closes the death pipes (each worker sees EOF and leaves its
busy loop on its own); :class:`TerminationPolicy` then escalates only as far
as it must:

1. wait ``grace_s`` for every process to exit (only for those that leave by
   themselves once told to: ``patient``; a Ray actor, whose gentle end ran
   before, goes straight to step 2);
2. SIGTERM the survivors and wait ``term_s`` (workers turn SIGTERM into one
   ``SystemExit`` and clean up);
3. SIGKILL whoever is still there and wait ``kill_s`` for the kernel to reap.

Each step is logged with the processes it acted on, and the returned
:class:`TerminationReport` says which step finished the job and who, if
anyone, survived.  The clock and sleep are injectable so tests run the whole
escalation instantly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

# Polling starts fine-grained (workers usually exit within milliseconds of
# their death pipe closing) and backs off so a long grace period stays cheap.
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.05


class Terminable(Protocol):
    """The part of ``multiprocessing.Process`` the policy uses."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class TerminationReport:
    """How termination ended: ``stage`` is exited, sigterm, sigkill or survived."""

    stage: str
    terminated: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)


def describe(proc: Terminable) -> str:
    return f"{proc.name} (pid {proc.pid})"


class TerminationPolicy:
    """Escalates from waiting to SIGTERM to SIGKILL; see the module docstring."""

    def __init__(
        self,
        grace_s: float = 4.0,
        term_s: float = 4.0,
        kill_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grace_s = grace_s
        self.term_s = term_s
        self.kill_s = kill_s
        self.clock = clock
        self.sleep = sleep

    def wait_for_exit(self, procs: Sequence[Terminable], timeout: float) -> bool:
        """True once none of ``procs`` is alive; False at the timeout."""
        deadline = self.clock() + timeout
        poll = _FIRST_POLL_S
        while True:
            if not any(p.is_alive() for p in procs):
                return True
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            self.sleep(min(poll, remaining))
            poll = min(poll * 2, _MAX_POLL_S)

    def terminate(self, procs: Sequence[Terminable],
                  patient: Sequence[bool] | None = None) -> TerminationReport:
        """``patient[i]``: ``procs[i]`` leaves by itself, worth waiting
        ``grace_s`` for (default: all of them)."""
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return TerminationReport("exited")
        waiting = alive if patient is None else [
            p for p, wait in zip(procs, patient, strict=True) if wait and p.is_alive()]
        if waiting:
            logger.debug("Worker termination: waiting up to %.1fs for %d process(es) to exit",
                         self.grace_s, len(waiting))
            self.wait_for_exit(waiting, self.grace_s)
        alive = [p for p in alive if p.is_alive()]
        if not alive:
            return TerminationReport("exited")

        terminated = [describe(p) for p in alive]
        logger.info("Worker termination: sending SIGTERM to %s", ", ".join(terminated))
        for p in alive:
            p.terminate()
        if self.wait_for_exit(alive, self.term_s):
            return TerminationReport("sigterm", terminated=terminated)

        alive = [p for p in alive if p.is_alive()]
        killed = [describe(p) for p in alive]
        logger.warning("Worker termination: %s ignored SIGTERM for %.1fs; sending SIGKILL",
                       ", ".join(killed), self.term_s)
        for p in alive:
            p.kill()
        if self.wait_for_exit(alive, self.kill_s):
            return TerminationReport("sigkill", terminated=terminated, killed=killed)

        survivors = [describe(p) for p in alive if p.is_alive()]
        logger.error("Worker termination: %s still alive %.1fs after SIGKILL",
                     ", ".join(survivors), self.kill_s)
        return TerminationReport("survived", terminated, killed, survivors)
