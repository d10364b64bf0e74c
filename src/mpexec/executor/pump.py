"""The reply pump: resolves calls while non-blocking futures are pending.

See ``futures`` for the call order it serves.  The pump is a thread started
on the first non-blocking call; it waits on a condition while no future is
pending (so blocking calls never share the replies with it) and otherwise
resolves the newest pending future - and with it, in call order, every
older call - as replies arrive.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import suppress

from mpexec.executor.futures import CallOrder

_LINGER_S = 0.0005


class ReplyPump:
    """Resolves calls while non-blocking futures are pending; sleeps otherwise.

    Started on the first non-blocking call, so an executor used only with
    blocking calls never runs it.
    """

    def __init__(self, order: CallOrder, name: str = "MpexecReplyPump") -> None:
        self._order = order
        self._cond = threading.Condition(threading.Lock())
        self._idle = True
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        order.pump = self
        self._thread.start()

    def wake(self) -> None:
        if self._idle:
            with self._cond:
                self._cond.notify()

    def stop(self, join_s: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        order = self._order
        while True:
            with self._cond:
                while True:
                    # Idle is announced before the check: a caller that adds
                    # a future after the check sees it and notifies.
                    self._idle = True
                    if self._stopped or order.futures_pending:
                        break
                    self._cond.wait()
                self._idle = False
                if self._stopped:
                    return
            target = order.newest_future()
            if target is None:
                continue
            with suppress(TimeoutError):
                order.wait(target)
            del target
            # A caller that keeps issuing futures (an engine step after step)
            # finds the pump still awake for a moment: no wake-up to pay.
            linger_until = time.monotonic() + _LINGER_S
            while not order.futures_pending and time.monotonic() < linger_until:
                os.sched_yield()
