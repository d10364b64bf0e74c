"""The driver's handle on one worker process, before and after READY.

A worker starts as an :class:`UnreadyWorkerProcHandle` (a process, its rank,
the read end of its ready pipe and the write end of its death pipe) and,
once it has sent READY with the handle of its reply queue, becomes a
:class:`WorkerProcHandle` that owns the driver's reader end of that queue.
The death pipe carries no data: the driver closing its end (or dying) is the
message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from mpexec.ipc import MessageQueue


@dataclass
class UnreadyWorkerProcHandle:
    """A worker process that has not reported READY yet."""

    proc: BaseProcess
    rank: int
    ready_pipe: Connection
    death_writer: Connection | None = None


@dataclass
class WorkerProcHandle:
    """A worker process that is READY, with the driver's end of its reply queue."""

    proc: BaseProcess
    rank: int
    worker_response_mq: MessageQueue | None
    # Multi-node only: reply queues of workers on other nodes, by global rank.
    peer_worker_response_mqs: list[MessageQueue | None] = field(default_factory=list)
    death_writer: Connection | None = None

    @classmethod
    def from_unready_handle(
        cls,
        unready_handle: UnreadyWorkerProcHandle,
        worker_response_mq: MessageQueue | None,
        peer_worker_response_mqs: list[MessageQueue | None],
    ) -> WorkerProcHandle:
        return cls(
            proc=unready_handle.proc,
            rank=unready_handle.rank,
            worker_response_mq=worker_response_mq,
            peer_worker_response_mqs=peer_worker_response_mqs,
            death_writer=unready_handle.death_writer,
        )

    def close_death_writer(self) -> None:
        if self.death_writer is not None:
            self.death_writer.close()
            self.death_writer = None
