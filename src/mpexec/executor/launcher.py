"""The launcher seam: how the driver starts, watches and ends workers.

The driver core (``driver``, ``lifecycle``, ``termination``, ``verdict``)
talks to workers only through the protocols here; each way of running a
worker implements them in its own sub-package (``local``: processes of this
machine; ``nodes``: the workers of a follower node, one handle per node;
``ray``: Ray actors)::

    WorkerLauncher.start(spec_for) -> WorkerHandle
    WorkerHandle     rank, name, is_alive, terminate, kill, describe_exit
    WatchedWorker    + what the lifecycle needs to watch and end it: the
                     launcher's death descriptor (``death_fd``), how long its
                     death may trail its queues closing (``death_lag_s``), its
                     process on this machine if any (``pid``, for the stall
                     check and the logs), ``join``, ``close_death_pipe``
                     (the gentle "end now"), whether that ends it
                     (``ends_on_close``), ``end_group``, ``close``

``describe_exit`` returns a :class:`WorkerExit`: the rank that failed, the
pid and exit code where there are such things, and the words the error
uses; nothing above the seam asks which kind of handle it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from mpexec.executor.spec import WorkerSpec


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended, in its handle's words (``describe_exit``).

    ``who`` names the worker before "died:" in an error ("worker rank 1 (pid
    42)"); it is empty where ``how`` names it already ("node 1 (ranks 2-3)
    lost: ...").  ``rank`` is the rank that failed: for a follower node the
    worker it reported, if it did.  ``stalled`` ("stopped" or "silent") says
    that the worker stopped answering and was judged so where it runs (a
    follower node, a Ray node's watch: see ``stall``); ``how`` then says what
    was seen, and the executor fails with ``WorkerStalledError``.
    """

    rank: int
    pid: int | None
    exitcode: int | None
    how: str
    who: str = ""
    remote_traceback: str = ""
    stalled: str = ""

    def sentence(self) -> str:
        return f"{self.who} died: {self.how}" if self.who else self.how


class WorkerHandle(Protocol):
    """One started worker as the failure table sees it (see the module docstring)."""

    rank: int

    @property
    def name(self) -> str: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def describe_exit(self) -> WorkerExit: ...


class WatchedWorker(WorkerHandle, Protocol):
    """A started worker as the lifecycle holds it (see the module docstring)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def death_fd(self) -> int: ...

    @property
    def death_lag_s(self) -> float: ...

    @property
    def ends_on_close(self) -> bool:
        """Whether closing its death pipe ends it (the teardown waits
        ``shutdown_grace_s`` for it before ``terminate``)."""

    def join(self, timeout: float | None) -> None: ...

    def close_death_pipe(self) -> None: ...

    def end_group(self) -> None: ...

    def close(self) -> None: ...


class WorkerLauncher(Protocol):
    def start(self, spec_for: SpecFactory) -> WatchedWorker:
        """Start one worker; it is not ready until its ``Ready`` arrives."""


class SpecFactory(Protocol):
    """Builds a worker's spec once the launcher has made its pipes."""

    def __call__(self, *, ready_pipe: Connection, death_pipe: Connection,
                 inherited_fds: tuple[int, ...]) -> WorkerSpec: ...
