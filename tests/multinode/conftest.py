"""pyzmq's zero-copy sends use one process-wide helper (a thread with its own
ZeroMQ context, and a socket to it, that release buffers once sent); like
multiprocessing's resource tracker it lives as long as the process, so one
zero-copy send is made before any leak check takes its baseline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _zmq_buffer_collector() -> Iterator[None]:
    try:
        import zmq  # noqa: F401
    except ImportError:
        yield
        return
    from mpexec.ipc import MessageQueue

    secret = "warm-up-secret-0123456789abcdef"
    writer = MessageQueue(1, 0, secret=secret, name="warm-up")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0, secret=secret)
    ready = threading.Thread(target=reader.wait_until_ready, args=(10,))
    ready.start()
    writer.wait_until_ready(10)
    ready.join(10)
    writer.enqueue(bytearray(1 << 20))
    reader.dequeue(10)
    reader.shutdown()
    writer.shutdown()
    yield
