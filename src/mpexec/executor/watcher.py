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

A Python signal handler runs only when the main thread is between two
bytecodes: a worker blocked in native code that does not give way to
signals (a ``torch.distributed`` rendezvous waiting for a peer that will
never come, a hung collective) would sit on SIGTERM until SIGKILL.  The
:class:`SignalBackstop` thread hears each SIGTERM/SIGINT through the
interpreter's wakeup descriptor; if the handler has not run within
``SIGNAL_GRACE_S``, it ends the process by that signal itself.

:class:`Heartbeat` is the worker's half of the driver's stall check
(``stall``): a thread that stamps this worker's cell in the driver's
heartbeat segment with CLOCK_MONOTONIC every beat, from the start of
``worker_main`` to its end, whatever the main thread is busy with.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from mpexec.ipc import MessageQueue, QueueReader
from mpexec.ipc.shm import Segment, SegmentRef
from mpexec.system import kill_process_group, process_gone

logger = logging.getLogger(__name__)

ORPHAN_GRACE_S = 0.5
# The death pipe closes as the driver's descriptors are released, a moment
# before the kernel marks it exited: look for that long before calling it
# an orderly shutdown.
_DRIVER_EXIT_LOOK_S = 0.2
# How long the main thread has to start handling SIGTERM/SIGINT before the
# backstop ends the process (a worker between bytecodes takes microseconds).
SIGNAL_GRACE_S = 1.0


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
        self._queues: list[MessageQueue | QueueReader] | None = None
        self._lock = threading.Lock()
        self._eof = False

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="DeathPipeMonitor").start()

    def watch(self, queues: list[MessageQueue | QueueReader]) -> None:
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


class Heartbeat:
    """Stamps cell ``index`` of the driver's heartbeat segment every ``period_s``."""

    def __init__(self, ref: SegmentRef, index: int, period_s: float) -> None:
        self._ref = ref
        self._index = index
        self._period_s = period_s
        self._stop = threading.Event()
        self._segment: Segment | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._segment = Segment.attach(self._ref, "the driver's heartbeat segment")
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="WorkerHeartbeat")
        self._thread.start()

    def _beat(self) -> None:
        assert self._segment is not None
        self._segment.store(self._index, time.monotonic_ns())

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self._period_s + 1.0)
        if self._segment is not None:
            self._segment.close()


def end_own_group() -> None:
    """SIGKILL this process's group (this process included) if it leads one."""
    if not kill_process_group(os.getpgrp(), signal.SIGKILL):
        os.kill(os.getpid(), signal.SIGKILL)


class SignalBackstop:
    """Ends the process on SIGTERM/SIGINT when the main thread cannot.

    ``install()`` (main thread, after the Python handlers) points the
    interpreter's wakeup descriptor at a pipe this thread reads.  The
    handlers call ``handled()``; a signal not handled within ``grace_s``
    means the main thread is stuck in native code: the signal's default
    action is restored and the signal sent again, so the process ends as
    SIGTERM would have ended it (its exit status says so).
    """

    def __init__(self, grace_s: float = SIGNAL_GRACE_S,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.grace_s = grace_s
        self.signals = signals
        self._handled = threading.Event()
        self._read_fd = -1

    def install(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no backstop, the handlers still work
            os.close(read_fd)
            os.close(write_fd)
            return
        self._read_fd = read_fd
        # A child forked from here keeps the Python handlers and the wakeup
        # descriptor, not this thread: its signals must not reach our pipe.
        os.register_at_fork(after_in_child=_no_wakeup_fd)
        threading.Thread(target=self._run, daemon=True, name="SignalBackstop").start()

    def handled(self) -> None:
        """The Python handler ran: the main thread takes it from here."""
        self._handled.set()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            signum = next((n for n in data if n in self.signals), None)
            if signum is None or self._handled.wait(self.grace_s):
                continue
            logger.warning("%s not handled within %.1f s (the main thread is blocked in "
                           "native code); ending the process", signal.Signals(signum).name,
                           self.grace_s)
            _die_by(signum)


def _no_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread than the main one: not ours to reset
        pass


def _die_by(signum: int) -> None:
    """Restore ``signum``'s default action (from any thread) and raise it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    os._exit(128 + signum)  # the default action did not end us: never come back
