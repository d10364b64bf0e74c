"""The launcher seam: how the driver starts, watches and ends workers.

The driver core (``driver``, ``lifecycle``, ``termination``, ``verdict``)
talks to workers only through the two protocols here; each way of running a
worker implements them in its own sub-package:

``WorkerLauncher.start(spec_for) -> WorkerHandle``
    start one worker from its :class:`~mpexec.executor.spec.WorkerSpec`.
``WorkerHandle``
    ``ready_conn`` (the one message, ``Ready`` or ``StartupFailed``),
    ``death_fd`` (readable once the worker is gone), ``is_alive``,
    ``terminate`` / ``kill`` (also what it started), ``join``,
    ``wait_exitcode`` / ``describe_exit``, ``end_group`` (what it started and
    left behind), ``close_death_pipe``, ``close``.

``local``: worker processes of this machine (``LocalProcessLauncher``);
``nodes``: the workers of a follower node, one handle per node; ``ray``:
Ray actors.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Protocol

from mpexec.executor.spec import WorkerSpec


class WorkerHandle(Protocol):
    """The driver's view of one started worker (see the module docstring)."""

    rank: int

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def ready_conn(self) -> Connection | None: ...

    @property
    def death_fd(self) -> int: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None) -> None: ...

    def wait_exitcode(self, timeout: float = ...) -> int | None: ...

    def describe_exit(self) -> str: ...

    def end_group(self) -> None: ...

    def close_ready(self) -> None: ...

    def close_death_pipe(self) -> None: ...

    def close(self) -> None: ...


class WorkerLauncher(Protocol):
    def start(self, spec_for: SpecFactory) -> WorkerHandle:
        """Start one worker; it is not ready until its ``Ready`` arrives."""


class SpecFactory(Protocol):
    """Builds a worker's spec once the launcher has made its pipes."""

    def __call__(self, *, ready_pipe: Connection, death_pipe: Connection,
                 inherited_fds: tuple[int, ...]) -> WorkerSpec: ...
