"""Noticing that the process at the other end of a queue has died.

A pidfd (Linux >= 5.3) becomes readable when its process exits, even before
the process is reaped, and cannot be fooled by pid reuse once open.  Where
pidfds are missing, ``kill(pid, 0)`` is the fallback.
"""

from __future__ import annotations

import os
import select


class PeerWatch:
    """Answers "is process ``pid`` still running?" cheaply and repeatedly."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = -1
        if hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._dead = True
                return
            except OSError:
                self._fd = -1
        self._dead = False

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._fd >= 0:
            readable, _, _ = select.select([self._fd], [], [], 0)
            self._dead = bool(readable)
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
            os.close(self._fd)
            self._fd = -1
