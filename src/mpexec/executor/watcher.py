"""The worker's guard against an orphaned life: the death-pipe watcher.

A thread blocks on the death pipe.  EOF there means the driver closed it
(orderly shutdown) or died.  Either way the watcher shuts the worker's
queues down, which ends a worker waiting for its next call.  Then::

    driver still alive   ->  nothing more: the driver escalates itself
    driver gone          ->  wait ORPHAN_GRACE_S for the worker to leave on
                             its own, then SIGKILL its whole process group
                             (the worker and everything it started)

so a worker busy in a call that never returns (a hung collective) is gone
well within two seconds of the driver's death.  Before the queues exist
(still starting up) the watcher interrupts the main thread with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from mpexec.ipc import MessageQueue
from mpexec.system import kill_process_group, process_gone

logger = logging.getLogger(__name__)

ORPHAN_GRACE_S = 0.5
# The death pipe closes as the driver's descriptors are released, a moment
# before the kernel marks it exited: look for that long before calling it
# an orderly shutdown.
_DRIVER_EXIT_LOOK_S = 0.2


class DeathPipeWatcher:
    """Notices the driver going away (EOF on the death pipe) and ends the worker."""

    def __init__(self, death_pipe: Connection, driver_pid: int) -> None:
        self._death_pipe = death_pipe
        self._driver_pid = driver_pid
        # Deliberately not the signal handler's flag: a worker still busy in
        # a long method when the driver leaves must stay interruptible by
        # the SIGTERM that follows, or only SIGKILL could end it.
        self.stopping = threading.Event()
        self.main_done = threading.Event()
        self._queues: list[MessageQueue] | None = None
        self._lock = threading.Lock()
        self._eof = False

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="DeathPipeMonitor").start()

    def watch(self, queues: list[MessageQueue]) -> None:
        """From now on, the death pipe closing shuts these queues down."""
        with self._lock:
            self._queues = queues
            eof = self._eof
        if eof:
            self._shut_down_queues()

    def driver_gone(self) -> bool:
        return process_gone(self._driver_pid)

    def _run(self) -> None:
        try:
            self._death_pipe.recv()
        except EOFError:
            pass
        except OSError:  # our own end was closed at exit
            return
        logger.debug("Death pipe closed (driver gone or shutting down); stopping queues")
        with self._lock:
            self._eof = True
            queues = self._queues
        if queues is None:
            # Still starting up: interrupt whatever the main thread is doing.
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._shut_down_queues()
        deadline = time.monotonic() + _DRIVER_EXIT_LOOK_S
        while not self.driver_gone():
            if time.monotonic() >= deadline or self.main_done.wait(0.01):
                return  # an orderly shutdown: the driver escalates if need be
        if not self.main_done.wait(ORPHAN_GRACE_S):
            logger.warning("The driver is gone and this worker is still busy; ending its "
                           "process group")
            end_own_group()

    def _shut_down_queues(self) -> None:
        self.stopping.set()
        for mq in self._queues or ():
            mq.shutdown()


def end_own_group() -> None:
    """SIGKILL this process's group (this process included) if it leads one."""
    if not kill_process_group(os.getpgrp(), signal.SIGKILL):
        os.kill(os.getpid(), signal.SIGKILL)
