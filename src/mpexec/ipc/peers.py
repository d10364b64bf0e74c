"""Noticing that the process at the other end of a queue has died.

A pidfd (Linux >= 5.3) becomes readable when its process exits, even before
the process is reaped, and cannot be fooled by pid reuse once open.  It is
asked with ``poll``, never ``select``: ``select`` refuses descriptors above
1,023, which any process serving many connections has.  Where pidfds are
missing, ``kill(pid, 0)`` is the fallback.
"""

from __future__ import annotations

import os
import select


class PeerWatch:
    """Answers "is process ``pid`` still running?" cheaply and repeatedly."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = -1
        self._poll: select.poll | None = None
        self._dead = False
        if hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._dead = True
                return
            except OSError:
                self._fd = -1
        if self._fd >= 0:
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._poll is not None:
            self._dead = bool(self._poll.poll(0))
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._dead = True
            except PermissionError:
                pass
        return not self._dead

    def close(self) -> None:
        if self._fd >= 0:
            self._poll = None
            os.close(self._fd)
            self._fd = -1
