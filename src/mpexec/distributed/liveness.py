"""Noticing that a peer process of a collective has died: pidfds and poll.

A collective that waits for a dead peer would wait forever, so every sleep
tick of a shared-memory collective asks :meth:`PeerWatch.check`.  A pidfd
(``pidfd_open``) becomes readable when its process exits, whoever its
parent is, and it names that process, never a later one that reuses the
pid.  ``poll`` (not ``select``) takes descriptors of any number.  Where
pidfds are missing (old kernels), ``kill(pid, 0)`` is the fallback: it
cannot see a pid reused in the same tick, which is good enough for a
failure path.
"""

from __future__ import annotations

import os
import select

from mpexec.errors import CollectiveFailedError


class PeerDiedInCollectiveError(CollectiveFailedError):
    """Ranks of the group exited while the others waited for them.

    A :class:`~mpexec.errors.CollectiveFailedError` (so also a
    ``RuntimeError``): the driver recognises it as a peer's death.

    ``dead`` maps each exited rank (within the group) to its pid.
    """

    def __init__(self, message: str, *, dead: dict[int, int]) -> None:
        super().__init__(message)
        self.dead = dict(dead)


class PeerWatch:
    """Watches the processes of a group's other ranks; ``check`` raises once one is gone."""

    def __init__(self, pids: dict[int, int], what: str) -> None:
        """``pids`` maps group rank to pid (this process left out)."""
        self.what = what
        self._pids = dict(pids)
        self._fds: dict[int, int] = {}  # descriptor -> group rank
        self._poll: select.poll | None = None
        if hasattr(os, "pidfd_open"):
            self._poll = select.poll()
            try:
                for group_rank, pid in self._pids.items():
                    fd = os.pidfd_open(pid)
                    self._fds[fd] = group_rank
                    self._poll.register(fd, select.POLLIN)
            except ProcessLookupError:
                self.close()
                raise self._error([group_rank]) from None
            except OSError:  # no pidfd support here: fall back to kill(pid, 0)
                self.close()
                self._poll = None

    def check(self) -> None:
        """Raise :class:`PeerDiedInCollectiveError` if a watched process has exited."""
        if self._poll is not None:
            dead = sorted(self._fds[fd] for fd, _events in self._poll.poll(0))
        else:
            dead = [r for r, pid in sorted(self._pids.items()) if not _alive(pid)]
        if dead:
            raise self._error(dead)

    def _error(self, group_ranks: list[int]) -> PeerDiedInCollectiveError:
        dead = {r: self._pids[r] for r in group_ranks}
        names = ", ".join(f"rank {r} of the group (pid {pid})" for r, pid in dead.items())
        return PeerDiedInCollectiveError(
            f"{self.what}: {names} exited while the others waited; the group is "
            "unusable, destroy it and restart the workers", dead=dead)

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, just not ours to signal
    return True


class CollectiveGuard:
    """``with CollectiveGuard(what):`` - a failure of the call inside becomes
    :class:`~mpexec.errors.CollectiveFailedError`.

    Wraps every torch.distributed call of a group: gloo's "Connection reset
    by peer" and NCCL's errors (RuntimeError and its subclasses such as
    ``DistBackendError``) become one type the driver recognises, the
    original kept as ``__cause__`` and its message in the new one.  Errors
    of the arguments (ValueError, TypeError) pass unchanged, and so does a
    CollectiveFailedError from a nested guard.
    """

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None or not isinstance(exc, RuntimeError) \
                or isinstance(exc, CollectiveFailedError):
            return
        raise CollectiveFailedError(
            f"{self.what} failed ({type(exc).__name__}: {exc}); a peer of the group "
            "may be gone") from exc


# The torch.distributed calls a process group makes, each under a guard.
GUARDED_CALLS = ("all_gather", "all_gather_object", "all_reduce", "all_to_all", "barrier",
                 "broadcast", "broadcast_object_list", "recv", "send")


def collective_guards(group: str, rank_in_group: int) -> dict[str, CollectiveGuard]:
    """A guard per call of :data:`GUARDED_CALLS`, made once per group: the
    collectives themselves build no string and no object."""
    return {call: CollectiveGuard(f"the {group} group's {call} (rank {rank_in_group})")
            for call in GUARDED_CALLS}
