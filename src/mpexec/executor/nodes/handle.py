"""A follower node as one of the leader's worker handles (see ``leader``).

The lifecycle and the failure table talk to workers only through the
``WatchedWorker`` protocol (``launcher``); a follower node answers it for all
of its ranks at once.  Its death descriptor is a pipe that becomes readable
when the node is lost (``lost``: silent for ``node_timeout_s``, or it
reported a failed worker, or one its stall watch found stopped or hung:
``describe_exit`` then says ``stalled``); ending it (``terminate``, ``close_death_pipe``)
asks the node server to say BYE.  It has no pid and no exit code here: the
node's processes are on another machine.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Protocol

from mpexec.executor.launcher import WorkerExit
from mpexec.ipc import Handle

if TYPE_CHECKING:
    from mpexec.executor.nodes.wire import Session


class NodeServerLink(Protocol):
    """What a node's handle asks of the leader's node server (``cluster.NodeServer``)."""

    def request_bye(self, handle: RemoteNodeHandle) -> None: ...

    def release(self, handle: RemoteNodeHandle) -> None: ...


class RemoteNodeHandle:
    """A follower node, as one entry among the lifecycle's worker handles."""

    def __init__(self, server: NodeServerLink, node_rank: int, ranks: range,
                 death_lag_s: float) -> None:
        self.server = server
        # Its queues close before the node monitor declares it lost: how
        # long a caller waits for that verdict.
        self.death_lag_s = death_lag_s
        self.node_rank = node_rank
        self.ranks = ranks
        self.rank = ranks.start
        self.identity: bytes | None = None
        self.session: Session | None = None
        self.reply_handles: dict[int, Handle] = {}
        # (when, the monitor's lateness then): see wire.Liveness
        self.heard: tuple[float, float] = (time.monotonic(), 0.0)
        self.how = ""
        self.remote_traceback = ""  # of the worker whose failure the node reported
        self.failed_rank: int | None = None  # and its rank
        # The node's stall watch judged that worker stopped or hung (and killed
        # it): what it saw ("stopped"/"silent"), its pid there, the words.
        self._stall: tuple[str, int, str] | None = None
        self.refused = ""  # why the last follower that tried to join as this node was refused
        self.gone = threading.Event()
        self.bye_requested = False
        self._death_r, self._death_w = os.pipe()

    ends_on_close = True  # BYE: the follower ends its workers, says BYE and exits

    @property
    def name(self) -> str:
        return f"node {self.node_rank} (ranks {self.ranks.start}-{self.ranks.stop - 1})"

    @property
    def pid(self) -> int | None:
        return None  # its workers' processes are on the follower

    @property
    def death_fd(self) -> int:
        return self._death_r

    def lost(self, how: str) -> None:
        if self.gone.is_set():
            return
        self.how = f"{self.name} {how}"
        self.gone.set()
        if self._death_w >= 0:
            os.write(self._death_w, b"x")

    def stalled(self, seen: str, pid: int, how: str) -> None:
        """Before ``lost``: the failed worker stopped answering (see ``stall``)."""
        self._stall = (seen, pid, how)

    def is_alive(self) -> bool:
        return not self.gone.is_set()

    def terminate(self) -> None:
        self.server.request_bye(self)

    def kill(self) -> None:
        self.server.request_bye(self)

    def join(self, timeout: float | None) -> None:
        self.gone.wait(timeout)

    def describe_exit(self) -> WorkerExit:
        rank = self.rank if self.failed_rank is None else self.failed_rank
        if self._stall is not None:
            seen, pid, how = self._stall
            return WorkerExit(rank, pid, None, how, stalled=seen)
        return WorkerExit(rank, None, None, self.how or f"{self.name} ended",
                          remote_traceback=self.remote_traceback)

    def close_death_pipe(self) -> None:
        self.server.request_bye(self)

    def end_group(self) -> None:
        pass

    def close(self) -> None:
        for fd in (self._death_r, self._death_w):
            if fd >= 0:
                os.close(fd)
        self._death_r = self._death_w = -1
        self.server.release(self)

    def __repr__(self) -> str:
        return f"<{self.name}>"
