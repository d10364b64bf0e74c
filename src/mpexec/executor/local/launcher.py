"""Workers as local processes: :class:`LocalProcessLauncher`.

Two one-way pipes per worker::

    ready pipe   worker -> driver   Ready(handle) or StartupFailed(failure)
    death pipe   driver -> worker   never written; the driver closing it (or
                                    dying) is the message

and a pidfd for the death notification: unlike ``multiprocessing``'s
sentinel pipe, a grandchild that inherited it cannot keep it from firing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from mpexec.errors import describe_exitcode
from mpexec.executor.launcher import SpecFactory, WorkerExit
from mpexec.executor.worker_proc import worker_main
from mpexec.system import kill_process_group, open_pidfd
from mpexec.system.start import serialize_exit_status

logger = logging.getLogger(__name__)

_EXITCODE_WAIT_S = 1.0
# A closed queue whose worker is still alive: how long to wait for it to exit.
_DEATH_LAG_S = 1.0


class LocalWorkerHandle:
    """A worker running as a local ``multiprocessing`` process.

    Beyond ``WatchedWorker`` it has what only a local process has: its
    ready pipe (``ready_conn``, read by ``ready.wait_for_ready``) and its
    exit code.
    """

    death_lag_s = _DEATH_LAG_S
    ends_on_close = True  # EOF on its death pipe: it leaves its loop and exits

    def __init__(self, rank: int, proc: BaseProcess, ready_conn: Connection,
                 death_writer: Connection) -> None:
        self.rank = rank
        self.proc = proc
        self._ready: Connection | None = ready_conn
        self._death_writer: Connection | None = death_writer
        assert proc.pid is not None
        self._pid = proc.pid
        self._pidfd = open_pidfd(proc.pid)
        self._closed = False

    @property
    def name(self) -> str:
        return self.proc.name

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return None if self._closed else self.proc.exitcode

    @property
    def ready_conn(self) -> Connection | None:
        return self._ready

    @property
    def death_fd(self) -> int:
        return self._pidfd if self._pidfd is not None else self.proc.sentinel

    def is_alive(self) -> bool:
        return not self._closed and self.proc.is_alive()

    def terminate(self) -> None:
        if self.is_alive():
            self.proc.terminate()

    def kill(self) -> None:
        """SIGKILL the worker and everything in its process group."""
        kill_process_group(self._pid, signal.SIGKILL)
        if self.is_alive():
            self.proc.kill()

    def join(self, timeout: float | None) -> None:
        if not self._closed:
            self.proc.join(timeout)

    def wait_exitcode(self, timeout: float = _EXITCODE_WAIT_S) -> int | None:
        """The exit code, waiting briefly for a worker that is dying."""
        self.join(timeout)
        return self.exitcode

    def describe_exit(self) -> WorkerExit:
        exitcode = self.wait_exitcode()
        return WorkerExit(self.rank, self._pid, exitcode, describe_exitcode(exitcode),
                          who=f"worker rank {self.rank} (pid {self._pid})")

    def close_ready(self) -> None:
        if self._ready is not None:
            self._ready.close()
            self._ready = None

    def close_death_pipe(self) -> None:
        if self._death_writer is not None:
            self._death_writer.close()
            self._death_writer = None

    def end_group(self) -> None:
        """SIGKILL whatever the worker started and left behind in its group."""
        kill_process_group(self._pid, signal.SIGKILL)

    def close(self) -> None:
        """Release the descriptors once the process has exited."""
        self.close_ready()
        self.close_death_pipe()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if not self._closed and self.proc.exitcode is not None:
            self.proc.close()
            self._closed = True

    def __repr__(self) -> str:
        return f"<worker rank {self.rank} pid {self._pid}>"


class LocalProcessLauncher:
    """Starts workers as processes of one ``multiprocessing`` context."""

    def __init__(self, context: BaseContext) -> None:
        self.context = context
        self.fork = context.get_start_method() == "fork"
        self.forkserver = context.get_start_method() == "forkserver"
        # A forked child inherits the driver's ends of its siblings' pipes;
        # it must close them, or a sibling's death pipe would never see EOF.
        self._driver_ends: list[int] = []
        self._env_lock = threading.Lock()

    def start(self, spec_for: SpecFactory) -> LocalWorkerHandle:
        ready_reader, ready_writer = self.context.Pipe(duplex=False)
        death_reader, death_writer = self.context.Pipe(duplex=False)
        inherited: tuple[int, ...] = ()
        if self.fork:
            inherited = (*self._driver_ends, ready_reader.fileno(), death_writer.fileno())
        spec = spec_for(ready_pipe=ready_writer, death_pipe=death_reader,
                        inherited_fds=inherited)
        if self.forkserver:
            # The worker's parent is the fork server, whose death says nothing
            # about the driver's (the death pipe does), and whose environment
            # is the one it started with.
            spec = dataclasses.replace(spec, parent_death_signal=False,
                                       environ={**os.environ, **spec.thread_env})
        proc: BaseProcess = self.context.Process(  # type: ignore[attr-defined]
            target=worker_main, args=(spec,), name=f"MpexecWorker-{spec.rank}", daemon=True)
        try:
            with self._environ(spec.thread_env):
                proc.start()
                serialize_exit_status(proc)
        except BaseException:
            for end in (ready_reader, death_writer):
                end.close()
            raise
        finally:
            # Whatever happened, these ends belong to the child now.
            ready_writer.close()
            death_reader.close()
        if self.fork:
            self._driver_ends += [ready_reader.fileno(), death_writer.fileno()]
        return LocalWorkerHandle(spec.rank, proc, ready_reader, death_writer)

    @contextlib.contextmanager
    def _environ(self, updates: Mapping[str, str]) -> Iterator[None]:
        """``updates`` in ``os.environ`` for one start only.

        A spawned interpreter reads its environment before any import, so the
        variables must be there when it starts; they are removed again at
        once, and the driver's own torch thread pool is never touched.
        """
        if not updates:
            yield
            return
        with self._env_lock:
            saved = {var: os.environ.get(var) for var in updates}
            os.environ.update(updates)
            try:
                yield
            finally:
                for var, value in saved.items():
                    if value is None:
                        os.environ.pop(var, None)
                    else:
                        os.environ[var] = value
