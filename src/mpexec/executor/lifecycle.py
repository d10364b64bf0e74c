"""One executor's life: its state, what it owns, and the one teardown order.

::

    STARTING --all READY--> READY --worker dies--> FAILED --teardown--> (torn down)
        |                     |                                ^
        +--start fails--------+--shutdown() / exit / GC--> CLOSED

:class:`Lifecycle` holds the state under one lock, the failure callbacks,
the worker handles, the queues, the call order, the reply pump, the
monitor thread and the reserved port - everything the executor must
release - and never a reference to the executor itself, so that
``weakref.finalize`` can run ``close`` at interpreter exit or when the
executor is collected.  An orderly end (``close``) sets CLOSED *first*:
workers leaving after that are not failures (no ERROR, no callback).

A death (``worker_died``, from the monitor or from a caller whose queue
closed) goes READY -> FAILED once: every pending call fails with its own
``WorkerDiedError`` and the queues close, which wakes any caller blocked on
a reply at once; then the failure callbacks run (``fire_callbacks``), and
only then ``teardown`` waits for the survivors.  A worker that stopped
answering (``worker_stalled``: stopped by a signal, or its heartbeat silent;
the monitor asks ``stall`` every tick; or a handle's ``describe_exit`` says
so, judged where the worker runs) fails the executor the same way, with
``WorkerStalledError``, after it is killed.  The first failure is kept
(``first_error``): every later call's error repeats its words (rank, pid,
signal) and has it as ``__cause__``, however long the executor sat idle.

``teardown`` runs once, whoever calls it first, in this order:

1. fail pending calls;
2. close queues (wakes blocked readers; workers leave their loops);
3. close death pipes;
4. escalate: wait (for the workers that leave on their own once their
   death pipe closes: ``ends_on_close``), SIGTERM, SIGKILL (``termination``);
5. join the monitor and the reply pump; SIGKILL what is left in each
   worker's process group;
6. close handles (pidfds, processes), the heartbeat segment, the monitor's
   wake-up pipe, the port.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mpexec.errors import (
    PeerDiedError,
    QueueClosedError,
    WorkerDiedError,
    WorkerStartupError,
    describe_exitcode,
)
from mpexec.executor.futures import CallOrder
from mpexec.executor.launcher import WatchedWorker, WorkerHandle
from mpexec.executor.spec import PortReservation
from mpexec.executor.stall import Stall, StallWatch
from mpexec.executor.termination import TerminationPolicy
from mpexec.ipc import MessageQueue, QueueReader

logger = logging.getLogger("mpexec.executor.multiproc")

FailureCallback = Callable[[], None]
_JOIN_S = 2.0


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class Death:
    """Which worker died, and how."""

    rank: int
    pid: int | None
    exitcode: int | None
    how: str = ""
    stall: Stall | None = None  # it stopped answering (and was killed)
    who: str = ""  # names the worker before "died:"; empty where ``how`` does

    def error(self) -> WorkerDiedError:
        if self.stall is not None:
            return self.stall.error()
        how = self.how or describe_exitcode(self.exitcode)
        what = f"{self.who} died: " if self.who else ""
        return WorkerDiedError(f"{what}{how}; the executor has failed",
                               rank=self.rank, pid=self.pid, exitcode=self.exitcode)


class Lifecycle:
    """See the module docstring."""

    def __init__(self, policy: TerminationPolicy) -> None:
        self.policy = policy
        self.owner_pid = os.getpid()
        self.lock = threading.Lock()
        self.state = State.STARTING
        # state is READY: one attribute read on every call's path
        self.usable = False
        self.death: Death | None = None
        # The first failure's error, kept as the cause of every later one.
        self.first_error: WorkerDiedError | None = None
        self.stall: StallWatch | None = None
        self.handles: list[WatchedWorker] = []
        self.queues: list[MessageQueue | QueueReader] = []
        self.calls: CallOrder | None = None
        self.port: PortReservation | None = None
        self.monitor: threading.Thread | None = None
        self._callbacks: list[FailureCallback] = []
        self._teardown_lock = threading.Lock()
        self._torn_down = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        # Set once the monitor stops polling the death descriptors (or never
        # will): only then may teardown close them.
        self._polling_done = threading.Event()
        # The backend's own last steps (an in-process worker's shutdown),
        # run once by whichever teardown happens.
        self._at_teardown: list[Callable[[], None]] = []

    # -- state ---------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        return self.state is State.FAILED

    def mark_ready(self) -> None:
        with self.lock:
            if self.state is State.STARTING:
                self.state = State.READY
                self.usable = True

    def begin_close(self) -> bool:
        """The first step of an orderly end: CLOSED (unless FAILED), unusable;
        True if it was READY (its workers may still run their own shutdown)."""
        with self.lock:
            orderly = self.state is State.READY
            self.usable = False
            if self.state is not State.FAILED:
                self.state = State.CLOSED
        return orderly

    def at_teardown(self, step: Callable[[], None]) -> None:
        """Run ``step`` once, at the end of the teardown (orderly or after a failure)."""
        self._at_teardown.append(step)

    def closed_error(self) -> Exception:
        """What a call sees once the executor is no longer usable: after a
        failure, a ``WorkerDiedError`` in the first one's words, with it as
        ``__cause__`` (a fresh instance per call: each gets its own traceback)."""
        first = self.first_error
        if first is not None:
            assert self.death is not None
            error = self.death.error()
            error.__cause__ = first
            return error
        return QueueClosedError("the executor is shut down")

    def register_callback(self, callback: FailureCallback) -> None:
        with self.lock:
            if self.state is not State.FAILED:
                self._callbacks.append(callback)
                return
        _run_callback(callback)

    def handshake_failure(self, exc: QueueClosedError,
                          wait_s: float = 1.0) -> WorkerStartupError | None:
        """A queue closed under the start-up handshake (``exc``): the worker
        whose death closed it, by rank and how it ended, as a start-up error.
        The monitor's record when it has one; else, when the queue saw a peer
        die (``PeerDiedError``), the first worker found gone within ``wait_s``
        (its exit takes a moment to be reaped); None otherwise (a queue shut
        down under the handshake: the workers that exit then are its effect)."""
        deadline = time.monotonic() + wait_s
        while True:
            death = self.death
            if death is not None:
                how = death.how or describe_exitcode(death.exitcode)
                return WorkerStartupError(f"worker rank {death.rank} died during the queue "
                                          f"handshake: {how}", rank=death.rank)
            if not isinstance(exc, PeerDiedError):
                return None
            gone = next((h for h in self.handles if not h.is_alive()), None)
            if gone is not None:
                exit = gone.describe_exit()
                return WorkerStartupError(f"{exit.sentence()} (during the queue handshake: "
                                          f"{exc})", rank=exit.rank,
                                          remote_traceback=exit.remote_traceback)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def worker_died(self, handle: WorkerHandle, how: str = "") -> bool:
        """Fail the executor because ``handle`` is gone; True for the first death.

        The handle says how it ended (``describe_exit``); ``how``, when given,
        is what the caller saw instead ("closed its queue ...": it may still run)."""
        exit = handle.describe_exit()
        if exit.stalled:  # judged where it runs (a follower node, a Ray node's watch)
            return self.worker_stalled(handle, Stall(-1, exit.rank, exit.pid or 0,
                                                     exit.stalled, exit.how))
        if how:
            how = f"{exit.who or handle.name} {how}"
            death = Death(handle.rank, exit.pid, exit.exitcode, how)
        else:
            death = Death(handle.rank, exit.pid, exit.exitcode, exit.how, who=exit.who)
        if not self._fail(death):
            return False
        logger.error("Worker proc %s died unexpectedly (%s), shutting down executor.",
                     handle.name, how or exit.how)
        self._after_fail()
        return True

    def worker_stalled(self, handle: WorkerHandle, stall: Stall) -> bool:
        """Fail the executor because ``handle`` stopped answering, and kill it
        (a stopped process takes no SIGTERM); True for the first failure."""
        if not self._fail(Death(stall.rank, stall.pid, None, stall.how, stall)):
            return False
        logger.error("Worker proc %s %s; killing it and shutting down executor.",
                     handle.name, stall.how)
        handle.kill()
        self._after_fail()
        return True

    def _fail(self, death: Death) -> bool:
        with self.lock:
            if self.state in (State.FAILED, State.CLOSED):
                return False
            self.state = State.FAILED
            self.usable = False
            self.death = death
            self.first_error = death.error()
        return True

    def _after_fail(self) -> None:
        death = self.death
        assert death is not None
        if self.calls is not None:
            self.calls.fail_all(death.error)
        self._close_queues()

    def worker_gone(self, handle: WorkerHandle, how: str = "", *,
                    teardown: bool = True) -> None:
        """A caller found ``handle`` gone (its queue closed): fail the executor
        and, with ``teardown`` (no monitor will see a death), run the failure
        callbacks and the teardown on a thread of their own."""
        if self.worker_died(handle, how) and teardown:
            threading.Thread(target=self._after_death, daemon=True,
                             name="MpexecAfterDeath").start()

    def _after_death(self) -> None:
        self.fire_callbacks()
        self.teardown()

    def fire_callbacks(self) -> None:
        with self.lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run_callback(callback)

    # -- monitor ----------------------------------------------------------------------

    def start_monitor(self) -> None:
        if self.monitor is not None:
            return  # one monitor, whoever starts it first
        thread = threading.Thread(target=self.watch, daemon=True,
                                  name="MultiprocWorkerMonitor")
        self.monitor = thread
        thread.start()

    def watch(self) -> None:
        """Wait for a worker death, a stalled worker (or teardown); handle the failure."""
        poller = select.poll()  # not select(): descriptors above 1024 are common
        by_fd = {h.death_fd: h for h in self.handles}
        for fd in (*by_fd, self._wake_r):
            poller.register(fd, select.POLLIN)
        stall = self.stall
        tick_ms = None if stall is None or stall.tick_s is None else int(stall.tick_s * 1000)
        stalled: Stall | None = None
        try:
            while True:
                ready = poller.poll(tick_ms)
                if ready or stall is None:
                    break
                if self.state is State.READY:
                    stalled = stall.check(self.handles)
                    if stalled is not None:
                        break
        finally:
            self._polling_done.set()
        with self.lock:
            closing = self.state is State.CLOSED
        dead = [by_fd[fd] for fd, _ in ready if fd in by_fd]
        if closing or not (dead or stalled):
            logger.debug("MultiprocWorkerMonitor: shutdown already initiated")
            return
        if dead:
            self.worker_died(dead[0])
        elif stalled is not None:
            self.worker_stalled(self.handles[stalled.index], stalled)
        if self.state is State.FAILED:
            self.fire_callbacks()
            self.teardown()

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """The orderly end: shutdown(), a failed start, interpreter exit, GC."""
        if os.getpid() != self.owner_pid:
            return  # a forked copy must not touch the parent's workers
        self.begin_close()
        self.teardown()

    def teardown(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        if not self._teardown_lock.acquire(blocking=False):
            # Another thread is tearing down: return once it is done, so no
            # worker outlives this call.
            bound = self.policy.grace_s + self.policy.term_s + self.policy.kill_s + 10.0
            self._torn_down.wait(bound)
            return
        me = threading.current_thread()
        monitor = self.monitor
        try:
            if self._torn_down.is_set():
                return
            if self.calls is not None:
                self.calls.fail_all(self.closed_error)
            self._close_queues()
            for handle in self.handles:
                handle.close_death_pipe()
            report = self.policy.terminate(self.handles,
                                           [h.ends_on_close for h in self.handles])
            logger.debug("worker termination: %s", report.stage)
            me = threading.current_thread()
            monitor = self.monitor
            if monitor is not None and monitor is not me:
                os.write(self._wake_w, b"x")
                self._polling_done.wait(_JOIN_S)
            pump = None if self.calls is None else self.calls.pump
            if pump is not None:
                pump.stop(_JOIN_S)
            for handle in self.handles:
                handle.end_group()
            if monitor is None or monitor is me or self._polling_done.is_set():
                for handle in self.handles:
                    handle.close()
                if self.stall is not None:
                    self.stall.close()
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            if self.port is not None:
                self.port.close()
            for step in self._at_teardown:
                try:
                    step()
                except Exception:
                    logger.exception("an executor's teardown step %r raised", step)
        finally:
            self._torn_down.set()
            self._teardown_lock.release()
        if monitor is not None and monitor is not me:
            # It may still be running a failure callback; a thread left behind
            # would make the next executor spawn rather than fork.
            monitor.join(_JOIN_S)

    def _close_queues(self) -> None:
        for mq in self.queues:
            mq.shutdown()


def _run_callback(callback: FailureCallback) -> None:
    try:
        callback()
    except Exception:
        logger.exception("The executor's failure callback %r raised", callback)
