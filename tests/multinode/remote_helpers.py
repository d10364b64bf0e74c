"""What the remote-queue tests share: the secret, the collective start, and a
writer with one local and one remote reader."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from mpexec.ipc import MessageQueue

SECRET = "a-test-cluster-secret-0123456789"


def ready_all(writer: MessageQueue, readers: list[MessageQueue]) -> None:
    threads = [threading.Thread(target=r.wait_until_ready, args=(10,)) for r in readers]
    for t in threads:
        t.start()
    writer.wait_until_ready(10)
    for t in threads:
        t.join(10)


def trio_queues() -> Iterator[tuple[MessageQueue, MessageQueue, MessageQueue]]:
    """A writer with one local reader (rank 0) and one remote reader (rank 1)."""
    writer = MessageQueue(2, 1, secret=SECRET, name="trio", max_chunks=4)
    handle = writer.export_handle()
    local = MessageQueue.create_from_handle(handle, 0)
    remote = MessageQueue.create_from_handle(handle, 1, secret=SECRET)
    ready_all(writer, [local, remote])
    yield writer, local, remote
    for q in (remote, local, writer):
        q.shutdown()
