"""How a queue waits: spin, then yield, then sleep on a futex.

``wait_until`` is the one waiting procedure of the queue, used by a reader
waiting for a message, by the writer waiting for a free chunk and by both
sides of the start-up handshake.  It runs in three phases:

1. *spin*: re-check between ``sched_yield`` calls for ``spin_s`` seconds: a
   partner on another core answers within microseconds, and one that shares
   our core gets it at once (pure spinning collapses once spinners outnumber
   cores);
2. *sleep*: raise our "sleeping" flag, read the futex word, re-check, then
   sleep on the word for at most ``tick_s``; the other side wakes us after it
   changes the word (see ``sync`` for why no wake-up is lost).  Every tick runs
   ``on_tick`` (deadline-free checks: shutdown, peer death), and every
   ``log_interval_s`` logs ``describe()`` — who is behind.

The caller checks (and may briefly poll) its condition before calling, so
the hot path never enters this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mpexec.ipc import sync

logger = logging.getLogger("mpexec.ipc.message_queue")

YIELD_BATCH = 8


def wait_until(
    ready: Callable[[], bool],
    *,
    futex_word: Callable[[], tuple[int, int]] | None,
    set_sleeping: Callable[[int], None] | None,
    deadline: float | None,
    spin_s: float,
    tick_s: float,
    log_interval_s: float,
    on_tick: Callable[[], None],
    describe: Callable[[], str],
    what: str,
    log_level: int | Callable[[], int] = logging.WARNING,
) -> None:
    """Return once ``ready()``; raise ``TimeoutError`` at ``deadline``.

    ``log_level`` may be a callable, asked at each progress line.
    ``futex_word()`` gives the (address, current value) of the word to sleep
    on; ``None`` means plain sleeps.  ``set_sleeping(1/0)`` raises and lowers
    the flag the waker checks.  ``on_tick`` raises to abort the wait.
    """
    now = time.monotonic()
    if deadline is not None and now >= deadline:  # a poll: one look, no spinning
        if ready():
            return
        raise TimeoutError(f"{what} timed out; {describe()}")
    spin_end = now + spin_s
    while True:
        for _ in range(YIELD_BATCH):
            sync.cpu_relax()
            if ready():
                return
        now = time.monotonic()
        if now >= spin_end or (deadline is not None and now >= deadline):
            break
    started = time.monotonic()
    next_log = started + log_interval_s
    pause = min(0.0005, tick_s)
    while True:
        if ready():  # first: what a peer published before it died is still delivered
            return
        on_tick()
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            if ready():
                return
            raise TimeoutError(f"{what} timed out; {describe()}")
        limit = tick_s if deadline is None else min(tick_s, deadline - now)
        if _sleep(ready, futex_word, set_sleeping, limit, pause):
            return
        pause = min(pause * 2, tick_s)
        now = time.monotonic()
        if now >= next_log:
            level = log_level() if callable(log_level) else log_level
            logger.log(level, "%s: still waiting after %.0f s; %s", what, now - started,
                       describe())
            next_log = now + log_interval_s


def _sleep(ready: Callable[[], bool], futex_word: Callable[[], tuple[int, int]] | None,
           set_sleeping: Callable[[int], None] | None, limit: float, pause: float) -> bool:
    """One sleep of at most ``limit`` s; True when ``ready()`` holds after it.

    The sleeping flag goes up before the last look at the word and comes down
    however the sleep ends (a KeyboardInterrupt included), so the other side
    never keeps paying for wake-ups nobody waits for.
    """
    if set_sleeping is not None:
        set_sleeping(1)
    try:
        word = futex_word() if futex_word is not None else None
        if ready():
            return True
        if word is not None:
            sync.futex_wait(word[0], word[1], limit)
        else:
            time.sleep(min(pause, limit))
    finally:
        if set_sleeping is not None:
            set_sleeping(0)
    return ready()
