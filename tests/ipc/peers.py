"""Child-process bodies for the transport tests (importable under spawn)."""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any

from mpexec.errors import QueueClosedError
from mpexec.ipc import Handle, MessageQueue


def payload(seed: int, max_size: int) -> bytes:
    rng = random.Random(seed)
    size = rng.choice([0, 1, 100, rng.randrange(max_size + 1)])
    return rng.randbytes(size)


def digest(data: Any) -> str:
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()


def echo_reader(handle: Handle, rank: int, reply_box: Any, options: dict[str, Any]) -> None:
    """Attach as ``rank``, then answer every message with (seq, digest) until None."""
    queue = MessageQueue.create_from_handle(handle, rank, **options.get("reader", {}))
    reply = MessageQueue(1, 1, name=f"reply-{rank}", **options.get("writer", {}))
    reply_box.put(reply.export_handle())
    try:
        queue.wait_until_ready(timeout=30)
        reply.wait_until_ready(timeout=30)
        expected = 0
        while True:
            message = queue.dequeue(timeout=options.get("timeout", 30))
            if message is None:
                break
            seq, data = message
            if seq != expected:
                reply.enqueue(("order", expected, seq))
                break
            expected += 1
            reply.enqueue((seq, digest(data) if options.get("digest", True) else None))
            pause = options.get("pause_every")
            if pause and seq % pause == 0:
                time.sleep(random.random() * options.get("pause_s", 0.002))
        reply.enqueue(("done", expected))
    finally:
        queue.shutdown()
        reply.shutdown()


def writer_then_hang(result_box: Any, options: dict[str, Any]) -> None:
    """Create a queue, publish its handle, send ``count`` messages, then sleep."""
    queue = MessageQueue(1, 1, **options.get("writer", {}))
    result_box.put(queue.export_handle())
    queue.wait_until_ready(timeout=30)
    for i in range(options.get("count", 3)):
        queue.enqueue(i)
    result_box.put("sent")
    time.sleep(60)


def slow_reader(handle: Handle, rank: int, box: Any, count: int) -> None:
    """Attach, read ``count`` messages, report, then sleep without reading."""
    queue = MessageQueue.create_from_handle(handle, rank)
    queue.wait_until_ready(timeout=30)
    for _ in range(count):
        queue.dequeue(timeout=30)
    box.put(("read", count, os.getpid()))
    time.sleep(60)


def blocked_reader(handle: Handle, rank: int, box: Any) -> None:
    """Attach and block in dequeue; report how it ended."""
    queue = MessageQueue.create_from_handle(handle, rank)
    queue.wait_until_ready(timeout=30)
    box.put("waiting")
    try:
        queue.dequeue(timeout=30)
        box.put("message")
    except QueueClosedError as err:
        box.put(type(err).__name__)
    except TimeoutError:
        box.put("TimeoutError")
    finally:
        queue.shutdown()


class PipeGroup:
    """A stand-in process group: ``broadcast_object`` over one pipe-backed
    inbox per rank, as ``MessageQueue.create_from_process_group`` expects."""

    def __init__(self, rank: int, inboxes: list[Any]) -> None:
        self.rank_in_group = rank
        self.world_size = len(inboxes)
        self._inboxes = inboxes

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.rank_in_group == src:
            for rank, box in enumerate(self._inboxes):
                if rank != src:
                    box.put(obj)
            return obj
        return self._inboxes[self.rank_in_group].get(timeout=30)

    def barrier(self) -> None:
        if self.rank_in_group == 0:
            for _ in range(self.world_size - 1):
                assert self._inboxes[0].get(timeout=30) == "arrived"
            for box in self._inboxes[1:]:
                box.put("go")
        else:
            self._inboxes[0].put("arrived")
            assert self._inboxes[self.rank_in_group].get(timeout=30) == "go"


def group_member(rank: int, inboxes: list[Any], writer_rank: int, results: Any) -> None:
    """One rank of a group queue: broadcast three objects, report what arrived."""
    group = PipeGroup(rank, inboxes)
    queue = MessageQueue.create_from_process_group(group, 4096, 2, writer_rank=writer_rank,
                                                   timeout=30)
    try:
        sent = [("hello", rank), b"z" * 100_000, list(range(1000))]
        got = [queue.broadcast_object(obj if rank == writer_rank else None) for obj in sent]
        results.put((rank, type(queue).__name__, [digest(repr(g).encode()) for g in got]))
        group.barrier()  # every reader has read everything before the writer closes
    finally:
        queue.shutdown()
