"""Point-to-point between ranks of one node: one MessageQueue per direction.

Pipeline stages hand each other a hidden state every step; over gloo that
is a loopback TCP round of its own.  Between two ranks of one machine a
send goes instead through an ``mpexec.ipc.MessageQueue`` (one writer, one
reader, torch CPU tensors out of band: one copy in, one copy out), set up
on the first send/recv between the pair, over gloo, like this::

    sender, first send to dst                  receiver, first recv from src
    q = MessageQueue(1 reader: dst)
    gloo: (node id, q's handle) ─────────────▶ same node? attach (create_from_handle)
    gloo: ◀─────────────────────────────────── None (attached) or why not
    attached: q.wait_until_ready()             attached: q.wait_until_ready()
    else: q.shutdown(); this pair uses gloo    else: this pair uses gloo

Both ends decide from the same answer, so a pair never splits between the
two routes.  A dead peer surfaces as the queue's ``PeerDiedError`` (which
the driver, like ``CollectiveFailedError``, takes for a symptom of a death).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mpexec.distributed.shm_collectives import node_identity
from mpexec.ipc import MessageQueue, QueueReader

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 10  # a [16, 576] float32 hidden state is 36 KiB; larger go to bulk
CHUNKS = 4
READY_TIMEOUT_S = 60.0

SendObject = Callable[[Any, int], None]
RecvObject = Callable[[int], Any]


class ShmChannels:
    """This rank's queues to and from its peers (global ranks), built on first use."""

    def __init__(self, rank: int, send_object: SendObject, recv_object: RecvObject) -> None:
        """``send_object(obj, peer)`` / ``recv_object(peer)``: the pair's gloo route."""
        self.rank = rank
        self._send_object = send_object
        self._recv_object = recv_object
        self._out: dict[int, MessageQueue | None] = {}
        self._in: dict[int, QueueReader | None] = {}

    def to(self, peer: int) -> MessageQueue | None:
        """The queue to ``peer``, or None when this pair goes through gloo."""
        if peer not in self._out:
            self._out[peer] = self._open_writer(peer)
        return self._out[peer]

    def from_(self, peer: int) -> QueueReader | None:
        """The queue from ``peer``, or None when this pair goes through gloo."""
        if peer not in self._in:
            self._in[peer] = self._open_reader(peer)
        return self._in[peer]

    def _open_writer(self, peer: int) -> MessageQueue | None:
        queue = MessageQueue(1, 1, [peer], max_chunk_bytes=CHUNK_BYTES, max_chunks=CHUNKS,
                             name=f"p2p-{self.rank}-{peer}")
        try:
            self._send_object((node_identity(), queue.export_handle()), peer)
            refusal = self._recv_object(peer)
            if refusal is None:
                queue.wait_until_ready(READY_TIMEOUT_S)
                return queue
        except BaseException:
            queue.shutdown()
            raise
        queue.shutdown()
        logger.info("rank %d -> %d: point to point through gloo (%s)", self.rank, peer,
                    refusal)
        return None

    def _open_reader(self, peer: int) -> QueueReader | None:
        node, handle = self._recv_object(peer)
        if node != node_identity():
            self._send_object("the ranks are on different nodes", peer)
            return None
        try:
            queue = MessageQueue.create_from_handle(handle, self.rank)
        except Exception as exc:
            self._send_object(f"{type(exc).__name__}: {exc}", peer)
            return None
        try:
            self._send_object(None, peer)
            queue.wait_until_ready(READY_TIMEOUT_S)
        except BaseException:
            queue.shutdown()
            raise
        return queue

    def routes(self) -> dict[tuple[int, int], str]:
        """``{(src, dst): "shm" | "gloo"}`` for every pair this rank has used."""
        out = {(self.rank, peer): "gloo" if q is None else "shm"
               for peer, q in self._out.items()}
        out.update({(peer, self.rank): "gloo" if q is None else "shm"
                    for peer, q in self._in.items()})
        return out

    def close(self) -> None:
        """Shut every queue down (not collective; idempotent)."""
        for queues in (self._out, self._in):
            for queue in queues.values():
                if queue is not None:
                    queue.shutdown()
            queues.clear()
